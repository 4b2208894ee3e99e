"""llama.cpp's own view of the devices: `llama-server --list-devices`.

The last source of a GPU's memory when neither NVML nor the kernel can tell: it sees what
llama.cpp's backends see (Vulkan, CUDA, HIP, SYCL, Metal), on any vendor and system. Its lines:

    Available devices:
      Vulkan0: AMD Radeon RX 7900 XTX (RADV NAVI31) (24560 MiB, 23012 MiB free)

It always runs in a short-lived process of its own, never in the service: asking a backend for
its devices creates a GPU context, and the service must hold none. Each run costs that context
and up to a few seconds, so its answer is cached and refreshed in the background.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# Backends print their own log lines around the list; only lines of this shape are devices.
# The description may itself hold parentheses ("llvmpipe (LLVM 15.0.6, 256 bits)"), so the
# memory is matched at the end of the line.
_DEVICE_LINE = re.compile(r"\s*(?P<name>[^\s:]+): (?P<description>.*) "
                          r"\((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)\s*")
_HEADER = "Available devices:"

PROBE_TIMEOUT_S = 20.0
REFRESH_AFTER_S = 60.0


@dataclass(frozen=True)
class LlamaDevice:
    name: str  # llama.cpp's device name, as --device takes it: "Vulkan0", "CUDA0"
    description: str
    total_mib: float
    free_mib: float


@dataclass(frozen=True)
class DeviceReport:
    devices: tuple[LlamaDevice, ...]
    # Why there is no list (the probe failed, timed out, printed something else), or None.
    error: str | None = None


# The GPU backends a modular llama.cpp build (GGML_BACKEND_DL) may carry beside
# llama-server, as ggml names their modules, with the driver each needs.
GPU_MODULES = {"cuda": "the NVIDIA driver or its libcuda.so.1 is missing or does not match the build "
                       "(nvidia-smi checks it)",
               "hip": "the AMD ROCm driver is missing (rocminfo checks it)",
               "vulkan": "no Vulkan driver for the GPU (vulkaninfo --summary checks it)",
               "sycl": "the Intel oneAPI runtime is missing (sycl-ls checks it)"}


def gpu_modules_beside(binary: str | Path) -> tuple[str, ...]:
    """The GPU backend modules installed beside a llama-server ("cuda", ...):
    a modular build loads them from its own folder at start."""
    folder = Path(binary).parent
    return tuple(name for name in GPU_MODULES if (folder / f"libggml-{name}.so").is_file())


def no_device_reason(binary: str | Path) -> str:
    """Why llama-server lists no GPU device, as far as its files tell."""
    modules = gpu_modules_beside(binary)
    if not modules:
        return "llama.cpp sees no GPU device (llama-server --list-devices lists none)"
    return "; ".join(f"llama.cpp's {name.upper() if name != 'vulkan' else 'Vulkan'} module sees no device: "
                     f"{GPU_MODULES[name]}" for name in modules)


def parse_list_devices(output: str) -> tuple[LlamaDevice, ...]:
    """The devices in `llama-server --list-devices` output, in llama.cpp's order.

    Raises ValueError when the output has no device list at all, so a binary that doesn't know
    the flag is not mistaken for one that sees no device ("  (none)").
    """
    lines = output.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == _HEADER)
    except StopIteration:
        raise ValueError(f"no {_HEADER!r} line in the output") from None
    devices = []
    for line in lines[start + 1:]:
        match = _DEVICE_LINE.fullmatch(line)
        if match is not None:
            devices.append(LlamaDevice(name=match["name"], description=match["description"].strip(),
                                       total_mib=float(match["total"]), free_mib=float(match["free"])))
    return tuple(devices)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def run_list_devices(argv: Sequence[str], env: Mapping[str, str] | None, timeout_s: float,
                     run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> DeviceReport:
    """One probe process; every failure becomes a report with the reason, never an exception."""
    command = " ".join([Path(argv[0]).name, *argv[1:]])
    try:
        done = run(list(argv), capture_output=True, text=True, errors="replace", timeout=timeout_s,
                   env=dict(env) if env is not None else None, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return DeviceReport((), f"{command} did not answer within {timeout_s:.0f} s")
    except OSError as error:
        return DeviceReport((), f"{command} could not run ({error})")
    if done.returncode != 0:
        return DeviceReport((), f"{command} exited with {done.returncode}: {_last_line(done.stderr or done.stdout)}")
    try:
        return DeviceReport(parse_list_devices(done.stdout))
    except ValueError as error:
        return DeviceReport((), f"{command} printed no device list ({error})")


class LlamaDeviceProbe:
    """`llama-server --list-devices`, cached.

    The first call runs the probe and waits for it (bounded by the timeout): the service decides
    at start whether there is a GPU. Later calls never wait: they return the last answer and,
    once it is older than `refresh_after_s`, start one refresh in a background thread.
    """

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None = None, *,
                 timeout_s: float = PROBE_TIMEOUT_S, refresh_after_s: float = REFRESH_AFTER_S,
                 clock: Callable[[], float] = time.monotonic,
                 run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> None:
        self.argv = tuple(argv)
        self._env = dict(env) if env is not None else None
        self._timeout_s = timeout_s
        self._refresh_after_s = refresh_after_s
        self._clock = clock
        self._run = run
        self._lock = threading.Lock()
        self._first = threading.Lock()  # one first probe, however many threads ask at once
        self._report: DeviceReport | None = None
        self._taken_at = 0.0
        self._refreshing = False

    def report(self) -> DeviceReport:
        with self._lock:
            report, stale = self._report, self._clock() - self._taken_at >= self._refresh_after_s
            start_refresh = report is not None and stale and not self._refreshing
            if start_refresh:
                self._refreshing = True
        if report is None:
            with self._first:
                with self._lock:
                    report = self._report
                if report is None:
                    report = self._probe()
            return report
        if start_refresh:
            threading.Thread(target=self._refresh, name="llama-list-devices", daemon=True).start()
        return report

    def _probe(self) -> DeviceReport:
        report = run_list_devices([*self.argv, "--list-devices"], self._env, self._timeout_s, self._run)
        with self._lock:
            self._report, self._taken_at = report, self._clock()
        return report

    def _refresh(self) -> None:
        try:
            self._probe()
        finally:
            with self._lock:
                self._refreshing = False


_shared: dict[tuple[tuple[str, ...], tuple[tuple[str, str], ...] | None], LlamaDeviceProbe] = {}
_shared_lock = threading.Lock()


def shared_probe(argv: Sequence[str], env: Mapping[str, str] | None = None) -> LlamaDeviceProbe:
    """One probe per binary and environment in this process: every service, CLI command and
    test that asks reuses its cached answer instead of starting another GPU context."""
    key = (tuple(argv), tuple(sorted(env.items())) if env is not None else None)
    with _shared_lock:
        probe = _shared.get(key)
        if probe is None:
            probe = _shared[key] = LlamaDeviceProbe(argv, env)
        return probe
