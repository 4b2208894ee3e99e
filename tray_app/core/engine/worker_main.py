"""Thin wrapper that runs a llama.cpp server as a supervised worker.

It does three things before handing over to the stock server (llama-cpp-python's
in this process, or llama-server, which it execs so that the pid stays the same):

1. Ties its life to the supervisor: on Linux, PR_SET_PDEATHSIG makes the
   kernel SIGKILL this process when the supervisor dies, even by SIGKILL, so
   no worker is ever orphaned holding GPU memory.
2. Plays the allocator of a simulated GPU: when the supervisor says what the
   worker needs and what the simulated device has free, a worker that does not
   fit fails the way llama.cpp's CUDA backend fails (the same log lines, exit
   status 1), so the same classification and breaker code runs as on a real
   GPU. On a real GPU these flags are absent and llama.cpp allocates for real.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import runpy
import re
import signal
import subprocess
import sys

from tray_app.core.engine.runtime import PARENT_PID_ENV, WORKER_KEY_VARIABLE

_PR_SET_PDEATHSIG = 1
# How the wrapper writes, into the worker's log, each device the GPU worker's
# llama-server sees (its own `--list-devices` line after the prefix).
DEVICE_LINE_PREFIX = "[device] "
# "Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)" (llama.cpp's common/arg.cpp)
_DEVICE_LINE = re.compile(r"(?P<name>[^\s:]+): (?P<description>.*) \((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)")
_DEVICE_LIST_TIMEOUT_S = 30
# llama-server's own name for --api-key (common/arg.cpp).
LLAMA_SERVER_KEY_VARIABLE = "LLAMA_API_KEY"


def _expected_parent_pid() -> int:
    value = os.environ.get(PARENT_PID_ENV, "")
    if value.isdigit():
        return int(value)
    # A launcher that does not say: reading it now narrows the race but cannot close it.
    return os.getppid()


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    expected = _expected_parent_pid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # The parent may have died before prctl; then nobody will kill us.
    if os.getppid() != expected:
        os._exit(1)


def _simulated_allocation(need_mib: float, free_mib: float) -> None:
    if need_mib <= free_mib:
        return
    need_bytes = int(need_mib * 1024 * 1024)
    print(
        f"[simulated device] ggml_backend_cuda_buffer_type_alloc_buffer: allocating {need_mib:.2f} MiB "
        f"on device 0: cudaMalloc failed: out of memory (free {free_mib:.2f} MiB)",
        file=sys.stderr,
    )
    print(f"[simulated device] alloc_tensor_range: failed to allocate CUDA0 buffer of size {need_bytes}", file=sys.stderr)
    print("[simulated device] llama_init_from_model: failed to initialize the context", file=sys.stderr, flush=True)
    sys.exit(1)


def parse_device_line(line: str) -> dict | None:
    """One device from the wrapper's DEVICE_LINE_PREFIX lines, or None for another line."""
    if not line.startswith(DEVICE_LINE_PREFIX):
        return None
    match = _DEVICE_LINE.fullmatch(line[len(DEVICE_LINE_PREFIX):].strip())
    if match is None:
        return None
    return {"name": match["name"], "description": match["description"],
            "total_mib": int(match["total"]), "free_mib": int(match["free"])}


def _offloads(server_args: list[str]) -> bool:
    return "--n-gpu-layers" in server_args and server_args[server_args.index("--n-gpu-layers") + 1] != "0"


def _log_devices(binary: str) -> None:
    """Write the devices this llama-server sees, as llama.cpp names them, into
    the worker's log before it loads: /status names the GPU worker's device
    from them. Its own log at warning level never names it. The listing
    process exits before the load starts, context and all."""
    try:
        listed = subprocess.run([binary, "--list-devices"], capture_output=True, text=True, errors="replace",
                                stdin=subprocess.DEVNULL, timeout=_DEVICE_LIST_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"tray-app: could not list llama.cpp's devices: {exc}", flush=True)
        return
    for line in listed.stdout.splitlines():
        if _DEVICE_LINE.fullmatch(line.strip()):
            print(DEVICE_LINE_PREFIX + line.strip(), flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        split = argv.index("--")
        own, server_args = argv[:split], argv[split + 1:]
    else:
        own, server_args = [], argv
    parser = argparse.ArgumentParser(prog="tray_app.core.engine.worker_main")
    parser.add_argument("--sim-vram-need-mib", type=float)
    parser.add_argument("--sim-vram-free-mib", type=float)
    parser.add_argument("--exec", dest="binary", help="run this llama-server instead of llama-cpp-python's server")
    options = parser.parse_args(own)

    _die_with_parent()
    if options.sim_vram_need_mib is not None and options.sim_vram_free_mib is not None:
        _simulated_allocation(options.sim_vram_need_mib, options.sim_vram_free_mib)

    key = os.environ.pop(WORKER_KEY_VARIABLE, None)
    if options.binary:
        if _offloads(server_args):
            _log_devices(options.binary)
        # llama-server reads its key from this variable; after exec the
        # environment is readable only by our own user, like our memory.
        env = dict(os.environ)
        if key:
            env[LLAMA_SERVER_KEY_VARIABLE] = key
        os.execve(options.binary, [options.binary, *server_args], env)
    # Only sys.argv changes here, not the argv the kernel shows in ps.
    if key:
        # One argv element: a key may begin with "-", which argparse would take for an option.
        server_args += [f"--api_key={key}"]
    sys.argv = ["llama_cpp.server", *server_args]
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
