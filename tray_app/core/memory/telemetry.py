"""Memory telemetry for the GPU and CPU workers: VRAM via NVML (or a simulated
device on machines without one), host RAM via psutil, a bounded history, and
the helpers the supervisor needs around GPU worker restarts.

Unknown is always reported as ``None`` with a reason, never as 0: admission
control treats 0 MiB free as "full" and 0 MiB used as "empty", and both would
be wrong guesses when NVML simply could not answer.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import os
import threading
import time
import types
import warnings
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil

MIB = 1024 * 1024

# NVML reports "not available" per-process usage as ULLONG_MAX on some
# platforms; recent nvidia-ml-py maps it to None, older versions do not.
_NVML_VALUE_NOT_AVAILABLE = 2**64 - 1

CUDA_REINSTALL_HINT = (
    'reinstall with CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall '
    "--no-cache-dir llama-cpp-python "
    '(PowerShell: $env:CMAKE_ARGS="-DGGML_CUDA=on" first, then the same pip command)'
)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


# --------------------------------------------------------------------------
# Readings
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    # None when NVML does not report per-process use (WDDM, containers).
    used_mib: float | None
    # The program's name, for "who else uses the GPU"; None when the process
    # is not visible to us (another user's, another container's). A label,
    # not part of the reading's identity.
    name: str | None = field(default=None, compare=False)

    def to_status(self) -> dict[str, Any]:
        return {"pid": self.pid, "used_mib": _round(self.used_mib), "name": self.name}


@dataclass(frozen=True)
class GpuDevice:
    index: int
    name: str
    total_mib: float
    used_mib: float
    free_mib: float
    processes: tuple[GpuProcess, ...] = ()
    # False when the driver refused to list processes (NotSupported); an empty
    # `processes` then means "unknown", not "nobody is using this GPU".
    processes_reported: bool = True

    def to_status(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "total_mib": _round(self.total_mib),
            "used_mib": _round(self.used_mib),
            "free_mib": _round(self.free_mib),
            "processes": [p.to_status() for p in self.processes],
            "processes_reported": self.processes_reported,
        }


@dataclass(frozen=True)
class GpuReading:
    available: bool
    simulated: bool
    devices: tuple[GpuDevice, ...]
    reason: str | None = None

    @property
    def _worker_device(self) -> GpuDevice | None:
        # The GPU worker runs on the first device; a reading that is not
        # available must not leak numbers even if devices were filled in.
        if not self.available or not self.devices:
            return None
        return self.devices[0]

    @property
    def total_mib(self) -> float | None:
        device = self._worker_device
        return None if device is None else device.total_mib

    @property
    def free_mib(self) -> float | None:
        device = self._worker_device
        return None if device is None else device.free_mib

    @property
    def used_mib(self) -> float | None:
        device = self._worker_device
        return None if device is None else device.used_mib

    def to_status(self) -> dict[str, Any]:
        return {
            "available": self.available,
            "simulated": self.simulated,
            "total_mib": _round(self.total_mib),
            "free_mib": _round(self.free_mib),
            "used_mib": _round(self.used_mib),
            "reason": self.reason,
            "devices": [d.to_status() for d in self.devices],
        }


def UNKNOWN_GPU(reason: str) -> GpuReading:  # noqa: N802 - name fixed by the contract
    return GpuReading(available=False, simulated=False, devices=(), reason=reason)


@dataclass(frozen=True)
class HostReading:
    total_mib: float
    available_mib: float
    swap_total_mib: float
    swap_used_mib: float
    rss_mib_by_pid: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Copy, then wrap: a caller keeping the original dict must not be
        # able to change a reading that other threads already hold.
        frozen = types.MappingProxyType(dict(self.rss_mib_by_pid))
        object.__setattr__(self, "rss_mib_by_pid", frozen)

    def to_status(self) -> dict[str, Any]:
        return {
            "total_mib": _round(self.total_mib),
            "available_mib": _round(self.available_mib),
            "swap_total_mib": _round(self.swap_total_mib),
            "swap_used_mib": _round(self.swap_used_mib),
            "rss_mib_by_pid": {pid: _round(mib) for pid, mib in self.rss_mib_by_pid.items()},
        }


@dataclass(frozen=True)
class MemorySnapshot:
    taken_at: float  # time.time(), so it can be shown and compared across processes
    gpu: GpuReading
    host: HostReading

    def to_status(self) -> dict[str, Any]:
        return {"taken_at": self.taken_at, "gpu": self.gpu.to_status(), "host": self.host.to_status()}


# --------------------------------------------------------------------------
# GPU readers
# --------------------------------------------------------------------------


class GpuReader(Protocol):
    def read(self) -> GpuReading: ...

    def close(self) -> None: ...


def _describe_nvml_error(nvml: Any, error: BaseException) -> str:
    """Turn an NVML exception into a sentence a user can act on."""
    detail = f"NVML: {error}"
    known: list[tuple[str, str]] = [
        ("NVMLError_LibraryNotFound", "NVIDIA management library (libnvidia-ml / nvml.dll) not found"),
        ("NVMLError_DriverNotLoaded", "NVIDIA driver not loaded"),
        ("NVMLError_NoPermission", "no permission to query the NVIDIA driver"),
        ("NVMLError_LibRmVersionMismatch", "NVIDIA driver and NVML library versions differ (reboot after a driver update?)"),
        ("NVMLError_GpuIsLost", "the GPU fell off the bus"),
    ]
    for class_name, sentence in known:
        cls = getattr(nvml, class_name, None)
        if isinstance(cls, type) and isinstance(error, cls):
            return f"{sentence} ({detail})"
    return f"NVML query failed ({detail})"


class NvmlGpuReader:
    """The one NVML gateway.

    nvmlInit happens lazily on the first read. A failed init (or a missing
    pynvml) is remembered and reported as an unknown reading with the reason;
    init is retried at most every ``retry_init_after_s`` because a driver can
    come back (e.g. after an update finishes installing). Any NVML error while
    reading yields an unknown reading, never zeros.
    """

    # Errors after which the NVML session itself is unusable, so the next
    # read must go through init again rather than reuse stale handles.
    _SESSION_ENDING_ERRORS = (
        "NVMLError_Uninitialized",
        "NVMLError_DriverNotLoaded",
        "NVMLError_LibraryNotFound",
        "NVMLError_GpuIsLost",
        "NVMLError_LibRmVersionMismatch",
    )

    def __init__(
        self,
        nvml_module: Any | None = None,
        *,
        retry_init_after_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nvml: Any | None = nvml_module
        self._retry_init_after_s = retry_init_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._initialized = False
        self._last_init_failure: GpuReading | None = None
        self._last_init_attempt: float | None = None

    def read(self) -> GpuReading:
        with self._lock:
            failure = self._ensure_initialized()
            if failure is not None:
                return failure
            return self._read_devices()

    def close(self) -> None:
        with self._lock:
            self._shutdown()
            # A closed reader that is read again starts over, without waiting
            # out the retry interval of an earlier failure.
            self._last_init_failure = None
            self._last_init_attempt = None

    # -- internals (all called with the lock held) --

    def _ensure_initialized(self) -> GpuReading | None:
        if self._initialized:
            return None
        now = self._clock()
        if (
            self._last_init_failure is not None
            and self._last_init_attempt is not None
            and now - self._last_init_attempt < self._retry_init_after_s
        ):
            return self._last_init_failure
        self._last_init_attempt = now
        failure = self._try_init()
        self._last_init_failure = failure
        return failure

    def _try_init(self) -> GpuReading | None:
        if self._nvml is None:
            try:
                with warnings.catch_warnings():
                    # The pynvml package now only re-exports nvidia-ml-py's module
                    # and warns about that on import; the API we use is the same.
                    warnings.simplefilter("ignore", FutureWarning)
                    self._nvml = importlib.import_module("pynvml")
            except ImportError as error:
                return UNKNOWN_GPU(f"pynvml is not installed ({error})")
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as error:
            return UNKNOWN_GPU(_describe_nvml_error(nvml, error))
        self._initialized = True
        return None

    def _shutdown(self) -> None:
        if not self._initialized:
            return
        self._initialized = False
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            # The session is being abandoned either way; a failed shutdown
            # (driver already gone) leaves nothing for us to release.
            pass

    def _read_devices(self) -> GpuReading:
        nvml = self._nvml
        try:
            count = nvml.nvmlDeviceGetCount()
            devices = tuple(self._read_device(index) for index in range(count))
        except nvml.NVMLError as error:
            if self._ends_session(error):
                self._shutdown()
            return UNKNOWN_GPU(_describe_nvml_error(nvml, error))
        if not devices:
            return UNKNOWN_GPU("NVML reports no NVIDIA GPUs")
        return GpuReading(available=True, simulated=False, devices=devices)

    def _ends_session(self, error: BaseException) -> bool:
        for class_name in self._SESSION_ENDING_ERRORS:
            cls = getattr(self._nvml, class_name, None)
            if isinstance(cls, type) and isinstance(error, cls):
                return True
        return False

    def _read_device(self, index: int) -> GpuDevice:
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name = nvml.nvmlDeviceGetName(handle)
        if isinstance(name, bytes):  # pynvml before 11.5 returned bytes
            name = name.decode(errors="replace")
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        processes, processes_reported = self._read_processes(handle)
        return GpuDevice(
            index=index,
            name=str(name),
            total_mib=memory.total / MIB,
            used_mib=memory.used / MIB,
            free_mib=memory.free / MIB,
            processes=processes,
            processes_reported=processes_reported,
        )

    def _read_processes(self, handle: Any) -> tuple[tuple[GpuProcess, ...], bool]:
        nvml = self._nvml
        not_supported = getattr(nvml, "NVMLError_NotSupported", None)
        # Raised (not as an NVMLError) by nvidia-ml-py when the installed
        # driver predates the _v3 process query; memory numbers still work.
        mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)
        tolerated = tuple(cls for cls in (not_supported, mismatch) if isinstance(cls, type))

        by_pid: dict[int, float | None] = {}
        reported = False
        for query_name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            query = getattr(nvml, query_name, None)
            if query is None:
                continue
            try:
                infos = query(handle)
            except tolerated:
                continue
            reported = True
            for info in infos:
                used = _process_used_mib(getattr(info, "usedGpuMemory", None))
                pid = int(info.pid)
                # A process with both a CUDA and a graphics context shows up in
                # both lists with the same allocation; keep the larger number
                # instead of counting it twice.
                if pid in by_pid:
                    previous = by_pid[pid]
                    if previous is None or (used is not None and used > previous):
                        by_pid[pid] = used
                else:
                    by_pid[pid] = used
        processes = tuple(GpuProcess(pid=pid, used_mib=used, name=process_name(pid))
                          for pid, used in sorted(by_pid.items()))
        return processes, reported


def process_name(pid: int) -> str | None:
    try:
        return psutil.Process(pid).name() or None
    except (psutil.Error, OSError):
        return None


def _process_used_mib(used_bytes: int | None) -> float | None:
    if used_bytes is None or used_bytes == _NVML_VALUE_NOT_AVAILABLE:
        return None
    return used_bytes / MIB


class SimulatedGpu:
    """A declared device for machines without a GPU.

    Free = total - registered footprints - injected pressure - what other
    processes hold, clamped at 0. Other processes take memory the way they
    would on a real card: a process registers an allocation as a file named
    after its pid in `others_dir` (see `hold_simulated_vram`), the device
    lists it with the process's name, and it is released when the process
    exits, however it exits. The service thread and the UI read while the
    service writes, hence the lock.
    """

    def __init__(self, total_mib: float, name: str = "Simulated GPU", others_dir: Path | None = None) -> None:
        if total_mib <= 0:
            raise ValueError(f"total_mib must be > 0, got {total_mib}")
        self._total_mib = float(total_mib)
        self._name = name
        self._lock = threading.Lock()
        self._footprints: dict[str, float] = {}
        self._pressure_mib = 0.0
        self.others_dir = others_dir

    def set_footprint(self, owner: str, mib: float) -> None:
        if mib < 0:
            raise ValueError(f"footprint must be >= 0 MiB, got {mib}")
        with self._lock:
            if mib == 0:
                self._footprints.pop(owner, None)
            else:
                self._footprints[owner] = float(mib)

    def set_pressure(self, mib: float) -> None:
        if mib < 0:
            raise ValueError(f"pressure must be >= 0 MiB, got {mib}")
        with self._lock:
            self._pressure_mib = float(mib)

    @property
    def pressure_mib(self) -> float:
        with self._lock:
            return self._pressure_mib

    def footprint(self, owner: str) -> float:
        with self._lock:
            return self._footprints.get(owner, 0.0)

    def read(self) -> GpuReading:
        others = _simulated_allocations(self.others_dir) if self.others_dir is not None else ()
        with self._lock:
            claimed = sum(self._footprints.values()) + self._pressure_mib
        claimed += sum(process.used_mib or 0.0 for process in others)
        free = max(0.0, self._total_mib - claimed)
        device = GpuDevice(
            index=0,
            name=self._name,
            total_mib=self._total_mib,
            used_mib=self._total_mib - free,
            free_mib=free,
            processes=others,
        )
        return GpuReading(available=True, simulated=True, devices=(device,))

    def close(self) -> None:
        """Nothing to release; present to satisfy GpuReader."""


def _simulated_allocations(directory: Path) -> tuple[GpuProcess, ...]:
    """Allocations on a simulated device by live processes; a dead process's
    file is ignored, as a driver frees a dead process's memory."""
    found = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return ()
    for entry in entries:
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            mib = float(entry.read_text().strip())
            process = psutil.Process(pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            name = process.name() or None
        except (OSError, ValueError, psutil.Error):
            continue
        if mib > 0 and math.isfinite(mib):
            found.append(GpuProcess(pid=pid, used_mib=mib, name=name))
    return tuple(sorted(found, key=lambda process: process.pid))


def hold_simulated_vram(directory: Path, mib: float) -> Path:
    """Take `mib` of a simulated device's memory for this process, until it
    exits or deletes the returned file."""
    directory.mkdir(parents=True, exist_ok=True)
    entry = directory / str(os.getpid())
    temporary = directory / f".{os.getpid()}.tmp"
    temporary.write_text(f"{mib:.1f}\n")
    os.replace(temporary, entry)
    return entry


# --------------------------------------------------------------------------
# Host memory
# --------------------------------------------------------------------------


def usable_cores() -> int:
    """The cores llama.cpp's threads can use: its default counts physical
    cores, and a CPU affinity mask (taskset, a container) may allow fewer."""
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        cores = min(cores, len(os.sched_getaffinity(0)))
    return cores


def read_host(pids: Iterable[int] = ()) -> HostReading:
    """Host RAM and swap, plus the RSS of each given pid that still exists."""
    virtual = psutil.virtual_memory()
    swap = psutil.swap_memory()
    rss: dict[int, float] = {}
    for pid in pids:
        try:
            rss[pid] = psutil.Process(pid).memory_info().rss / MIB
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            # Workers exit and restart between the supervisor's pid list and
            # this call; a missing entry is the honest answer (ZombieProcess
            # is a NoSuchProcess).
            continue
    return HostReading(
        total_mib=virtual.total / MIB,
        available_mib=virtual.available / MIB,
        swap_total_mib=swap.total / MIB,
        swap_used_mib=swap.used / MIB,
        rss_mib_by_pid=rss,
    )


# --------------------------------------------------------------------------
# History
# --------------------------------------------------------------------------


class TelemetryHistory:
    """Bounded ring buffer of snapshots; default 600 = 10 minutes at 1 Hz."""

    def __init__(self, capacity: int = 600) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._lock = threading.Lock()
        self._snapshots: deque[MemorySnapshot] = deque(maxlen=capacity)

    @property
    def capacity(self) -> int:
        return self._snapshots.maxlen or 0

    def append(self, snap: MemorySnapshot) -> None:
        with self._lock:
            self._snapshots.append(snap)

    def latest(self) -> MemorySnapshot | None:
        with self._lock:
            return self._snapshots[-1] if self._snapshots else None

    def since(self, t: float) -> list[MemorySnapshot]:
        """Snapshots taken at or after ``t``, oldest first."""
        with self._lock:
            # A filter rather than a bisect: time.time() can step backwards
            # (NTP), so the buffer is not guaranteed to be sorted.
            return [snap for snap in self._snapshots if snap.taken_at >= t]

    def list(self) -> list[MemorySnapshot]:
        """All retained snapshots, oldest first."""
        with self._lock:
            return [*self._snapshots]

    def __len__(self) -> int:
        with self._lock:
            return len(self._snapshots)


# --------------------------------------------------------------------------
# llama.cpp GPU offload and VRAM recovery
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class OffloadSupport:
    supported: bool | None  # None = llama_cpp could not be imported
    message: str


# A reading says what it saw of the device; what the service makes of it
# ("serving CPU-only") is said once, here, after the reason.
CPU_ONLY = "serving CPU-only"
GPU_DISABLED_IN_CONFIG = "the GPU path is disabled in the config ([gpu] enabled = false)"


def gpu_path_missing_reason(enabled: bool, simulated: bool, read_gpu: Callable[[], GpuReading],
                            offload: OffloadSupport) -> str | None:
    """Why the service has no GPU path, or None when it has one: the config
    turned it off, no device answered, or the worker's build can't offload.
    The device is read only when that decides it (a disabled GPU is never probed)."""
    if not enabled:
        return GPU_DISABLED_IN_CONFIG
    if simulated:
        return None
    reading = read_gpu()
    if not reading.available:
        return f"no usable GPU: {reading.reason}; {CPU_ONLY}"
    if offload.supported is False:
        return f"GPU found, but {offload.message}; {CPU_ONLY}"
    return None


def gpu_too_small_reason(total_mib: float | None, model: str, model_mib: float, reserve_mib: float) -> str | None:
    """Why a model's GPU path is out from the start: the device holds the
    model, but not with the reserve kept free for the house's other apps.
    Loading it anyway left the worker to give the GPU back at once, to an
    "other app" that was only the reserve (app: null), and never come back.
    A model over the whole device is still tried: the estimate can be off,
    and a real out-of-memory at load is classified and failed over as it is
    (the GPU check proves that path on real cards)."""
    if total_mib is None or model_mib + reserve_mib <= total_mib or model_mib > total_mib:
        return None
    return (f"the GPU's {total_mib:.0f} MiB can't hold {model} ({model_mib:.0f} MiB estimated) and the "
            f"{reserve_mib:.0f} MiB kept free for other apps ([gpu] reserve_mib) together; {CPU_ONLY} "
            "(a smaller reserve, a smaller [gpu] n_ctx or fewer [gpu] gpu_layers would let it fit)")


def _local_gpu_backend(llama_cpp: Any) -> bool:
    """llama_supports_gpu_offload() is also true for a CPU build with the RPC
    backend (other machines' devices): ask ggml for a local GPU device."""
    supports_rpc = getattr(llama_cpp, "llama_supports_rpc", None)
    if supports_rpc is None or not supports_rpc():
        return True
    try:
        import ctypes

        by_type = llama_cpp.llama_cpp._lib.ggml_backend_dev_by_type
        by_type.restype, by_type.argtypes = ctypes.c_void_p, [ctypes.c_int]
        # ggml_backend_dev_type: 1 = GPU, 2 = IGPU (an integrated one)
        return by_type(1) is not None or by_type(2) is not None
    except (AttributeError, OSError):
        return True  # can't tell: trust llama.cpp's own answer


def detect_gpu_offload_support() -> OffloadSupport:
    """Whether the installed llama-cpp-python was built with GPU offload."""
    try:
        llama_cpp = importlib.import_module("llama_cpp")
    except Exception as error:  # noqa: BLE001
        # Not just ImportError: importing llama_cpp loads its shared library,
        # which raises OSError/RuntimeError when e.g. a CUDA runtime DLL is
        # missing. That is exactly the case the user needs a message for.
        return OffloadSupport(
            supported=None,
            message=f"llama-cpp-python could not be imported ({type(error).__name__}: {error})",
        )
    probe = getattr(llama_cpp, "llama_supports_gpu_offload", None)
    if probe is None:
        return OffloadSupport(
            supported=None,
            message="this llama-cpp-python has no llama_supports_gpu_offload(); upgrade it",
        )
    if bool(probe()) and _local_gpu_backend(llama_cpp):
        return OffloadSupport(supported=True, message="llama.cpp was built with GPU offload")
    return OffloadSupport(
        supported=False,
        message=f"llama-cpp-python was built without GPU offload (CPU-only); {CUDA_REINSTALL_HINT}",
    )


async def wait_for_vram_recovery(
    read_free_mib: Callable[[], float | None],
    baseline_free_mib: float,
    expected_release_mib: float,
    *,
    fraction: float = 0.75,
    poll_s: float = 0.25,
    timeout_s: float = 5.0,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Wait until a dead GPU worker's VRAM shows up as free again.

    NVML lags a process exit (the driver frees the context asynchronously),
    so starting a replacement immediately would see the old footprint and
    either refuse to load or fail to allocate. Same habit as Ollama: poll
    until ``fraction`` of the expected release is visible, or give up.
    Unknown readings count as not recovered. Returns True if recovered.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if poll_s <= 0:
        raise ValueError(f"poll_s must be > 0, got {poll_s}")
    if expected_release_mib <= 0:
        # The dead worker held nothing we know of; nothing to wait for.
        return True
    needed_mib = fraction * expected_release_mib
    deadline = clock() + timeout_s
    while True:
        free = read_free_mib()
        if free is not None and free - baseline_free_mib >= needed_mib:
            return True
        remaining = deadline - clock()
        if remaining <= 0:
            return False
        await sleep(min(poll_s, remaining))
