"""The panel's widgets for shapes a simulated GPU never gives: two real
devices, a worker out of memory, no GPU at all (no service needed)."""

from __future__ import annotations

import copy

from PySide6.QtCore import Qt

from tests.status_sample import conforming
from tray_app.ui import viewmodel as vm
from tray_app.ui.client import ServiceClient
from tray_app.ui.panel import HeadroomPanel

from .test_viewmodel import READY, paused, whole_request, whole_requests


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
    return conforming(status)


def no_gpu() -> dict:
    status = copy.deepcopy(READY)
    status["gpu"] = {"available": False, "simulated": False, "total_mib": None, "free_mib": None, "used_mib": None,
                     "reason": "NVML: driver not loaded", "reserve_mib": 512, "devices": [],
                     "path_out_reason": "no usable GPU: NVML: driver not loaded; serving CPU-only"}
    status["workers"] = status["workers"][1:]
    status["degraded"].update(active=True, reason="no usable GPU: NVML: driver not loaded; serving CPU-only")
    return conforming(status)


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
    # No GPU path at all: no VRAM to show, and nothing degraded to warn about.
    assert panel.vram_blocks == [] and not panel.vram_chart.isVisible()
    assert panel.worker_cells[0][0].text() == "CPU"
    assert not any(cell.isVisible() for cell in panel.worker_cells[1])
    assert not panel.banner.isVisible() and panel.header.title.text() == vm.STATE_TITLES[vm.CPU]
    assert not panel.grab().isNull()


def degraded_with_cpu_requests(count: int) -> dict:
    status = paused()
    status["requests"] = whole_requests([
        {"id": f"queued-{n}", "state": "queued", "path": "cpu", "reason": "forced_cpu", "queue_position": n,
         "age_s": 1.0, "estimated_latency_s": 20.0} for n in range(1, count + 1)])
    status["degraded"]["cpu_queue_depth"] = count
    return status


def fed_panel(qtbot, status: dict) -> HeadroomPanel:
    client = ServiceClient("http://127.0.0.1:9")  # never started: the test feeds snapshots
    panel = HeadroomPanel(client, vm.History(), floor_mib=1024)
    qtbot.addWidget(panel)
    panel.show()
    client.last_status = status
    panel.refresh()
    return panel


def test_a_full_cpu_queue_lists_three_rows_then_a_count_and_fits_the_screen(qtbot) -> None:
    panel = fed_panel(qtbot, degraded_with_cpu_requests(8))
    banner = panel.banner
    assert [banner.cancel_button(f"queued-{n}") is not None for n in range(1, 9)] == [True] * 3 + [False] * 5
    assert banner.more_label.isVisible() and banner.more_label.text() == "5 more requests on the CPU, not listed"
    eight_high = panel.body.sizeHint().height()
    panel.client.last_status = degraded_with_cpu_requests(3)
    panel.refresh()
    # Five more requests cost one line, not five.
    assert eight_high - panel.body.sizeHint().height() <= 2 * banner.more_label.sizeHint().height()
    # The window never asks for more than the screen has; the rest scrolls.
    assert panel.sizeHint().height() <= panel.screen().availableGeometry().height()
    assert panel.minimumSizeHint().height() <= 768


def test_a_long_model_name_is_elided_in_the_middle_with_the_whole_name_in_a_tooltip(qtbot) -> None:
    status = paused()
    name = "Meta-Llama-3.1-70B-Instruct-abliterated-" + "x" * 200 + "-Q4_K_M.gguf"
    status["degraded"]["fallback_model"] = name
    panel = fed_panel(qtbot, status)
    label = panel.banner.values["model"]
    qtbot.waitUntil(lambda: "…" in label.text())
    assert label.text().startswith("Meta-Llama") and label.text().endswith("Q4_K_M.gguf")
    assert label.toolTip() == name
    assert panel.width() < 1000 and panel.sizeHint().width() < 1000


def test_the_reserve_legend_says_the_configured_reserve_when_free_vram_is_short(qtbot) -> None:
    status = copy.deepcopy(READY)
    status["gpu"].update(free_mib=315.1, used_mib=1732.9)
    status["gpu"]["devices"][0].update(free_mib=315.1, used_mib=1732.9)
    panel = fed_panel(qtbot, status)
    (block,) = panel.vram_blocks
    legend = block.legend.text()
    assert "reserve&nbsp;<b>512 MiB</b>" in legend and "315 MiB" not in legend
    assert "512 MiB reserve" in block.warning.text()


def test_a_gpu_reporting_zero_total_shows_unknown_without_a_warning(qtbot) -> None:
    status = copy.deepcopy(READY)
    status["gpu"].update(simulated=False, total_mib=0.0, free_mib=0.0, used_mib=0.0)
    status["gpu"]["devices"][0].update(total_mib=0.0, free_mib=0.0, used_mib=0.0)
    panel = fed_panel(qtbot, status)
    (block,) = panel.vram_blocks
    assert block.badge.text() == "UNKNOWN" and not block.warning.isVisible()
    assert "0 MiB free of 0 MiB" not in block.caption.text()


def test_a_failed_cancel_stays_in_the_footer_for_a_few_seconds(qtbot, monkeypatch) -> None:
    panel = fed_panel(qtbot, degraded_with_cpu_requests(1))
    monkeypatch.setattr(panel.client, "cancel", lambda request_id, callback: callback(
        False, 404, None, f"no queued or running request has id '{request_id}'"))
    qtbot.mouseClick(panel.banner.cancel_button("queued-1"), Qt.MouseButton.LeftButton)
    failed = "Cancel failed: no queued or running request has id 'queued-1'"
    assert panel.footer.text() == failed
    assert panel.banner.cancel_button("queued-1").text() == "Cancel"  # the button is back
    panel.refresh()  # the next poll
    assert panel.footer.text() == failed
    # Some seconds later the footer is the poll's again.
    monkeypatch.setattr(panel.footer_note, "_clock", lambda: float("inf"))
    panel.refresh()
    assert panel.footer.text().startswith("SmolLM2 · ")


def test_a_finished_request_row_is_gone_at_once_and_a_peer_row_can_be_canceled(qtbot) -> None:
    status = degraded_with_cpu_requests(2)
    status["degraded"]["peers"] = ["desk"]
    status["requests"].insert(0, whole_request({"id": "away", "state": "running", "path": "peer", "peer": "desk",
                                  "reason": "peer", "age_s": 1.0}))
    panel = fed_panel(qtbot, status)
    assert panel.banner.title.text() == "Degraded mode: the CPU and peer desk are serving"
    dropped = panel.banner.cancel_button("queued-2").parentWidget()
    assert panel.banner.cancel_button("away") is not None
    panel.client.last_status = degraded_with_cpu_requests(1)
    panel.refresh()
    # Hidden before the event loop deletes it: never drawn over the rows that moved up.
    assert not dropped.isVisible()
    assert panel.banner.title.text() == "Degraded mode: the CPU is serving"
