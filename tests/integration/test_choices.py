"""OpenAI's `n` (issue 30, part 4): several choices in one request, run by
llama-server as parallel slots, through the `openai` client on both paths,
streamed and not, and replayed whole on the CPU when the GPU dies before
the first byte."""

from __future__ import annotations

import json

import openai
import pytest

from tests.harness import BASE_CONFIG, running

pytestmark = pytest.mark.integration

# Deterministic and long: at temperature 0 every choice runs to its limit.
STORY = "Write a long story about a lighthouse keeper and the sea."
LIMIT = 4
# The CPU worker gets three slots here (BASE_CONFIG gives it one), so the
# CPU path can run n = 3; the GPU keeps llama-server's four.
CPU_SLOTS = 3


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    config = BASE_CONFIG.replace("max_concurrency = 1\n", f"max_concurrency = {CPU_SLOTS}\n")
    assert config != BASE_CONFIG
    with running(tmp_path_factory.mktemp("choices"), config) as service:
        yield service


@pytest.fixture(scope="module")
def client(service):
    with openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def _ask(client, kind: str, n: int, path: str, **extra):
    headers = {"X-Force-Path": "cpu"} if path == "cpu" else {}
    common = dict(model="default", n=n, max_tokens=LIMIT, temperature=0, extra_headers=headers, **extra)
    if kind == "chat":
        return client.chat.completions.with_raw_response.create(
            messages=[{"role": "user", "content": STORY}], **common)
    return client.completions.with_raw_response.create(prompt=f"{STORY}\n\nOnce upon a time", **common)


@pytest.mark.parametrize("path", ["gpu", "cpu"])
@pytest.mark.parametrize("kind", ["chat", "completions"])
@pytest.mark.parametrize("n", [2, 3])
def test_n_choices_in_one_answer(fresh, client, path, kind, n):
    before = fresh.status()["accounting"]["completed_executions"]
    raw = _ask(client, kind, n, path)
    assert raw.headers["x-served-by"] == path
    answer = raw.parse()
    assert [choice.index for choice in answer.choices] == list(range(n))
    assert all(choice.finish_reason == "length" for choice in answer.choices)
    texts = [choice.message.content if kind == "chat" else choice.text for choice in answer.choices]
    assert all(texts)
    # Every choice's tokens, summed; the prompt once.
    assert answer.usage.completion_tokens == n * LIMIT
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + n * LIMIT
    # One request, executed once, however many choices it had.
    assert fresh.status()["accounting"]["completed_executions"] == before + 1


@pytest.mark.parametrize("path", ["gpu", "cpu"])
@pytest.mark.parametrize("kind", ["chat", "completions"])
@pytest.mark.parametrize("n", [2, 3])
def test_n_choices_streamed(fresh, client, path, kind, n):
    raw = _ask(client, kind, n, path, stream=True, stream_options={"include_usage": True})
    assert raw.headers["x-served-by"] == path
    chunks = list(raw.parse())
    tokens = {index: 0 for index in range(n)}
    finished = {}
    for chunk in chunks:
        for choice in chunk.choices:
            text = choice.delta.content if kind == "chat" else choice.text
            tokens[choice.index] += bool(text)
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert finished == {index: "length" for index in range(n)}
    assert all(count >= 1 for count in tokens.values())
    # The one usage chunk, last: every choice's tokens summed.
    usage = [chunk.usage for chunk in chunks if chunk.usage is not None]
    assert len(usage) == 1 and chunks[-1].usage is not None
    assert usage[0].completion_tokens == sum(tokens.values()) == n * LIMIT


@pytest.mark.parametrize("n", [5, 0, -1, 1.5, True, "2"])
def test_n_out_of_bounds_is_a_400_naming_n_and_the_bound(fresh, n):
    response = fresh.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "n": n})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "n" and error["type"] == "invalid_request_error"
    assert "from 1 to 4" in error["message"] and "at most 4 choices" in error["message"]


def test_the_model_list_says_the_bound(fresh):
    assert fresh.http.get("/v1/models").json()["data"][0]["capabilities"]["max_choices"] == 4


def test_a_gpu_death_before_the_first_byte_replays_all_choices_once_on_the_cpu(fresh):
    # A long prompt keeps the GPU in prompt evaluation while the kill lands.
    prompt = [{"role": "user", "content": "word " * 900 + "\nSay ok."}]
    before = fresh.status()["accounting"]

    def run():
        with fresh.http.stream("POST", "/v1/chat/completions", json={
                "messages": prompt, "max_tokens": LIMIT, "temperature": 0, "n": 2, "stream": True,
                "stream_options": {"include_usage": True}},
                headers={"X-Request-Id": "choices-replay"}) as response:
            return response.headers, [line for line in response.iter_lines() if line.startswith("data:")]

    headers, lines = fresh.kill_gpu_before_first_token("choices-replay", run)
    assert headers["x-route-reason"] == "gpu_failed_replayed" and headers["x-served-by"] == "cpu"
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[5:]) for line in lines[:-1]]
    assert not any("error" in event for event in events)
    finished = {c["index"]: c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")}
    assert set(finished) == {0, 1}
    tokens = sum(1 for e in events for c in e["choices"] if (c.get("delta") or {}).get("content"))
    assert events[-1]["usage"]["completion_tokens"] == tokens
    # The replay is the same request: one completed execution, no duplicate.
    after = fresh.status()["accounting"]
    assert after["completed_executions"] == before["completed_executions"] + 1
    assert after["duplicate_executions"] == before["duplicate_executions"]


def test_a_gpu_death_with_more_choices_than_cpu_slots_is_a_capacity_error(fresh):
    """The CPU's llama-server refuses n above its slots, and the choices run
    together or not at all: the replay is refused with a 503 that says why,
    not run partly or split into several executions."""
    prompt = [{"role": "user", "content": "word " * 900 + "\nSay ok."}]
    before = fresh.status()["accounting"]

    def run():
        response = fresh.http.post("/v1/chat/completions", json={
            "messages": prompt, "max_tokens": LIMIT, "n": CPU_SLOTS + 1},
            headers={"X-Request-Id": "choices-over-cpu"})
        return response.headers, response

    headers, response = fresh.kill_gpu_before_first_token("choices-over-cpu", run)
    assert response.status_code == 503 and "retry-after" in headers and headers["x-served-by"] == "cpu"
    error = response.json()["error"]
    assert error["code"] == "too_many_choices" and error["param"] == "n"
    assert f"n={CPU_SLOTS + 1}" in error["message"] and f"CPU path has {CPU_SLOTS}" in error["message"]
    assert fresh.status()["accounting"]["completed_executions"] == before["completed_executions"]


def test_the_openai_stream_helper_reads_every_choice(fresh, client):
    # A short answer that ends by itself: the helper refuses a final
    # completion cut off at its limit (LengthFinishReasonError).
    with client.chat.completions.stream(model="default", n=3, max_tokens=200, temperature=0,
                                        messages=[{"role": "user", "content": "Say hello."}]) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert [(c.index, c.message.role) for c in final.choices] == [(0, "assistant"), (1, "assistant"), (2, "assistant")]
    assert all(c.message.content and c.finish_reason == "stop" for c in final.choices)
