"""GPU memory readers for every vendor, and the choice of one for this machine.

- NVIDIA: NVML (`telemetry.NvmlGpuReader`).
- AMD: the amdgpu driver's sysfs for the card, fdinfo for each process (`AmdGpuReader`).
- Intel and other DRM drivers: fdinfo for each process; the card's total from sysfs where a
  kernel publishes it, else from llama.cpp's device list (`DrmFdinfoGpuReader`).
- Anything else llama.cpp can drive (Windows, macOS, a driver without fdinfo): llama.cpp's own
  device list, from a probe process (`LlamaReportGpuReader`).
- Nothing: an explicit unknown with what each was missing, looked at again after 30 s, then less often (up to 5 min)
  (`RedetectingGpuReader`).

Every reader fills the same `GpuReading` NVML's does, so "other apps", the give-back to games
and the worker's own footprint work the same way wherever per-process numbers exist.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from .drm import (
    PCI_IDS_PATHS,
    PROC_ROOT,
    SYS_ROOT,
    CardClients,
    ClientScanner,
    DrmCard,
    card_label,
    clients_of_card,
    intel_vram_total_bytes,
    read_pci_ids,
    read_sysfs_int,
    read_text,
    scan_cards,
)
from .llama_devices import LlamaDeviceProbe, no_device_reason, shared_probe
from .telemetry import MIB, UNKNOWN_GPU, GpuDevice, GpuProcess, GpuReader, GpuReading, NvmlGpuReader, process_name

# Drivers whose cards another reader owns: NVIDIA's through NVML (its fdinfo has no memory).
_NOT_FDINFO_DRIVERS = ("nvidia",)


class _CardNames:
    """Card labels, worked out once per card: the PCI database is a megabyte of text."""

    def __init__(self, pci_ids_paths: tuple[Path, ...]) -> None:
        self._pci_ids_paths = pci_ids_paths
        self._labels: dict[str, str] = {}

    def label(self, card: DrmCard) -> str:
        key = card.pci_slot or str(card.path)
        if key not in self._labels:
            product = (read_text(card.device_dir / "product_name") or "").strip() or None
            pci_ids = None if product else read_pci_ids(self._pci_ids_paths)
            self._labels[key] = card_label(card, product, pci_ids)
        return self._labels[key]


def _device(index: int, name: str, total_bytes: int, used_bytes: int, clients: CardClients) -> GpuDevice:
    processes = tuple(GpuProcess(pid=pid, used_mib=used / MIB, name=process_name(pid))
                      for pid, used in sorted(clients.vram_bytes_by_pid.items()))
    return GpuDevice(index=index, name=name, total_mib=total_bytes / MIB, used_mib=used_bytes / MIB,
                     free_mib=max(0, total_bytes - used_bytes) / MIB,
                     processes=processes, processes_reported=clients.reported)


def _largest_first(devices: list[GpuDevice]) -> tuple[GpuDevice, ...]:
    """Devices by VRAM, largest first (card order among equals), renumbered. The GPU worker runs
    on device 0, and llama.cpp's Vulkan backend by default takes the discrete GPUs over an
    integrated one, whose VRAM is a small carve-out of host RAM."""
    ordered = sorted(devices, key=lambda device: -device.total_mib)
    return tuple(replace(device, index=i) for i, device in enumerate(ordered))


class AmdGpuReader:
    """AMD cards through the amdgpu driver: the card's VRAM from sysfs (the whole card, every
    user's processes and the driver's own), each process's from its fdinfo."""

    def __init__(self, sys_root: Path = SYS_ROOT, proc_root: Path = PROC_ROOT,
                 pci_ids_paths: tuple[Path, ...] = PCI_IDS_PATHS) -> None:
        self._sys_root = sys_root
        self._clients = ClientScanner(proc_root)
        self._names = _CardNames(pci_ids_paths)

    def read(self) -> GpuReading:
        cards = [card for card in scan_cards(self._sys_root) if card.driver == "amdgpu"]
        if not cards:
            return UNKNOWN_GPU(f"no amdgpu card in {self._sys_root / 'class' / 'drm'}")
        clients = self._clients.scan()
        found, missing = [], []
        for card in cards:
            total = read_sysfs_int(card.device_dir / "mem_info_vram_total")
            used = read_sysfs_int(card.device_dir / "mem_info_vram_used")
            if not total or used is None:
                missing.append(card.name)
                continue
            mine = clients_of_card(clients, card, cards_with_driver=len(cards))
            found.append(_device(len(found), self._names.label(card), total, used, mine))
        if not found:
            return UNKNOWN_GPU(f"the amdgpu driver publishes no VRAM numbers (mem_info_vram_total, "
                               f"mem_info_vram_used) for {', '.join(missing)}")
        return GpuReading(available=True, simulated=False, devices=_largest_first(found))

    def close(self) -> None:
        """Nothing held between reads."""


class DrmFdinfoGpuReader:
    """Cards of other DRM drivers (Intel's i915 and xe) through fdinfo.

    Used is what the processes we can see hold in the card's VRAM regions: another user's
    processes are hidden from us without root, so it can read low. The total comes from sysfs
    where the kernel publishes one, else from `total_mib_fallback` (llama.cpp's first device,
    the GPU worker's), which only the first card may use.
    """

    def __init__(self, sys_root: Path = SYS_ROOT, proc_root: Path = PROC_ROOT, *,
                 total_mib_fallback: Callable[[], tuple[float | None, str]] | None = None,
                 pci_ids_paths: tuple[Path, ...] = PCI_IDS_PATHS) -> None:
        self._sys_root = sys_root
        self._clients = ClientScanner(proc_root)
        self._total_mib_fallback = total_mib_fallback
        self._names = _CardNames(pci_ids_paths)

    def read(self) -> GpuReading:
        cards = [card for card in scan_cards(self._sys_root)
                 if card.driver is not None and card.driver not in _NOT_FDINFO_DRIVERS]
        if not cards:
            return UNKNOWN_GPU(f"no DRM card in {self._sys_root / 'class' / 'drm'}")
        clients = self._clients.scan()
        found, problems = [], []
        for card in cards:
            same_driver = sum(1 for other in cards if other.driver == card.driver)
            mine = clients_of_card(clients, card, cards_with_driver=same_driver)
            total = intel_vram_total_bytes(card)
            if total is None and not mine.reported:
                problems.append(f"{card.name} ({card.driver}): no VRAM figure in sysfs, and no process we can "
                                "see reports VRAM for it in fdinfo (an integrated GPU has none)")
                continue
            if total is None:
                total, why_not = self._fallback_total(first=not found)
                if total is None:
                    problems.append(f"{card.name} ({card.driver}): fdinfo reports each process's VRAM, but "
                                    f"nothing tells the card's total ({why_not})")
                    continue
            used = sum(mine.vram_bytes_by_pid.values())
            found.append(_device(len(found), self._names.label(card), total, used, mine))
        if not found:
            return UNKNOWN_GPU("; ".join(problems))
        return GpuReading(available=True, simulated=False, devices=_largest_first(found))

    def _fallback_total(self, *, first: bool) -> tuple[int | None, str]:
        why = "sysfs has none: mainline i915 and xe publish no VRAM total"
        if not first:
            return None, f"{why}, and llama.cpp's device list speaks for the first card only"
        if self._total_mib_fallback is None:
            return None, f"{why}, and llama-server is not there to ask"
        total_mib, why_not = self._total_mib_fallback()
        if total_mib is None:
            return None, f"{why}; {why_not}"
        return int(total_mib * MIB), ""

    def close(self) -> None:
        """Nothing held between reads."""


class LlamaReportGpuReader:
    """llama.cpp's own device list: total and free per device, from a probe process.

    Its numbers are as old as the last probe (refreshed in the background, see
    `LlamaDeviceProbe`), and it names no processes, so nobody's footprint is read from it.
    """

    def __init__(self, probe: LlamaDeviceProbe) -> None:
        self._probe = probe

    def read(self) -> GpuReading:
        report = self._probe.report()
        if report.error is not None:
            return UNKNOWN_GPU(f"llama.cpp's device list is not available: {report.error}")
        if not report.devices:
            return UNKNOWN_GPU(no_device_reason(self._probe.argv[0]))
        devices = tuple(GpuDevice(index=i, name=f"{d.name}: {d.description}", total_mib=d.total_mib,
                                  used_mib=max(0.0, d.total_mib - d.free_mib), free_mib=d.free_mib,
                                  processes=(), processes_reported=False)
                        for i, d in enumerate(report.devices))
        return GpuReading(available=True, simulated=False, devices=devices)

    def close(self) -> None:
        """The probe is shared by every reader of this binary; it holds no process between runs."""


class RedetectingGpuReader:
    """No reader sees a GPU yet: unknown, with what each one was missing, and another look
    after `retry_after_s`, as NVML's reader retries its init: a driver that finishes loading
    after the tray started, or an update that needed a reboot, is found without a restart.
    Each look that finds nothing doubles the wait, up to `max_retry_after_s`: a look may run
    `llama-server --list-devices`, a process that loads all of ggml (about 18 ms of CPU), and
    on a machine with no GPU at all it would otherwise run every minute for as long as the
    service does, the largest part of its idle CPU. From the first look that finds a device on, reads go
    through that reader."""

    def __init__(self, reason: str, find: Callable[[], tuple[GpuReader | None, str]], *,
                 retry_after_s: float = 30.0, max_retry_after_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._reason = reason
        self._find = find
        self._retry_after_s = retry_after_s
        self._max_retry_after_s = max_retry_after_s
        self._clock = clock
        self._looked_at = clock()
        self._found: GpuReader | None = None
        self._lock = threading.Lock()

    def read(self) -> GpuReading:
        with self._lock:
            if self._found is None and self._clock() - self._looked_at >= self._retry_after_s:
                self._looked_at = self._clock()
                self._found, self._reason = self._find()
                if self._found is None:
                    self._retry_after_s = min(self._retry_after_s * 2, self._max_retry_after_s)
            found, reason = self._found, self._reason
        return found.read() if found is not None else UNKNOWN_GPU(reason)

    def close(self) -> None:
        with self._lock:
            if self._found is not None:
                self._found.close()


def first_device_total_mib(probe: LlamaDeviceProbe) -> Callable[[], tuple[float | None, str]]:
    """llama.cpp's first device's total, the GPU worker's. A card's total does not change, so
    once known it is kept: asking again would start a GPU context each refresh for nothing."""
    known: list[float] = []

    def total() -> tuple[float | None, str]:
        if known:
            return known[0], ""
        report = probe.report()
        if report.error is not None:
            return None, f"llama.cpp's device list is not available: {report.error}"
        if not report.devices:
            return None, "llama.cpp sees no GPU device"
        known.append(report.devices[0].total_mib)
        return known[0], ""
    return total


def llama_server_probe(llama_server_path: str = "",
                       environment: Mapping[str, str] | None = None) -> LlamaDeviceProbe | None:
    """A probe of the llama-server the GPU worker would run, in the environment the GPU worker
    gets (its libraries, the user's visible devices, which the service hides from itself);
    None when there is no llama-server. `environment` stands for the service's own."""
    from ..engine.runtime import LaunchRequest, LlamaServerRuntime, choose_runtime
    from ..engine.worker import worker_environment

    runtime = choose_runtime("llama-server", llama_server_path).runtime
    if not isinstance(runtime, LlamaServerRuntime):
        return None
    gpu_launch = LaunchRequest(model_path=Path(), port=0, n_ctx=0, n_gpu_layers=999, n_batch=0, n_threads=0)
    env = worker_environment(dict(os.environ if environment is None else environment), runtime.environment(gpu_launch))
    return shared_probe([str(runtime.binary)], env)


def detect_gpu_reader(llama_server_path: str = "", *, environment: Mapping[str, str] | None = None,
                      sys_root: Path = SYS_ROOT, proc_root: Path = PROC_ROOT,
                      nvml: GpuReader | None = None,
                      probe: Callable[[], LlamaDeviceProbe | None] | None = None,
                      clock: Callable[[], float] = time.monotonic) -> GpuReader:
    """The reader for this machine's GPU: NVML when it sees a device, else the amdgpu reader
    when there is an amdgpu card, else fdinfo for other DRM cards that report VRAM, else
    llama.cpp's device list, else an explicit unknown that says what each was missing (and
    looks again now and then)."""
    nvml = nvml if nvml is not None else NvmlGpuReader()

    def find() -> tuple[GpuReader | None, str]:
        llama_probe = (probe or (lambda: llama_server_probe(llama_server_path, environment)))()
        return find_gpu_reader(nvml, sys_root, proc_root, llama_probe)

    reader, reason = find()
    return reader if reader is not None else RedetectingGpuReader(reason, find, clock=clock)


def find_gpu_reader(nvml: GpuReader, sys_root: Path, proc_root: Path,
                    llama_probe: LlamaDeviceProbe | None) -> tuple[GpuReader | None, str]:
    """The first reader, in detect_gpu_reader's order, that sees a device now; else None and
    what each was missing."""
    nvml_reading = nvml.read()
    if nvml_reading.available:
        return nvml, ""
    nvml.close()
    # The service says "serving CPU-only" itself, after all the reasons.
    reasons = [nvml_reading.reason or "NVML sees no NVIDIA GPU"]

    cards = scan_cards(sys_root)
    fallback = first_device_total_mib(llama_probe) if llama_probe is not None else None
    candidates: list[GpuReader] = []
    if any(card.driver == "amdgpu" for card in cards):
        candidates.append(AmdGpuReader(sys_root, proc_root))
    if any(card.driver not in (None, "amdgpu", *_NOT_FDINFO_DRIVERS) for card in cards):
        candidates.append(DrmFdinfoGpuReader(sys_root, proc_root, total_mib_fallback=fallback))
    if not candidates:
        reasons.append(f"no AMD or Intel card in {sys_root / 'class' / 'drm'}")
    if llama_probe is not None:
        candidates.append(LlamaReportGpuReader(llama_probe))
    for candidate in candidates:
        reading = candidate.read()
        if reading.available:
            return candidate, ""
        reasons.append(reading.reason or f"{type(candidate).__name__} sees no device")
    if llama_probe is None:
        reasons.append("llama-server is not installed, so llama.cpp can't be asked for its devices")
    return None, "; ".join(reasons)
