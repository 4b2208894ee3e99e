"""The tray checks each /status against the contract at its edge (ui/client.py):
a service of another shape is a state the panel names, not a Qt slot's
KeyError or a screen of Nones."""

from __future__ import annotations

import copy

import pytest

from tests.status_sample import sample_status
from tests.unit import fake_status_service
from tests.unit.fake_status_service import KeyCheckingService
from tray_app.ui import viewmodel as vm
from tray_app.ui.client import ServiceClient
from tray_app.ui.panel import HeadroomPanel

KEY = "shape-test-key"


@pytest.fixture
def service():
    served = KeyCheckingService(KEY)
    yield served
    served.close()


def another_versions_status() -> dict:
    """What a service that renamed gpu.path would answer."""
    status = sample_status()
    status["gpu"]["gpu_path"] = status["gpu"].pop("path")
    return status


def test_a_status_of_another_shape_is_named_in_the_panel_and_a_conforming_one_clears_it(qtbot, monkeypatch, service):
    monkeypatch.setattr(fake_status_service, "STATUS", another_versions_status())
    client = ServiceClient(service.url, api_key=KEY)
    panel = HeadroomPanel(client, vm.History(), floor_mib=1024)
    qtbot.addWidget(panel)
    panel.show()
    shown: list[dict] = []
    client.status_changed.connect(shown.append)

    with qtbot.waitSignal(client.unreachable, timeout=10_000) as refused:
        client.poll_now()
    message = refused.args[0]
    assert "gpu.path: missing" in message and "gpu.gpu_path: not in the contract" not in message
    assert "(and 1 more)" in message and service.url in message
    assert client.shape_mismatch and client.last_status is None and not shown
    assert panel.header.title.text() == vm.SHAPE_MISMATCH_TITLE
    assert panel.header.detail.text() == message

    monkeypatch.setattr(fake_status_service, "STATUS", copy.deepcopy(sample_status()))
    with qtbot.waitSignal(client.status_changed, timeout=10_000):
        client.poll_now()
    assert not client.shape_mismatch
    assert panel.header.title.text() != vm.SHAPE_MISMATCH_TITLE
