"""The core service with real workers, real router, real clients."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from tests.harness import RunningService, running, wait_gone

pytestmark = pytest.mark.integration

HELLO = [{"role": "user", "content": "Say hello in five words."}]
STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]


def client(service) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_bundled_model(fresh):
    models = client(fresh).models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1"]


def test_chat_with_the_openai_client(fresh):
    raw = client(fresh).chat.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=HELLO, max_tokens=16, temperature=0)
    completion = raw.parse()
    assert completion.choices[0].message.content.strip()
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage.prompt_tokens > 10 and 0 < completion.usage.completion_tokens <= 16
    assert raw.headers["x-served-by"] == "gpu" and raw.headers["x-route-reason"] == "admitted"
    assert raw.headers["x-request-id"].startswith("req-")
    assert completion.id == "chatcmpl-" + raw.headers["x-request-id"]


def test_streaming_with_the_openai_client(fresh):
    stream = client(fresh).chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=HELLO, max_tokens=16, temperature=0, stream=True)
    pieces, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces).strip() and finish in ("stop", "length")


def test_text_completion_with_raw_httpx(fresh):
    response = fresh.http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 8,
                                                        "temperature": 0}, headers={"X-Request-Id": "my-id-1"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"]
    assert response.headers["x-request-id"] == "my-id-1" and body["id"] == "cmpl-my-id-1"


def test_sse_arrives_as_generated_not_buffered(fresh):
    times = []
    with fresh.http.stream("POST", "/v1/chat/completions", json={
            "messages": STORY, "max_tokens": 60, "temperature": 0, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                times.append(time.monotonic())
    assert len(times) > 20
    # Buffered output would land in one burst; generated output is spread out.
    assert times[-1] - times[0] > 0.1


def test_two_concurrent_streams_both_finish(fresh):
    def run(prompt: str):
        text, finish = [], None
        stream = client(fresh).chat.completions.create(
            messages=[{"role": "user", "content": prompt}], model="default", max_tokens=40, temperature=0, stream=True)
        for chunk in stream:
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        return "".join(text), finish

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, ["Tell me about cats.", "Tell me about dogs."]))
    for text, finish in results:
        assert finish in ("stop", "length") and len(text) > 20


@pytest.mark.parametrize("body, status, code", [
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_json"),
    (b'{"model": "default"}', 400, "missing_field"),
    (b'{"messages": []}', 400, "invalid_type"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}', 404, "model_not_found"),
    (b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "invalid_value"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', 400, "invalid_value"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 5}', 400, "invalid_value"),
])
def test_bad_input_gets_an_openai_error_envelope(fresh, body, status, code):
    response = fresh.http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == code and len(error["message"]) > 10 and "type" in error


def test_body_over_the_limit_is_413(fresh):
    huge = b'{"messages": [{"role": "user", "content": "' + b"a" * (5 * 1024 * 1024) + b'"}]}'
    response = fresh.http.post("/v1/chat/completions", content=huge, headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"


def test_unknown_route_is_an_envelope(fresh):
    response = fresh.http.get("/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


def test_status_has_workers_memory_and_requests(fresh):
    status = fresh.status()
    roles = {w["role"]: w for w in status["workers"]}
    assert set(roles) == {"gpu", "cpu"}
    for worker in roles.values():
        assert worker["state"] == "ready" and worker["pid"] and worker["port"] and worker["rss_mib"] > 50
        assert worker["model"] == "SmolLM2-135M-Instruct.Q4_1"
    assert roles["gpu"]["n_gpu_layers"] == -1 and roles["cpu"]["n_gpu_layers"] == 0
    assert roles["gpu"]["n_ctx"] == 1024 and roles["cpu"]["n_ctx"] == 2048
    gpu = status["gpu"]
    assert gpu["available"] and gpu["simulated"] and gpu["total_mib"] == 2048
    assert gpu["free_mib"] == pytest.approx(2048 - roles["gpu"]["estimated_vram_mib"], abs=0.2)
    assert status["ram"]["total_mib"] > status["ram"]["available_mib"] > 0
    assert status["requests"] == []
    assert fresh.http.get("/health").status_code == 200


def test_requests_in_flight_show_in_status(fresh):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(fresh.http.post, "/v1/chat/completions", json={
            "messages": STORY, "max_tokens": 200, "temperature": 0}, headers={"X-Request-Id": "visible-1"})
        status = fresh.wait_for(lambda s: any(r["id"] == "visible-1" for r in s["requests"]), what="request in status")
        entry = next(r for r in status["requests"] if r["id"] == "visible-1")
        assert entry["path"] == "gpu" and entry["state"] in ("queued", "running")
        assert future.result().status_code == 200


def test_killed_worker_comes_back(fresh):
    old = fresh.worker("cpu")
    os.kill(old["pid"], signal.SIGKILL)
    status = fresh.wait_for(lambda s: next(w for w in s["workers"] if w["role"] == "cpu")["pid"] not in (None, old["pid"])
                            and next(w for w in s["workers"] if w["role"] == "cpu")["state"] == "ready",
                            what="cpu worker back")
    cpu = next(w for w in status["workers"] if w["role"] == "cpu")
    assert cpu["restarts"] == old["restarts"] + 1
    assert cpu["last_exit"]["kind"] == "crash" and cpu["last_exit"]["signal"] == "SIGKILL"
    response = fresh.http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 4},
                               headers={"X-Force-Path": "cpu"})
    assert response.status_code == 200 and response.headers["x-served-by"] == "cpu"


def test_worker_logs_are_written(fresh):
    log_path = fresh.worker("cpu")["log"]
    assert os.path.exists(log_path) and "llama" in open(log_path).read().lower()


def test_stopping_the_service_leaves_no_worker(tmp_path):
    running = RunningService(tmp_path)
    running.wait_ready()
    pids = running.worker_pids()
    assert len(pids) == 2
    # uvicorn re-raises SIGTERM once its graceful shutdown is done.
    assert running.stop() in (0, -signal.SIGTERM)
    assert wait_gone(pids) == []
    for role in ("gpu", "cpu"):
        log = (tmp_path / "state" / "tray-app" / "log" / f"{role}-worker.log").read_text()
        assert "exited: stopped as requested" in log


def test_sigkill_of_the_service_leaves_no_worker(tmp_path):
    running = RunningService(tmp_path)
    running.wait_ready()
    pids = running.worker_pids()
    running.process.kill()
    running.process.wait()
    try:
        assert wait_gone(pids) == [], "workers outlived a SIGKILLed service"
    finally:
        running.stop()


def test_bad_model_file_fails_fast_with_one_line(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 definitely not a gguf")
    result = subprocess.run([sys.executable, "-m", "tray_app", "serve", "--model", str(bogus), "--port", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bogus) in lines[0] and "GGUF" in lines[0]


def test_missing_model_file_fails_fast(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tray_app", "serve", "--model", str(tmp_path / "nope.gguf")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "nope.gguf" in result.stderr and "does not exist" in result.stderr


def test_status_command_prints_paths_workers_headroom_breaker_and_degraded(fresh):
    fresh.http.post("/admin/gpu", json={"paused": True})
    result = subprocess.run([sys.executable, "-m", "tray_app", "status", "--url", fresh.url],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "simulated" in out and "free of 2,048 MiB" in out
    assert "breaker:   closed" in out and "DEGRADED" in out and "paused" in out
    for role in ("gpu", "cpu"):
        assert f"  {role}" in out and "ready" in out
    raw = subprocess.run([sys.executable, "-m", "tray_app", "status", "--url", fresh.url, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert __import__("json").loads(raw.stdout)["degraded"]["active"] is True


def test_status_command_without_a_service_says_how_to_start_one():
    result = subprocess.run([sys.executable, "-m", "tray_app", "status", "--url", "http://127.0.0.1:9"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "tray-app serve" in result.stderr


def test_the_restart_is_answered_once_it_has_begun(tmp_path):
    # The tray reads /status as soon as the answer comes, to show the restart
    # on its icon; a worker still "ready" with its old process then hid it.
    with running(tmp_path) as service:
        before = {worker["role"]: worker["pid"] for worker in service.status()["workers"]}
        assert service.http.post("/admin/restart").json() == {"restarting": True}
        after = {worker["role"]: worker for worker in service.status()["workers"]}
        assert not [role for role, worker in after.items()
                    if worker["state"] == "ready" and worker["pid"] == before[role]], after


def test_a_gpu_too_small_for_model_and_reserve_serves_from_the_cpu_and_says_why(tmp_path):
    """2 GiB of simulated GPU, a model of about 806 MiB and a 1.5 GiB reserve:
    it used to load, give the GPU back to an "other app" that was only the
    reserve, and never come back. Now it is never loaded, and every place
    that shows the GPU's state says why."""
    from tests.harness import BASE_CONFIG

    config = BASE_CONFIG.replace("reserve_mib = 256", "reserve_mib = 1500")
    with running(tmp_path, config, roles=("cpu",)) as service:
        status = service.status()
        reason = status["gpu"]["path_out_reason"]
        assert reason and "can't hold" in reason and "reserve_mib" in reason, status["gpu"]
        assert status["gpu"]["path"] == "none"
        answer = service.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                                 "max_tokens": 2})
        assert answer.status_code == 200 and answer.headers["x-served-by"] == "cpu"
        printed = subprocess.run([sys.executable, "-m", "tray_app", "status", "--url", service.url],
                                 capture_output=True, text=True, timeout=60, env=service.env)
        assert "can't hold" in printed.stdout, printed.stdout
        kinds = {event["kind"] for event in service.status()["events"]}
        assert not any(kind.startswith("gpu_yield") for kind in kinds), kinds


def test_contexts_left_to_the_app_are_sized_from_memory_and_reported_everywhere(tmp_path):
    """No n_ctx in the config: each path gets the largest context its memory
    budget holds, up to the model's trained 8192, with q8_0 where that is what
    lets it grow. A 1400 MiB simulated GPU (less a 256 MiB reserve) can't hold
    four f16 slots of 8192 for SmolLM2, and can with q8_0; the CPU has RAM for
    8192. The old fixed defaults were 4096 and 2048."""
    from tests.harness import BASE_CONFIG

    config = (BASE_CONFIG.replace("n_ctx = 1024\n", "").replace("n_ctx = 2048\n", "")
              .replace("simulate_mib = 2048", "simulate_mib = 1400"))
    with running(tmp_path, config) as service:
        listed = service.http.get("/v1/models").json()["data"][0]["capabilities"]
        by_path = listed["context_by_path"]
        gpu, cpu = by_path["gpu"], by_path["cpu"]
        assert gpu["automatic"] and cpu["automatic"]
        assert cpu["n_ctx"] == 8192 and cpu["kv_cache"] == "f16", cpu
        assert gpu["kv_cache"] == "q8_0" and gpu["n_ctx"] > 4096 and "q8_0" in gpu["why"], gpu
        assert listed["context_length"] == 8192
        status = service.status()
        worker = next(w for w in status["workers"] if w["role"] == "gpu")
        assert worker["n_ctx"] == gpu["n_ctx"]
        assert status["models"][0]["served_context"] == by_path
        show = service.http.post("/api/show", json={"model": service.http.get("/api/tags").json()["models"][0]["name"]})
        assert show.json()["tray_app"]["context_by_path"] == by_path
        # A prompt the old 2048-token CPU default refused runs on the CPU now.
        long_prompt = [{"role": "user", "content": "word " * 3000 + "\nSay ok."}]
        answer = service.http.post("/v1/chat/completions", json={"messages": long_prompt, "max_tokens": 2},
                                   headers={"X-Force-Path": "cpu"}, timeout=300)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["prompt_tokens"] > 3000
        # The GPU worker's llama-server really runs with the quantised cache, and the CPU's without.
        import psutil

        def argv(role):
            process = psutil.Process(next(w for w in status["workers"] if w["role"] == role)["pid"])
            return " ".join(" ".join(p.cmdline()) for p in [process, *process.children(recursive=True)])
        assert "--cache-type-k q8_0 --cache-type-v q8_0" in argv("gpu")
        assert "--cache-type-k" not in argv("cpu") and "--ctx-size 8192" in argv("cpu")


def test_speculative_decoding_on_a_path_runs_in_its_worker_and_counts_every_token(tmp_path):
    """[cpu] speculative = "ngram-mod": the CPU worker's llama-server drafts from
    n-grams; the answer still counts each token once (one event per token), and
    a request that repeats text gets drafts accepted."""
    import psutil

    from tests.harness import BASE_CONFIG

    config = BASE_CONFIG.replace("[cpu]\n", "[cpu]\nspeculative = \"ngram-mod\"\n")
    with running(tmp_path, config) as service:
        cpu = next(w for w in service.status()["workers"] if w["role"] == "cpu")
        assert cpu["speculative"] == "ngram-mod"
        process = psutil.Process(cpu["pid"])
        argv = " ".join(" ".join(p.cmdline()) for p in [process, *process.children(recursive=True)])
        assert "--spec-type ngram-mod" in argv
        gpu = next(w for w in service.status()["workers"] if w["role"] == "gpu")
        assert gpu["speculative"] is None  # the GPU path's own setting ("auto": off, as measured)
        code = "def add(a, b):\n    return a + b\n\n" * 12
        body = {"messages": [{"role": "user", "content": f"Repeat this code exactly:\n{code}"}],
                "max_tokens": 80, "temperature": 0}
        for _ in range(2):  # the second request finds the n-grams of the first
            answer = service.http.post("/v1/chat/completions", json=body, headers={"X-Force-Path": "cpu"},
                                       timeout=300)
            assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        choice = answer.json()["choices"][0]
        assert usage["completion_tokens"] == 80 or choice["finish_reason"] == "stop"
        streamed = []
        with service.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True,
                                 "stream_options": {"include_usage": True}}, headers={"X-Force-Path": "cpu"}) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    streamed.append(json.loads(line[5:]))
        text = "".join((c.get("delta") or {}).get("content") or "" for e in streamed for c in e.get("choices") or ())
        assert text == choice["message"]["content"]
        assert streamed[-1]["usage"]["completion_tokens"] == usage["completion_tokens"]
        # How the drafts fare, from llama-server's own counts, on the path that drafts only.
        workers = {w["role"]: w for w in service.status()["workers"]}
        drafts = workers["cpu"]["drafts"]
        assert drafts["answers"] >= 3 and drafts["accepted"] <= drafts["drafted"]
        assert drafts["drafted"] > 0 and 0 < drafts["acceptance"] <= 1, drafts
        assert workers["gpu"]["drafts"] is None
        metrics = service.http.get("/metrics").text
        assert f'tray_app_draft_acceptance{{role="cpu",type="ngram-mod"}} {drafts["acceptance"]}' in metrics
        # This llama.cpp reads no per-request speculative field: refused, not dropped.
        refused = service.http.post("/v1/chat/completions", json={**body, "speculative.n_max": 4})
        assert refused.status_code == 400 and "set per path here" in refused.json()["error"]["message"]


def test_speculation_never_changes_a_temperature_0_answer_on_either_path(tmp_path):
    """The same requests at temperature 0 through two services, one drafting on
    each path where the other doesn't: byte-identical answers (the simulated
    GPU runs the same CPU build, so any difference is the drafting's)."""
    from tests.harness import BASE_CONFIG

    def with_speculation(gpu: str, cpu: str) -> str:
        return (BASE_CONFIG.replace("[gpu]\n", f"[gpu]\nspeculative = \"{gpu}\"\n", 1)
                .replace("[cpu]\n", f"[cpu]\nspeculative = \"{cpu}\"\n", 1))

    code = "x = [1, 2, 3]\n" * 6
    requests = [{"messages": [{"role": "user", "content": f"Repeat this exactly:\n{code}"}]},
                {"messages": [{"role": "user", "content": "Write a short poem about the sea."}]}]
    answers: dict[str, list[str]] = {}
    for name, config in (("a", with_speculation("ngram-mod", "off")), ("b", with_speculation("off", "ngram-mod"))):
        with running(tmp_path / name, config) as service:
            answers[name] = []
            for path in ("gpu", "cpu"):
                for request in requests:
                    for _ in range(2):  # the second finds the first's n-grams
                        # The GPU takes a request that fits (auto); the CPU is forced.
                        answer = service.http.post("/v1/chat/completions",
                                                   headers={"X-Force-Path": "cpu"} if path == "cpu" else {},
                                                   json={**request, "max_tokens": 48, "temperature": 0},
                                                   timeout=300)
                        assert answer.status_code == 200, answer.text
                        assert answer.headers["x-served-by"] == path
                        answers[name].append(answer.json()["choices"][0]["message"]["content"])
            drafted = {w["role"]: (w["drafts"] or {}).get("drafted") for w in service.status()["workers"]}
            assert drafted["gpu" if name == "a" else "cpu"], drafted  # the drafting path did draft
    assert answers["a"] == answers["b"]
