"""A key per app, with scopes and limits, and who used what (issue 31, parts 2 and 3).

The real service on SmolLM2, its keys made with the real `tray-app keys`
command in the service's own config folder while it runs, and called with the
official clients.
"""

from __future__ import annotations

import concurrent.futures
import math
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.harness import BASE_CONFIG, RunningService

pytestmark = pytest.mark.integration

LEGACY_KEY = "legacy-admin-key-for-tests-0123456789"
HI = [{"role": "user", "content": "Say hi."}]
LONG = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]
# Every admin route there is, and one there isn't: the scope check comes
# before routing, so an inference key learns nothing even of what exists.
ADMIN_POSTS = ("/admin/gpu", "/admin/restart", "/admin/models/anything", "/admin/library/rescan", "/admin/nothing")


def keys_command(service: RunningService, *args: str) -> subprocess.CompletedProcess:
    """`tray-app keys ...` with the service's own config folder."""
    return subprocess.run([sys.executable, "-m", "tray_app", "keys", *args], env=service.env, capture_output=True,
                          text=True, timeout=60, check=True)


def add_key(service: RunningService, name: str, *options: str) -> str:
    return keys_command(service, "add", name, *options).stdout.strip()


def start(tmp: Path) -> RunningService:
    service = RunningService(tmp, BASE_CONFIG, env={"TRAY_APP_API_KEY": LEGACY_KEY})
    service.http.headers["Authorization"] = f"Bearer {LEGACY_KEY}"
    service.wait_ready()
    return service


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    service = start(tmp_path_factory.mktemp("keys"))
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture
def keys(keyed):
    keyed.reset()
    return keyed


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(service: RunningService, key: str, request_id: str | None = None, max_tokens: int = 4,
         messages=HI, headers: dict[str, str] | None = None, **extra) -> httpx.Response:
    headers = {**bearer(key), **({"X-Request-Id": request_id} if request_id else {}), **(headers or {})}
    return httpx.post(f"{service.url}/v1/chat/completions", headers=headers, timeout=180,
                      json={"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra})


def hold(service: RunningService, pool, key: str, request_id: str):
    """A request of `key` that stays in flight until the test cancels it: on
    the CPU worker, whose context (2048) lets it run the longest."""
    future = pool.submit(chat, service, key, request_id, 1900, LONG, {"X-Force-Path": "cpu"}, ignore_eos=True)
    # Done instead of in flight is a refusal: say which, rather than time out.
    service.wait_for(lambda s: future.done() or any(r["id"] == request_id for r in s["requests"]),
                     what=f"{request_id} in flight")
    assert not future.done(), f"{request_id} ended at once: {future.result().status_code} {future.result().text}"
    return future


def test_an_inference_key_gets_403_on_every_admin_route_and_an_admin_key_does_not(keys):
    app_key, ops_key = add_key(keys, "scoped-app"), add_key(keys, "scoped-ops", "--scope", "admin")
    # text/plain: a key with the scope passes to the content check (415), so
    # nothing is restarted or paused by this test.
    for path in ADMIN_POSTS:
        refused = httpx.post(keys.url + path, headers={**bearer(app_key), "Content-Type": "text/plain"}, content="x")
        assert refused.status_code == 403, path
        assert refused.json()["error"]["code"] == "insufficient_scope" and "scoped-app" in refused.json()["error"][
            "message"]
        for admin in (ops_key, LEGACY_KEY):
            passed = httpx.post(keys.url + path, headers={**bearer(admin), "Content-Type": "text/plain"}, content="x")
            assert passed.status_code == 415, (path, passed.text)
    assert httpx.get(keys.url + "/admin/logs", headers=bearer(app_key)).status_code == 403
    assert httpx.get(keys.url + "/admin/logs", headers=bearer(ops_key)).status_code != 403
    # The web page logged in with an inference key: it reads, its controls are refused.
    page = httpx.Client(base_url=keys.url)
    assert page.post("/ui/login", json={"key": app_key}).json()["scope"] == "inference"
    assert page.get("/status").status_code == 200
    csrf = {"X-CSRF-Token": page.cookies["tray_app_csrf"]}
    refused = page.post("/admin/gpu", json={"paused": True}, headers=csrf)
    assert refused.status_code == 403 and keys.status()["service"]["gpu_paused"] is False
    # The API itself is an inference key's.
    assert chat(keys, app_key).status_code == 200


def test_an_inference_key_cancels_only_its_own_requests(keys):
    owner, other = add_key(keys, "cancel-owner"), add_key(keys, "cancel-other")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = hold(keys, pool, owner, "owned-1")
        refused = httpx.delete(f"{keys.url}/v1/requests/owned-1", headers=bearer(other))
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "insufficient_scope"
        assert any(r["id"] == "owned-1" for r in keys.status()["requests"])
        assert httpx.delete(f"{keys.url}/v1/requests/owned-1", headers=bearer(owner)).status_code == 200
        assert first.result().status_code == 499
        second = hold(keys, pool, owner, "owned-2")
        # The old single api_key is an admin key: it cancels anyone's.
        assert keys.http.delete("/v1/requests/owned-2").status_code == 200
        assert second.result().status_code == 499
    # An id nobody has is a 404 whoever asks, as before.
    assert httpx.delete(f"{keys.url}/v1/requests/nobody", headers=bearer(other)).status_code == 404


def test_a_revoked_key_stops_working_on_the_running_service(keys):
    key = add_key(keys, "short-lived")
    with httpx.Client(base_url=keys.url, headers=bearer(key)) as client:
        assert client.get("/v1/models").status_code == 200
        keys_command(keys, "revoke", "short-lived")
        # The same client, on the same connection if it was kept: refused now.
        refused = client.get("/v1/models")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert "short-lived" not in keys_command(keys, "list").stdout


def test_a_key_uses_only_its_models(keys):
    model = keys.status()["service"]["model"]
    elsewhere, allowed = add_key(keys, "other-model", "--models", "some-other-model"), add_key(
        keys, "this-model", "--models", model)
    refused = chat(keys, elsewhere)
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
    assert "some-other-model" in refused.json()["error"]["message"]
    assert chat(keys, allowed).status_code == 200


def test_over_its_concurrency_a_key_gets_429_with_retry_after_in_each_protocols_envelope(keys):
    model = keys.status()["service"]["model"]
    key = add_key(keys, "one-at-a-time", "--max-concurrency", "1")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        blocker = hold(keys, pool, key, "one-blocker")
        try:
            # Its estimate is made again at its first token: wait for that, so Retry-After
            # and /status below read the same one.
            keys.wait_for(lambda s: any(r["id"] == "one-blocker" and r["attempts"] and r["attempts"][-1]["tokens"]
                                        for r in s["requests"]), what="one-blocker's first token")
            with openai.OpenAI(base_url=f"{keys.url}/v1", api_key=key, max_retries=0) as client:
                with pytest.raises(openai.RateLimitError) as limited:
                    client.chat.completions.create(model=model, messages=HI, max_tokens=2)
            assert limited.value.body["code"] == "key_concurrency_limit"
            # When its one request is expected to end: its estimate, less its
            # age (read after the 429, so at most what was left then).
            blocker_now = next(r for r in keys.status()["requests"] if r["id"] == "one-blocker")
            estimate, age = blocker_now["estimated_latency_s"], blocker_now["age_s"]
            assert estimate is not None and estimate - age > 1, blocker_now  # so the 1 s default can't pass
            assert math.ceil(estimate - age) <= int(limited.value.response.headers["retry-after"]) <= math.ceil(
                estimate)
            with anthropic.Anthropic(base_url=keys.url, api_key=key, max_retries=0) as client:
                with pytest.raises(anthropic.RateLimitError) as limited:
                    client.messages.create(model=model, max_tokens=2, messages=HI)
            assert 1 <= int(limited.value.response.headers["retry-after"]) <= math.ceil(estimate)
            assert limited.value.body["error"]["type"] == "rate_limit_error"
            with pytest.raises(ollama.ResponseError) as limited:
                ollama.Client(host=keys.url, headers=bearer(key)).chat(model=model, messages=HI)
            assert limited.value.status_code == 429 and "one-at-a-time" in limited.value.error
            raw = httpx.post(f"{keys.url}/api/chat", headers=bearer(key),
                             json={"model": model, "messages": HI, "stream": False})
            assert raw.status_code == 429 and int(raw.headers["retry-after"]) >= 1 and set(raw.json()) == {"error"}
            # Another key is not held back by this one's limit.
            assert keys.http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2}).status_code == 200
        finally:
            keys.http.delete("/v1/requests/one-blocker")
            assert blocker.result().status_code == 499
    usage = keys.status()["usage"]["by_name"]["one-at-a-time"]["today"]
    assert (usage["refused"], usage["cancelled"]) == (4, 1)
    assert chat(keys, key).status_code == 200  # its slot is free again


def test_usage_by_key_and_path_matches_what_was_sent_and_survives_a_restart(tmp_path):
    service = start(tmp_path)
    try:
        phone, laptop = add_key(service, "phone"), add_key(service, "laptop")
        sent = {"phone": [], "laptop": []}  # (path, prompt tokens, completion tokens)
        for key, name in ((phone, "phone"), (phone, "phone"), (laptop, "laptop")):
            answer = chat(service, key)
            sent[name].append((answer.headers["x-served-by"], answer.json()["usage"]))
        with openai.OpenAI(base_url=f"{service.url}/v1", api_key=phone, max_retries=0) as client:
            stream = client.chat.completions.with_raw_response.create(
                model="default", messages=HI, max_tokens=4, stream=True, stream_options={"include_usage": True})
            chunks = list(stream.parse())
        sent["phone"].append((stream.headers["x-served-by"], chunks[-1].usage.model_dump()))
        # The GPU paused (by the admin key): the next request is the CPU's, degraded.
        assert service.http.post("/admin/gpu", json={"paused": True}).status_code == 200
        answer = chat(service, laptop)
        sent["laptop"].append((answer.headers["x-served-by"], answer.json()["usage"]))
        assert service.http.post("/admin/gpu", json={"paused": False}).status_code == 200
        assert [path for path, _ in sent["phone"]] == ["gpu", "gpu", "gpu"]
        assert [path for path, _ in sent["laptop"]] == ["gpu", "cpu"]

        def expected(name: str) -> dict:
            by_path = {path: {"requests": 0, "tokens_in": 0, "tokens_out": 0} for path in ("gpu", "cpu", "peer")}
            for path, usage in sent[name]:
                by_path[path]["requests"] += 1
                by_path[path]["tokens_in"] += usage["prompt_tokens"]
                by_path[path]["tokens_out"] += usage["completion_tokens"]
            return by_path

        def check(usage: dict) -> None:
            for name in ("phone", "laptop"):
                today = usage["by_name"][name]["today"]
                assert today["paths"] == expected(name), name
                assert today["requests"] == len(sent[name])
                assert today["tokens_out"] == sum(u["completion_tokens"] for _, u in sent[name])
                assert usage["by_name"][name]["last_7_days"] == today
            assert usage["by_name"]["laptop"]["today"]["degraded"] == 1
            assert usage["by_name"]["phone"]["today"]["degraded"] == 0

        check(service.status()["usage"])
        metrics = service.http.get("/metrics").text
        assert 'tray_app_usage_requests_total{key="laptop",path="cpu"} 1.0' in metrics
        assert 'tray_app_usage_requests_total{key="phone",path="gpu"} 3.0' in metrics
        listed = subprocess.run([sys.executable, "-m", "tray_app", "usage", "--url", service.url], env=service.env,
                                capture_output=True, text=True, timeout=60, check=True).stdout
        assert any(line.split()[:4] == ["phone", "today", "3", "3"] for line in listed.splitlines()), listed
    finally:
        service.stop()
    restarted = start(tmp_path)
    try:
        check(restarted.status()["usage"])
    finally:
        restarted.stop()


def test_an_inference_key_sees_its_own_requests_and_usage_in_status_and_an_admin_key_sees_all(keys):
    mine, theirs = add_key(keys, "status-mine"), add_key(keys, "status-theirs")
    admin = add_key(keys, "status-admin", "--scope", "admin")
    assert chat(keys, theirs, "theirs-done").status_code == 200
    assert chat(keys, mine, "mine-done").status_code == 200
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = hold(keys, pool, mine, "mine-held")
        try:
            def seen_by(key: str) -> tuple[dict, str]:
                return (httpx.get(f"{keys.url}/status", headers=bearer(key)).json(),
                        httpx.get(f"{keys.url}/metrics", headers=bearer(key)).text)

            def ids(status: dict) -> set[str]:
                return ({r["id"] for r in status["requests"]} | {d["id"] for d in status["recent_decisions"]}
                        | {e["id"] for e in status["events"] if "id" in e})

            theirs_view, theirs_metrics = seen_by(theirs)
            # Another key's running request is a count only: the CPU lane's, not an id or an app name.
            assert "mine-held" not in ids(theirs_view) and theirs_view["queues"]["cpu"]["running"] == 1
            assert "theirs-done" in ids(theirs_view)
            assert set(theirs_view["usage"]["by_name"]) == {"status-theirs"}
            assert all(set(day["by_name"]) <= {"status-theirs"} for day in theirs_view["usage"]["days"])
            assert 'key="status-theirs"' in theirs_metrics and 'key="status-mine"' not in theirs_metrics

            mine_view, _ = seen_by(mine)
            assert [r["id"] for r in mine_view["requests"]] == ["mine-held"]
            assert "mine-done" in ids(mine_view) and "theirs-done" not in ids(mine_view)
            assert set(mine_view["usage"]["by_name"]) == {"status-mine"}

            admin_view, admin_metrics = seen_by(admin)
            assert {"mine-held", "mine-done", "theirs-done"} <= ids(admin_view)
            assert {"status-theirs", "status-mine"} <= set(admin_view["usage"]["by_name"])
            assert 'key="status-theirs"' in admin_metrics
        finally:
            assert httpx.delete(f"{keys.url}/v1/requests/mine-held", headers=bearer(mine)).status_code == 200
            assert held.result().status_code == 499


def test_a_key_limited_to_some_models_lists_only_those(keys):
    model = keys.status()["service"]["model"]
    elsewhere = add_key(keys, "lists-elsewhere", "--models", "some-other-model")
    here = add_key(keys, "lists-here", "--models", model)

    def listed(key: str) -> tuple[list[str], list[str]]:
        openai_ids = [m["id"] for m in httpx.get(f"{keys.url}/v1/models", headers=bearer(key)).json()["data"]]
        ollama_names = [m.model for m in ollama.Client(host=keys.url, headers=bearer(key)).list().models]
        return openai_ids, ollama_names

    everything = listed(LEGACY_KEY)
    assert model in everything[0] and model + ":latest" in everything[1]
    assert listed(elsewhere) == ([], [])
    assert listed(here) == everything


def test_a_key_limited_to_some_models_is_refused_details_of_the_others_as_a_chat_is(keys):
    model = keys.status()["service"]["model"]
    elsewhere = add_key(keys, "shows-elsewhere", "--models", "some-other-model")
    here = add_key(keys, "shows-here", "--models", model)
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=keys.url, headers=bearer(elsewhere)).show(model)
    assert refused.value.status_code == 404 and "shows-elsewhere" in refused.value.error
    shown = ollama.Client(host=keys.url, headers=bearer(here)).show(model)
    assert shown.details is not None and shown.modelfile


def test_a_keys_embedding_refusal_comes_before_its_inputs_are_tokenized(keys):
    """An input over [embeddings] n_ctx (512 tokens) is a 400 input_too_long
    only once it is tokenized: a key that may not use the model is refused
    first, in each protocol's envelope."""
    model = keys.status()["service"]["model"]
    elsewhere = add_key(keys, "embed-long-elsewhere", "--models", "some-other-model")
    too_long = "word " * 2000
    for path, body in (("/v1/embeddings", {"model": model, "input": too_long}),
                       ("/api/embed", {"model": model, "input": too_long}),
                       ("/api/embeddings", {"model": model, "prompt": too_long})):
        answer = httpx.post(keys.url + path, headers=bearer(elsewhere), json=body, timeout=60)
        assert answer.status_code == 404 and "embed-long-elsewhere" in answer.text, (path, answer.text)
    assert httpx.post(f"{keys.url}/v1/embeddings", headers=bearer(elsewhere),
                      json={"model": model, "input": too_long}).json()["error"]["code"] == "model_not_found"
    allowed = httpx.post(f"{keys.url}/v1/embeddings", headers=bearer(LEGACY_KEY), json={"model": model, "input": too_long},
                         timeout=60)
    assert allowed.status_code == 400 and allowed.json()["error"]["code"] == "input_too_long"


def test_embeddings_and_tokenizer_routes_go_through_a_keys_models_and_concurrency(keys):
    model = keys.status()["service"]["model"]
    elsewhere = add_key(keys, "embed-elsewhere", "--models", "some-other-model")
    one = add_key(keys, "embed-one", "--max-concurrency", "1")
    # Every route that reads the model: each refuses a key that may not use it, in its own envelope.
    with openai.OpenAI(base_url=f"{keys.url}/v1", api_key=elsewhere, max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as refused:
            client.embeddings.create(model=model, input="hello")
    assert refused.value.body["code"] == "model_not_found" and "embed-elsewhere" in refused.value.body["message"]
    for path, body in (("/api/embed", {"model": model, "input": "hello"}),
                       ("/api/embeddings", {"model": model, "prompt": "hello"}),
                       ("/tokenize", {"content": "hello"}), ("/detokenize", {"tokens": [1]}),
                       ("/apply-template", {"messages": HI}),
                       ("/v1/messages/count_tokens", {"model": model, "messages": HI})):
        answer = httpx.post(keys.url + path, headers=bearer(elsewhere), json=body)
        assert answer.status_code == 404 and "embed-elsewhere" in answer.text, (path, answer.text)
    assert httpx.get(f"{keys.url}/props", headers=bearer(elsewhere)).status_code == 404
    assert httpx.post(f"{keys.url}/tokenize", headers=bearer(one), json={"content": "hello"}).status_code == 200

    # An embedding counts in the key's usage: a request and its tokens in, on the CPU (the embedding worker's).
    with openai.OpenAI(base_url=f"{keys.url}/v1", api_key=one, max_retries=0) as client:
        embedded = client.embeddings.create(model=model, input=["hello", "world"])
    ollama_embedded = httpx.post(f"{keys.url}/api/embed", headers=bearer(one),
                                 json={"model": model, "input": "hello"}).json()
    usage = keys.status()["usage"]["by_name"]["embed-one"]["today"]
    tokens = embedded.usage.prompt_tokens + ollama_embedded["prompt_eval_count"]
    assert (usage["requests"], usage["tokens_in"], usage["tokens_out"]) == (2, tokens, 0)
    assert usage["paths"]["cpu"] == {"requests": 2, "tokens_in": tokens, "tokens_out": 0}

    # At its concurrency, each of them is a 429 with Retry-After.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        blocker = hold(keys, pool, one, "embed-blocker")
        try:
            for path, body in (("/v1/embeddings", {"model": model, "input": "hello"}),
                               ("/api/embed", {"model": model, "input": "hello"}),
                               ("/api/embeddings", {"model": model, "prompt": "hello"}),
                               ("/tokenize", {"content": "hello"}),
                               ("/v1/messages/count_tokens", {"model": model, "messages": HI})):
                answer = httpx.post(keys.url + path, headers=bearer(one), json=body)
                assert answer.status_code == 429 and int(answer.headers["retry-after"]) >= 1, (path, answer.text)
                assert "embed-one" in answer.text, path
        finally:
            keys.http.delete("/v1/requests/embed-blocker")
            assert blocker.result().status_code == 499
    assert httpx.post(f"{keys.url}/tokenize", headers=bearer(one), json={"content": "hello"}).status_code == 200


def test_revoking_the_last_key_never_turns_the_key_check_off(tmp_path):
    """No [server] api_key: the named keys are the only lock. Revoking the
    last one used to open every route, /admin/keys included, to anyone."""
    service = RunningService(tmp_path, BASE_CONFIG)
    try:
        service.wait_ready()
        phone = add_key(service, "phone")
        assert httpx.get(f"{service.url}/admin/keys", timeout=30).status_code == 401
        keys_command(service, "revoke", "phone")
        for method, path, body in (("GET", "/admin/keys", None), ("POST", "/admin/keys", {"name": "x", "scope": "admin"}),
                                   ("POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 2})):
            answer = httpx.request(method, f"{service.url}{path}", json=body, timeout=30)
            assert answer.status_code == 401, (path, answer.text)
        assert chat(service, phone).status_code == 401
        # The last admin key stays, and every door says why.
        owner = add_key(service, "owner", "--scope", "admin")
        refused = httpx.delete(f"{service.url}/admin/keys/owner", headers=bearer(owner), timeout=30)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "last_admin_key"
        cli = subprocess.run([sys.executable, "-m", "tray_app", "keys", "revoke", "owner"], env=service.env,
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 2 and "last admin key" in cli.stderr
        assert httpx.get(f"{service.url}/admin/keys", headers=bearer(owner), timeout=30).status_code == 200
    finally:
        service.stop()


def test_an_inference_keys_keep_alive_neither_unloads_nor_loads_past_its_models(keys):
    """Ollama's load-only requests count as using the model: a key can't load
    a model outside its list, and can't unload one other keys are using."""
    model = keys.status()["service"]["model"]
    elsewhere = add_key(keys, "loads-elsewhere", "--models", "some-other-model")
    here = add_key(keys, "loads-here", "--models", model)

    def load_only(key: str, keep_alive: int) -> httpx.Response:
        return httpx.post(f"{keys.url}/api/generate", headers=bearer(key), timeout=60,
                          json={"model": model, "prompt": "", "keep_alive": keep_alive, "stream": False})

    refused = load_only(elsewhere, -1)
    assert refused.status_code == 404 and "loads-elsewhere" in refused.json()["error"]
    unload = load_only(here, 0)
    assert unload.status_code == 403 and "admin key" in unload.json()["error"]
    assert load_only(here, -1).status_code == 200
    # keep_alive 0 on a generation: answered, and the model stays loaded.
    answered = httpx.post(f"{keys.url}/api/generate", headers=bearer(here), timeout=60, json={
        "model": model, "prompt": "Hi", "keep_alive": 0, "stream": False, "options": {"num_predict": 2}})
    assert answered.status_code == 200, answered.text
    time.sleep(1.0)
    residency = keys.status()["gpu"]["residency"]
    assert residency["state"] == "loaded", residency
