"""The tray's own key is an admin key: with named keys closing the port and
no [server] api_key, the tray still reads /status and uses the controls of
the service it runs, while a client without a key is refused."""

from __future__ import annotations

import httpx
import pytest

from tests.harness import BASE_CONFIG
from tray_app.core.config import apply_overrides, load_config
from tray_app.core.engine.worker import free_loopback_port
from tray_app.core.access.keys import KeyStore
from tray_app.ui.client import ServiceClient
from tray_app.ui.service_runner import ServiceRunner, base_url_for

START_MS = 180_000


@pytest.mark.integration
def test_the_tray_is_an_admin_when_named_keys_close_the_port(qtbot, tmp_path, monkeypatch) -> None:
    for name in ("CONFIG", "STATE", "DATA", "CACHE"):
        monkeypatch.setenv(f"XDG_{name}_HOME", str(tmp_path / name.lower()))
    monkeypatch.delenv("TRAY_APP_API_KEY", raising=False)
    path = tmp_path / "config.toml"
    path.write_text(BASE_CONFIG)
    app_key = KeyStore().add("phone")  # an inference key: the port needs a key now
    config = apply_overrides(load_config(path), {"server": {"port": free_loopback_port()}})
    runner = ServiceRunner(config, "WARNING")
    client = ServiceClient(base_url_for(config))
    try:
        runner.start()
        client.start()
        qtbot.waitUntil(lambda: client.last_status is not None, timeout=START_MS)
        answers: list[tuple[bool, int]] = []
        client.set_gpu_paused(True, lambda ok, code, data, message: answers.append((ok, code)))
        qtbot.waitUntil(lambda: bool(answers), timeout=30_000)
        assert answers == [(True, 200)]
        assert httpx.get(f"{base_url_for(config)}/status").status_code == 401
        refused = httpx.post(f"{base_url_for(config)}/admin/gpu", json={"paused": False},
                             headers={"Authorization": f"Bearer {app_key}"})
        assert refused.status_code == 403
    finally:
        client.stop()
        runner.stop_and_wait(60)
