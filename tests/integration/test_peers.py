"""Peers on loopback: a second instance of the service ("b", its own port,
its own workers) is the first one's ([[peers]]) peer. With the first one's
GPU paused, its requests go to the peer before its own CPU, under the usual
rules: identity and idempotency keys forwarded, degraded mode names the
peer, a peer killed mid-request is replayed once on the local CPU, and a
peer that refuses our key is never used."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import openai
import pytest

from tests.harness import BASE_CONFIG, READY_TIMEOUT_S, RunningService

pytestmark = pytest.mark.integration

PEER_KEY = "peer-secret-key"
CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}


def peer_failure_reason(status: dict, request_id: str) -> str:
    """Why the peer failed this request, by the event log."""
    return next(e for e in reversed(status["events"]) if e["kind"] == "peer_failure" and e["id"] == request_id)["reason"]


def replayed_once_on_the_local_cpu(local: RunningService, response) -> dict:
    """Assert that the first peer failed the request and the local CPU
    answered it, once; the status after."""
    assert response.status_code == 200, response.text
    assert response.headers["x-served-by"] == "cpu"
    assert response.headers["x-route-reason"] == "peer_failed_replayed"
    assert response.json()["choices"][0]["message"]["content"]
    status = local.status()
    assert status["accounting"]["duplicate_executions"] == 0
    # The request ended: it holds no place at the peer, and the service answers.
    assert status["peers"][0]["in_flight"] == 0
    assert local.http.get("/health").status_code == 200
    return status


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peers")
    peer = RunningService(tmp / "b", BASE_CONFIG + f'[server]\napi_key = "{PEER_KEY}"\n')
    peer.http.headers["Authorization"] = f"Bearer {PEER_KEY}"
    local = None
    try:
        peer.wait_ready()
        local = RunningService(tmp / "a", BASE_CONFIG + f"""
[[peers]]
name = "b"
url = "{peer.url}/v1"
api_key = "{PEER_KEY}"
[[peers]]
name = "b-wrong-key"
url = "{peer.url}"
api_key = "not-the-key"
""")
        local.wait_ready()
        local.wait_for(lambda s: s["peers"][0]["healthy"], timeout=20, what="the peer healthy")
        # The local GPU takes no work: every request is one the local GPU can't serve.
        assert local.http.post("/admin/gpu", json={"paused": True}).status_code == 200
        yield local, peer
    finally:
        if local is not None:
            local.stop()
        peer.stop()


def test_status_shows_each_peer_its_health_and_latency(pair):
    local, _ = pair
    good, wrong = local.status()["peers"]
    assert good["healthy"] and good["reachable"] and good["problem"] is None
    assert good["latency_ms"] > 0 and good["role"] == "fallback"
    # Its key travels over loopback only: no cleartext warning.
    assert good["key_in_cleartext"] is False and good["warning"] is None
    assert local.status()["service"]["model"] in good["models"]
    assert not wrong["healthy"] and wrong["reachable"]
    assert "refused our API key (HTTP 401)" in wrong["problem"]
    metrics = local.http.get("/metrics").text
    assert 'tray_app_peer_up{peer="b"} 1.0' in metrics and 'tray_app_peer_up{peer="b-wrong-key"} 0.0' in metrics


def test_a_request_the_local_gpu_cant_take_goes_to_the_peer_with_its_identity(pair):
    local, peer = pair
    client = openai.OpenAI(base_url=f"{local.url}/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="default", extra_headers={"X-Request-Id": "via-peer-1"}, **CHAT)
    answer = raw.parse()
    assert raw.headers["x-served-by"] == "peer" and raw.headers["x-peer"] == "b"
    assert raw.headers["x-route-reason"] == "peer"
    # This server's identity on the answer: its id and model name.
    assert answer.id == "chatcmpl-via-peer-1"
    assert answer.model == local.status()["service"]["model"]
    assert answer.choices[0].message.content
    # The peer served it under the same request id, and never sent it on.
    decisions = peer.status()["recent_decisions"]
    assert any(d["id"] == "via-peer-1" for d in decisions)
    # Streamed, through the official client.
    chunks = list(client.chat.completions.create(model="default", stream=True, **CHAT))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    status = local.status()
    assert status["peers"][0]["served"] >= 2 and status["peers"][1]["served"] == 0
    assert status["accounting"]["duplicate_executions"] == 0
    # ...and the peer ran each of them once, by its own ledger.
    assert peer.status()["accounting"]["duplicate_executions"] == 0


def test_the_idempotency_key_is_forwarded_to_the_peer(pair):
    local, peer = pair
    headers = {"Idempotency-Key": "peer-idem-1"}
    first = local.http.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert first.status_code == 200 and first.headers["x-served-by"] == "peer"
    again = local.http.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert again.headers["x-idempotent-replay"] == "true" and again.json() == first.json()
    # The peer holds the key too: another body under it is refused there
    # (422), which it could only do if the key came with the forwarded request.
    other = peer.http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3}, headers=headers)
    assert other.status_code == 422, other.text
    assert local.status()["peers"][0]["served"] >= 1


def test_other_protocols_go_to_the_peer_too(pair):
    local, _ = pair
    ollama = local.http.post("/api/chat", json={"model": "default", "messages": CHAT["messages"], "stream": False,
                                                "options": {"num_predict": 8}})
    assert ollama.status_code == 200 and ollama.headers["x-served-by"] == "peer"
    assert ollama.json()["message"]["content"]
    anthropic = local.http.post("/v1/messages", json={"model": "default", "max_tokens": 8,
                                                      "messages": CHAT["messages"]})
    assert anthropic.status_code == 200 and anthropic.headers["x-served-by"] == "peer"


def test_a_request_forwarded_by_a_peer_is_never_sent_on(pair):
    local, _ = pair
    response = local.http.post("/v1/chat/completions", json=CHAT, headers={"X-Peer-Hop": "1"})
    assert response.status_code == 200
    assert response.headers["x-served-by"] == "cpu" and response.headers["x-route-reason"] == "forced_cpu"


def test_the_peer_killed_mid_request_is_replayed_once_on_the_local_cpu(pair):
    local, peer = pair

    def long_request():
        return local.http.post("/v1/chat/completions", headers={"X-Request-Id": "peer-kill"}, timeout=180, json={
            "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 120, "temperature": 0,
            "logit_bias": {"2": -100}})

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(long_request)
        peer.wait_for(lambda s: any(r["id"] == "peer-kill" and r["state"] == "running" for r in s["requests"]),
                      interval=0.01, what="running on the peer")
        # Degraded mode names the peer while it serves (and why the GPU can't).
        degraded = local.status()["degraded"]
        assert degraded["active"] and degraded["peers"] == ["b"] and "paused" in degraded["reason"]
        # Measured on its earlier answers: what a typical request takes there.
        assert degraded["peer_latency_s"]["b"] > 0
        killed_at = time.monotonic()
        peer.process.send_signal(signal.SIGKILL)
        response = future.result()
        answered_s = time.monotonic() - killed_at
    status = replayed_once_on_the_local_cpu(local, response)
    assert status["peers"][0]["failures"] == 1
    print(f"\npeer killed mid-request: answered by the local CPU {answered_s:.2f} s after the kill "
          f"({response.json()['usage']['completion_tokens']} tokens)")
    # The health check notices; later requests stay local without trying it.
    local.wait_for(lambda s: s["peers"][0]["reachable"] is False, timeout=15, what="the peer seen unreachable")
    after = local.http.post("/v1/chat/completions", json=CHAT)
    assert after.status_code == 200 and after.headers["x-served-by"] == "cpu"
    assert after.headers["x-route-reason"] == "forced_cpu"


def test_the_local_service_is_healthy_after_the_peer_died(pair):
    local, _ = pair
    local.http.post("/admin/gpu", json={"paused": False})
    status = local.wait_for(lambda s: s["breaker"]["state"] == "closed", timeout=READY_TIMEOUT_S, what="closed")
    assert status["service"]["healthy"]
    response = local.http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200 and response.headers["x-served-by"] == "gpu"


# ----- a careless or hostile peer -------------------------------------------------------------


class HostilePeer:
    """A real HTTP server on loopback that lists the model, as a healthy peer
    does (or, with `models_mode` "drip", a byte of the list at a time, never
    all of it), and then answers chats in the way `mode` says: never, with
    junk, with an error event, with a line that never ends, refusing the
    key, busy, with an error whose body stalls, or with tokens that never end."""

    def __init__(self, model: str) -> None:
        import http.server
        import threading

        self.mode = "hang"
        self.models_mode = "list"
        self.release = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                listing = json.dumps({"object": "list", "data": [{"id": model}]}).encode()
                if outer.models_mode == "drip":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(listing) + 100_000))
                    self.end_headers()
                    self._write_until_closed(b" ", pause_s=0.05)
                else:
                    self._send(200, listing)

            def _write_until_closed(self, chunk: bytes, pause_s: float = 0.0) -> None:
                """Write `chunk` over and over until the client hangs up (or the server closes)."""
                try:
                    while not outer.release.is_set():
                        self.wfile.write(chunk)
                        self.wfile.flush()
                        if pause_s:
                            outer.release.wait(pause_s)
                except OSError:
                    pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                mode = outer.mode
                if mode == "hang":
                    outer.release.wait(30)
                elif mode == "junk":
                    self._send(200, b"hello, I am not an event stream", "text/plain")
                elif mode == "error_event":
                    self._send(200, b'data: {"error": {"message": "out of memory"}}\n\n', "text/event-stream")
                elif mode == "endless_line":
                    self._send(200, b"data: " + b"x" * (5 * 1024 * 1024), "text/event-stream")
                elif mode == "refuse_key":
                    self._send(401, b'{"error": {"message": "bad key"}}')
                elif mode == "busy":
                    self._send(503, b'{"error": {"message": "my GPU is busy"}}')
                elif mode == "stalled_error":
                    # An error status, and then a body that never comes.
                    self.send_response(500)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    self.wfile.write(b'{"error": {"mess')
                    self.wfile.flush()
                    outer.release.wait(60)
                elif mode == "endless_tokens":
                    # Valid token events, forever: never cut at max_tokens.
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    token = {"choices": [{"index": 0, "delta": {"content": "la"}}]}
                    self._write_until_closed(f"data: {json.dumps(token)}\n\n".encode() * 8)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def with_hostile_peer(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    config = BASE_CONFIG.replace("failure_threshold = 2", "failure_threshold = 100")
    # The model's id as this service names it, before the peer exists.
    from tray_app.core.config import bundled_model_path

    hostile = HostilePeer(bundled_model_path().stem)
    local = RunningService(tmp / "a", config + f"""
[[peers]]
name = "careless"
url = "{hostile.url}"
first_token_timeout_s = 2
""")
    try:
        local.wait_ready()
        local.wait_for(lambda s: s["peers"][0]["healthy"], timeout=20, what="the peer healthy")
        assert local.http.post("/admin/gpu", json={"paused": True}).status_code == 200
        yield local, hostile
    finally:
        local.stop()
        hostile.close()


@pytest.mark.parametrize("mode, failure", [
    ("hang", "no output for 2 s"),
    ("junk", "its stream ended without [DONE]"),
    ("error_event", "it reported an error"),
    ("endless_line", "an SSE line longer than"),
])
def test_a_peer_that_answers_badly_costs_the_request_nothing_but_time(with_hostile_peer, mode, failure):
    local, hostile = with_hostile_peer
    hostile.mode = mode
    request_id = f"hostile-{mode.replace('_', '-')}"
    response = local.http.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": request_id})
    status = replayed_once_on_the_local_cpu(local, response)
    assert failure in peer_failure_reason(status, request_id)


def test_a_peer_that_refuses_the_key_mid_flight_is_taken_out_and_nothing_reruns(with_hostile_peer):
    local, hostile = with_hostile_peer
    hostile.mode = "refuse_key"
    response = local.http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    # It ran nothing there: decided again here, not a replay.
    assert response.headers["x-served-by"] == "cpu" and response.headers["x-route-reason"] == "forced_cpu"
    peer = local.status()["peers"][0]
    # Its breaker opened at once and says why. (By now it may be half-open,
    # past the 3 s cooldown, and a health check may have found its model list
    # again: the local CPU's answer takes its time on a busy machine.)
    assert not peer["healthy"] and peer["breaker"]["state"] != "closed"
    assert "refused our API key (HTTP 401)" in peer["breaker"]["last_failure_reason"]
    assert "refused our API key (HTTP 401)" in peer["last_failure"]


# ----- a hostile peer beside a well-behaved one: every read is bounded -------------------------------


@pytest.fixture(scope="module")
def hostile_and_bystander(tmp_path_factory):
    """A service with two peers: "careless" (a HostilePeer, tried first) and
    "bystander", a plain one that lists the model and declines every chat
    (busy), so a request it is offered ends on the local CPU too."""
    tmp = tmp_path_factory.mktemp("hostile-pair")
    config = BASE_CONFIG.replace("failure_threshold = 2", "failure_threshold = 100")
    from tray_app.core.config import bundled_model_path

    hostile, bystander = HostilePeer(bundled_model_path().stem), HostilePeer(bundled_model_path().stem)
    bystander.mode = "busy"
    local = RunningService(tmp / "a", config + f"""
[[peers]]
name = "careless"
url = "{hostile.url}"
first_token_timeout_s = 2
[[peers]]
name = "bystander"
url = "{bystander.url}"
""")
    try:
        local.wait_ready()
        local.wait_for(lambda s: all(p["healthy"] for p in s["peers"]), timeout=20, what="the peers healthy")
        assert local.http.post("/admin/gpu", json={"paused": True}).status_code == 200
        yield local, hostile
    finally:
        local.stop()
        hostile.close()
        bystander.close()




def test_a_peer_that_stalls_its_error_answer_costs_the_request_only_its_deadline(hostile_and_bystander):
    local, hostile = hostile_and_bystander
    hostile.mode = "stalled_error"
    response = local.http.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "stalled-error"})
    status = replayed_once_on_the_local_cpu(local, response)
    assert peer_failure_reason(status, "stalled-error") == "it answered HTTP 500 but sent no more of its body for 2 s"


def test_a_peer_whose_tokens_never_end_is_cut_at_max_tokens(hostile_and_bystander):
    local, hostile = hostile_and_bystander
    hostile.mode = "endless_tokens"
    cut = f"it sent more than {CHAT['max_tokens'] + 16} events for max_tokens {CHAT['max_tokens']}: its answer was cut"
    # Nothing reached a JSON client: the one re-run, on the local CPU.
    response = local.http.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "endless-json"})
    status = replayed_once_on_the_local_cpu(local, response)
    assert peer_failure_reason(status, "endless-json") == cut
    # A streaming client had the tokens up to the cut, and then a clear error.
    with local.http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True},
                           headers={"X-Request-Id": "endless-stream"}) as streamed:
        assert streamed.headers["x-served-by"] == "peer"
        events = [json.loads(line[5:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    tokens = [e for e in events if e.get("choices") and e["choices"][0]["delta"].get("content")]
    assert len(tokens) == CHAT["max_tokens"] + 16
    error = events[-1]["error"]
    assert error["code"] == "peer_failed" and cut in error["message"] and "nothing was re-run" in error["message"]
    status = local.status()
    assert status["peers"][0]["in_flight"] == 0 and status["accounting"]["duplicate_executions"] == 0


def test_a_peer_whose_model_list_drips_is_marked_down_and_the_others_stay_watched(hostile_and_bystander):
    local, hostile = hostile_and_bystander
    hostile.mode = "hang"
    hostile.models_mode = "drip"
    try:
        status = local.wait_for(lambda s: s["peers"][0]["problem"] is not None, timeout=30,
                                what="the dripping peer's check to end")
        careless, _ = status["peers"]
        assert careless["problem"] == "its /v1/models did not answer in full within 3 s"
        assert careless["reachable"] is False and not careless["healthy"]
        # The other peer's checks go on meanwhile: one newer than the dripping peer's.
        local.wait_for(lambda s: s["peers"][1]["checked_at"] > careless["checked_at"] and s["peers"][1]["healthy"],
                       timeout=30, what="the bystander checked again")
        assert local.http.get("/health").status_code == 200
        # A request goes past the unhealthy peer (the bystander declines it) to the local CPU, once.
        response = local.http.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "after-drip"})
        assert response.status_code == 200 and response.headers["x-served-by"] == "cpu"
        assert response.json()["choices"][0]["message"]["content"]
        status = local.status()
        assert status["peers"][0]["served"] == 0 and status["accounting"]["duplicate_executions"] == 0
        assert not any(e["kind"] == "peer_failure" and e.get("peer") == "careless" and e["id"] == "after-drip"
                       for e in status["events"])
    finally:
        hostile.models_mode = "list"
