"""GPU memory beyond NVML: AMD (amdgpu sysfs + fdinfo), Intel (i915/xe fdinfo), llama.cpp's own
device list, and the choice among them.

The kernel's files are faked as trees under tmp_path, in the shapes the kernel prints them
(Documentation/gpu/drm-usage-stats.rst, amdgpu_fdinfo.c, i915_drm_client.c, xe_drm_client.c);
the readers take their /sys and /proc roots as parameters. The llama.cpp probe runs a real
process where it can.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tray_app.core.memory.drm import (
    ClientScanner,
    DrmCard,
    DrmClient,
    card_label,
    clients_of_card,
    parse_fdinfo,
    parse_size,
    pci_device_name,
    scan_cards,
    scan_clients,
)
from tray_app.core.memory.gpu_readers import (
    AmdGpuReader,
    DrmFdinfoGpuReader,
    LlamaReportGpuReader,
    RedetectingGpuReader,
    detect_gpu_reader,
    first_device_total_mib,
    llama_server_probe,
)
from tray_app.core.memory.llama_devices import (
    LlamaDevice,
    LlamaDeviceProbe,
    parse_list_devices,
    run_list_devices,
)
from tray_app.core.memory.telemetry import MIB, UNKNOWN_GPU, GpuDevice, GpuReading

GIB = 1024 * MIB
WORKER_PID = 4242  # "ours": the GPU worker
GAME_PID = 5151  # another app on the same card
AMD_SLOT = "0000:03:00.0"
INTEL_SLOT = "0000:0a:00.0"


# --------------------------------------------------------------------------
# Fake /sys and /proc trees
# --------------------------------------------------------------------------


def add_card(sys_root: Path, name: str, *, driver: str, slot: str, pci_id: str,
             files: dict[str, str] | None = None) -> Path:
    """/sys/class/drm/<name>/device with a uevent as the PCI core writes it, plus `files`."""
    device = sys_root / "class" / "drm" / name / "device"
    device.mkdir(parents=True)
    (device / "uevent").write_text(f"DRIVER={driver}\nPCI_CLASS=30000\nPCI_ID={pci_id}\n"
                                   f"PCI_SUBSYS_ID=1DA2:E471\nPCI_SLOT_NAME={slot}\nMODALIAS=pci:v0\n")
    # A connector beside the card, which is not a card.
    (sys_root / "class" / "drm" / f"{name}-DP-1").mkdir()
    for relative, text in (files or {}).items():
        path = device / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return device


def open_fd(proc_root: Path, pid: int, fd: int, fdinfo: str, target: str = "/dev/dri/renderD128") -> None:
    """An fd of `pid` pointing at `target`, with its fdinfo text."""
    (proc_root / str(pid) / "fd").mkdir(parents=True, exist_ok=True)
    (proc_root / str(pid) / "fdinfo").mkdir(parents=True, exist_ok=True)
    os.symlink(target, proc_root / str(pid) / "fd" / str(fd))
    (proc_root / str(pid) / "fdinfo" / str(fd)).write_text(f"pos:\t0\nflags:\t02100002\nmnt_id:\t24\n{fdinfo}")


def amdgpu_fdinfo(client_id: int, vram_kib: int, slot: str = AMD_SLOT) -> str:
    """What amdgpu prints on a 6.x kernel: the common stats by region, then its legacy keys."""
    return (f"drm-driver:\tamdgpu\ndrm-client-id:\t{client_id}\ndrm-pdev:\t{slot}\npasid:\t32781\n"
            f"drm-total-gtt:\t6 MiB\ndrm-resident-gtt:\t6 MiB\n"
            f"drm-total-vram:\t{vram_kib} KiB\ndrm-shared-vram:\t0\ndrm-active-vram:\t0\n"
            f"drm-resident-vram:\t{vram_kib} KiB\ndrm-purgeable-vram:\t0\n"
            f"drm-memory-vram:\t{vram_kib} KiB\ndrm-memory-gtt: \t6144 KiB\ndrm-memory-cpu: \t0 KiB\n"
            f"amd-evicted-vram:\t0 KiB\namd-requested-vram:\t{vram_kib} KiB\n"
            f"drm-engine-gfx:\t160000000000 ns\n")


def i915_fdinfo(client_id: int, local0_resident: str, local0_total: str, slot: str = INTEL_SLOT) -> str:
    """i915 on a discrete card: every region of the device, even empty ones."""
    return (f"drm-driver:\ti915\ndrm-client-id:\t{client_id}\ndrm-pdev:\t{slot}\n"
            "drm-total-system0:\t4 MiB\ndrm-shared-system0:\t0\ndrm-active-system0:\t0\n"
            "drm-resident-system0:\t4 MiB\ndrm-purgeable-system0:\t0\n"
            "drm-total-stolen-local0:\t0\ndrm-resident-stolen-local0:\t0\n"
            f"drm-total-local0:\t{local0_total}\ndrm-shared-local0:\t0\ndrm-active-local0:\t0\n"
            f"drm-resident-local0:\t{local0_resident}\ndrm-purgeable-local0:\t0\n"
            "drm-engine-render:\t25662044495 ns\ndrm-engine-copy:\t0 ns\n")


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    sys_root, proc_root = tmp_path / "sys", tmp_path / "proc"
    (sys_root / "class" / "drm").mkdir(parents=True)
    proc_root.mkdir()
    return sys_root, proc_root


def amd_card_with_two_processes(sys_root: Path, proc_root: Path) -> None:
    """A 16 GiB card with 6 GiB used: the worker holds 4 GiB through two fds of one client
    (a dup) plus 256 MiB through a second client; a game holds 1 GiB. An fd to another card,
    and a plain file, are not the card's."""
    add_card(sys_root, "card1", driver="amdgpu", slot=AMD_SLOT, pci_id="1002:744C", files={
        "mem_info_vram_total": f"{16 * GIB}\n", "mem_info_vram_used": f"{6 * GIB}\n",
        "product_name": "\n",  # most consumer boards have no FRU product name
    })
    open_fd(proc_root, WORKER_PID, 7, amdgpu_fdinfo(client_id=91, vram_kib=4 * 1024 * 1024))
    open_fd(proc_root, WORKER_PID, 8, amdgpu_fdinfo(client_id=91, vram_kib=4 * 1024 * 1024))
    open_fd(proc_root, WORKER_PID, 9, amdgpu_fdinfo(client_id=92, vram_kib=256 * 1024))
    open_fd(proc_root, WORKER_PID, 10, amdgpu_fdinfo(client_id=93, vram_kib=512 * 1024, slot="0000:0b:00.0"),
            target="/dev/dri/renderD129")
    open_fd(proc_root, WORKER_PID, 3, "drm-driver:\tamdgpu\n", target="/home/user/model.gguf")
    open_fd(proc_root, GAME_PID, 20, amdgpu_fdinfo(client_id=40, vram_kib=1024 * 1024))


# --------------------------------------------------------------------------
# AMD
# --------------------------------------------------------------------------


def test_amd_card_with_two_processes_one_ours(roots: tuple[Path, Path]) -> None:
    sys_root, proc_root = roots
    amd_card_with_two_processes(sys_root, proc_root)
    reading = AmdGpuReader(sys_root, proc_root, pci_ids_paths=()).read()

    assert reading.available and not reading.simulated
    assert (reading.total_mib, reading.used_mib, reading.free_mib) == (16384.0, 6144.0, 10240.0)
    (device,) = reading.devices
    assert device.name == "AMD GPU [1002:744c]"
    assert device.processes_reported
    by_pid = {process.pid: process.used_mib for process in device.processes}
    # The dup'd client counted once; the other card's client and the plain file not at all.
    assert by_pid == {WORKER_PID: 4096.0 + 256.0, GAME_PID: 1024.0}
    # What the service derives from it, as on NVIDIA: the worker's own footprint, and the others'.
    ours = [p.used_mib for p in device.processes if p.pid == WORKER_PID]
    strangers = [p for p in device.processes if p.pid != WORKER_PID]
    assert ours == [4352.0] and [p.pid for p in strangers] == [GAME_PID]


def test_amd_driver_that_reports_nothing(roots: tuple[Path, Path]) -> None:
    """No mem_info files (a driver too old, or the radeon driver's sysfs): unknown, saying what
    is missing, never zeros."""
    sys_root, proc_root = roots
    add_card(sys_root, "card0", driver="amdgpu", slot=AMD_SLOT, pci_id="1002:6798")
    open_fd(proc_root, WORKER_PID, 7, f"drm-driver:\tamdgpu\ndrm-pdev:\t{AMD_SLOT}\ndrm-client-id:\t3\n")
    reading = AmdGpuReader(sys_root, proc_root).read()
    assert not reading.available and reading.free_mib is None and reading.devices == ()
    assert "mem_info_vram_total" in (reading.reason or "") and "card0" in (reading.reason or "")


def test_amd_fdinfo_without_memory_keys_means_processes_unknown(roots: tuple[Path, Path]) -> None:
    sys_root, proc_root = roots
    add_card(sys_root, "card0", driver="amdgpu", slot=AMD_SLOT, pci_id="1002:744C",
             files={"mem_info_vram_total": f"{8 * GIB}\n", "mem_info_vram_used": f"{GIB}\n"})
    open_fd(proc_root, WORKER_PID, 7, f"drm-driver:\tamdgpu\ndrm-pdev:\t{AMD_SLOT}\ndrm-client-id:\t3\n")
    (device,) = AmdGpuReader(sys_root, proc_root).read().devices
    # The card's numbers still stand; an empty list must not read as "nobody uses it".
    assert device.used_mib == 1024.0 and device.processes == () and not device.processes_reported


def test_amd_older_kernel_with_only_the_legacy_key(roots: tuple[Path, Path]) -> None:
    """Kernels before the common memory stats print only drm-memory-vram, and no client id on
    the oldest: each fd then counts on its own."""
    sys_root, proc_root = roots
    add_card(sys_root, "card0", driver="amdgpu", slot=AMD_SLOT, pci_id="1002:73BF",
             files={"mem_info_vram_total": f"{16 * GIB}\n", "mem_info_vram_used": f"{2 * GIB}\n",
                    "product_name": "AMD Radeon Pro W6800\n"})
    open_fd(proc_root, WORKER_PID, 7, f"drm-driver:\tamdgpu\ndrm-pdev:\t{AMD_SLOT}\ndrm-memory-vram:\t524288 KiB\n")
    open_fd(proc_root, WORKER_PID, 8, f"drm-driver:\tamdgpu\ndrm-pdev:\t{AMD_SLOT}\ndrm-memory-vram:\t524288 KiB\n")
    (device,) = AmdGpuReader(sys_root, proc_root).read().devices
    assert device.name == "AMD Radeon Pro W6800"
    assert [(p.pid, p.used_mib) for p in device.processes] == [(WORKER_PID, 1024.0)]


def test_amd_largest_card_is_device_zero(roots: tuple[Path, Path]) -> None:
    """An APU's small carve-out (card0) and a discrete card (card1): the worker's device 0 is
    the discrete one, as llama.cpp's Vulkan backend picks it."""
    sys_root, proc_root = roots
    add_card(sys_root, "card0", driver="amdgpu", slot="0000:0c:00.0", pci_id="1002:164E",
             files={"mem_info_vram_total": f"{512 * MIB}\n", "mem_info_vram_used": f"{100 * MIB}\n"})
    add_card(sys_root, "card1", driver="amdgpu", slot=AMD_SLOT, pci_id="1002:744C",
             files={"mem_info_vram_total": f"{24 * GIB}\n", "mem_info_vram_used": f"{GIB}\n"})
    reading = AmdGpuReader(sys_root, proc_root, pci_ids_paths=()).read()
    assert [(d.index, d.name, d.total_mib) for d in reading.devices] == [
        (0, "AMD GPU [1002:744c]", 24576.0), (1, "AMD GPU [1002:164e]", 512.0)]
    assert reading.total_mib == 24576.0


def test_amd_card_is_named_from_the_pci_database(roots: tuple[Path, Path], tmp_path: Path) -> None:
    sys_root, proc_root = roots
    add_card(sys_root, "card0", driver="amdgpu", slot=AMD_SLOT, pci_id="1002:744C",
             files={"mem_info_vram_total": f"{24 * GIB}\n", "mem_info_vram_used": "0\n"})
    pci_ids = tmp_path / "pci.ids"
    pci_ids.write_text("# comment\n1000  Broadcom\n\t0001  53c810\n"
                       "1002  Advanced Micro Devices, Inc. [AMD/ATI]\n"
                       "\t73bf  Navi 21 [Radeon RX 6800/6800 XT / 6900 XT]\n"
                       "\t744c  Navi 31 [Radeon RX 7900 XT/7900 XTX/7900 GRE/7900M]\n"
                       "\t\t1da2 e471  Sapphire board\n1003  ULSI Systems\n")
    (device,) = AmdGpuReader(sys_root, proc_root, pci_ids_paths=(tmp_path / "absent", pci_ids)).read().devices
    assert device.name == "AMD Navi 31 [Radeon RX 7900 XT/7900 XTX/7900 GRE/7900M]"


# --------------------------------------------------------------------------
# Intel (and other DRM drivers) through fdinfo
# --------------------------------------------------------------------------


def test_intel_i915_card_with_two_processes_one_ours(roots: tuple[Path, Path]) -> None:
    """Out-of-tree i915 publishes lmem_total_bytes on the card; used is what the processes
    hold resident in local0 (system0 and stolen memory are not VRAM)."""
    sys_root, proc_root = roots
    add_card(sys_root, "card0", driver="i915", slot=INTEL_SLOT, pci_id="8086:56A0")
    (sys_root / "class" / "drm" / "card0" / "lmem_total_bytes").write_text(f"{16 * GIB}\n")
    # One client through two fds: 3 GiB resident of the 4 GiB it asked for.
    for fd in (7, 8):
        open_fd(proc_root, WORKER_PID, fd, i915_fdinfo(11, local0_resident="3072 MiB", local0_total="4096 MiB"))
    open_fd(proc_root, GAME_PID, 5, i915_fdinfo(12, local0_resident="524288 KiB", local0_total="524288 KiB"))
    reading = DrmFdinfoGpuReader(sys_root, proc_root, pci_ids_paths=()).read()

    assert reading.available
    (device,) = reading.devices
    assert device.name == "Intel GPU [8086:56a0]"
    assert {p.pid: p.used_mib for p in device.processes} == {WORKER_PID: 3072.0, GAME_PID: 512.0}
    assert device.processes_reported
    assert (device.total_mib, device.used_mib, device.free_mib) == (16384.0, 3584.0, 12800.0)


def test_intel_xe_card_from_tile_sysfs(roots: tuple[Path, Path]) -> None:
    sys_root, proc_root = roots
    add_card(sys_root, "card1", driver="xe", slot=INTEL_SLOT, pci_id="8086:E20B",
             files={"tile0/physical_vram_size_bytes": f"{12 * GIB}\n"})
    open_fd(proc_root, WORKER_PID, 7, f"drm-driver:\txe\ndrm-client-id:\t5\ndrm-pdev:\t{INTEL_SLOT}\n"
                                      "drm-total-system:\t0\ndrm-resident-system:\t0\ndrm-total-gtt:\t192 KiB\n"
                                      "drm-total-vram0:\t2048 MiB\ndrm-shared-vram0:\t16 MiB\n"
                                      "drm-resident-vram0:\t2000 MiB\ndrm-total-stolen:\t0\n"
                                      "drm-cycles-rcs:\t28257900\ndrm-total-cycles-rcs:\t7655183225\n")
    (device,) = DrmFdinfoGpuReader(sys_root, proc_root).read().devices
    assert (device.total_mib, device.used_mib) == (12288.0, 2000.0)
    assert [(p.pid, p.used_mib) for p in device.processes] == [(WORKER_PID, 2000.0)]


def test_intel_without_a_sysfs_total_takes_llama_cpps(roots: tuple[Path, Path]) -> None:
    """Mainline i915 and xe publish no VRAM total: the card's total is llama.cpp's first device's."""
    sys_root, proc_root = roots
    add_card(sys_root, "card0", driver="i915", slot=INTEL_SLOT, pci_id="8086:56A0")
    open_fd(proc_root, GAME_PID, 5, i915_fdinfo(12, local0_resident="1024 MiB", local0_total="1024 MiB"))
    reader = DrmFdinfoGpuReader(sys_root, proc_root, total_mib_fallback=lambda: (15473.0, ""))
    (device,) = reader.read().devices
    assert (device.total_mib, device.used_mib, device.free_mib) == (15473.0, 1024.0, 14449.0)

    without = DrmFdinfoGpuReader(sys_root, proc_root, total_mib_fallback=lambda: (None, "it timed out")).read()
    assert not without.available and "it timed out" in (without.reason or "")
    assert "mainline i915 and xe publish no VRAM total" in (without.reason or "")


def test_intel_integrated_gpu_has_no_vram(roots: tuple[Path, Path]) -> None:
    """An integrated GPU's clients hold only system memory: no VRAM to read, said so."""
    sys_root, proc_root = roots
    add_card(sys_root, "card0", driver="i915", slot="0000:00:02.0", pci_id="8086:46A6")
    open_fd(proc_root, WORKER_PID, 7, "drm-driver:\ti915\ndrm-client-id:\t3\ndrm-pdev:\t0000:00:02.0\n"
                                      "drm-total-system0:\t100 MiB\ndrm-resident-system0:\t100 MiB\n")
    reading = DrmFdinfoGpuReader(sys_root, proc_root, total_mib_fallback=lambda: (8000.0, "")).read()
    assert not reading.available and reading.devices == ()
    assert "an integrated GPU has none" in (reading.reason or "")


def test_intel_driver_that_reports_nothing(roots: tuple[Path, Path]) -> None:
    """A kernel whose i915 prints no memory stats: unknown, never zeros."""
    sys_root, proc_root = roots
    add_card(sys_root, "card0", driver="i915", slot=INTEL_SLOT, pci_id="8086:56A0")
    open_fd(proc_root, WORKER_PID, 7, f"drm-driver:\ti915\ndrm-client-id:\t3\ndrm-pdev:\t{INTEL_SLOT}\n"
                                      "drm-engine-render:\t1 ns\n")
    reading = DrmFdinfoGpuReader(sys_root, proc_root).read()
    assert not reading.available and reading.used_mib is None
    assert "card0 (i915)" in (reading.reason or "")


# --------------------------------------------------------------------------
# The kernel's text
# --------------------------------------------------------------------------


def test_sizes_in_the_units_the_kernel_prints() -> None:
    assert parse_size("0") == 0
    assert parse_size("4096") == 4096
    assert parse_size("1232896 KiB") == 1232896 * 1024
    assert parse_size("16 MiB") == 16 * MIB
    assert parse_size("2 GiB") == 2 * GIB
    assert parse_size("12 ns") is None and parse_size("") is None


def test_fdinfo_prefers_resident_over_total() -> None:
    client = parse_fdinfo("drm-driver:\txe\ndrm-total-vram0:\t4 MiB\ndrm-resident-vram0:\t1 MiB\n"
                          "drm-total-vram1:\t2 MiB\n")
    # vram0's resident, and vram1's total where it prints nothing else.
    assert client == DrmClient(driver="xe", pdev=None, client_id=None, vram_bytes=3 * MIB)


def test_fdinfo_of_a_file_that_is_not_drm() -> None:
    assert parse_fdinfo("pos:\t0\nflags:\t0100000\nmnt_id:\t24\n") is None


def test_a_client_without_pdev_belongs_to_the_only_card_of_its_driver() -> None:
    card = DrmCard("card0", Path("/sys/class/drm/card0"), "amdgpu", AMD_SLOT, 0x1002, 0x744C)
    client = DrmClient(driver="amdgpu", pdev=None, client_id="1", vram_bytes=MIB)
    assert clients_of_card([(1, 3, client)], card).vram_bytes_by_pid == {1: MIB}
    # With two amdgpu cards it could be either's.
    assert clients_of_card([(1, 3, client)], card, cards_with_driver=2).vram_bytes_by_pid == {}


def test_a_client_shared_by_two_processes_counts_once() -> None:
    """An fd passed over a socket: the same client in two processes, charged to the first."""
    card = DrmCard("card0", Path("/sys/class/drm/card0"), "amdgpu", AMD_SLOT, 0x1002, 0x744C)
    client = DrmClient(driver="amdgpu", pdev=AMD_SLOT, client_id="7", vram_bytes=MIB)
    assert clients_of_card([(20, 4, client), (10, 9, client)], card).vram_bytes_by_pid == {10: MIB}


def test_pci_database_lookup_stays_within_its_vendor() -> None:
    text = "8086  Intel Corporation\n\t56a0  DG2 [Arc A770]\n1002  AMD\n\t56a0  Not this one\n"
    assert pci_device_name(text, 0x8086, 0x56A0) == "DG2 [Arc A770]"
    assert pci_device_name(text, 0x8086, 0x1234) is None
    card = DrmCard("card3", Path("/x"), "i915", None, None, None)
    assert card_label(card, None, None) == "GPU (card3)"


def test_scans_of_trees_that_are_not_there(tmp_path: Path) -> None:
    assert scan_cards(tmp_path / "no-sys") == []
    assert scan_clients(tmp_path / "no-proc") == []


def test_scan_reads_only_fds_into_dev_dri(roots: tuple[Path, Path]) -> None:
    sys_root, proc_root = roots
    amd_card_with_two_processes(sys_root, proc_root)
    found = {(pid, fd) for pid, fd, _ in scan_clients(proc_root)}
    assert found == {(WORKER_PID, 7), (WORKER_PID, 8), (WORKER_PID, 9), (WORKER_PID, 10), (GAME_PID, 20)}
    assert [card.name for card in scan_cards(sys_root)] == ["card1"]
    assert scan_cards(sys_root)[0].pci_slot == AMD_SLOT


def test_scanner_rereads_known_clients_and_finds_new_ones_on_the_next_full_scan(roots: tuple[Path, Path]) -> None:
    _, proc_root = roots
    now = [0.0]
    open_fd(proc_root, WORKER_PID, 7, amdgpu_fdinfo(client_id=91, vram_kib=1024))
    scanner = ClientScanner(proc_root, full_scan_every_s=5.0, clock=lambda: now[0])
    assert [(pid, client.vram_bytes) for pid, _, client in scanner.scan()] == [(WORKER_PID, MIB)]

    (proc_root / str(WORKER_PID) / "fdinfo" / "7").write_text(amdgpu_fdinfo(client_id=91, vram_kib=2048))
    open_fd(proc_root, GAME_PID, 20, amdgpu_fdinfo(client_id=40, vram_kib=4096))
    now[0] = 4.9
    # The known client's new size at once; the new process not yet.
    assert [(pid, client.vram_bytes) for pid, _, client in scanner.scan()] == [(WORKER_PID, 2 * MIB)]
    now[0] = 5.0
    assert sorted((pid, client.vram_bytes) for pid, _, client in scanner.scan()) == [
        (WORKER_PID, 2 * MIB), (GAME_PID, 4 * MIB)]
    # A closed fd drops out without waiting for a full scan.
    (proc_root / str(GAME_PID) / "fdinfo" / "20").unlink()
    now[0] = 6.0
    assert [pid for pid, _, _ in scanner.scan()] == [WORKER_PID]


# --------------------------------------------------------------------------
# llama.cpp's device list
# --------------------------------------------------------------------------

LAVAPIPE = ("ggml_vulkan: Found 1 Vulkan devices:\n"
            "ggml_vulkan: 0 = llvmpipe (LLVM 15.0.6, 256 bits) (llvmpipe) | uma: 0 | fp16: 1 | warp size: 8\n"
            "Available devices:\n"
            "  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)\n")


def test_list_devices_parser() -> None:
    assert parse_list_devices(LAVAPIPE) == (
        LlamaDevice("Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)", 2048.0, 2048.0),)
    two = ("Available devices:\n  CUDA0: NVIDIA GeForce RTX 4090 (24080 MiB, 23500 MiB free)\n"
           "  Vulkan0: AMD Radeon RX 7900 XTX (RADV NAVI31) (24560 MiB, 1012 MiB free)\n")
    assert [(d.name, d.free_mib) for d in parse_list_devices(two)] == [("CUDA0", 23500.0), ("Vulkan0", 1012.0)]
    assert parse_list_devices("Available devices:\n  (none)\n") == ()
    with pytest.raises(ValueError):
        parse_list_devices("error: invalid argument: --list-devices\n")


class FakeRun:
    """subprocess.run's stand-in for the cache tests: counts calls, answers what it is given."""

    def __init__(self, stdout: str = LAVAPIPE, returncode: int = 0) -> None:
        self.stdout, self.returncode = stdout, returncode
        self.calls: list[list[str]] = []
        self.called = threading.Event()

    def __call__(self, argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        self.called.set()
        return subprocess.CompletedProcess(argv, self.returncode, self.stdout, "")


def test_probe_is_cached_and_refreshed_in_the_background() -> None:
    now = [100.0]
    run = FakeRun()
    probe = LlamaDeviceProbe(["/opt/llama-server"], {}, refresh_after_s=60, clock=lambda: now[0], run=run)
    first = probe.report()
    assert first.devices[0].total_mib == 2048.0 and run.calls == [["/opt/llama-server", "--list-devices"]]
    now[0] += 59
    assert probe.report() == first and len(run.calls) == 1
    run.called.clear()
    now[0] += 2
    run.stdout = LAVAPIPE.replace("2048 MiB free", "1000 MiB free")
    assert probe.report() == first  # the stale answer, at once
    assert run.called.wait(timeout=30)
    for thread in threading.enumerate():
        if thread.name == "llama-list-devices":
            thread.join(timeout=30)
    assert probe.report().devices[0].free_mib == 1000.0 and len(run.calls) == 2


def test_probe_failures_say_why() -> None:
    assert "exited with 1" in (run_list_devices(["llama-server"], None, 5, FakeRun("", 1)).error or "")
    assert "no device list" in (run_list_devices(["llama-server"], None, 5, FakeRun("usage: ...")).error or "")
    missing = run_list_devices(["/nonexistent/llama-server"], None, 5)
    assert "could not run" in (missing.error or "")


def fake_llama_server(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "llama-server"
    script.write_text(f"#!{sys.executable}\nimport sys, time\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_probe_runs_a_real_process_with_a_timeout(tmp_path: Path) -> None:
    answers = fake_llama_server(tmp_path, f"assert sys.argv[1:] == ['--list-devices']\nprint({LAVAPIPE!r})")
    report = run_list_devices([str(answers), "--list-devices"], dict(os.environ), 60)
    assert report.error is None and report.devices[0].name == "Vulkan0"

    (tmp_path / "hangs").mkdir()
    hangs = fake_llama_server(tmp_path / "hangs", "time.sleep(600)")
    slow = run_list_devices([str(hangs), "--list-devices"], dict(os.environ), 0.5)
    assert slow.devices == () and "did not answer within" in (slow.error or "")


def test_llama_report_reader() -> None:
    reading = LlamaReportGpuReader(LlamaDeviceProbe(["llama-server"], run=FakeRun(
        LAVAPIPE.replace("2048 MiB free", "1536 MiB free")))).read()
    assert reading.available
    (device,) = reading.devices
    assert device.name == "Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits)"
    assert (device.total_mib, device.used_mib, device.free_mib) == (2048.0, 512.0, 1536.0)
    assert device.processes == () and not device.processes_reported

    none = LlamaReportGpuReader(LlamaDeviceProbe(["llama-server"], run=FakeRun("Available devices:\n  (none)\n")))
    assert not none.read().available and "lists none" in (none.read().reason or "")
    total = first_device_total_mib(LlamaDeviceProbe(["llama-server"], run=FakeRun("Available devices:\n  (none)\n")))
    assert total() == (None, "llama.cpp sees no GPU device")


def test_a_cards_total_is_asked_of_llama_cpp_once() -> None:
    """Each probe starts a GPU context: the fdinfo reader's total, which never changes, is not
    worth another one every refresh."""
    now = [0.0]
    run = FakeRun()
    total = first_device_total_mib(LlamaDeviceProbe(["llama-server"], refresh_after_s=60, clock=lambda: now[0],
                                                    run=run))
    assert total() == (2048.0, "")
    now[0] = 3600.0
    assert total() == (2048.0, "") and len(run.calls) == 1


# --------------------------------------------------------------------------
# The choice
# --------------------------------------------------------------------------


class FakeNvml:
    def __init__(self, reading: GpuReading) -> None:
        self.reading = reading
        self.closed = False

    def read(self) -> GpuReading:
        return self.reading

    def close(self) -> None:
        self.closed = True


NO_NVML = UNKNOWN_GPU("NVIDIA driver not loaded (NVML: Driver Not Loaded)")
NVIDIA = GpuReading(available=True, simulated=False, devices=(
    GpuDevice(index=0, name="NVIDIA GeForce RTX 4090", total_mib=24564.0, used_mib=500.0, free_mib=24064.0),))


def test_nvml_wins_when_it_sees_a_device(roots: tuple[Path, Path]) -> None:
    sys_root, proc_root = roots
    amd_card_with_two_processes(sys_root, proc_root)
    nvml = FakeNvml(NVIDIA)
    assert detect_gpu_reader(nvml=nvml, sys_root=sys_root, proc_root=proc_root, probe=lambda: None) is nvml
    assert not nvml.closed


def test_an_amd_card_without_nvml_gets_the_amd_reader(roots: tuple[Path, Path]) -> None:
    sys_root, proc_root = roots
    amd_card_with_two_processes(sys_root, proc_root)
    nvml = FakeNvml(NO_NVML)
    reader = detect_gpu_reader(nvml=nvml, sys_root=sys_root, proc_root=proc_root, probe=lambda: None)
    assert isinstance(reader, AmdGpuReader) and nvml.closed
    assert reader.read().total_mib == 16384.0


def test_an_intel_card_gets_the_fdinfo_reader_with_llama_cpps_total(roots: tuple[Path, Path]) -> None:
    sys_root, proc_root = roots
    add_card(sys_root, "card0", driver="i915", slot=INTEL_SLOT, pci_id="8086:56A0")
    open_fd(proc_root, GAME_PID, 5, i915_fdinfo(12, local0_resident="1024 MiB", local0_total="1024 MiB"))
    arc = "Available devices:\n  Vulkan0: Intel(R) Arc(tm) A770 Graphics (DG2) (16032 MiB, 15000 MiB free)\n"
    probe = LlamaDeviceProbe(["llama-server"], run=FakeRun(arc))
    reader = detect_gpu_reader(nvml=FakeNvml(NO_NVML), sys_root=sys_root, proc_root=proc_root, probe=lambda: probe)
    assert isinstance(reader, DrmFdinfoGpuReader)
    assert (reader.read().total_mib, reader.read().used_mib) == (16032.0, 1024.0)


def test_no_card_the_kernel_reports_falls_back_to_llama_cpp(roots: tuple[Path, Path]) -> None:
    sys_root, proc_root = roots
    probe = LlamaDeviceProbe(["llama-server"], run=FakeRun())
    reader = detect_gpu_reader(nvml=FakeNvml(NO_NVML), sys_root=sys_root, proc_root=proc_root, probe=lambda: probe)
    assert isinstance(reader, LlamaReportGpuReader) and reader.read().free_mib == 2048.0


def test_nothing_anywhere_is_an_explicit_unknown_that_says_what_is_missing(roots: tuple[Path, Path]) -> None:
    sys_root, proc_root = roots
    add_card(sys_root, "card0", driver="i915", slot="0000:00:02.0", pci_id="8086:46A6")
    reader = detect_gpu_reader(nvml=FakeNvml(NO_NVML), sys_root=sys_root, proc_root=proc_root, probe=lambda: None)
    assert isinstance(reader, RedetectingGpuReader)
    reading = reader.read()
    assert not reading.available and reading.free_mib is None
    reason = reading.reason or ""
    assert reason.startswith("NVIDIA driver not loaded") and "running CPU-only" not in reason
    assert "card0 (i915)" in reason and "llama-server is not installed" in reason


def test_a_driver_that_comes_up_later_is_found_without_a_restart(roots: tuple[Path, Path]) -> None:
    """NVML's reader retried its init; the choice keeps that: it looks again every 30 s."""
    sys_root, proc_root = roots
    now = [0.0]
    nvml = FakeNvml(NO_NVML)
    reader = detect_gpu_reader(nvml=nvml, sys_root=sys_root, proc_root=proc_root, probe=lambda: None,
                               clock=lambda: now[0])
    assert not reader.read().available
    nvml.reading = NVIDIA  # the driver finished loading
    now[0] = 29.0
    assert not reader.read().available
    now[0] = 30.0
    assert reader.read() == NVIDIA and reader.read().devices[0].name == "NVIDIA GeForce RTX 4090"


def test_a_machine_without_a_gpu_is_looked_at_less_and_less_often(roots: tuple[Path, Path]) -> None:
    """A look may start llama-server --list-devices (all of ggml loaded, ~18 ms of CPU): with no
    GPU at all it backs off to one look in 5 minutes instead of running every minute forever."""
    sys_root, proc_root = roots
    now = [0.0]
    looks: list[float] = []

    def probe() -> None:
        looks.append(now[0])
        return None

    reader = detect_gpu_reader(nvml=FakeNvml(NO_NVML), sys_root=sys_root, proc_root=proc_root, probe=probe,
                               clock=lambda: now[0])
    looks.clear()  # the look at the start
    for second in range(0, 3600):
        now[0] = float(second)
        assert not reader.read().available
    assert looks[:5] == [30.0, 90.0, 210.0, 450.0, 750.0]
    assert [b - a for a, b in zip(looks[4:], looks[5:])] == [300.0] * (len(looks) - 5)
    assert len(looks) == 14


def test_an_amdgpu_card_without_numbers_falls_through_to_llama_cpp(roots: tuple[Path, Path]) -> None:
    sys_root, proc_root = roots
    add_card(sys_root, "card0", driver="amdgpu", slot=AMD_SLOT, pci_id="1002:6798")
    probe = LlamaDeviceProbe(["llama-server"], run=FakeRun())
    reader = detect_gpu_reader(nvml=FakeNvml(NO_NVML), sys_root=sys_root, proc_root=proc_root, probe=lambda: probe)
    assert isinstance(reader, LlamaReportGpuReader)


def test_the_real_llama_server_on_this_machine_is_asked_in_a_process_of_its_own(roots: tuple[Path, Path]) -> None:
    """The bundled llama-server is a CPU build here: it lists no GPU device, and the reader
    says so. The router's process stays free of any GPU backend: the probe is a child."""
    probe = llama_server_probe()
    if probe is None:
        pytest.skip("no llama-server installed")
    sys_root, proc_root = roots
    reading = detect_gpu_reader(nvml=FakeNvml(NO_NVML), sys_root=sys_root, proc_root=proc_root).read()
    report = probe.report()
    assert report.error is None, report.error
    if report.devices:
        assert reading.available and reading.devices[0].name.startswith(report.devices[0].name)
    else:
        assert not reading.available and "lists none" in (reading.reason or "")
