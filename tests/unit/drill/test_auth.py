"""The drill is an ordinary client: with an API key set, it must send it."""

from __future__ import annotations

from tray_app.core.api.security import API_KEY_ENV
from tray_app.drill.client import DrillClient, DrillClock
from tray_app.drill.monitor import StatusMonitor
from tray_app.drill.pressure import SimulatedPressure
from tray_app.drill.target import LiveService, OwnService


def test_live_target_and_its_clients_send_the_key(key_checking_service):
    target = LiveService(key_checking_service.url, key_checking_service.api_key)
    assert target.start()["service"]["model"] == "fake-model"
    client = DrillClient(target.url, DrillClock(), api_key=target.api_key)
    monitor = StatusMonitor(target.url, DrillClock(), api_key=target.api_key)
    pressure = SimulatedPressure(target.url, target.api_key)
    try:
        assert client.status()["service"]["model"] == "fake-model"
        assert monitor.sample_now() is not None and monitor.failed_samples == 0
        assert pressure._gpu()["total_mib"] == 2048
    finally:
        client.close()
        monitor.start()  # stop() joins the sampling thread, so it must have been started
        monitor.stop()
    assert len(key_checking_service.authorizations) >= 4
    assert set(key_checking_service.authorizations) == {"Bearer the-right-key"}


def test_own_service_target_uses_the_key_its_service_will_inherit(monkeypatch, tmp_path):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    target = OwnService(tmp_path, simulated=True, device="simulated GPU")
    assert target.api_key == "from-env"
