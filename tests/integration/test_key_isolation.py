"""What one API key can learn of, or do to, another's: against the real
service on SmolLM2, with keys made by the real `tray-app keys` command.

Each test here was an attack that worked: key B reading or evicting key A's
stored responses, getting A's answer through A's Idempotency-Key, taking
A's decision entry by reusing its X-Request-Id, a web page's cookie that
became an admin's when a new key took a revoked key's name, and an
inference key reading the machine's layout in /status.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import time

import httpx
import pytest

from tests.integration.test_keys_and_usage import LEGACY_KEY, add_key, bearer, chat, keys_command, start

pytestmark = pytest.mark.integration

HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    running = start(tmp_path_factory.mktemp("isolation"))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def two_keys(service, request):
    service.reset()
    suffix = re.sub(r"\W", "", request.node.name)[-24:]
    return add_key(service, f"a-{suffix}"), add_key(service, f"b-{suffix}")


def respond(service, key: str, **body) -> httpx.Response:
    return httpx.post(f"{service.url}/v1/responses", headers=bearer(key), timeout=120,
                      json={"input": "Say hi.", "max_output_tokens": 16, **body})


def test_stored_responses_are_each_keys_own_and_another_keys_flood_keeps_them(service, two_keys):
    a, b = two_keys
    kept = respond(service, a)
    assert kept.status_code == 200, kept.text
    response_id = kept.json()["id"]
    assert httpx.get(f"{service.url}/v1/responses/{response_id}", headers=bearer(b)).status_code == 404
    assert httpx.delete(f"{service.url}/v1/responses/{response_id}", headers=bearer(b)).status_code == 404
    assert respond(service, b, previous_response_id=response_id).status_code == 404
    # What used to push A's response out: 18 answers of 3.9 MB of ignored fields each.
    junk = "x" * 3_900_000
    for _ in range(18):
        flood = respond(service, b, text={"format": {"type": "text"}, "junk": junk})
        assert flood.status_code == 200, flood.text
        assert junk not in flood.text
    again = httpx.get(f"{service.url}/v1/responses/{response_id}", headers=bearer(a))
    assert again.status_code == 200 and again.json()["id"] == response_id


def test_an_idempotency_key_is_each_api_keys_own(service, two_keys):
    a, b = two_keys
    body = {"messages": HI, "max_tokens": 4, "temperature": 0}
    first = httpx.post(f"{service.url}/v1/chat/completions", json=body, timeout=120,
                       headers={**bearer(a), "Idempotency-Key": "shared-key-1"})
    assert first.status_code == 200
    same = httpx.post(f"{service.url}/v1/chat/completions", json=body, timeout=120,
                      headers={**bearer(b), "Idempotency-Key": "shared-key-1"})
    assert same.status_code == 200 and same.headers.get("x-idempotent-replay") != "true"
    assert same.json()["id"] != first.json()["id"]
    other = httpx.post(f"{service.url}/v1/chat/completions", json={**body, "max_tokens": 3}, timeout=120,
                       headers={**bearer(b), "Idempotency-Key": "shared-key-2-only-a-knows"})
    assert other.status_code == 200
    replay = httpx.post(f"{service.url}/v1/chat/completions", json=body, timeout=120,
                        headers={**bearer(a), "Idempotency-Key": "shared-key-1"})
    assert replay.headers.get("x-idempotent-replay") == "true"


def test_a_reused_request_id_gets_a_new_one_and_no_one_elses_decision(service, two_keys):
    a, b = two_keys
    first = chat(service, a, request_id="my-request-1")
    assert first.status_code == 200 and first.headers["x-request-id"] == "my-request-1"
    reused = chat(service, b, request_id="my-request-1")
    assert reused.status_code == 200 and reused.headers["x-request-id"] != "my-request-1"
    seen_by_b = httpx.get(f"{service.url}/status", headers=bearer(b)).json()
    assert "my-request-1" not in json.dumps(seen_by_b["recent_decisions"])
    seen_by_a = httpx.get(f"{service.url}/status", headers=bearer(a)).json()
    assert any(d["id"] == "my-request-1" for d in seen_by_a["recent_decisions"])
    # The same key reusing its own ended id: a new id too, and no duplicate execution counted.
    assert chat(service, a, request_id="my-request-1").headers["x-request-id"] != "my-request-1"
    assert service.status()["accounting"]["duplicate_executions"] == 0


def test_a_web_session_belongs_to_its_key_not_to_the_keys_name(service):
    service.reset()
    old = add_key(service, "page-user")
    page = httpx.Client(base_url=service.url, timeout=30)
    assert page.post("/ui/login", json={"key": old}).status_code == 200
    assert page.get("/status").status_code == 200
    keys_command(service, "revoke", "page-user")
    add_key(service, "page-user", "--scope", "admin")
    # The old page's cookie is not the new admin key's.
    assert page.get("/status").status_code == 401
    assert page.get("/admin/keys").status_code in (401, 403)
    page.close()


def test_an_inference_key_sees_the_service_not_the_machines_layout(service):
    service.reset()
    limited = add_key(service, "layout-guest", "--models", "some-other-model")
    seen = httpx.get(f"{service.url}/status", headers=bearer(limited)).json()
    text = json.dumps(seen)
    assert not re.search(r'"/[^"]*/', text), re.search(r'"/[^"]*/', text)
    assert all(w["pid"] is None and w["port"] is None for w in seen["workers"])
    assert seen["models"] == [] and seen["ram"]["rss_mib_by_pid"] == {} and "simulated_device_dir" not in seen["gpu"]
    assert seen["workers"][0]["model_path"].endswith(".gguf")  # the file's name: which model
    admin = service.status()
    assert admin["workers"][0]["pid"] and admin["workers"][0]["model_path"].startswith("/")
    unknown = httpx.post(f"{service.url}/v1/chat/completions", headers=bearer(limited),
                         json={"model": "nope", "messages": HI, "max_tokens": 2})
    assert unknown.status_code == 404 and admin["service"]["model"] not in unknown.json()["error"]["message"]
    mine = add_key(service, "layout-user", "--models", admin["service"]["model"])
    shown = httpx.post(f"{service.url}/api/show", headers=bearer(mine), json={"model": admin["service"]["model"]})
    assert shown.status_code == 200 and "FROM /" not in shown.json()["modelfile"]


def test_a_revoked_keys_running_stream_ends(service):
    service.reset()
    key = add_key(service, "revoked-mid-stream")
    events: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", f"{service.url}/v1/chat/completions", headers=bearer(key), timeout=180,
                          json={"messages": [{"role": "user", "content": "Write a very long story."}],
                                "max_tokens": 1900, "ignore_eos": True, "stream": True}) as answer:
            for line in answer.iter_lines():
                events.append(line)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream)
        deadline = time.monotonic() + 60
        while len(events) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        keys_command(service, "revoke", "revoked-mid-stream")
        revoked_at = time.monotonic()
        running.result(timeout=60)
    ended_in_s = time.monotonic() - revoked_at
    assert ended_in_s < 10, ended_in_s
    text = "\n".join(events)
    assert "revoked" in text and '"finish_reason":"length"' not in text.replace(" ", "")
