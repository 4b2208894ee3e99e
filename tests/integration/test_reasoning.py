"""Reasoning, both ways, on a model that thinks (issue 30, part 3): each
dialect's knob through the official clients, llama-server's reasoning
parser on real workers, and the answer in each dialect's own field.

No thinking model ships in a package here, so the bundled SmolLM2 is
copied with a Qwen3-style chat template: its generation prompt opens a
<think> block (or, with enable_thinking false, closes an empty one), which
is what makes llama.cpp recognise a thinking template (its thinking
switch, its reasoning budget and its parser). SmolLM2 then thinks for
real, "\\nhi\\n\\nhi...", until the budget writes </think>."""

from __future__ import annotations

import json
import os
import signal

import anthropic
import gguf
import ollama
import openai
import pytest
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

from tests.harness import BASE_CONFIG, running, streamed_text
from tray_app.core.config import bundled_model_path

pytestmark = pytest.mark.integration

THINKING_TEMPLATE = """\
{%- for message in messages -%}
{%- if message.role == "assistant" and message.reasoning_content is defined and message.reasoning_content -%}
<|im_start|>assistant
<think>
{{ message.reasoning_content }}
</think>

{{ message.content }}<|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif -%}
{%- endif -%}
"""
HI = [{"role": "user", "content": "hi"}]
# With "low" the thinking gets a quarter of this (10 tokens), the answer the rest.
LIMIT = 40


def write_thinking_model(path) -> None:
    """The bundled model with THINKING_TEMPLATE as its chat template."""
    reader = gguf.GGUFReader(bundled_model_path(), "r")
    writer = gguf.GGUFWriter(path, arch=reader.get_field(gguf.Keys.General.ARCHITECTURE).contents(),
                             endianess=reader.endianess)
    alignment = reader.get_field(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = alignment.contents()
    copy_with_new_metadata(reader, writer, {gguf.Keys.Tokenizer.CHAT_TEMPLATE: MetadataDetails(
        gguf.GGUFValueType.STRING, THINKING_TEMPLATE)}, [])


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """A real service on the thinking copy, answering OpenAI chat in both fields."""
    tmp = tmp_path_factory.mktemp("reasoning")
    write_thinking_model(tmp / "thinking-smollm2.gguf")
    config = BASE_CONFIG + (f'[server]\nreasoning_field = "both"\n'
                            f'[model]\npath = {json.dumps(str(tmp / "thinking-smollm2.gguf"))}\n')
    with running(tmp / "service", config) as service:
        yield service


@pytest.fixture(scope="module")
def model(service):
    return service.http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def openai_client(service):
    with openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def test_openai_low_effort_thinks_briefly_then_answers_in_both_fields(fresh, openai_client, model):
    def answer(effort):
        return openai_client.chat.completions.create(model=model, messages=HI, max_tokens=LIMIT, temperature=0,
                                                     reasoning_effort=effort).choices[0].message

    high, low = answer("high"), answer("low")
    # This model never ends its thinking by itself: without a budget, it fills the answer.
    assert high.reasoning_content.strip() and not high.content
    # The budget ended the thinking: the answer got the rest of the tokens.
    assert low.reasoning_content.strip() and low.content.strip()
    assert len(low.reasoning_content) < len(high.reasoning_content)
    assert low.reasoning == low.reasoning_content  # [server] reasoning_field = "both"
    assert "<think>" not in low.content and "</think>" not in low.content


def test_openai_reasoning_effort_none_in_the_reasoning_object_skips_the_thinking(fresh, openai_client, model):
    message = openai_client.chat.completions.create(model=model, messages=HI, max_tokens=LIMIT, temperature=0,
                                                    extra_body={"reasoning": {"effort": "none"}}).choices[0].message
    assert message.content.strip()
    assert getattr(message, "reasoning_content", None) is None and getattr(message, "reasoning", None) is None


def test_openai_stream_carries_reasoning_deltas_in_both_fields_then_the_answer(fresh, openai_client, model):
    kinds = []
    with openai_client.chat.completions.create(model=model, messages=HI, max_tokens=LIMIT, temperature=0,
                                               reasoning_effort="low", stream=True) as stream:
        for chunk in stream:
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is not None and getattr(delta, "reasoning_content", None):
                assert delta.reasoning == delta.reasoning_content
                kinds.append("reasoning")
            if delta is not None and delta.content:
                kinds.append("content")
    assert "reasoning" in kinds and "content" in kinds
    assert kinds.index("content") > max(i for i, kind in enumerate(kinds) if kind == "reasoning")


def test_ollama_think_levels_and_off(fresh, service, model):
    client = ollama.Client(host=service.url, timeout=120)
    options = {"num_predict": LIMIT, "temperature": 0}
    brief = client.chat(model=model, messages=HI, think="low", options=options).message
    assert brief.thinking.strip() and brief.content.strip()
    off = client.chat(model=model, messages=HI, think=False, options=options).message
    assert not off.thinking and off.content.strip()
    streamed = list(client.chat(model=model, messages=HI, think="low", options=options, stream=True))
    assert "".join(part.message.thinking or "" for part in streamed) == brief.thinking
    assert "".join(part.message.content for part in streamed) == brief.content
    generated = client.generate(model=model, prompt="hi", think="low", options=options)
    assert generated.thinking.strip() and generated.response.strip()


def test_anthropic_thinking_budget_gives_a_thinking_block_then_text(fresh, service, model):
    with anthropic.Anthropic(base_url=service.url, api_key="unused", max_retries=0, timeout=120) as client:
        thinking = {"type": "enabled", "budget_tokens": 10}
        message = client.messages.create(model=model, max_tokens=LIMIT, messages=HI, thinking=thinking,
                                         extra_body={"temperature": 0})
        assert [block.type for block in message.content] == ["thinking", "text"]
        assert message.content[0].thinking.strip() and message.content[1].text.strip()
        with client.messages.stream(model=model, max_tokens=LIMIT, messages=HI, thinking=thinking,
                                    extra_body={"temperature": 0}) as stream:
            deltas = [event.delta.type for event in stream if event.type == "content_block_delta"]
        assert "thinking_delta" in deltas and "text_delta" in deltas
        off = client.messages.create(model=model, max_tokens=LIMIT, messages=HI, thinking={"type": "disabled"},
                                     extra_body={"temperature": 0})
        assert [block.type for block in off.content] == ["text"]


def test_responses_reasoning_effort_gives_a_reasoning_item_then_the_message(fresh, openai_client, model):
    response = openai_client.responses.create(model=model, input="hi", max_output_tokens=LIMIT, temperature=0,
                                              reasoning={"effort": "low"})
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text.strip() and response.output_text.strip()
    assert response.reasoning.effort == "low"


def test_a_gpu_death_before_the_first_token_replays_with_the_same_split(fresh):
    # A long prompt keeps the GPU in prompt evaluation while it is killed.
    prompt = [{"role": "user", "content": "Tell me about the sea. " * 150}]

    def run():
        with fresh.http.stream("POST", "/v1/chat/completions", headers={"X-Request-Id": "reasoning-replay"}, json={
                "messages": prompt, "max_tokens": LIMIT, "temperature": 0, "stream": True,
                "reasoning_effort": "low"}) as response:
            return response.headers, [json.loads(line[5:]) for line in response.iter_lines()
                                      if line.startswith("data:") and line != "data: [DONE]"]

    headers, chunks = fresh.kill_gpu_before_first_token("reasoning-replay", run)
    assert headers["x-served-by"] == "cpu" and headers["x-route-reason"] == "gpu_failed_replayed"
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk.get("choices")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas).strip()
    assert "".join(d.get("content") or "" for d in deltas).strip()
    assert fresh.wait_workers_ready()["accounting"]["duplicate_executions"] == 0


def answer_deltas(line: str) -> bool:
    return line.startswith("data:") and '"content":"' in line


def reasoning_deltas(line: str) -> bool:
    return line.startswith("data:") and '"reasoning_content":"' in line


@pytest.mark.parametrize("cut_in, counting, kill_after", [
    # Early in a 30-token reasoning: far from its end, however late the kill lands.
    ("reasoning", reasoning_deltas, 2),
    ("answer", answer_deltas, 3),
])
def test_a_gpu_death_mid_stream_goes_on_with_the_reasoning_or_the_answer(fresh, cut_in, counting, kill_after):
    body = {"messages": HI, "max_tokens": 120, "temperature": 0, "reasoning_effort": "low",
            "stream_options": {"include_usage": True}}
    response, lines = fresh.kill_gpu_mid_stream(body, kill_after, headers={"X-Request-Id": f"think-{cut_in}"},
                                                counting=counting)
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines), lines
    events = [json.loads(line[5:]) for line in lines if line.startswith("data:") and line != "data: [DONE]"]
    (finish,) = [e for e in events for c in e["choices"] if c.get("finish_reason")]
    assert finish["resumed"]["cut_in"] == cut_in and finish["resumed"]["on"] == "cpu"
    # One whole answer: the CPU's own, from the start, to the same request
    # (greedy decoding, the same model file), reasoning and answer alike.
    whole = fresh.http.post("/v1/chat/completions", json=body, headers={"X-Force-Path": "cpu"}).json()
    message = whole["choices"][0]["message"]
    assert streamed_text(lines, "reasoning_content") == message["reasoning_content"]
    assert streamed_text(lines) == message["content"]
    assert events[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert finish["resumed"]["cut_at_tokens"] + finish["resumed"]["tokens_added"] == whole["usage"]["completion_tokens"]


def test_anthropic_and_ollama_clients_get_one_thinking_block_when_the_gpu_dies_inside_it(fresh, service, model):
    """The official clients, the GPU worker SIGKILLed at the 3rd thinking
    delta of a 30-token thinking budget: one thinking block, one answer, both
    the CPU's own from the start (nothing twice, nothing lost at the seam)."""
    whole = fresh.http.post("/v1/chat/completions", headers={"X-Force-Path": "cpu"}, json={
        "messages": HI, "max_tokens": 120, "temperature": 0, "reasoning_budget_tokens": 30}).json()
    expected = whole["choices"][0]["message"]
    with anthropic.Anthropic(base_url=service.url, api_key="unused", max_retries=0, timeout=120) as client:
        gpu_pid, kinds, thinking, text, deltas = fresh.worker("gpu")["pid"], [], [], [], 0
        with client.messages.stream(model=model, max_tokens=120, messages=HI, extra_body={"temperature": 0},
                                    thinking={"type": "enabled", "budget_tokens": 30}) as stream:
            for event in stream:
                if event.type == "content_block_start":
                    kinds.append(event.content_block.type)
                elif event.type == "content_block_delta" and event.delta.type == "thinking_delta":
                    thinking.append(event.delta.thinking)
                    deltas += 1
                    if deltas == 3:
                        os.kill(gpu_pid, signal.SIGKILL)
                elif event.type == "content_block_delta" and event.delta.type == "text_delta":
                    text.append(event.delta.text)
    assert kinds == ["thinking", "text"]
    assert ("".join(thinking), "".join(text)) == (expected["reasoning_content"], expected["content"])
    fresh.reset()
    client = ollama.Client(host=service.url, timeout=120)
    thinking, text = [], []
    gpu_pid = fresh.worker("gpu")["pid"]
    for part in client.chat(model=model, messages=HI, think="low", stream=True,
                            options={"num_predict": 120, "temperature": 0}):
        if part.message.thinking:
            thinking.append(part.message.thinking)
            if len(thinking) == 3:
                os.kill(gpu_pid, signal.SIGKILL)
        text.append(part.message.content or "")
    assert part.done and ("".join(thinking), "".join(text)) == (expected["reasoning_content"], expected["content"])
