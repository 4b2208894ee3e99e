"""Anthropic's Messages API, through the official `anthropic` package,
against the real service on the real small model (issue 15)."""

from __future__ import annotations

import base64
import json

import anthropic
import pytest

from tests.tiny_projector import tiny_png

pytestmark = pytest.mark.integration

HELLO = [{"role": "user", "content": "Say hello."}]
STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def client(service):
    with anthropic.Anthropic(base_url=service.url, api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def model(service):
    return service.http.get("/v1/models").json()["data"][0]["id"]


def test_a_message_without_streaming(fresh, client, model):
    message = client.messages.create(model=model, max_tokens=8, extra_body={"temperature": 0}, messages=HELLO,
                                     system="You are terse.")
    assert message.type == "message" and message.role == "assistant" and message.model == model
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 5 and 1 <= message.usage.output_tokens <= 8


def test_a_stream_gives_anthropics_events_and_the_same_text(fresh, client, model):
    with client.messages.stream(model=model, max_tokens=12, extra_body={"temperature": 0}, messages=STORY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    whole = client.messages.create(model=model, max_tokens=12, extra_body={"temperature": 0}, messages=STORY)
    assert final.content[0].text == whole.content[0].text


def test_a_large_max_tokens_means_up_to_the_context(fresh, client, model):
    # Claude Code and others send their model's ceiling; it must not be a 400.
    message = client.messages.create(model=model, max_tokens=32000, extra_body={"temperature": 0}, messages=HELLO)
    assert message.stop_reason in ("end_turn", "max_tokens")


def test_tool_use_round_trip(fresh, client, model):
    forced = client.messages.create(model=model, max_tokens=60, extra_body={"temperature": 0}, tools=[WEATHER],
                                    tool_choice={"type": "tool", "name": "get_weather"},
                                    messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert forced.stop_reason == "tool_use"
    call = next(block for block in forced.content if block.type == "tool_use")
    assert call.name == "get_weather" and isinstance(call.input, dict)
    # The tool's result goes back as a tool_result block; the model answers in text.
    follow_up = client.messages.create(model=model, max_tokens=16, extra_body={"temperature": 0}, tools=[WEATHER], messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]}])
    assert follow_up.content and follow_up.usage.input_tokens > forced.usage.input_tokens


def test_streamed_tool_use_arrives_as_input_json(fresh, client, model):
    with client.messages.stream(model=model, max_tokens=60, extra_body={"temperature": 0}, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather in Oslo?"}]) as stream:
        final = stream.get_final_message()
    call = next(block for block in final.content if block.type == "tool_use")
    assert call.name == "get_weather" and isinstance(call.input, dict) and final.stop_reason == "tool_use"


def test_count_tokens_matches_the_usage(fresh, client, model):
    counted = client.messages.count_tokens(model=model, messages=HELLO)
    used = client.messages.create(model=model, max_tokens=1, messages=HELLO)
    assert counted.input_tokens == used.usage.input_tokens


def test_errors_come_in_anthropics_shape(fresh, client, model):
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="no-such-model", max_tokens=8, messages=HELLO)
    assert unknown.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(tiny_png()).decode()}}]}])
    assert bad.value.body["error"]["type"] == "invalid_request_error" and "vision" in bad.value.body["error"]["message"]
    for body, field in (({"model": model, "messages": HELLO}, "max_tokens"),
                        ({"model": model, "max_tokens": 8}, "messages"),
                        ({"model": model, "max_tokens": 8, "messages": [{"role": "robot", "content": "hi"}]}, "role"),
                        ({"model": model, "max_tokens": 8, "messages": HELLO, "temperature": 9}, "temperature"),
                        ({"model": model, "max_tokens": 8, "messages": HELLO, "tool_choice": {"type": "maybe"}},
                         "tool_choice")):
        response = fresh.http.post("/v1/messages", json=body)
        error = response.json()
        assert response.status_code == 400 and error["type"] == "error", (body, response.text)
        assert field in error["error"]["message"], (body, error)


def test_a_capacity_error_is_overloaded(fresh, service, model):
    fresh.http.post("/admin/gpu", json={"paused": True})
    with anthropic.Anthropic(base_url=service.url, api_key="unused", max_retries=0,
                             default_headers={"X-Fallback": "never"}) as no_fallback:
        with pytest.raises(anthropic.APIStatusError) as refused:
            no_fallback.messages.create(model=model, max_tokens=8, messages=HELLO)
    assert refused.value.status_code == 503 and refused.value.body["error"]["type"] == "overloaded_error"
    assert refused.value.response.headers["retry-after"]


def test_a_cpu_served_answer_says_so(fresh, client, model):
    raw = client.messages.with_raw_response.create(model=model, max_tokens=4, messages=HELLO,
                                                   extra_headers={"X-Force-Path": "cpu"})
    assert raw.headers["x-served-by"] == "cpu" and raw.headers["x-fallback-model"]
    assert raw.parse().content[0].text


def test_gpu_death_before_the_first_event_replays_once_on_the_cpu(fresh, service, model):
    """A stream whose GPU worker dies before any event reached the client is
    run again on the CPU; the client sees one clean stream."""
    prompt = [{"role": "user", "content": "word " * 900 + "\nSay ok."}]

    def run():
        with service.http.stream("POST", "/v1/messages", headers={"X-Request-Id": "anthropic-replay"}, json={
                "model": model, "max_tokens": 8, "temperature": 0, "stream": True, "messages": prompt}) as response:
            return response.headers, [line for line in response.iter_lines() if line.startswith("event:")]

    headers, events = fresh.kill_gpu_before_first_token("anthropic-replay", run)
    assert headers["x-route-reason"] == "gpu_failed_replayed"
    assert events[0] == "event: message_start" and events[-1] == "event: message_stop"
    assert "event: error" not in events
    status = fresh.wait_workers_ready()
    assert status["accounting"]["duplicate_executions"] == 0
    assert json.dumps(status["events"]).count('"anthropic-replay"') >= 1


def test_structured_output_follows_the_schema(fresh, client, model):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    message = client.messages.create(model=model, max_tokens=60, extra_body={"temperature": 0},
                                     output_config={"format": {"type": "json_schema", "schema": schema}},
                                     messages=[{"role": "user", "content": "Alice is 30. Give her name and age."}])
    if message.stop_reason == "end_turn":
        person = json.loads(message.content[0].text)
        assert set(person) == {"name", "age"} and isinstance(person["age"], int)
