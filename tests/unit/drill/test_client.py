"""The drill's client reads /status through the contract at the edge: what
comes back is a Status, and anything else is an error naming why."""

from __future__ import annotations

import pytest

from tray_app.drill.client import DrillClient, DrillClock, DrillTimeout, StatusUnreadable


def test_a_conforming_status_is_returned_as_it_came(key_checking_service):
    client = DrillClient(key_checking_service.url, DrillClock(), api_key=key_checking_service.api_key)
    try:
        assert client.status()["service"]["model"] == "fake-model"
        assert client.wait_status(lambda s: s["breaker"]["state"] == "closed", timeout=30)["breaker"]["state"] == "closed"
    finally:
        client.close()


def test_an_error_body_is_not_read_as_a_status(key_checking_service):
    # The wrong key: the service's 401 error envelope, not a /status.
    client = DrillClient(key_checking_service.url, DrillClock(), api_key="the-wrong-key")
    try:
        with pytest.raises(StatusUnreadable, match=r"/status answered 401, not a /status this drill reads: "
                                                    r"status\.accounting: missing"):
            client.status()
        # Waiting for a state never sees one, and the timeout says why.
        with pytest.raises(DrillTimeout, match=r"the breaker closed; the last /status: StatusUnreadable: "
                                               r"/status answered 401"):
            client.wait_status(lambda s: True, timeout=0.2, what="the breaker closed")
    finally:
        client.close()
