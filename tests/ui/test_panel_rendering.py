"""The panel's widgets for shapes a simulated GPU never gives: two real
devices, a worker out of memory, no GPU at all (no service needed)."""

from __future__ import annotations

import copy

from tray_app.ui import viewmodel as vm
from tray_app.ui.client import ServiceClient
from tray_app.ui.panel import HeadroomPanel

from .test_viewmodel import READY


def two_gpus_one_worker_down() -> dict:
    status = copy.deepcopy(READY)
    status["gpu"].update(simulated=False, total_mib=24564.0, free_mib=2100.0, used_mib=22464.0,
                         path_out_reason="the GPU worker is unhealthy: CUDA out of memory")
    status["gpu"]["devices"] = [
        {"index": 0, "name": "NVIDIA GeForce RTX 4090", "total_mib": 24564.0, "used_mib": 22464.0, "free_mib": 2100.0},
        {"index": 1, "name": "NVIDIA RTX A6000", "total_mib": 49140.0, "used_mib": 1200.0, "free_mib": 47940.0},
    ]
    status["workers"][0].update(state="unhealthy", restarts=3,
                                last_exit={"kind": "out_of_memory", "description": "CUDA out of memory"})
    status["degraded"].update(active=True, reason="the GPU worker is unhealthy: CUDA out of memory", since=1.0)
    return status


def no_gpu() -> dict:
    status = copy.deepcopy(READY)
    status["gpu"] = {"available": False, "simulated": False, "total_mib": None, "free_mib": None, "used_mib": None,
                     "reason": "NVML: driver not loaded", "reserve_mib": 512, "devices": [],
                     "path_out_reason": "no usable GPU: NVML: driver not loaded; serving CPU-only"}
    status["workers"] = status["workers"][1:]
    status["degraded"].update(active=True, reason="no usable GPU: NVML: driver not loaded; serving CPU-only")
    return status


def test_panel_follows_devices_and_workers_coming_and_going(qtbot) -> None:
    client = ServiceClient("http://127.0.0.1:9")  # never started: the test feeds snapshots
    panel = HeadroomPanel(client, vm.History(), floor_mib=1024)
    qtbot.addWidget(panel)
    panel.show()

    client.last_status = two_gpus_one_worker_down()
    panel.refresh()
    assert [b.title.text() for b in panel.vram_blocks] == [
        "VRAM · NVIDIA GeForce RTX 4090 (GPU 0)", "VRAM · NVIDIA RTX A6000 (GPU 1)"]
    assert panel.vram_blocks[0].caption.text() == "2.1 GiB free of 24.0 GiB"
    assert not panel.vram_blocks[0].badge.isVisible()  # a real device: no SIMULATED label
    assert panel.worker_cells[0][1].text() == "unhealthy"
    assert panel.worker_cells[0][-1].isVisible() and "CUDA out of memory" in panel.worker_cells[0][-1].text()
    assert panel.banner.isVisible() and panel.header.title.text() == vm.STATE_TITLES[vm.DEGRADED]
    assert not panel.grab().isNull()

    client.last_status = no_gpu()
    panel.refresh()
    (block,) = panel.vram_blocks
    assert block.badge.text() == "UNAVAILABLE"
    assert block.caption.text() == "" and not block.legend.isVisible()
    assert panel.worker_cells[0][0].text() == "CPU"
    assert not any(cell.isVisible() for cell in panel.worker_cells[1])
    assert panel.banner.values["reason"].text() == "No usable GPU: NVML: driver not loaded; serving CPU-only"
    assert not panel.grab().isNull()
