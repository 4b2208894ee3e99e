"""Degraded mode inside the answer (issue 31, part 5): with the opt-in, an
answer the CPU serves begins with one note in each dialect's own reasoning
field (OpenAI's reasoning_content, Ollama's thinking, Anthropic's thinking
block, a Responses reasoning item), never in the content; without it, or
when the GPU serves, there is none. Real workers on the bundled SmolLM2,
which never thinks by itself, so any reasoning in these answers is the note.
Called with the official clients, streamed and not."""

from __future__ import annotations

import json

import anthropic
import ollama
import openai
import pytest

pytestmark = pytest.mark.integration

HI = [{"role": "user", "content": "hi"}]
LIMIT = 8
NOTE_ON = {"X-Degraded-Note": "on"}
FORCED_CPU = {**NOTE_ON, "X-Force-Path": "cpu"}
# The banner's words for a forced CPU (core/base/route_reasons.py), then who serves.
FORCED_NOTE_START = "GPU paused (force CPU): "


@pytest.fixture(scope="module")
def model(service):
    return service.http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def fallback_model(service):
    """The model the CPU answers with, as the route headers name it."""
    response = service.http.post("/v1/chat/completions", headers={"X-Force-Path": "cpu"},
                                 json={"messages": HI, "max_tokens": 1})
    return response.headers["x-fallback-model"]


def openai_client(service, headers):
    return openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0, timeout=120,
                         default_headers=headers)


def assert_is_the_cpu_note(note: str, reason_words: str = FORCED_NOTE_START) -> None:
    assert note.startswith(reason_words), note
    assert "The CPU answers with " in note and ", about " in note and note.endswith(" s.\n\n"), note


def test_openai_forced_onto_the_cpu_carries_the_note_in_reasoning_content_only(fresh, model):
    with openai_client(fresh, FORCED_CPU) as client:
        message = client.chat.completions.create(model=model, messages=HI, max_tokens=LIMIT,
                                                 temperature=0).choices[0].message
    assert_is_the_cpu_note(message.reasoning_content)
    assert message.content.strip() and "CPU" not in message.content


def test_openai_stream_sends_the_note_first_and_never_as_content(fresh, model, fallback_model):
    kinds, reasoning, content = [], [], []
    with openai_client(fresh, FORCED_CPU) as client:
        with client.chat.completions.create(model=model, messages=HI, max_tokens=LIMIT, temperature=0,
                                            stream=True) as stream:
            for chunk in stream:
                delta = chunk.choices[0].delta if chunk.choices else None
                if delta is not None and getattr(delta, "reasoning_content", None):
                    kinds.append("reasoning")
                    reasoning.append(delta.reasoning_content)
                if delta is not None and delta.content:
                    kinds.append("content")
                    content.append(delta.content)
    assert kinds[0] == "reasoning" and kinds.count("reasoning") == 1, kinds
    assert_is_the_cpu_note(reasoning[0])
    assert f"The CPU answers with {fallback_model}, about " in reasoning[0]
    assert "".join(content).strip() and "CPU" not in "".join(content)


def test_no_note_without_the_opt_in_nor_when_the_gpu_serves(fresh, model):
    def reasoning(headers):
        response = fresh.http.post("/v1/chat/completions", headers=headers,
                                   json={"messages": HI, "max_tokens": LIMIT, "temperature": 0})
        return response.headers["x-served-by"], response.json()["choices"][0]["message"].get("reasoning_content")

    served_by, note = reasoning(FORCED_CPU)
    assert served_by == "cpu"
    assert_is_the_cpu_note(note)
    assert reasoning({"X-Force-Path": "cpu"}) == ("cpu", None)
    assert reasoning(NOTE_ON) == ("gpu", None)


def test_ollama_with_the_gpu_paused_carries_the_note_in_thinking(fresh, model):
    assert fresh.http.post("/admin/gpu", json={"paused": True}).status_code == 200
    client = ollama.Client(host=fresh.url, timeout=120, headers=NOTE_ON)
    options = {"num_predict": LIMIT, "temperature": 0}
    message = client.chat(model=model, messages=HI, options=options).message
    assert_is_the_cpu_note(message.thinking)
    assert message.content.strip() and "CPU" not in message.content
    streamed = list(client.chat(model=model, messages=HI, options=options, stream=True))
    # The estimate is the latest measured speed's, so only its shape is compared.
    assert_is_the_cpu_note(streamed[0].message.thinking)
    assert not streamed[0].message.content
    assert all(not part.message.thinking for part in streamed[1:])
    assert "CPU" not in "".join(part.message.content for part in streamed)


def test_anthropic_gets_a_thinking_block_before_the_text(fresh, model):
    with anthropic.Anthropic(base_url=fresh.url, api_key="unused", max_retries=0, timeout=120,
                             default_headers=FORCED_CPU) as client:
        message = client.messages.create(model=model, max_tokens=LIMIT, messages=HI, extra_body={"temperature": 0})
        assert [block.type for block in message.content] == ["thinking", "text"]
        assert_is_the_cpu_note(message.content[0].thinking)
        assert "CPU" not in message.content[1].text
        with client.messages.stream(model=model, max_tokens=LIMIT, messages=HI,
                                    extra_body={"temperature": 0}) as stream:
            deltas = [event.delta for event in stream if event.type == "content_block_delta"]
    assert deltas[0].type == "thinking_delta" and [d.type for d in deltas].count("thinking_delta") == 1
    assert_is_the_cpu_note(deltas[0].thinking)
    assert "CPU" not in "".join(d.text for d in deltas if d.type == "text_delta")


def test_responses_gets_a_reasoning_item_before_the_message(fresh, model):
    with openai_client(fresh, FORCED_CPU) as client:
        response = client.responses.create(model=model, input="hi", max_output_tokens=16, temperature=0)
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert_is_the_cpu_note(response.output[0].content[0].text)
        assert "CPU" not in response.output_text
        with client.responses.stream(model=model, input="hi", max_output_tokens=16, temperature=0) as stream:
            reasoning = "".join(event.delta for event in stream if event.type == "response.reasoning_text.delta")
    assert_is_the_cpu_note(reasoning)


def test_an_unknown_opt_in_value_is_a_400_in_the_envelope(fresh):
    response = fresh.http.post("/v1/chat/completions", headers={"X-Degraded-Note": "yes please"},
                               json={"messages": HI, "max_tokens": 1})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_header"
    assert response.json()["error"]["param"] == "X-Degraded-Note"


def test_a_replay_after_a_gpu_death_carries_the_note(fresh):
    # A long prompt keeps the GPU in prompt evaluation while it is killed.
    prompt = [{"role": "user", "content": "Tell me about the sea. " * 150}]

    def run():
        with fresh.http.stream("POST", "/v1/chat/completions",
                               headers={**NOTE_ON, "X-Request-Id": "note-replay"},
                               json={"messages": prompt, "max_tokens": LIMIT, "stream": True}) as response:
            return response.headers, [json.loads(line[5:]) for line in response.iter_lines()
                                      if line.startswith("data:") and line != "data: [DONE]"]

    headers, chunks = fresh.kill_gpu_before_first_token("note-replay", run)
    assert headers["x-served-by"] == "cpu" and headers["x-route-reason"] == "gpu_failed_replayed"
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk.get("choices")]
    assert_is_the_cpu_note(deltas[0]["reasoning_content"], "GPU failed, re-run on the CPU: ")
    assert all(not d.get("reasoning_content") for d in deltas[1:])
