"""The Ollama and Anthropic edges as plain functions: request translation,
the answer's shape and the stream framing, with plain values (issue 15)."""

from __future__ import annotations

import json

import pytest

from tray_app.core.api.anthropic import AnthropicMessages, error_payload, translate_messages
from tray_app.core.api.ollama import OllamaChat, OllamaGenerate, parameter_size, parse_keep_alive, strip_tag
from tray_app.core.api.openai_request import InvalidRequest
from tray_app.core.dispatch.jobs import Attempt, Job, JobKind, JobRequest

CONTEXT = 2048


def job(body=None, kind=JobKind.CHAT, tokens=3, prompt=7) -> Job:
    done = Job(JobRequest(id="req-1", kind=kind, body=body or {"model": "m:latest"}, stream=True, prompt_tokens=prompt))
    done.attempts.append(Attempt(path="gpu", started_at=done.created_at, first_token_at=done.created_at + 0.1,
                                 ended_at=done.created_at + 0.3, tokens=tokens, outcome="completed"))
    return done


def text_chunk(text, finish=None):
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


def tool_chunk(index, *, call_id=None, name=None, arguments=None, finish=None):
    function = {k: v for k, v in (("name", name), ("arguments", arguments)) if v is not None}
    call = {"index": index, "function": function, **({"id": call_id} if call_id else {})}
    return {"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": finish}]}


# ----- Ollama --------------------------------------------------------------------------------


@pytest.mark.parametrize("value, seconds", [
    ("5m", 300.0), ("1h", 3600.0), ("30s", 30.0), ("1.5m", 90.0), ("-1", -1.0), ("-1m", -1.0), (0, 0.0),
    (600, 600.0), ("0", 0.0), ("250ms", 0.25), (1e30, 10 * 365 * 86400.0)])
def test_keep_alive_reads_go_durations_and_seconds(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "", True, [], {"m": 5}, "1e999999"])
def test_keep_alive_refuses_what_is_not_a_duration(value):
    with pytest.raises(InvalidRequest) as bad:
        parse_keep_alive(value)
    assert bad.value.param == "keep_alive"


def test_chat_options_map_onto_the_openai_body():
    translated = OllamaChat(CONTEXT).translate({
        "model": "m:latest", "messages": [{"role": "user", "content": "hi"}], "format": "json", "keep_alive": "1m",
        "options": {"num_predict": 9, "temperature": 0.5, "top_k": 3, "seed": 1, "stop": "END", "num_ctx": 99,
                    "num_gpu": 12, "mirostat": 2}}, JobKind.CHAT)
    body = translated.body
    assert body["max_tokens"] == 9 and body["temperature"] == 0.5 and body["top_k"] == 3 and body["seed"] == 1
    assert body["stop"] == ["END"] and body["response_format"] == {"type": "json_object"}
    # Ollama streams unless told not to.
    assert body["stream"] is True
    assert translated.context_cap == 99 and translated.keep_alive_s == 60
    # Load-time options are the server's here; nothing leaks into the worker's body.
    assert "num_gpu" not in body and "mirostat" not in body and "options" not in body


@pytest.mark.parametrize("predict", [-1, -2, 10**9])
def test_num_predict_until_full_or_past_the_context_is_as_much_as_fits(predict):
    body = OllamaChat(CONTEXT).translate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                         "options": {"num_predict": predict}}, JobKind.CHAT).body
    assert body.get("max_tokens", CONTEXT) == CONTEXT


@pytest.mark.parametrize("options, param", [
    ({"num_predict": 0}, "options.num_predict"), ({"num_predict": "9"}, "options.num_predict"),
    ({"num_predict": -3}, "options.num_predict"), ({"num_ctx": 0}, "options.num_ctx"),
    ({"num_ctx": True}, "options.num_ctx"), ([1, 2], "options")])
def test_bad_options_are_400s_that_name_them(options, param):
    with pytest.raises(InvalidRequest) as bad:
        OllamaChat(CONTEXT).translate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                       "options": options}, JobKind.CHAT)
    assert bad.value.status == 400 and bad.value.param == param


def test_tool_calls_and_results_become_openais():
    body = OllamaChat(CONTEXT).translate({"model": "m", "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "weather", "arguments": {"c": 1}}}]},
        {"role": "tool", "tool_name": "weather", "content": "sunny"}]}, JobKind.CHAT).body
    call = body["messages"][1]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"c": 1}
    assert body["messages"][2]["tool_call_id"] == call["id"]


def test_an_empty_chat_or_prompt_only_loads():
    assert OllamaChat(CONTEXT).translate({"model": "m"}, JobKind.CHAT).load_only
    generate = OllamaGenerate(CONTEXT)
    assert generate.translate({"model": "m", "prompt": ""}, JobKind.CHAT).load_only
    answer = json.loads(generate.load_answer(generate.translate(
        {"model": "m", "prompt": "", "keep_alive": 0, "stream": False}, JobKind.CHAT)).body)
    assert answer["done"] is True and answer["done_reason"] == "unload" and answer["response"] == ""


def test_generate_is_templated_unless_raw():
    generate = OllamaGenerate(CONTEXT)
    templated = generate.translate({"model": "m", "prompt": "hi", "system": "be brief"}, JobKind.CHAT)
    assert templated.kind is JobKind.CHAT
    assert templated.body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    raw = generate.translate({"model": "m", "prompt": "Once", "raw": True}, JobKind.CHAT)
    assert raw.kind is JobKind.COMPLETION and raw.body["prompt"] == "Once"
    # Not OpenAI's 16-token default: until the model stops or the context is full.
    assert raw.body["max_tokens"] == CONTEXT
    for unsupported in ("suffix", "template", "context"):
        with pytest.raises(InvalidRequest):
            generate.translate({"model": "m", "prompt": "x", unsupported: "y" if unsupported != "context" else [1]},
                               JobKind.CHAT)


def test_the_ndjson_stream_sends_tool_calls_whole_and_a_final_line():
    encoder = OllamaChat(CONTEXT).encoder(job())
    out = encoder.event(text_chunk("Hel")) + encoder.event(text_chunk("lo"))
    out += encoder.event(tool_chunk(0, call_id="c1", name="weather", arguments='{"ci'))
    out += encoder.event(tool_chunk(0, arguments='ty": "Oslo"}', finish="tool_calls"))
    lines = [json.loads(line) for line in (out + encoder.done(job(), {})).decode().splitlines()]
    assert [line["message"]["content"] for line in lines[:2]] == ["Hel", "lo"]
    assert lines[2]["message"]["tool_calls"] == [{"function": {"name": "weather", "arguments": {"city": "Oslo"}}}]
    final = lines[-1]
    assert final["done"] is True and final["done_reason"] == "stop" and final["eval_count"] == 3
    assert final["prompt_eval_count"] == 7 and final["eval_duration"] > 0 and not any(x["done"] for x in lines[:-1])


def test_model_names_and_sizes():
    assert strip_tag("smol:latest") == "smol" and strip_tag("smol:7b") == "smol:7b"
    assert parameter_size(134_515_008) == "134.5M" and parameter_size(7_000_000_000) == "7B"


# ----- Anthropic ------------------------------------------------------------------------------


def test_a_conversation_with_tools_becomes_an_openai_chat():
    body = translate_messages({
        "model": "m", "max_tokens": 100, "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["END"], "tools": [{"name": "weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                              {"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "t1", "name": "weather", "input": {"c": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "sunny"}]},
                                         {"type": "text", "text": "And tomorrow?"}]}]}, CONTEXT)
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    assistant = body["messages"][2]
    assert assistant["content"] == "Checking." and assistant["tool_calls"][0]["id"] == "t1"
    assert body["messages"][3] == {"role": "tool", "tool_call_id": "t1", "content": "sunny"}
    assert body["messages"][4] == {"role": "user", "content": "And tomorrow?"}
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["tools"][0]["function"]["parameters"] == {"type": "object"} and body["stop"] == ["END"]


def test_system_entries_inside_messages_join_the_system_prompt_in_order():
    """What Claude Code sends: a role "system" entry among the messages."""
    body = translate_messages({"model": "m", "max_tokens": 10, "system": "You are Claude Code.", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": [{"type": "text", "text": "Reminder: be brief."}]},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]}, CONTEXT)
    assert body["messages"] == [
        {"role": "system", "content": "You are Claude Code.\n\nReminder: be brief."},
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]


def test_max_tokens_is_required_and_means_up_to_the_context():
    assert translate_messages({"model": "m", "max_tokens": 32000, "messages": [
        {"role": "user", "content": "x"}]}, CONTEXT)["max_tokens"] == CONTEXT
    for bad in (None, 0, -5, "10", True, 1.5):
        with pytest.raises(InvalidRequest) as refused:
            translate_messages({"model": "m", "max_tokens": bad, "messages": [{"role": "user", "content": "x"}]},
                               CONTEXT)
        assert refused.value.param == "max_tokens"


@pytest.mark.parametrize("message, where", [
    ({"role": "system", "content": "x"}, "messages"),  # a system prompt and nothing to answer
    ({"role": "system", "content": 5}, "messages.0.content"),
    ({"role": "tool", "content": "x"}, "messages.0"),
    ({"role": "user", "content": 5}, "messages.0.content"),
    ({"role": "user", "content": [{"type": "image", "source": {}}]}, "messages.0.content.0.source"),
    ({"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b"}]}, "messages.0.content.0"),
    ({"role": "user", "content": [{"type": "tool_result"}]}, "messages.0.content.0"),
    ({"role": "user", "content": ["text"]}, "messages.0.content.0")])
def test_bad_messages_are_400s_that_say_where(message, where):
    with pytest.raises(InvalidRequest) as bad:
        translate_messages({"model": "m", "max_tokens": 5, "messages": [message]}, CONTEXT)
    assert bad.value.status == 400 and bad.value.param == where


def test_the_event_stream_opens_and_closes_each_block():
    messages = AnthropicMessages(CONTEXT)
    done_job = job({"model": "m"})
    encoder = messages.encoder(done_job)
    out = encoder.event(text_chunk("Hi")) + encoder.event(tool_chunk(0, call_id="c1", name="f", arguments='{"a"'))
    out += encoder.event(tool_chunk(0, arguments=": 1}")) + encoder.event(tool_chunk(1, call_id="c2", name="g"))
    out += encoder.done(done_job, {})
    events = [block.split("\n") for block in out.decode().strip().split("\n\n")]
    names = [lines[0].removeprefix("event: ") for lines in events]
    assert names == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_stop", "message_delta", "message_stop"]
    payloads = [json.loads(lines[1].removeprefix("data: ")) for lines in events]
    assert payloads[0]["message"]["usage"] == {"input_tokens": 7, "output_tokens": 0}
    assert payloads[4]["content_block"] == {"type": "tool_use", "id": "c1", "name": "f", "input": {}}
    assert [p["index"] for p in payloads[1:10] if "index" in p] == [0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert payloads[10]["usage"] == {"output_tokens": 3}


def test_answers_and_errors_in_anthropics_shape():
    response = {"choices": [{"message": {"content": "Hi", "tool_calls": [
        {"id": "c1", "function": {"name": "f", "arguments": "not json"}}]}, "finish_reason": "tool_calls"}]}
    answer = AnthropicMessages(CONTEXT).answer(response, job({"model": "m"}))
    assert answer["stop_reason"] == "tool_use" and answer["id"] == "msg_req-1"
    assert answer["content"][1] == {"type": "tool_use", "id": "c1", "name": "f", "input": {"arguments": "not json"}}
    assert error_payload(503, "busy")["error"]["type"] == "overloaded_error"
    assert error_payload(404, "no")["error"]["type"] == "not_found_error"
    assert error_payload(422, "x")["error"]["type"] == "invalid_request_error"
    assert error_payload(500, "x")["error"]["type"] == "api_error"
