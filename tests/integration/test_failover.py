"""Admission and failover on the simulated GPU, with real workers and real faults."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import time

import pytest

from tests.harness import streamed_text

pytestmark = pytest.mark.integration

LONG_ANSWER = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]


def chat(service, messages=LONG_ANSWER, max_tokens=16, headers=None, **extra):
    return service.http.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}, headers=headers or {})


def running_on(status, request_id, path):
    return any(r["id"] == request_id and r["path"] == path and r["state"] == "running" and r["attempts"]
               and r["attempts"][-1]["tokens"] > 0 for r in status["requests"])


def test_prompt_over_gpu_context_cap_is_served_by_cpu(fresh):
    # GPU cap is 1024 tokens, CPU cap 2048: this prompt fits only the CPU.
    long_prompt = [{"role": "user", "content": "word " * 1100 + "\nSummarise."}]
    response = chat(fresh, long_prompt, max_tokens=4)
    assert response.status_code == 200, response.text
    assert response.headers["x-served-by"] == "cpu"
    assert response.headers["x-route-reason"] == "gpu_context_cap"
    assert response.headers["x-fallback-model"] == "SmolLM2-135M-Instruct.Q4_1"
    assert float(response.headers["x-estimated-latency"]) > 0
    assert response.json()["usage"]["prompt_tokens"] > 1024


def test_prompt_over_every_cap_is_400(fresh):
    response = chat(fresh, [{"role": "user", "content": "word " * 2100}], max_tokens=4)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


def test_vram_pressure_redirects_new_requests_while_inflight_finish(fresh):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        inflight = pool.submit(chat, fresh, LONG_ANSWER, 120, {"X-Request-Id": "inflight-1"})
        fresh.wait_for(lambda s: running_on(s, "inflight-1", "gpu"), what="inflight on gpu")
        free = fresh.status()["gpu"]["free_mib"]
        fresh.http.post("/admin/gpu", json={"simulated_pressure_mib": free - 100})
        redirected = chat(fresh, max_tokens=4)
        assert redirected.headers["x-served-by"] == "cpu"
        assert redirected.headers["x-route-reason"] == "gpu_vram_headroom"
        finished = inflight.result()
    assert finished.status_code == 200 and finished.headers["x-served-by"] == "gpu"
    assert finished.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGABRT])
def test_gpu_death_mid_request_continues_once_on_cpu(fresh, sig):
    gpu_pid = fresh.worker("gpu")["pid"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(chat, fresh, LONG_ANSWER, 60, {"X-Request-Id": f"replay-{sig.name}"})
        fresh.wait_for(lambda s: running_on(s, f"replay-{sig.name}", "gpu"), what="request running on gpu")
        os.kill(gpu_pid, sig)
        response = future.result()
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == f"replay-{sig.name}"
    assert response.headers["x-served-by"] == "cpu"
    assert response.headers["x-route-reason"] == "gpu_failed_resumed"
    body = response.json()
    assert body["id"] == f"chatcmpl-replay-{sig.name}"
    # The CPU went on from the tokens the GPU had made (nothing had been
    # sent, so the seam is invisible): the whole answer, its usage summed.
    assert body["usage"]["completion_tokens"] == 60 and body["choices"][0]["finish_reason"] == "length"
    resumed = body["resumed"]
    assert resumed["cut_at_tokens"] >= 1 and resumed["cut_at_tokens"] + resumed["tokens_added"] == 60
    cpu_only = chat(fresh, LONG_ANSWER, 60, {"X-Force-Path": "cpu"})
    assert body["choices"][0]["message"]["content"] == cpu_only.json()["choices"][0]["message"]["content"]
    status = fresh.wait_workers_ready()
    gpu = next(w for w in status["workers"] if w["role"] == "gpu")
    assert gpu["pid"] != gpu_pid and gpu["last_exit"]["signal"] == sig.name
    assert any(e["kind"] == "resume" and e["id"] == f"replay-{sig.name}" and not e["streamed"]
               for e in status["events"])
    metrics = fresh.http.get("/metrics").text
    resumes = next(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith('tray_app_resumes_total{streamed="no"}'))
    assert resumes >= 1


def test_gpu_death_mid_stream_continues_on_the_cpu_from_the_text_sent(fresh):
    body = {"messages": LONG_ANSWER, "max_tokens": 60, "temperature": 0, "stream_options": {"include_usage": True}}
    response, lines = fresh.kill_gpu_mid_stream(body, kill_after=6, headers={"X-Request-Id": "resume-1"})
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    comments = [line for line in lines if line.startswith(":")]
    assert any("resumed on the CPU" in line for line in comments), lines
    events = [json.loads(line[5:]) for line in lines if line.startswith("data:") and line != "data: [DONE]"]
    # One stream: one id, one role, one finish, and the usage of both parts.
    assert {e["id"] for e in events} == {"chatcmpl-resume-1"}
    roles = [c for e in events for c in e["choices"] if (c.get("delta") or {}).get("role")]
    assert len(roles) == 1
    finishes = [e for e in events for c in e["choices"] if c.get("finish_reason")]
    assert len(finishes) == 1 and finishes[0]["choices"][0]["finish_reason"] == "length"
    resumed = finishes[0]["resumed"]
    assert resumed["from"] == "gpu" and resumed["on"] == "cpu" and resumed["cut_at_tokens"] >= 4
    assert resumed["cut_at_tokens"] + resumed["tokens_added"] == 60
    assert events[-1]["usage"]["completion_tokens"] == 60
    # Nothing at the seam was sent twice: the text is the CPU's own answer to
    # the same request from the start (greedy decoding, the same model file).
    cpu_only = chat(fresh, LONG_ANSWER, 60, {"X-Force-Path": "cpu"}).json()["choices"][0]["message"]["content"]
    text = streamed_text(lines)
    seam = resumed["cut_at_chars"]
    assert text[:seam] == cpu_only[:seam]
    assert text == cpu_only, (text[:seam], text[seam:])
    status = fresh.status()
    assert status["failover"]["resumes"] >= 1
    assert any(e["kind"] == "resumed" and e["id"] == "resume-1" for e in status["events"])
    metrics = fresh.http.get("/metrics").text
    assert any(line.startswith('tray_app_resumes_total{streamed="yes"}') for line in metrics.splitlines())


def test_gpu_death_mid_stream_of_a_completion_continues_from_its_prompt_and_text(fresh):
    body = {"prompt": "Once upon a time, in a small village by the sea,", "max_tokens": 40, "temperature": 0}
    response, lines = fresh.kill_gpu_mid_stream(body, kill_after=5, path="/v1/completions")
    assert lines[-1] == "data: [DONE]"
    whole = fresh.http.post("/v1/completions", json=body, headers={"X-Force-Path": "cpu"}).json()
    assert streamed_text(lines) == whole["choices"][0]["text"]


@pytest.mark.parametrize("protocol", ["anthropic", "responses", "ollama"])
def test_a_cut_stream_goes_on_in_each_protocols_own_way(fresh, protocol):
    story = "Write a long story about a lighthouse keeper and the sea."
    model = fresh.http.get("/api/tags").json()["models"][0]["name"]
    path, body = {
        "anthropic": ("/v1/messages", {"model": "default", "max_tokens": 40, "temperature": 0,
                                       "messages": [{"role": "user", "content": story}]}),
        "responses": ("/v1/responses", {"model": "default", "max_output_tokens": 40, "temperature": 0,
                                        "input": story}),
        "ollama": ("/api/chat", {"model": model, "messages": [{"role": "user", "content": story}],
                                 "options": {"num_predict": 40, "temperature": 0}}),
    }[protocol]
    response, lines = fresh.kill_gpu_mid_stream(body, kill_after=8, path=path)
    if protocol == "ollama":
        last = json.loads(lines[-1])
        # NDJSON has no comments: its last line says where the answer went on.
        assert last["done"] and last["resumed"]["from"] == "gpu" and last["eval_count"] == 40, last
        text = "".join(json.loads(line)["message"]["content"] for line in lines)
    else:
        assert any(line.startswith(":") and "resumed on the CPU" in line for line in lines), lines
        events = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
        assert not any(e["type"] in ("error", "response.failed") for e in events)
        # (max_output_tokens reached: Responses calls that incomplete.)
        assert events[-1]["type"] == ("message_stop" if protocol == "anthropic" else "response.incomplete")
        text = "".join(e["delta"].get("text", "") if protocol == "anthropic" else e["delta"]
                       for e in events if e["type"] in ("content_block_delta", "response.output_text.delta"))
    cpu_only = chat(fresh, [{"role": "user", "content": story}], 40, {"X-Force-Path": "cpu"})
    assert text == cpu_only.json()["choices"][0]["message"]["content"]


STORY = "Write a long story about a lighthouse keeper and the sea."


def official_stream(service, client_name):
    """(text chunks, final object) of a 48-token story streamed through an
    official client package, the GPU worker SIGKILLed after the 5th event."""
    import anthropic
    import ollama
    import openai

    gpu_pid = service.worker("gpu")["pid"]
    if client_name == "openai":
        client = openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(model="default", messages=[{"role": "user", "content": STORY}],
                                                max_tokens=48, temperature=0, stream=True)
        pieces = (chunk.choices[0].delta.content if chunk.choices else None for chunk in stream)
    elif client_name == "anthropic":
        client = anthropic.Anthropic(base_url=service.url, api_key="unused", max_retries=0)
        # (This anthropic version takes temperature only through extra_body.)
        stream = client.messages.create(model="default", max_tokens=48, stream=True, extra_body={"temperature": 0},
                                        messages=[{"role": "user", "content": STORY}])
        pieces = (getattr(event.delta, "text", None) if event.type == "content_block_delta" else None
                  for event in stream)
    else:
        client = ollama.Client(host=service.url, timeout=120)
        model = client.list().models[0].model
        stream = client.chat(model=model, messages=[{"role": "user", "content": STORY}], stream=True,
                             options={"num_predict": 48, "temperature": 0})
        pieces = (part.message.content for part in stream)
    text = []
    for n, piece in enumerate(pieces, start=1):
        text.append(piece or "")
        if n == 5:
            os.kill(gpu_pid, signal.SIGKILL)
    return text


@pytest.mark.parametrize("client_name", ["openai", "anthropic", "ollama"])
def test_official_clients_get_one_whole_answer_when_the_gpu_dies_after_the_5th_event(fresh, client_name):
    before_and_after = official_stream(fresh, client_name)
    # What was sent before the kill and after it, joined, is the whole answer
    # the CPU gives the same request from the start: nothing repeated or missing.
    cpu_only = chat(fresh, [{"role": "user", "content": STORY}], 48, {"X-Force-Path": "cpu"})
    assert "".join(before_and_after) == cpu_only.json()["choices"][0]["message"]["content"]
    resumed = [e for e in fresh.status()["events"] if e["kind"] == "resumed"]
    assert resumed and resumed[-1]["streamed"] and resumed[-1]["cut_at_tokens"] >= 3


def test_x_resume_never_keeps_the_explicit_error(fresh):
    body = {"messages": LONG_ANSWER, "max_tokens": 200, "temperature": 0}
    response, lines = fresh.kill_gpu_mid_stream(body, kill_after=4, headers={"X-Resume": "never"})
    error = json.loads(lines[-1][5:])["error"]
    assert error["code"] == "gpu_worker_failed" and "X-Resume: never" in error["message"]
    refused = fresh.http.post("/v1/chat/completions", json=body, headers={"X-Resume": "sometimes"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "X-Resume"


def test_gpu_death_after_first_bytes_of_a_tool_or_logprobs_answer_ends_with_an_error_event(fresh):
    # Logprobs can't be continued (the seam's tokens would have none): the
    # explicit error, as before, and it says why.
    body = {"messages": LONG_ANSWER, "max_tokens": 200, "temperature": 0, "logprobs": True}
    response, lines = fresh.kill_gpu_mid_stream(body, kill_after=3)
    events = [line[5:].strip() for line in lines if line.startswith("data:")]
    assert events[-1] != "[DONE]"
    error = json.loads(events[-1])["error"]
    assert error["code"] == "gpu_worker_failed" and "safe to retry" in error["message"]
    assert "can't be continued" in error["message"]
    assert len(events) < 200


def test_streaming_gpu_death_before_first_token_replays(fresh):
    """A stream whose GPU dies before any token is replayed on the CPU invisibly."""
    # Make the GPU slow to start answering: a long prompt costs prompt-eval time.
    prompt = [{"role": "user", "content": "word " * 900 + "\nSay ok."}]

    def run():
        with fresh.http.stream("POST", "/v1/chat/completions", json={
                "messages": prompt, "max_tokens": 8, "temperature": 0, "stream": True},
                headers={"X-Request-Id": "stream-replay"}) as response:
            return response.headers, [line for line in response.iter_lines() if line.startswith("data:")]

    headers, lines = fresh.kill_gpu_before_first_token("stream-replay", run)
    assert headers["x-route-reason"] == "gpu_failed_replayed"
    assert lines[-1] == "data: [DONE]"


def test_gpu_start_oom_opens_breaker_then_recovers(fresh):
    status = fresh.status()
    gpu = next(w for w in status["workers"] if w["role"] == "gpu")
    # Leave less than the worker needs, then take the worker down: its restart can't allocate.
    fresh.http.post("/admin/gpu", json={"simulated_pressure_mib": 2048 - gpu["estimated_vram_mib"] / 2})
    os.kill(gpu["pid"], signal.SIGKILL)
    status = fresh.wait_for(lambda s: s["breaker"]["state"] == "open", what="breaker open")
    gpu = next(w for w in status["workers"] if w["role"] == "gpu")
    assert gpu["last_exit"]["kind"] == "out_of_memory"
    assert status["degraded"]["active"] and status["degraded"]["fallback_model"]
    response = chat(fresh, max_tokens=4)
    assert response.status_code == 200 and response.headers["x-served-by"] == "cpu"
    assert response.headers["x-route-reason"] == "gpu_unavailable"
    assert "X-Estimated-Latency" in response.headers
    assert fresh.http.get("/health").status_code == 200

    fresh.http.post("/admin/gpu", json={"simulated_pressure_mib": 0})
    fresh.wait_for(lambda s: next(w for w in s["workers"] if w["role"] == "gpu")["state"] == "ready"
                   and s["breaker"]["state"] != "open", timeout=60, what="gpu back and breaker half-open")
    probe = chat(fresh, max_tokens=4)
    assert probe.status_code == 200 and probe.headers["x-served-by"] == "gpu"
    status = fresh.status()
    assert status["breaker"]["state"] == "closed" and not status["degraded"]["active"]
    assert status["gpu_recovery_s"] is not None


def test_a_restarting_gpu_worker_takes_the_gpu_path_out(service):
    """While the GPU worker restarts, the service says so as the reason the GPU
    path is out (a worker that never gets ready: test_worker_faults.py)."""
    service.reset()
    service.http.post("/admin/restart")
    status = service.wait_for(lambda s: s["gpu"]["path_out_reason"] is not None, interval=0.01,
                              what="gpu out while restarting")
    assert "GPU worker" in status["gpu"]["path_out_reason"]
    service.wait_ready()


def test_full_cpu_queue_is_503_with_retry_after(fresh):
    fresh.http.post("/admin/gpu", json={"paused": True})
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        # One running plus two waiting fill the CPU lane (queue_limit = 2).
        futures = [pool.submit(chat, fresh, LONG_ANSWER, 40, {"X-Request-Id": f"fill-{i}"}) for i in range(3)]
        fresh.wait_for(lambda s: s["queues"]["cpu"]["depth"] == 2 and s["queues"]["cpu"]["running"] == 1,
                       what="cpu lane full")
        started = time.monotonic()
        rejected = chat(fresh, max_tokens=4)
        elapsed = time.monotonic() - started
        assert rejected.status_code == 503 and rejected.json()["error"]["code"] == "cpu_queue_full"
        assert int(rejected.headers["retry-after"]) >= 1 and elapsed < 2
        assert [f.result().status_code for f in futures] == [200, 200, 200]


def test_deadline_too_short_for_cpu_is_refused_at_once(fresh):
    fresh.http.post("/admin/gpu", json={"paused": True})
    started = time.monotonic()
    response = chat(fresh, max_tokens=200, headers={"X-Request-Timeout": "0.05"})
    assert time.monotonic() - started < 2
    assert response.status_code == 503 and response.json()["error"]["code"] == "deadline_too_short"
    assert "Retry-After" in response.headers and float(response.headers["x-estimated-latency"]) > 0.05


def test_cancel_a_queued_request(fresh):
    fresh.http.post("/admin/gpu", json={"paused": True})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        blocker = pool.submit(chat, fresh, LONG_ANSWER, 60, {"X-Request-Id": "blocker"})
        fresh.wait_for(lambda s: running_on(s, "blocker", "cpu"), what="blocker running")
        queued = pool.submit(chat, fresh, LONG_ANSWER, 60, {"X-Request-Id": "queued-1"})
        status = fresh.wait_for(lambda s: any(r["id"] == "queued-1" and r["state"] == "queued" for r in s["requests"]),
                                what="queued")
        assert next(r for r in status["requests"] if r["id"] == "queued-1")["queue_position"] == 1
        cancel = fresh.http.delete("/v1/requests/queued-1")
        assert cancel.status_code == 200 and cancel.json()["state_was"] == "queued"
        canceled = queued.result()
        assert canceled.status_code == 499 and canceled.json()["error"]["code"] == "request_canceled"
        assert blocker.result().status_code == 200  # nothing else affected
    assert fresh.http.delete("/v1/requests/queued-1").status_code == 404


def test_cancel_a_running_request_stops_generation(fresh):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(chat, fresh, LONG_ANSWER, 400, {"X-Request-Id": "running-1"})
        fresh.wait_for(lambda s: running_on(s, "running-1", "gpu"), what="running")
        started = time.monotonic()
        assert fresh.http.delete("/v1/requests/running-1").json()["state_was"] == "running"
        response = running.result()
        assert time.monotonic() - started < 3
    assert response.status_code == 499
    # The worker stopped generating: the next request is served at once.
    started = time.monotonic()
    follow = chat(fresh, max_tokens=4)
    assert follow.status_code == 200 and follow.headers["x-served-by"] == "gpu"
    assert time.monotonic() - started < 3


def test_client_disconnect_cancels_the_stream(fresh):
    with fresh.http.stream("POST", "/v1/chat/completions", json={
            "messages": LONG_ANSWER, "max_tokens": 400, "temperature": 0, "stream": True},
            headers={"X-Request-Id": "walk-away"}) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                break
    status = fresh.wait_for(lambda s: not any(r["id"] == "walk-away" for r in s["requests"]), timeout=5,
                            what="request gone after disconnect")
    assert status["queues"]["gpu"]["running"] == 0


def test_idempotency_key_runs_once(fresh):
    body = {"messages": LONG_ANSWER, "max_tokens": 30, "temperature": 0}
    headers = {"Idempotency-Key": "key-123"}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(fresh.http.post, "/v1/chat/completions", json=body, headers=headers)
        fresh.wait_for(lambda s: len(s["requests"]) == 1, what="first running")
        during = pool.submit(fresh.http.post, "/v1/chat/completions", json=body, headers=headers)
        first, during = first.result(), during.result()
    after = fresh.http.post("/v1/chat/completions", json=body, headers=headers)
    assert first.json() == during.json() == after.json()
    assert during.headers["x-idempotent-replay"] == "true" and after.headers["x-idempotent-replay"] == "true"
    executions = [d for d in fresh.status()["recent_decisions"] if d["id"] == first.headers["x-request-id"]]
    assert len(executions) == 1
    other = fresh.http.post("/v1/chat/completions", json={**body, "max_tokens": 5}, headers=headers)
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"


def test_temperature_zero_gives_the_same_tokens_on_both_paths(fresh):
    prompt = [{"role": "user", "content": "List three colours."}]
    gpu = chat(fresh, prompt, max_tokens=40)
    cpu = chat(fresh, prompt, max_tokens=40, headers={"X-Force-Path": "cpu"})
    assert gpu.headers["x-served-by"] == "gpu" and cpu.headers["x-served-by"] == "cpu"
    assert cpu.headers["x-route-reason"] == "forced_cpu"
    assert gpu.json()["choices"][0]["message"]["content"] == cpu.json()["choices"][0]["message"]["content"]


def test_degraded_status_while_paused(fresh):
    fresh.http.post("/admin/gpu", json={"paused": True})
    degraded = fresh.status()["degraded"]
    assert degraded["active"] and "paused" in degraded["reason"]
    assert degraded["fallback_model"] == "SmolLM2-135M-Instruct.Q4_1" and degraded["estimated_latency_s"] > 0
    assert degraded["since"] <= time.time()
    fresh.http.post("/admin/gpu", json={"paused": False})
    assert not fresh.status()["degraded"]["active"]


def test_idempotency_key_twins_sent_at_the_same_instant_run_once(fresh):
    body = {"messages": LONG_ANSWER, "max_tokens": 12, "temperature": 0}
    barrier = __import__("threading").Barrier(2)

    def send(request_id):
        barrier.wait()
        return fresh.http.post("/v1/chat/completions", json=body,
                               headers={"Idempotency-Key": "twins-1", "X-Request-Id": request_id})

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        responses = list(pool.map(send, ["twin-a", "twin-b"]))
    assert [r.status_code for r in responses] == [200, 200]
    assert responses[0].json() == responses[1].json()
    decided = {d["id"] for d in fresh.status()["recent_decisions"]}
    assert len(decided & {"twin-a", "twin-b"}) == 1


def test_a_failed_stream_does_not_pin_its_idempotency_key(fresh):
    gpu_pid = fresh.worker("gpu")["pid"]
    # Logprobs: an answer that can't be continued from its text, so the stream ends with the error.
    body = {"messages": LONG_ANSWER, "max_tokens": 200, "temperature": 0, "stream": True, "logprobs": True}
    headers = {"Idempotency-Key": "retry-after-failure"}
    with fresh.http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        events = []
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(line)
                if len(events) == 3:
                    os.kill(gpu_pid, signal.SIGKILL)
    assert "gpu_worker_failed" in events[-1]
    fresh.wait_workers_ready()
    with fresh.http.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": 200},
                           headers=headers) as retry:
        lines = [line for line in retry.iter_lines() if line.startswith("data:")]
        assert "x-idempotent-replay" not in retry.headers
    assert lines[-1] == "data: [DONE]"


def test_a_frozen_gpu_worker_is_found_in_seconds_and_the_request_replays(fresh):
    gpu_pid = fresh.worker("gpu")["pid"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(chat, fresh, LONG_ANSWER, 60, {"X-Request-Id": "frozen-1"})
        fresh.wait_for(lambda s: running_on(s, "frozen-1", "gpu"), what="request running on gpu")
        os.kill(gpu_pid, signal.SIGSTOP)
        try:
            response = future.result()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(gpu_pid, signal.SIGCONT)
    assert response.status_code == 200, response.text
    assert response.headers["x-served-by"] == "cpu"
    assert response.headers["x-route-reason"] == "gpu_failed_resumed"
    status = fresh.wait_workers_ready()
    replay = next(e for e in status["events"] if e["kind"] == "resume" and e["id"] == "frozen-1")
    # Found by the liveness check, not by the first-token or inter-token deadline.
    assert "stopped" in replay["reason"], replay


def test_a_request_that_crashes_the_gpu_worker_is_not_replayed_and_is_quarantined(fresh):
    before = fresh.status()
    gpu_before = next(w for w in before["workers"] if w["role"] == "gpu")
    cpu_before = next(w for w in before["workers"] if w["role"] == "cpu")
    poison = {"messages": [{"role": "user", "content": "Write a long poem about a crash."}], "max_tokens": 60,
              "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(fresh.http.post, "/v1/chat/completions", json=poison,
                             headers={"X-Request-Id": "poison-1"})
        fresh.wait_for(lambda s: running_on(s, "poison-1", "gpu"), what="poison running on gpu")
        # What a bad input does to llama.cpp: a segfault while it serves this request.
        os.kill(gpu_before["pid"], signal.SIGSEGV)
        response = future.result()
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "request_crashed_worker"
    assert "SIGSEGV" in response.json()["error"]["message"]
    status = fresh.wait_workers_ready()
    assert not any(e["kind"] == "replay" and e["id"] == "poison-1" for e in status["events"])
    gpu_after = next(w for w in status["workers"] if w["role"] == "gpu")
    assert gpu_after["restarts"] == gpu_before["restarts"] + 1

    retry = fresh.http.post("/v1/chat/completions", json={**poison, "stream": True})
    assert retry.status_code == 400 and retry.json()["error"]["code"] == "request_crashed_worker"
    other = fresh.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Say hi."}],
                                                          "max_tokens": 4, "temperature": 0})
    assert other.status_code == 200
    cpu_only = fresh.http.post("/v1/chat/completions", headers={"X-Force-Path": "cpu"},
                               json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4})
    assert cpu_only.status_code == 200
    final = fresh.status()
    assert next(w for w in final["workers"] if w["role"] == "gpu")["restarts"] == gpu_before["restarts"] + 1
    assert next(w for w in final["workers"] if w["role"] == "cpu")["pid"] == cpu_before["pid"]
    assert final["breaker"]["state"] == "closed"
