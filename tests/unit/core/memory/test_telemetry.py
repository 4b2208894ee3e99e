"""Unit tests for tray_app.core.memory.telemetry.

NVML is faked with a small module object that carries the *real* pynvml
exception classes, so the reader's except clauses are exercised against what
the driver would actually raise.
"""

from __future__ import annotations

import asyncio
import ctypes.util
import os
import subprocess
import sys
import types
from dataclasses import FrozenInstanceError
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.clock import FakeClock

pynvml = pytest.importorskip("pynvml")

from tray_app.core.memory import telemetry  # noqa: E402
from tray_app.core.memory.telemetry import (  # noqa: E402
    MIB,
    UNKNOWN_GPU,
    GpuDevice,
    GpuProcess,
    GpuReading,
    HostReading,
    MemorySnapshot,
    NvmlGpuReader,
    SimulatedGpu,
    TelemetryHistory,
    detect_gpu_offload_support,
    read_host,
    wait_for_vram_recovery,
)

GIB = 1024 * MIB


# --------------------------------------------------------------------------
# Fake NVML
# --------------------------------------------------------------------------


class FakeDevice:
    def __init__(
        self,
        name: str | bytes,
        total: int,
        used: int,
        compute: list[tuple[int, int | None]] | Exception = (),  # type: ignore[assignment]
        graphics: list[tuple[int, int | None]] | Exception = (),  # type: ignore[assignment]
    ) -> None:
        self.name = name
        self.total = total
        self.used = used
        self.compute = compute
        self.graphics = graphics
        self.memory_error: Exception | None = None


def _make_fake_nvml(devices: list[FakeDevice]) -> types.ModuleType:
    """A module object shaped like pynvml, backed by `devices`."""
    fake = types.ModuleType("fake_pynvml")
    for name in dir(pynvml):
        if name.startswith("NVMLError") or name == "NVMLLibraryMismatchError":
            setattr(fake, name, getattr(pynvml, name))
    fake.devices = devices
    fake.init_error = None
    fake.init_calls = 0
    fake.shutdown_calls = 0
    fake.count_error = None

    def nvmlInit() -> None:
        fake.init_calls += 1
        if fake.init_error is not None:
            raise fake.init_error

    def nvmlShutdown() -> None:
        fake.shutdown_calls += 1

    def nvmlDeviceGetCount() -> int:
        if fake.count_error is not None:
            raise fake.count_error
        return len(fake.devices)

    def nvmlDeviceGetHandleByIndex(index: int) -> FakeDevice:
        return fake.devices[index]

    def nvmlDeviceGetName(handle: FakeDevice) -> str | bytes:
        return handle.name

    def nvmlDeviceGetMemoryInfo(handle: FakeDevice) -> Any:
        if handle.memory_error is not None:
            raise handle.memory_error
        return types.SimpleNamespace(total=handle.total, used=handle.used, free=handle.total - handle.used)

    def _procs(entries: Any) -> list[Any]:
        if isinstance(entries, Exception):
            raise entries
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in entries]

    fake.nvmlInit = nvmlInit
    fake.nvmlShutdown = nvmlShutdown
    fake.nvmlDeviceGetCount = nvmlDeviceGetCount
    fake.nvmlDeviceGetHandleByIndex = nvmlDeviceGetHandleByIndex
    fake.nvmlDeviceGetName = nvmlDeviceGetName
    fake.nvmlDeviceGetMemoryInfo = nvmlDeviceGetMemoryInfo
    fake.nvmlDeviceGetComputeRunningProcesses = lambda h: _procs(h.compute)
    fake.nvmlDeviceGetGraphicsRunningProcesses = lambda h: _procs(h.graphics)
    return fake


def _two_gpus() -> list[FakeDevice]:
    return [
        FakeDevice(
            "NVIDIA GeForce RTX 4090",
            total=24 * GIB,
            used=10 * GIB,
            compute=[(4242, 8 * GIB), (5151, 512 * MIB)],
            # Processes with both a CUDA and a graphics context are listed
            # twice: the same allocation must not be counted twice, and a
            # known number must win over an unknown one.
            graphics=[(4242, None), (5151, 512 * MIB), (777, None)],
        ),
        FakeDevice(
            b"Tesla T4",  # older pynvml returned bytes
            total=16 * GIB,
            used=1 * GIB,
            compute=pynvml.NVMLError_NotSupported(),
            graphics=pynvml.NVMLError_NotSupported(),
        ),
    ]


# --------------------------------------------------------------------------
# NvmlGpuReader
# --------------------------------------------------------------------------


def test_missing_pynvml_reports_unknown_with_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes `import pynvml` raise ImportError.
    monkeypatch.setitem(sys.modules, "pynvml", None)
    reading = NvmlGpuReader().read()

    assert reading.available is False
    assert reading.simulated is False
    assert reading.devices == ()
    assert "pynvml is not installed" in (reading.reason or "")
    assert reading.total_mib is None and reading.free_mib is None and reading.used_mib is None


def test_driver_not_loaded_is_remembered_and_retried_after_interval() -> None:
    fake = _make_fake_nvml(_two_gpus())
    fake.init_error = pynvml.NVMLError_DriverNotLoaded()
    clock = FakeClock()
    reader = NvmlGpuReader(nvml_module=fake, retry_init_after_s=30.0, clock=clock)

    first = reader.read()
    assert first.available is False
    assert first.total_mib is None
    assert "NVIDIA driver not loaded" in (first.reason or "")
    assert "Driver Not Loaded" in (first.reason or "")

    # Within the interval the failure is reported from memory, not retried.
    clock.now += 29.0
    assert reader.read().reason == first.reason
    assert fake.init_calls == 1

    # The driver comes back; after the interval init is tried again.
    fake.init_error = None
    clock.now += 1.5
    recovered = reader.read()
    assert fake.init_calls == 2
    assert recovered.available is True
    assert recovered.total_mib == pytest.approx(24 * 1024)


def test_real_pynvml_without_driver_reports_unknown() -> None:
    if ctypes.util.find_library("nvidia-ml") or os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has an NVIDIA driver; see test_real_pynvml_with_driver")
    reader = NvmlGpuReader()
    try:
        reading = reader.read()
    finally:
        reader.close()
    assert reading.available is False
    assert reading.reason  # non-empty and human-readable
    assert reading.total_mib is None
    assert reading.to_status()["free_mib"] is None


def test_real_pynvml_with_driver_reports_device_zero() -> None:
    if not (ctypes.util.find_library("nvidia-ml") or os.path.exists("/dev/nvidiactl")):
        pytest.skip("no NVIDIA driver on this machine")
    reader = NvmlGpuReader()
    try:
        reading = reader.read()
    finally:
        reader.close()
    assert reading.available is True, reading.reason
    assert reading.total_mib is not None and reading.total_mib > 1024
    assert reading.free_mib is not None and 0 <= reading.free_mib <= reading.total_mib
    assert reading.devices[0].name


def test_two_devices_with_processes_in_mib() -> None:
    reader = NvmlGpuReader(nvml_module=_make_fake_nvml(_two_gpus()))
    reading = reader.read()

    assert reading.available is True
    assert reading.simulated is False
    assert reading.reason is None
    gpu0, gpu1 = reading.devices

    assert (gpu0.index, gpu0.name) == (0, "NVIDIA GeForce RTX 4090")
    assert gpu0.total_mib == 24576.0
    assert gpu0.used_mib == 10240.0
    assert gpu0.free_mib == 14336.0
    assert gpu0.processes_reported is True
    assert gpu0.processes == (
        GpuProcess(pid=777, used_mib=None),  # WDDM-style "not available"
        GpuProcess(pid=4242, used_mib=8192.0),
        GpuProcess(pid=5151, used_mib=512.0),
    )

    assert (gpu1.index, gpu1.name) == (1, "Tesla T4")
    assert gpu1.total_mib == 16384.0
    assert gpu1.free_mib == 15360.0
    assert gpu1.processes == ()
    assert gpu1.processes_reported is False

    # The headline numbers are device 0's, which the GPU worker uses.
    assert (reading.total_mib, reading.used_mib, reading.free_mib) == (24576.0, 10240.0, 14336.0)


def test_ullong_max_process_usage_means_unknown() -> None:
    device = FakeDevice("GPU", total=8 * GIB, used=GIB, compute=[(10, 2**64 - 1)])
    reading = NvmlGpuReader(nvml_module=_make_fake_nvml([device])).read()
    assert reading.devices[0].processes == (GpuProcess(pid=10, used_mib=None),)


def test_old_driver_without_v3_process_query_still_reports_memory() -> None:
    device = FakeDevice(
        "GPU",
        total=8 * GIB,
        used=GIB,
        compute=pynvml.NVMLLibraryMismatchError("no _v3"),
        graphics=pynvml.NVMLLibraryMismatchError("no _v3"),
    )
    reading = NvmlGpuReader(nvml_module=_make_fake_nvml([device])).read()
    assert reading.available is True
    assert reading.free_mib == 7168.0
    assert reading.devices[0].processes_reported is False


def test_nvml_error_mid_read_is_unknown_not_zeros() -> None:
    devices = _two_gpus()
    devices[1].memory_error = pynvml.NVMLError_Unknown()
    fake = _make_fake_nvml(devices)
    reader = NvmlGpuReader(nvml_module=fake)

    reading = reader.read()
    assert reading.available is False
    assert reading.devices == ()
    assert reading.total_mib is None and reading.free_mib is None and reading.used_mib is None
    assert "Unknown Error" in (reading.reason or "")
    status = reading.to_status()
    assert status["free_mib"] is None and status["used_mib"] is None and status["total_mib"] is None

    # A transient error keeps the NVML session; the next good read works.
    devices[1].memory_error = None
    assert reader.read().available is True
    assert (fake.init_calls, fake.shutdown_calls) == (1, 0)


def test_gpu_lost_mid_read_drops_the_session_and_reinitializes() -> None:
    fake = _make_fake_nvml(_two_gpus())
    reader = NvmlGpuReader(nvml_module=fake, clock=FakeClock())
    assert reader.read().available is True

    fake.count_error = pynvml.NVMLError_GpuIsLost()
    lost = reader.read()
    assert lost.available is False
    assert "fell off the bus" in (lost.reason or "")
    assert fake.shutdown_calls == 1

    fake.count_error = None
    assert reader.read().available is True
    assert fake.init_calls == 2


def test_no_devices_is_unknown() -> None:
    reading = NvmlGpuReader(nvml_module=_make_fake_nvml([])).read()
    assert reading.available is False
    assert "no NVIDIA GPUs" in (reading.reason or "")


def test_close_shuts_nvml_down_once() -> None:
    fake = _make_fake_nvml(_two_gpus())
    reader = NvmlGpuReader(nvml_module=fake)
    reader.read()
    reader.close()
    reader.close()
    assert fake.shutdown_calls == 1


# --------------------------------------------------------------------------
# Readings
# --------------------------------------------------------------------------


def test_gpu_reading_to_status_rounds_and_keeps_none() -> None:
    device = GpuDevice(
        index=0,
        name="X",
        total_mib=8191.96,
        used_mib=100.04,
        free_mib=8091.92,
        processes=(GpuProcess(pid=1, used_mib=99.95), GpuProcess(pid=2, used_mib=None)),
    )
    status = GpuReading(available=True, simulated=False, devices=(device,)).to_status()
    assert status["total_mib"] == 8192.0
    assert status["used_mib"] == 100.0
    assert status["free_mib"] == 8091.9
    assert status["reason"] is None
    assert status["devices"][0]["processes"] == [{"pid": 1, "used_mib": 100.0, "name": None},
                                                  {"pid": 2, "used_mib": None, "name": None}]

    unknown = UNKNOWN_GPU("because").to_status()
    assert unknown == {
        "available": False,
        "simulated": False,
        "total_mib": None,
        "free_mib": None,
        "used_mib": None,
        "reason": "because",
        "devices": [],
    }


def test_unavailable_reading_hides_numbers_even_with_devices() -> None:
    device = GpuDevice(index=0, name="X", total_mib=1.0, used_mib=0.0, free_mib=1.0)
    reading = GpuReading(available=False, simulated=False, devices=(device,), reason="stale")
    assert reading.free_mib is None


def test_host_reading_is_immutable_and_copies_its_input() -> None:
    rss = {1: 10.0}
    reading = HostReading(total_mib=1.0, available_mib=1.0, swap_total_mib=0.0, swap_used_mib=0.0, rss_mib_by_pid=rss)
    rss[2] = 20.0
    assert dict(reading.rss_mib_by_pid) == {1: 10.0}
    with pytest.raises(TypeError):
        reading.rss_mib_by_pid[3] = 30.0  # type: ignore[index]
    with pytest.raises(FrozenInstanceError):
        reading.total_mib = 2.0  # type: ignore[misc]


# --------------------------------------------------------------------------
# SimulatedGpu
# --------------------------------------------------------------------------


def test_simulated_gpu_arithmetic() -> None:
    sim = SimulatedGpu(total_mib=8192, name="Sim")
    sim.set_footprint("gpu-worker", 3000)
    sim.set_footprint("other", 1000)
    sim.set_pressure(500)

    reading = sim.read()
    assert reading.available is True and reading.simulated is True
    assert len(reading.devices) == 1
    assert reading.devices[0].name == "Sim"
    assert reading.devices[0].processes == ()
    assert reading.total_mib == 8192
    assert reading.free_mib == 8192 - 3000 - 1000 - 500
    assert reading.used_mib == 4500
    assert sim.pressure_mib == 500

    # Re-setting replaces, 0 removes.
    sim.set_footprint("gpu-worker", 2000)
    sim.set_footprint("other", 0)
    assert sim.read().free_mib == 8192 - 2000 - 500


def test_simulated_gpu_clamps_free_at_zero() -> None:
    sim = SimulatedGpu(total_mib=4096)
    sim.set_footprint("gpu-worker", 3000)
    sim.set_pressure(2000)
    reading = sim.read()
    assert reading.free_mib == 0.0
    assert reading.used_mib == 4096.0

    sim.set_pressure(0)
    assert sim.read().free_mib == 1096.0


def test_simulated_gpu_validates_inputs() -> None:
    sim = SimulatedGpu(total_mib=1024)
    with pytest.raises(ValueError):
        sim.set_pressure(-1)
    with pytest.raises(ValueError):
        sim.set_footprint("gpu-worker", -5)
    with pytest.raises(ValueError):
        SimulatedGpu(total_mib=0)
    assert sim.pressure_mib == 0.0  # the rejected value was not stored


# --------------------------------------------------------------------------
# TelemetryHistory
# --------------------------------------------------------------------------


def _snap(t: float) -> MemorySnapshot:
    host = HostReading(total_mib=1.0, available_mib=1.0, swap_total_mib=0.0, swap_used_mib=0.0, rss_mib_by_pid={})
    return MemorySnapshot(taken_at=t, gpu=UNKNOWN_GPU("test"), host=host)


def test_history_is_bounded_and_keeps_newest() -> None:
    history = TelemetryHistory(capacity=3)
    assert history.latest() is None
    assert len(history) == 0
    for t in range(5):
        history.append(_snap(float(t)))
    assert len(history) == 3
    assert [s.taken_at for s in history.list()] == [2.0, 3.0, 4.0]
    assert history.latest().taken_at == 4.0  # type: ignore[union-attr]


def test_history_since_is_inclusive_and_ordered() -> None:
    history = TelemetryHistory()
    assert history.capacity == 600
    for t in (10.0, 11.0, 12.0, 13.0):
        history.append(_snap(t))
    assert [s.taken_at for s in history.since(11.0)] == [11.0, 12.0, 13.0]
    assert [s.taken_at for s in history.since(12.5)] == [13.0]
    assert history.since(100.0) == []


def test_history_rejects_zero_capacity() -> None:
    with pytest.raises(ValueError):
        TelemetryHistory(capacity=0)


# --------------------------------------------------------------------------
# read_host
# --------------------------------------------------------------------------


def test_read_host_for_current_process_and_a_vanished_one() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped, so its pid no longer exists

    reading = read_host([os.getpid(), dead.pid])

    assert reading.total_mib > 256
    assert 0 < reading.available_mib <= reading.total_mib
    assert reading.swap_total_mib >= 0
    assert 0 <= reading.swap_used_mib <= max(reading.swap_total_mib, 0.0) + 1
    assert set(reading.rss_mib_by_pid) == {os.getpid()}
    own_rss = reading.rss_mib_by_pid[os.getpid()]
    assert 5 < own_rss < reading.total_mib  # an interpreter with pytest loaded
    status = reading.to_status()
    assert status["rss_mib_by_pid"] == {os.getpid(): round(own_rss, 1)}


# --------------------------------------------------------------------------
# wait_for_vram_recovery
# --------------------------------------------------------------------------


class FakeTime:
    """A clock that only advances when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _readings(values: list[float | None]) -> Any:
    remaining = list(values)

    def read() -> float | None:
        # Repeat the last value once the script runs out.
        return remaining.pop(0) if len(remaining) > 1 else remaining[0]

    return read


def test_vram_recovery_succeeds_once_enough_is_free() -> None:
    fake = FakeTime()
    # baseline 1000, the dead worker held 4000: needs free >= 1000 + 3000.
    read = _readings([1000.0, 2000.0, 3999.0, 4000.0])
    recovered = asyncio.run(
        wait_for_vram_recovery(read, 1000.0, 4000.0, poll_s=0.25, timeout_s=5.0, sleep=fake.sleep, clock=fake.clock)
    )
    assert recovered is True
    assert fake.sleeps == [0.25, 0.25, 0.25]


def test_vram_recovery_times_out_without_overshooting() -> None:
    fake = FakeTime()
    recovered = asyncio.run(
        wait_for_vram_recovery(
            _readings([1000.0]), 1000.0, 4000.0, poll_s=0.4, timeout_s=1.0, sleep=fake.sleep, clock=fake.clock
        )
    )
    assert recovered is False
    assert fake.now == pytest.approx(1.0)
    assert fake.sleeps == pytest.approx([0.4, 0.4, 0.2])


def test_vram_recovery_treats_unknown_as_not_recovered() -> None:
    fake = FakeTime()
    always_unknown = asyncio.run(
        wait_for_vram_recovery(
            _readings([None]), 0.0, 100.0, poll_s=0.5, timeout_s=2.0, sleep=fake.sleep, clock=fake.clock
        )
    )
    assert always_unknown is False

    fake = FakeTime()
    unknown_then_free = asyncio.run(
        wait_for_vram_recovery(
            _readings([None, None, 80.0]), 0.0, 100.0, poll_s=0.5, timeout_s=2.0, sleep=fake.sleep, clock=fake.clock
        )
    )
    assert unknown_then_free is True
    assert fake.now == pytest.approx(1.0)


def test_vram_recovery_validates_fraction() -> None:
    with pytest.raises(ValueError):
        asyncio.run(wait_for_vram_recovery(lambda: 0.0, 0.0, 1.0, fraction=0.0))


# --------------------------------------------------------------------------
# detect_gpu_offload_support
# --------------------------------------------------------------------------


@pytest.mark.parametrize("supported", [True, False])
def test_offload_support_reflects_llama_cpp(monkeypatch: pytest.MonkeyPatch, supported: bool) -> None:
    fake = types.ModuleType("llama_cpp")
    fake.llama_supports_gpu_offload = lambda: supported  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)

    result = detect_gpu_offload_support()
    assert result.supported is supported
    if not supported:
        assert 'CMAKE_ARGS="-DGGML_CUDA=on"' in result.message
        assert "--force-reinstall --no-cache-dir llama-cpp-python" in result.message


def test_offload_support_unknown_when_llama_cpp_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    result = detect_gpu_offload_support()
    assert result.supported is None
    assert "could not be imported" in result.message


def test_module_has_no_qt_dependency() -> None:
    source = Path(telemetry.__file__).read_text(encoding="utf-8")
    assert "PySide" not in source and "PyQt" not in source


def test_a_gpu_process_is_named_when_we_can_see_it() -> None:
    import psutil

    device = FakeDevice("GPU", total=8 * GIB, used=GIB, compute=[(os.getpid(), 2**20 * 100)])
    (process,) = NvmlGpuReader(nvml_module=_make_fake_nvml([device])).read().devices[0].processes
    assert process.name == psutil.Process().name()
    assert process.to_status() == {"pid": os.getpid(), "used_mib": 100.0, "name": process.name}


def test_a_gpu_too_small_for_the_model_and_its_reserve_is_named_once():
    from tray_app.core.memory.telemetry import gpu_too_small_reason

    reason = gpu_too_small_reason(2048, "SmolLM2", 1103, 1024)
    assert reason and "2048 MiB" in reason and "1103 MiB" in reason and "reserve_mib" in reason
    assert gpu_too_small_reason(2048, "SmolLM2", 806, 1024) is None
    assert gpu_too_small_reason(None, "SmolLM2", 1103, 1024) is None
    # Over the whole card: tried, and a real out-of-memory fails it over.
    assert gpu_too_small_reason(2048, "big", 4096, 1024) is None
