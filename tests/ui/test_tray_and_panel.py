"""State changes of a real service drive the tray icon, the tooltip, the panel
and its degraded banner; the banner's Cancel cancels a real queued request."""

from __future__ import annotations

import re
import socket
import time

import pytest
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QToolButton

from tray_app.core.config import Config
from tray_app.ui import client as client_module
from tray_app.ui import viewmodel as vm
from tray_app.ui.app import NO_TRAY_NOTE, TrayController
from tray_app.ui.client import ServiceClient
from tray_app.ui.icons import state_icon

from .conftest import wait_status

WAIT_MS = 60_000


def wait_kind(qtbot, controller: TrayController, kind: str, timeout: int = WAIT_MS) -> None:
    qtbot.waitUntil(lambda: controller.kind == kind, timeout=timeout)


@pytest.mark.integration
def test_icon_tooltip_and_notifications_follow_pause_and_resume(qtbot, controller, live) -> None:
    wait_kind(qtbot, controller, vm.GPU)
    assert "VRAM (simulated):" in controller.tooltip and "MiB headroom" in controller.tooltip
    assert "RAM:" in controller.tooltip and "floor" in controller.tooltip
    assert controller.tray_menu.state_action.text() == "Serving on the GPU"
    assert controller.tray_menu.state_action.icon().cacheKey() == state_icon(vm.GPU).cacheKey()

    # Force CPU from the menu's own action: a real POST /admin/gpu.
    with qtbot.waitSignal(controller.notifications.notified, timeout=WAIT_MS) as started:
        controller.tray_menu.force_cpu_action.setChecked(True)
    assert started.args[0] == "degraded_start"
    assert "The GPU path is paused (force CPU)" in started.args[2]
    assert live.status()["service"]["gpu_paused"] is True
    assert controller.kind == vm.DEGRADED
    assert controller.tray_menu.state_action.icon().cacheKey() == state_icon(vm.DEGRADED).cacheKey()
    assert "Why: the GPU path is paused (force CPU)" in controller.tooltip

    with qtbot.waitSignal(controller.notifications.notified, timeout=WAIT_MS) as ended:
        controller.tray_menu.force_cpu_action.setChecked(False)
    assert ended.args[0] == "degraded_end"
    assert controller.kind == vm.GPU
    assert [n[0] for n in controller.notifications.notices] == ["degraded_start", "degraded_end"]


@pytest.mark.integration
def test_pause_from_outside_is_reflected_in_the_menu(qtbot, controller, live) -> None:
    wait_kind(qtbot, controller, vm.GPU)
    live.http.post("/admin/gpu", json={"paused": True})
    qtbot.waitUntil(lambda: controller.tray_menu.force_cpu_action.isChecked(), timeout=WAIT_MS)
    assert controller.kind == vm.DEGRADED
    live.http.post("/admin/gpu", json={"paused": False})
    qtbot.waitUntil(lambda: not controller.tray_menu.force_cpu_action.isChecked(), timeout=WAIT_MS)


@pytest.mark.integration
def test_tray_icon_shows_the_state(qtbot, live) -> None:
    client = ServiceClient(live.url)
    controller = TrayController(client, Config(), tray_available=True)
    controller.exit_app = lambda: None
    try:
        client.start()
        wait_kind(qtbot, controller, vm.GPU)
        assert controller.tray.icon().cacheKey() == state_icon(vm.GPU).cacheKey()
        assert controller.tray.toolTip() == controller.tooltip
        assert controller.tray.contextMenu() is controller.tray_menu.menu
        # Compared without the '&' that marks each action's Alt+letter.
        texts = [a.text().replace("&", "") for a in controller.tray_menu.menu.actions()
                 if not a.isSeparator() and a.isVisible()]
        assert texts[1].startswith("VRAM ") and texts[1].endswith(" headroom")
        del texts[1]  # the headroom line, under the state
        assert texts == ["Serving on the GPU", "Open headroom panel", "Open chat", "Force CPU (pause the GPU path)",
                         "Give the GPU back now", "Restart workers", "Choose model…", "Download model…", "View logs…", "Open logs folder", "Copy API URL",
                         "Settings…", "Start on login", "Quit"]
        live.http.post("/admin/gpu", json={"paused": True})
        wait_kind(qtbot, controller, vm.DEGRADED)
        assert controller.tray.icon().cacheKey() == state_icon(vm.DEGRADED).cacheKey()
    finally:
        client.stop()
        controller.tray.hide()


@pytest.mark.integration
def test_panel_shows_live_headroom_and_the_simulated_label(qtbot, controller, live) -> None:
    wait_kind(qtbot, controller, vm.GPU)
    panel = controller.windows.panel()
    qtbot.addWidget(panel)
    controller.windows.show_panel()
    qtbot.waitUntil(lambda: len(panel.vram_blocks) == 1, timeout=WAIT_MS)
    block = panel.vram_blocks[0]
    assert block.badge.isVisible() and block.badge.text() == "SIMULATED"
    assert "Simulated GPU" in block.title.text()
    free_before = live.status()["gpu"]["free_mib"]
    assert block.caption.text() == f"{vm.fmt_mib(free_before)} free of 2,048 MiB"
    # Less free VRAM on the (simulated) device shows within a couple of polls.
    live.http.post("/admin/gpu", json={"simulated_pressure_mib": 300})
    expected = f"{vm.fmt_mib(free_before - 300)} free of 2,048 MiB"
    qtbot.waitUntil(lambda: block.caption.text() == expected, timeout=10_000)
    assert "other use" in block.legend.text() and "300 MiB" in block.legend.text()
    # The workers' footprint is listed.
    cells = panel.worker_cells
    assert [cells[i][0].text() for i in sorted(cells)] == ["GPU", "CPU"]
    assert all(cells[i][1].text() == "ready" for i in cells)
    assert cells[0][4].text().endswith("MiB")  # estimated VRAM of the GPU worker
    assert panel.header.title.text() == "Serving on the GPU"
    assert not panel.banner.isVisible()
    # The chart has samples, and painting it works.
    assert len(controller.history.samples) >= 2
    assert not panel.grab().isNull()


@pytest.mark.integration
def test_status_is_polled_about_once_a_second_without_blocking(qtbot, controller) -> None:
    wait_kind(qtbot, controller, vm.GPU)
    # Once a second while someone looks; with every window closed and nothing
    # in flight the tray polls every 5 s (tests/ui/test_idle_polling.py).
    controller.windows.show_panel()
    received: list[float] = []
    controller.client.status_changed.connect(lambda _s: received.append(time.monotonic()))
    ticks: list[float] = []
    timer = QTimer()
    timer.timeout.connect(lambda: ticks.append(time.monotonic()))
    timer.start(20)
    qtbot.wait(4200)
    timer.stop()
    assert 2 <= len(received) <= 6
    # The GUI thread kept running the whole time. A blocking poll would stall it
    # for the whole request; the bound is loose because other suites may share the CPU.
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert max(gaps) < 1.0, max(gaps)


def test_a_silent_service_does_not_block_the_ui_and_shows_down(qtbot, monkeypatch) -> None:
    # The poll's own deadline, shortened: the GUI must not block for any of it, however long.
    monkeypatch.setattr(client_module, "STATUS_TIMEOUT_MS", 1500)
    # A server that accepts connections and never answers.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    client = ServiceClient(f"http://127.0.0.1:{port}")
    controller = TrayController(client, Config(), tray_available=False)
    ticks: list[float] = []
    timer = QTimer()
    timer.timeout.connect(lambda: ticks.append(time.monotonic()))
    try:
        timer.start(20)
        with qtbot.waitSignal(client.unreachable, timeout=15_000) as blocked:
            client.start()
        timer.stop()
        assert "no answer" in blocked.args[0]
        assert controller.kind == vm.DOWN
        assert "not answering" in controller.tooltip or "no answer" in controller.tooltip
        # The poll waited 1.5 s for an answer that never came; the GUI never did.
        gaps = [b - a for a, b in zip(ticks, ticks[1:])]
        assert gaps and max(gaps) < 1.0
    finally:
        client.stop()
        listener.close()


@pytest.mark.integration
def test_degraded_banner_and_cancel_a_real_queued_request(qtbot, controller, live, background) -> None:
    wait_kind(qtbot, controller, vm.GPU)
    panel = controller.windows.panel()
    qtbot.addWidget(panel)
    controller.windows.show_panel()
    live.http.post("/admin/gpu", json={"paused": True})
    long = background("ui-long-1")
    wait_status(qtbot, live, lambda s: any(r["id"] == "ui-long-1" and r["state"] == "running" for r in s["requests"]),
                what="the long request running on the CPU")
    queued = background("ui-queued-1", prompt="Say hello.", max_tokens=20)
    wait_status(qtbot, live, lambda s: any(r["id"] == "ui-queued-1" and r["state"] == "queued" for r in s["requests"]),
                what="the second request queued")

    # Its row (and Cancel) shows from the snapshot where it is still being admitted; the
    # waiting count from the first one where it is in the CPU's queue.
    banner = panel.banner
    qtbot.waitUntil(lambda: banner.cancel_button("ui-queued-1") is not None
                    and " · 1 waiting " in banner.values["limits"].text(), timeout=WAIT_MS)
    assert banner.isVisible()
    assert banner.title.text() == "Degraded mode: the CPU is serving"
    assert banner.values["reason"].text() == "The GPU path is paused (force CPU)"
    assert banner.values["model"].text() == live.status()["degraded"]["fallback_model"]
    assert banner.values["limits"].text().startswith("context up to 2,048 tokens · 1 waiting (limit 2)")
    assert banner.values["latency"].text().startswith("a new request would be answered in about ")
    row_text = banner._rows["ui-queued-1"][1].text()
    assert re.match(r"app ui-queued-1 · 1st in the CPU queue · (about .+ left|due now|overdue by .+) · ", row_text)
    assert banner._rows["ui-long-1"][1].text().startswith("app ui-long-1 · running on the CPU")

    qtbot.mouseClick(banner.cancel_button("ui-queued-1"), Qt.MouseButton.LeftButton)
    result = queued.wait(qtbot, 60_000)
    assert result["status"] == 499, result
    assert '"request_canceled"' in result["text"]
    assert any(r["id"] == "ui-long-1" for r in live.status()["requests"])  # only that one was canceled
    qtbot.waitUntil(lambda: banner.cancel_button("ui-queued-1") is None, timeout=10_000)

    # Cancel the running one as well, from the same banner.
    qtbot.mouseClick(banner.cancel_button("ui-long-1"), Qt.MouseButton.LeftButton)
    outcome = long.wait(qtbot, 60_000)
    assert "request_canceled" in outcome.get("text", ""), outcome
    qtbot.waitUntil(lambda: banner.cancel_button("ui-long-1") is None, timeout=10_000)
    assert banner.empty_label.isVisible()

    live.http.post("/admin/gpu", json={"paused": False})
    qtbot.waitUntil(lambda: not banner.isVisible(), timeout=WAIT_MS)


@pytest.mark.integration
def test_cancel_of_an_unknown_request_gives_the_button_back(qtbot, controller, live) -> None:
    wait_kind(qtbot, controller, vm.GPU)
    panel = controller.windows.panel()
    qtbot.addWidget(panel)
    panel.banner._add_row("gone-already")
    button = panel.banner.cancel_button("gone-already")
    qtbot.mouseClick(button, Qt.MouseButton.LeftButton)
    assert not button.isEnabled()
    qtbot.waitUntil(lambda: button.isEnabled(), timeout=10_000)
    assert panel.footer.text().startswith("Cancel failed: no queued or running request has id 'gone-already'")


@pytest.mark.integration
def test_no_system_tray_opens_the_panel_as_a_window_and_says_why(qtbot, live) -> None:
    client = ServiceClient(live.url)
    controller = TrayController(client, Config(), tray_available=False)
    quits: list[bool] = []
    controller.exit_app = lambda: quits.append(True)
    try:
        controller.start()
        panel = controller.windows.panel()
        qtbot.addWidget(panel)
        assert controller.tray is None
        assert panel.isVisible()
        assert panel.no_tray_note.isVisible() and panel.no_tray_note.text() == NO_TRAY_NOTE
        assert "no system tray" in NO_TRAY_NOTE
        wait_kind(qtbot, controller, vm.GPU)
        # Every tray action is reachable from the window.
        texts = {b.defaultAction().text().replace("&", "")
                 for b in panel.findChildren(QToolButton) if b.defaultAction()}
        assert {"Open chat", "Force CPU (pause the GPU path)", "Restart workers", "Settings…"} <= texts
        more = {a.text().replace("&", "") for a in controller.tray_menu.more_menu.actions() if not a.isSeparator()}
        assert more == {"Choose model…", "Download model…", "View logs…", "Open logs folder", "Copy API URL",
                        "Quit"}
        # Closing the window quits (there is no tray icon to come back to).
        panel.close()
        assert quits == [True]
    finally:
        client.stop()


@pytest.mark.integration
def test_restart_workers_from_the_menu_restarts_them(qtbot, controller, live) -> None:
    wait_kind(qtbot, controller, vm.GPU)
    before = {w["role"]: w["pid"] for w in live.status()["workers"]}
    kinds: list[str] = []
    controller.state_changed.connect(kinds.append)
    controller.tray_menu.restart_action.trigger()

    def new_pids() -> bool:
        status = controller.client.last_status or {}
        workers = {w["role"]: w for w in status.get("workers") or ()}
        return (controller.kind == vm.GPU and len(workers) == 2
                and all(w["state"] == "ready" and w["pid"] != before[r] for r, w in workers.items()))

    qtbot.waitUntil(new_pids, timeout=WAIT_MS)
    assert vm.STARTING in kinds  # the icon showed the restart


@pytest.mark.integration
def test_copy_api_url_and_open_logs(qtbot, controller, live, monkeypatch) -> None:
    from PySide6.QtGui import QDesktopServices, QGuiApplication

    wait_kind(qtbot, controller, vm.GPU)
    controller.tray_menu.copy_url_action.trigger()
    assert QGuiApplication.clipboard().text() == f"{live.url}/v1"
    assert controller.notifications.notices[-1][1] == "API URL copied"

    opened: list[str] = []
    monkeypatch.setattr(QDesktopServices, "openUrl", staticmethod(lambda url: opened.append(url.toLocalFile()) or True))
    controller.tray_menu.open_logs_action.trigger()
    worker_log = live.status()["workers"][0]["log"]
    assert opened == [str(__import__("pathlib").Path(worker_log).parent)]


@pytest.mark.integration
def test_choose_model_validates_the_file_and_saves_it(qtbot, live, tmp_path, monkeypatch, parser_threads) -> None:
    import sys
    import threading

    from PySide6.QtWidgets import QMessageBox

    from tray_app.core.config import bundled_model_path, load_config
    from tray_app.ui import settings

    config_file = tmp_path / "config.toml"
    config_file.write_text("[cpu]\nn_ctx = 2048\n")
    client = ServiceClient(live.url)
    controller = TrayController(client, load_config(config_file), tray_available=False)
    warnings: list[str] = []
    monkeypatch.setattr(QMessageBox, "warning", staticmethod(lambda parent, title, text: warnings.append(text)))


    # The file is read off the GUI thread; its verdict arrives through the event loop.
    monkeypatch.setattr(settings, "choose_model_file", lambda parent, start="": sys.executable)
    controller.tray_menu.choose_model_action.trigger()
    with qtbot.waitSignal(controller.commands.model_check.delivered, timeout=10_000):
        pass
    assert len(warnings) == 1 and "is not a GGUF file" in warnings[0]
    assert config_file.read_text() == "[cpu]\nn_ctx = 2048\n"

    model = str(bundled_model_path())
    monkeypatch.setattr(settings, "choose_model_file", lambda parent, start="": model)
    controller.tray_menu.choose_model_action.trigger()
    with qtbot.waitSignal(controller.commands.model_check.delivered, timeout=10_000):
        pass
    assert len(parser_threads) == 2 and threading.main_thread() not in parser_threads
    assert load_config(config_file).model.path == model
    assert controller.config.model.path == model
    assert controller.notifications.notices[-1][1] == "Settings saved"


@pytest.mark.integration
def test_start_on_login_toggle_writes_and_removes_the_autostart_entry(qtbot, controller, tmp_path, monkeypatch) -> None:
    from tray_app.desktop import autostart

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_DIRS", str(tmp_path / "system"))
    entry = tmp_path / "autostart" / "tray-app.desktop"
    assert not controller.tray_menu.autostart_action.isChecked() or autostart.is_enabled()
    controller.tray_menu.autostart_action.setChecked(True)
    assert entry.exists() and "Exec=" in entry.read_text() and autostart.is_enabled()
    controller.tray_menu.autostart_action.setChecked(False)
    assert not autostart.is_enabled() and not controller.tray_menu.autostart_action.isChecked()
