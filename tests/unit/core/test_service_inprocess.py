"""The real Service and HTTP app, in-process (tests/fakes/service.py): every
protocol's shapes, a replay before the first byte, an idempotent retry and
a capacity refusal, with no llama.cpp process. Fake workers answer through
a fake llama-server upstream, so each answer says which worker gave it
("Hello from gpu", "Hello from cpu").

What only a real process can show (a SIGKILL mid-answer, llama.cpp's own
errors, real memory) stays in tests/integration/."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import httpx2
import ollama
import openai
import pytest

from tests.fakes.service import InProcess, in_process_service, isolate_user_folders
from tests.fakes.upstream import FakeUpstream
from tests.harness import BASE_CONFIG
from tray_app.core.config import bundled_model_path
from tray_app.core.engine.worker import WorkerState

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def rig(tmp_path, monkeypatch):
    isolate_user_folders(monkeypatch, tmp_path)
    async with in_process_service(tmp_path) as running:
        yield running


def model_of(rig: InProcess) -> str:
    return rig.service.model_id


def sse_data(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


# ----- every protocol's shapes, through the official clients where there is one ------------------


async def test_openai_chat_answers_in_openais_shape_whole_and_streamed(rig):
    client = openai.AsyncOpenAI(base_url="http://router/v1", api_key="none", http_client=rig.client)
    whole = await client.chat.completions.create(model=model_of(rig), messages=HI, max_tokens=8)
    assert whole.choices[0].message.content == "Hello from gpu" and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == 3 and whole.model == model_of(rig)
    stream = await client.chat.completions.create(model=model_of(rig), messages=HI, max_tokens=8, stream=True)
    pieces = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
    assert "".join(pieces) == "Hello from gpu"


async def test_openai_completions_answer_in_the_completions_shape(rig):
    answer = await rig.client.post("/v1/completions", json={"model": model_of(rig), "prompt": "Once", "max_tokens": 8})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "Hello from gpu"
    assert rig.upstream.answered_by("gpu")[-1].path == "/v1/completions"


async def test_ollama_chat_and_generate_answer_in_ollamas_shape(rig):
    client = ollama.AsyncClient(host="http://router", transport=httpx.ASGITransport(app=rig.app))
    chat = await client.chat(model=model_of(rig), messages=HI, stream=False, options={"num_predict": 8})
    assert chat.done and chat.message.role == "assistant" and chat.message.content == "Hello from gpu"
    parts = [part async for part in await client.generate(model=model_of(rig), prompt="Once", stream=True,
                                                         options={"num_predict": 8})]
    assert "".join(p.response for p in parts) == "Hello from gpu" and parts[-1].done and parts[-1].eval_count == 3


async def test_anthropic_messages_answer_in_anthropics_shape(rig):
    # This SDK speaks httpx2, whose transport reaches the same app.
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=rig.app))
    client = anthropic.AsyncAnthropic(base_url="http://router", api_key="none", http_client=http)
    message = await client.messages.create(model=model_of(rig), max_tokens=8, messages=HI)
    assert message.type == "message" and message.content[0].text == "Hello from gpu"
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == 3


async def test_the_responses_api_answers_in_its_shape(rig):
    client = openai.AsyncOpenAI(base_url="http://router/v1", api_key="none", http_client=rig.client)
    response = await client.responses.create(model=model_of(rig), input="hi", max_output_tokens=16)
    assert response.status == "completed" and response.output[0].type == "message"
    assert response.output_text == "Hello from gpu"


async def test_llama_cpps_completion_route_answers_in_llama_servers_shape(rig):
    answer = await rig.client.post("/completion", json={"prompt": "Once", "n_predict": 2})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    # n_predict 2 reached the upstream as max_tokens: the answer is cut, as llama-server cuts it.
    assert body["content"] == "Hello from" and body["stop"] is True and body["tokens_predicted"] == 2


# ----- replay, idempotency, capacity ---------------------------------------------------------------


async def test_a_gpu_failure_before_the_first_byte_is_replayed_on_the_cpu_exactly_once(rig):
    rig.upstream.script("gpu").fail_before_first_byte = True
    answer = await rig.client.post("/v1/chat/completions", json={"model": model_of(rig), "messages": HI,
                                                                  "max_tokens": 8, "stream": True})
    assert answer.status_code == 200 and answer.headers["x-served-by"] == "cpu"
    assert answer.headers["x-route-reason"] == "gpu_failed_replayed"
    events = sse_data(answer.text)
    # The client sees one answer, the CPU's, and one end: the failed GPU attempt sent nothing.
    assert events.count("[DONE]") == 1
    text = "".join(c["delta"].get("content") or "" for e in events[:-1] for c in json.loads(e)["choices"])
    assert text == "Hello from cpu"
    assert len(rig.upstream.answered_by("gpu")) == 1 and len(rig.upstream.answered_by("cpu")) == 1
    assert rig.workers["gpu"].failures and rig.workers["cpu"].failures == []
    status = (await rig.client.get("/status")).json()
    assert [e["kind"] for e in status["events"]].count("replay") == 1
    assert status["accounting"]["duplicate_executions"] == 0


async def test_a_worker_dying_mid_stream_is_not_replayed_and_the_stream_ends_in_an_error_event(rig):
    gpu = rig.upstream.script("gpu")
    gpu.fail_after_tokens, gpu.on_break = 1, rig.workers["gpu"].crash
    answer = await rig.client.post("/v1/chat/completions", json={"model": model_of(rig), "messages": HI,
                                                                  "max_tokens": 8, "stream": True})
    events = sse_data(answer.text)
    assert answer.headers["x-served-by"] == "gpu"
    assert any("error" in json.loads(e) for e in events if e != "[DONE]")
    # A byte reached the client: running it again would send a second answer.
    assert rig.upstream.answered_by("cpu") == []
    await rig.workers["gpu"].wait_for_state(WorkerState.READY, timeout=30)
    assert rig.workers["gpu"].exits == 1 and rig.workers["gpu"].last_exit.signal_name == "SIGKILL"


async def test_an_idempotent_retry_gets_the_first_answer_and_runs_nothing(rig):
    body = {"model": model_of(rig), "messages": HI, "max_tokens": 8}
    first = await rig.client.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": "order-1"})
    rig.upstream.script("gpu").tokens = ["a", " different", " answer"]
    again = await rig.client.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": "order-1"})
    assert first.status_code == again.status_code == 200
    assert again.json() == first.json() and again.json()["choices"][0]["message"]["content"] == "Hello from gpu"
    assert len(rig.upstream.answered_by("gpu")) == 1
    other = await rig.client.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": "order-2"})
    assert other.json()["choices"][0]["message"]["content"] == "a different answer"


async def test_no_path_for_a_request_is_a_503_with_retry_after_in_each_protocols_envelope(rig):
    assert (await rig.client.post("/admin/gpu", json={"paused": True})).status_code == 200
    never = {"X-Fallback": "never"}
    openai_style = await rig.client.post("/v1/chat/completions", headers=never,
                                         json={"model": model_of(rig), "messages": HI, "max_tokens": 8})
    assert openai_style.status_code == 503 and int(openai_style.headers["retry-after"]) > 0
    assert "GPU" in openai_style.json()["error"]["message"]
    ollama_style = await rig.client.post("/api/chat", headers=never, json={
        "model": model_of(rig), "messages": HI, "stream": False})
    assert ollama_style.status_code == 503 and "GPU" in ollama_style.json()["error"]
    anthropic_style = await rig.client.post("/v1/messages", headers=never, json={
        "model": model_of(rig), "messages": HI, "max_tokens": 8})
    assert anthropic_style.status_code == 503 and anthropic_style.json()["type"] == "error"
    assert rig.upstream.seen == []


async def test_full_lanes_refuse_the_next_request_with_a_503_and_serve_the_admitted_ones(rig):
    held = asyncio.Event()
    rig.upstream.script("gpu").hold = held
    rig.upstream.script("cpu").hold = held
    body = {"model": model_of(rig), "messages": HI, "max_tokens": 8}
    host = rig.service.default_model_host
    lanes = [backend.lane for backend in (host.dispatcher.gpu, host.dispatcher.cpu)]

    def admitted() -> int:
        return sum(len(lane.running_ids) + len(lane.waiting_ids) for lane in lanes)

    pending: list[asyncio.Task] = []
    refused = None
    # Every slot and queue place of both paths, and one more: admission must refuse before then.
    capacity = sum(lane.concurrency + lane.queue_limit for lane in lanes)
    for _ in range(capacity + 1):
        task = asyncio.ensure_future(rig.client.post("/v1/chat/completions", json=body))
        while admitted() == len(pending) and not task.done():
            await asyncio.sleep(0.01)
        if task.done():
            refused = task.result()
            break
        pending.append(task)
    assert refused is not None and refused.status_code == 503, refused and refused.text
    assert refused.json()["error"]["code"] and int(refused.headers["retry-after"]) > 0
    held.set()
    served = await asyncio.gather(*pending)
    assert pending and all(answer.status_code == 200 for answer in served)


# ----- GPU sharing -----------------------------------------------------------------------------------


async def test_the_gpu_given_back_sends_requests_to_the_cpu_until_it_is_used_again(rig):
    body = {"model": model_of(rig), "messages": HI, "max_tokens": 8}
    gpu = rig.workers["gpu"]
    assert (await rig.client.post("/admin/gpu", json={"given_back": True})).status_code == 200
    await gpu.wait_for_state(WorkerState.STOPPED, timeout=30)
    status = (await rig.client.get("/status")).json()
    assert status["gpu"]["residency"]["state"] == "given_back_by_user"
    given = await rig.client.post("/v1/chat/completions", json=body)
    assert given.headers["x-served-by"] == "cpu" and given.headers["x-route-reason"] == "gpu_yielded"
    assert given.json()["choices"][0]["message"]["content"] == "Hello from cpu"
    assert (await rig.client.post("/admin/gpu", json={"given_back": False})).status_code == 200
    await gpu.wait_for_state(WorkerState.READY, timeout=30)
    back = await rig.client.post("/v1/chat/completions", json=body)
    assert back.headers["x-served-by"] == "gpu" and back.json()["choices"][0]["message"]["content"] == "Hello from gpu"
    kinds = [event["kind"] for event in (await rig.client.get("/status")).json()["events"]]
    assert kinds.index("gpu_given_back") < kinds.index("gpu_taken_again") and gpu.loads_started == 2


# ----- peers ---------------------------------------------------------------------------------------------


@pytest.fixture
async def with_peer(tmp_path, monkeypatch):
    """The service with one fallback peer, "desk", that the fake upstream answers for; once its
    first health check has found it."""
    isolate_user_folders(monkeypatch, tmp_path)
    upstream = FakeUpstream()
    model = bundled_model_path().stem
    upstream.script("desk").models = [model]
    config = BASE_CONFIG + '\n[[peers]]\nname = "desk"\nurl = "http://desk.worker:8642"\n'
    async with in_process_service(tmp_path, config, upstream=upstream) as running:
        peer = running.service.peers.get("desk")
        while peer.health.reachable is not True:
            await asyncio.sleep(0.01)
        assert (await running.client.post("/admin/gpu", json={"paused": True})).status_code == 200
        yield running


async def test_a_fallback_peer_takes_what_the_gpu_cant_before_the_local_cpu(with_peer):
    rig = with_peer
    answer = await rig.client.post("/v1/chat/completions", json={"model": model_of(rig), "messages": HI,
                                                                  "max_tokens": 8})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-served-by"] == "peer" and answer.json()["choices"][0]["message"]["content"] == \
        "Hello from desk"
    assert rig.upstream.answered_by("cpu") == []


async def test_a_peer_failing_before_the_first_byte_hands_the_request_to_the_local_cpu_once(with_peer):
    rig = with_peer
    rig.upstream.script("desk").error_status = 500
    answer = await rig.client.post("/v1/chat/completions", json={"model": model_of(rig), "messages": HI,
                                                                  "max_tokens": 8})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-served-by"] == "cpu" and answer.headers["x-route-reason"] == "peer_failed_replayed"
    assert answer.json()["choices"][0]["message"]["content"] == "Hello from cpu"
    chats = [seen for seen in rig.upstream.seen if seen.path == "/v1/chat/completions"]
    assert [seen.upstream for seen in chats] == ["desk", "cpu"]
