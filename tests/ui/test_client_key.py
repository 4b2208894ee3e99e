"""The tray sends the key the service checks: the environment's over the config's."""

from __future__ import annotations

import pytest

from tray_app.core.api.security import API_KEY_ENV, process_admin_key
from tray_app.ui.client import ServiceClient


def sent_authorization(client: ServiceClient) -> bytes:
    return client.request("/status").rawHeader("Authorization").data()


@pytest.mark.parametrize("environment, configured, expected", [
    ("from-env", "from-config", b"Bearer from-env"),
    (None, "from-config", b"Bearer from-config"),
    ("from-env", None, b"Bearer from-env"),
    # Neither: the tray's own key, which the service in this process takes as an admin's.
    (None, None, f"Bearer {process_admin_key()}".encode()),
], ids=["env-over-config", "config", "env", "the-tray-s-own-key"])  # the own key is random per process
def test_the_tray_resolves_the_key_as_the_service_does(qtbot, monkeypatch, environment, configured, expected):
    if environment is None:
        monkeypatch.delenv(API_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(API_KEY_ENV, environment)
    client = ServiceClient("http://127.0.0.1:9", api_key=configured)
    assert sent_authorization(client) == expected
