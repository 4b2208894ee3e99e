"""Idempotency-Key at the door, over real HTTP: a key that is not printable
ASCII is a 400 in each protocol's envelope before anything runs (it would
otherwise be forwarded to a peer as a header httpx can't encode)."""

from __future__ import annotations

import pytest

from tests.harness import running

pytestmark = pytest.mark.integration

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with running(tmp_path_factory.mktemp("idempotency-keys")) as running_service:
        yield running_service


@pytest.mark.parametrize("path, body, error_of", [
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 1}, lambda j: j["error"]["message"]),
    ("/api/chat", {"model": "default", "messages": HI, "stream": False, "options": {"num_predict": 1}},
     lambda j: j["error"]),
    ("/v1/messages", {"model": "default", "messages": HI, "max_tokens": 1}, lambda j: j["error"]["message"]),
])
def test_a_non_ascii_idempotency_key_is_a_400_at_the_door(service, path, body, error_of):
    before = service.status()["accounting"]
    # UTF-8 bytes on the wire, as curl sends them; the server reads header bytes as latin-1.
    answer = service.http.post(path, json=body, headers={"Idempotency-Key": "clé-1".encode()})
    assert answer.status_code == 400, answer.text
    assert "printable ASCII" in error_of(answer.json())
    assert service.status()["accounting"] == before  # nothing ran
    fine = service.http.post(path, json=body, headers={"Idempotency-Key": f"cle-{path}"})
    assert fine.status_code == 200, fine.text
