"""Ollama's API, through the official `ollama` package, against the real
service on the real small model (issue 15). Raw httpx only where the
package hides what is checked (headers, the NDJSON framing)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal

import httpx
import ollama
import pytest

from tests.harness import BASE_CONFIG, running
from tray_app.core.engine.worker import free_loopback_port

pytestmark = pytest.mark.integration

HELLO = [{"role": "user", "content": "Say hello."}]
STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]


@pytest.fixture(scope="module")
def ollama_port():
    return free_loopback_port()


@pytest.fixture(scope="module")
def service(tmp_path_factory, ollama_port):
    """The suite's service, also listening on an Ollama port ([server] ollama_port)."""
    config = BASE_CONFIG + f"\n[server]\nollama_port = {ollama_port}\n"
    with running(tmp_path_factory.mktemp("ollama"), config) as service:
        yield service


@pytest.fixture(scope="module")
def client(service, ollama_port):
    # Ollama's own port, as an app that assumes 11434 would use it.
    return ollama.Client(host=f"http://127.0.0.1:{ollama_port}", timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.list().models[0].model


def test_the_main_port_speaks_ollama_too(service, model):
    on_main_port = ollama.Client(host=service.url).list().models
    assert [m.model for m in on_main_port] == [model]


def test_list_show_and_version_describe_the_served_model(fresh, client, model):
    listed = client.list().models
    assert model.endswith(":latest") and listed[0].size > 50 * 1024 * 1024
    assert listed[0].details.format == "gguf" and listed[0].details.family == "llama"
    assert listed[0].details.quantization_level and listed[0].details.parameter_size.endswith("M")
    shown = client.show(model)
    assert "completion" in shown.capabilities and shown.modelinfo["general.architecture"] == "llama"
    # The context served (the larger path's, 2048 on the CPU here), not the training length.
    assert shown.modelinfo["llama.context_length"] == 2048 and shown.parameters == "num_ctx 2048"
    # The model /api/embed runs says so: llm-ollama embeds only with such a model.
    assert "embedding" in shown.capabilities
    assert "im_start" in (shown.template or "")
    # What `codex --oss` asks for at least.
    version = tuple(int(part) for part in fresh.http.get("/api/version").json()["version"].split("."))
    assert version >= (0, 13, 4)


def test_chat_without_streaming(fresh, client, model):
    answer = client.chat(model=model, messages=HELLO, stream=False, options={"num_predict": 8, "temperature": 0})
    assert answer.done and answer.message.role == "assistant" and answer.message.content
    assert 1 <= answer.eval_count <= 8 and answer.prompt_eval_count > 5
    assert answer.done_reason in ("stop", "length") and answer.total_duration > 0


def test_chat_streams_ndjson_by_default_and_matches_the_whole_answer(fresh, client, model):
    options = {"num_predict": 12, "temperature": 0}
    pieces = list(client.chat(model=model, messages=STORY, stream=True, options=options))
    assert pieces[-1].done and pieces[-1].done_reason == "length" and pieces[-1].eval_count == 12
    assert not any(p.done for p in pieces[:-1]) and len(pieces) >= 3
    whole = client.chat(model=model, messages=STORY, stream=False, options=options)
    assert "".join(p.message.content for p in pieces) == whole.message.content
    # Ollama's default: no "stream" field means a stream, framed as NDJSON.
    with fresh.http.stream("POST", "/api/chat", json={"model": model, "messages": HELLO,
                                                      "options": {"num_predict": 4}}) as response:
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in response.iter_lines() if line]
    assert lines[-1]["done"] is True and response.headers["x-served-by"] == "gpu"


def test_generate_templated_and_raw(fresh, client, model):
    answer = client.generate(model=model, prompt="Say hello.", system="You are terse.",
                             options={"num_predict": 6, "temperature": 0})
    assert answer.done and answer.response and answer.eval_count <= 6
    raw = list(client.generate(model=model, prompt="The capital of France is", raw=True, stream=True,
                               options={"num_predict": 5, "temperature": 0, "stop": ["\n\n"]}))
    assert raw[-1].done and "".join(r.response for r in raw)
    # An empty prompt only loads the model, as in Ollama.
    loaded = client.generate(model=model, prompt="")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_num_ctx_bounds_prompt_and_answer(fresh, client, model):
    answer = client.chat(model=model, messages=STORY, stream=False,
                         options={"num_ctx": 60, "num_predict": 500, "temperature": 0})
    assert answer.prompt_eval_count + answer.eval_count <= 60 and answer.done_reason == "length"
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model=model, messages=STORY, stream=False, options={"num_ctx": 5})
    assert refused.value.status_code == 400 and "num_ctx" in refused.value.error


def test_json_format_gives_json(fresh, client, model):
    answer = client.chat(model=model, format="json", stream=False, options={"num_predict": 40, "temperature": 0},
                         messages=[{"role": "user", "content": "Give a JSON object with a key 'ok'."}])
    if answer.done_reason == "stop":
        json.loads(answer.message.content)


def test_ps_shows_the_loaded_model_and_keep_alive(fresh, client, model):
    running = client.ps().models
    assert [m.model for m in running] == [model]
    assert running[0].size_vram > 0 and running[0].size >= running[0].size_vram
    # The same file serves both paths: the larger context (the CPU's 2048 here).
    assert running[0].context_length == 2048
    # keep_alive -1: loaded until told otherwise (the suite's config never unloads anyway).
    client.chat(model=model, messages=HELLO, stream=False, keep_alive=-1, options={"num_predict": 1})
    assert fresh.status()["gpu"]["residency"]["idle_limit_s"] is None
    client.chat(model=model, messages=HELLO, stream=False, keep_alive="10m", options={"num_predict": 1})
    assert fresh.status()["gpu"]["residency"]["idle_limit_s"] == 600


def test_errors_come_in_ollamas_shape(fresh, client, model):
    with pytest.raises(ollama.ResponseError) as unknown:
        client.chat(model="no-such-model:7b", messages=HELLO)
    assert unknown.value.status_code == 404 and "no-such-model" in unknown.value.error
    with pytest.raises(ollama.ResponseError) as bad:
        client.chat(model=model, messages=HELLO, options={"num_predict": "lots"})
    assert bad.value.status_code == 400 and "num_predict" in bad.value.error
    for body, field in (({"model": model, "messages": "hi"}, "messages"),
                        ({"messages": HELLO}, "model"),
                        ({"model": model, "messages": HELLO, "keep_alive": "soon"}, "keep_alive"),
                        ({"model": model, "messages": HELLO, "format": "yaml"}, "format"),
                        ({"model": model, "messages": [{"role": "user", "content": "hi", "images": ["AAAA"]}]},
                         "images")):
        response = fresh.http.post("/api/chat", json=body)
        assert response.status_code == 400 and field in response.json()["error"], (body, response.text)
    assert fresh.http.post("/api/pull", json={"model": model}).json()["error"].startswith("no route")
    # `curl -d` labels its JSON as a form; Ollama's examples use it, so it is read.
    plain = fresh.http.post("/api/generate", content=json.dumps({"model": model, "prompt": "Hi", "stream": False,
                                                                 "options": {"num_predict": 2}}),
                            headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert plain.status_code == 200 and plain.json()["done"] is True


def test_a_capacity_error_is_a_503_in_ollamas_shape(fresh, service, model):
    fresh.http.post("/admin/gpu", json={"paused": True})
    no_fallback = ollama.Client(host=service.url, headers={"X-Fallback": "never"})
    with pytest.raises(ollama.ResponseError) as refused:
        no_fallback.chat(model=model, messages=HELLO, stream=False)
    assert refused.value.status_code == 503 and "GPU" in refused.value.error


def test_a_cpu_served_answer_says_so(fresh, model):
    response = fresh.http.post("/api/chat", headers={"X-Force-Path": "cpu"}, json={
        "model": model, "messages": HELLO, "stream": False, "options": {"num_predict": 4}})
    assert response.status_code == 200 and response.json()["done"] is True
    assert response.headers["x-served-by"] == "cpu" and response.headers["x-fallback-model"]
    assert response.headers["x-route-reason"] == "forced_cpu"


def test_gpu_death_before_the_answer_is_whole_continues_once_on_the_cpu(fresh, service, model):
    gpu_pid = fresh.worker("gpu")["pid"]
    tagged = ollama.Client(host=service.url, headers={"X-Request-Id": "ollama-replay"}, timeout=120)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(tagged.chat, model=model, messages=STORY, stream=False,
                             options={"num_predict": 40, "temperature": 0})
        fresh.wait_for(lambda s: any(r["id"] == "ollama-replay" and r["path"] == "gpu" and r["state"] == "running"
                                     and r["attempts"][-1]["tokens"] > 0 for r in s["requests"]),
                       what="request running on gpu")
        os.kill(gpu_pid, signal.SIGKILL)
        answer = future.result()
    # The CPU went on from the tokens the GPU had made: the whole answer, counted once.
    assert answer.done and answer.eval_count == 40
    cpu_only = httpx.post(f"{service.url}/api/chat", headers={"X-Force-Path": "cpu"}, timeout=120, json={
        "model": model, "messages": STORY, "stream": False, "options": {"num_predict": 40, "temperature": 0}})
    assert answer.message.content == cpu_only.json()["message"]["content"]
    status = fresh.wait_workers_ready()
    assert any(e["kind"] == "resume" and e["id"] == "ollama-replay" for e in status["events"])
    assert status["accounting"]["duplicate_executions"] == 0


def test_embed_and_the_older_embeddings_route(fresh, client, model):
    batch = client.embed(model=model, input=["The sea", "A lighthouse", "The sea"])
    vectors = batch.embeddings
    assert len(vectors) == 3 and vectors[0] == vectors[2] and vectors[0] != vectors[1]
    assert sum(x * x for x in vectors[0]) == pytest.approx(1.0, abs=1e-3) and batch.prompt_eval_count > 0
    single = client.embeddings(model=model, prompt="The sea")
    assert single.embedding == pytest.approx(vectors[0], abs=1e-5)
    # /v1/models says which model answers embeddings, and how.
    listed = fresh.http.get("/v1/models").json()["data"][0]["capabilities"]
    assert listed["embeddings"] is True and listed["embeddings_dimensions"] == len(vectors[0])
    with pytest.raises(ollama.ResponseError) as empty:
        client.embed(model=model, input=[])
    assert empty.value.status_code == 400 and "input" in empty.value.error
    with pytest.raises(ollama.ResponseError) as unknown:
        client.embed(model="nomic-embed-text", input="x")
    assert unknown.value.status_code == 404
    too_long = fresh.http.post("/api/embed", json={"model": model, "input": "word " * 2000})
    assert too_long.status_code == 400 and "input" in too_long.json()["error"]


def test_a_history_longer_than_the_context_loses_its_oldest_messages_as_in_ollama(fresh, client, model):
    """Apps written for Ollama send the whole chat every time and rely on it
    cutting the oldest turns: a 400 there is a broken chat. The system
    message and the newest turns stay."""
    turns = []
    for number in range(60):
        turns += [{"role": "user", "content": f"Question {number}: " + "tell me about the sea " * 12},
                  {"role": "assistant", "content": f"Answer {number}: " + "the sea is wide and deep " * 10}]
    messages = [{"role": "system", "content": "You are a sailor."}, *turns,
                {"role": "user", "content": "Say the word ANCHOR."}]
    answer = client.chat(model=model, messages=messages, stream=False, options={"num_predict": 4})
    assert answer.done and 0 < answer.prompt_eval_count <= 2048
    # The whole history would not have fitted: something was dropped, and the log says how much.
    assert "oldest messages of 122" in fresh.log_text()
