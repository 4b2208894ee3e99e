"""The in-process service (what `tray-app` runs): Settings restart it with the
new config, Quit stops its workers cleanly, a busy port is a clear message."""

from __future__ import annotations

import socket

import pytest

from tests.harness import BASE_CONFIG, wait_gone
from tray_app.core.config import apply_overrides, load_config
from tray_app.core.engine.worker import free_loopback_port
from tray_app.ui import viewmodel as vm
from tray_app.ui.app import TrayController
from tray_app.ui.client import ServiceClient
from tray_app.ui.service_runner import ServiceRunner, base_url_for
from tray_app.ui.settings import save_changes

START_MS = 180_000


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    for name in ("CONFIG", "STATE", "DATA", "CACHE"):
        monkeypatch.setenv(f"XDG_{name}_HOME", str(tmp_path / name.lower()))
    path = tmp_path / "config.toml"
    path.write_text(BASE_CONFIG)
    return path


def _pids(status: dict) -> list[int]:
    return [w["pid"] for w in status["workers"] if w.get("pid")]


@pytest.mark.integration
def test_settings_restart_the_service_and_quit_stops_the_workers(qtbot, isolated) -> None:
    config = apply_overrides(load_config(isolated), {"server": {"port": free_loopback_port()}})
    runner = ServiceRunner(config, "WARNING")
    client = ServiceClient(base_url_for(config))
    controller = TrayController(client, config, runner=runner, tray_available=False)
    exits: list[int] = []
    controller.exit_app = lambda: exits.append(1)
    try:
        assert controller.kind == vm.DOWN  # not started yet
        runner.start()
        controller.start()  # no tray here: this also opens the panel as a window
        qtbot.addWidget(controller.windows.panel())
        assert controller.kind == vm.STARTING
        qtbot.waitUntil(lambda: controller.kind == vm.GPU, timeout=START_MS)
        first_pids = _pids(client.last_status)
        assert len(first_pids) == 2

        # Save new settings: another port and a smaller CPU context.
        new_port = free_loopback_port()
        changes = {"server": {"port": new_port}, "cpu": {"n_ctx": 1024}}
        new_config, where = save_changes(config, changes)
        assert where == isolated
        controller._apply_config(new_config, changes)
        assert controller.kind == vm.STARTING
        assert client.base_url == f"http://127.0.0.1:{new_port}"
        assert wait_gone(first_pids, timeout=60) == []

        def restarted() -> bool:
            status = client.last_status
            return (controller.kind == vm.GPU and status is not None
                    and any(w["role"] == "cpu" and w["n_ctx"] == 1024 and w["state"] == "ready"
                            for w in status["workers"]))

        qtbot.waitUntil(restarted, timeout=START_MS)
        assert controller.notifications.notices[-1][1] == "Settings saved"
        second_pids = _pids(client.last_status)
        assert set(second_pids).isdisjoint(first_pids)

        # Quit: the workers are stopped, then the app exits.
        controller.quit()
        qtbot.waitUntil(lambda: exits == [1], timeout=60_000)
        assert not runner.is_alive()
        assert wait_gone(second_pids, timeout=30) == []
        with socket.socket() as probe:  # nobody listens there any more
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", new_port))
    finally:
        client.stop()
        runner.stop_and_wait(60)


@pytest.mark.integration
def test_a_busy_port_is_reported_and_the_icon_says_down(qtbot, isolated) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        config = apply_overrides(load_config(isolated), {"server": {"port": port}})
        runner = ServiceRunner(config, "WARNING")
        client = ServiceClient(base_url_for(config))
        controller = TrayController(client, config, runner=runner, tray_available=False)
        with qtbot.waitSignal(runner.failed, timeout=30_000) as failed:
            runner.start()
        assert f"port {port} on 127.0.0.1 is already in use" in failed.args[0]
        assert controller.kind == vm.DOWN
        assert "already in use" in controller.tooltip
        assert controller.notifications.notices[-1][0] == "down"
        runner.stop_and_wait(10)
