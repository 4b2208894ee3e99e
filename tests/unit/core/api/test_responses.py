"""The Responses API's edge as plain functions: request translation, the
Response object, the stream's events and the store of past responses
(issue 30, part 2)."""

from __future__ import annotations

import json

import pytest

from starlette.requests import Request

from tray_app.core.access.keys import ApiKey
from tray_app.core.api.openai_request import InvalidRequest
from tray_app.core.api.security import PRINCIPAL_SCOPE_KEY
from tray_app.core.api.responses import (
    ResponseStore, ResponsesProtocol, caller_of, convert_items, translate_request,
)
from tray_app.core.dispatch.jobs import Attempt, Job, JobFailed, JobKind, JobRequest

CONTEXT = 2048
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def translate(**body):
    return translate_request(body, CONTEXT, [])[0]


def finished_job(body, tokens=3, prompt=7) -> Job:
    job = Job(JobRequest(id="req-1", kind=JobKind.CHAT, body=body, stream=True, prompt_tokens=prompt))
    job.attempts.append(Attempt(path="gpu", started_at=job.created_at, first_token_at=job.created_at + 0.1,
                                ended_at=job.created_at + 0.3, tokens=tokens, outcome="completed"))
    return job


def text_chunk(text, finish=None):
    return {"model": "m", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


def tool_chunk(index, *, call_id=None, name=None, arguments=None, finish=None):
    function = {k: v for k, v in (("name", name), ("arguments", arguments)) if v is not None}
    call = {"index": index, "function": function, **({"id": call_id} if call_id else {})}
    return {"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": finish}]}


def events_of(stream: bytes) -> list[dict]:
    """The SSE frames, checking that each names its own type."""
    events = []
    for frame in stream.decode().strip().split("\n\n"):
        name, data = frame.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        events.append(payload)
    return events


# ----- request ---------------------------------------------------------------------------------


def test_a_string_input_is_one_user_message_and_instructions_the_system():
    body = translate(model="m", input="Hi", instructions="Be terse.", max_output_tokens=5, temperature=0.2,
                     top_p=0.9, user="u", stream=True, reasoning={"effort": "low"}, include=["x"],
                     metadata={"k": "v"}, truncation="auto", store=False)
    assert body["messages"] == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    assert body["max_tokens"] == 5 and body["temperature"] == 0.2 and body["top_p"] == 0.9 and body["user"] == "u"
    assert body["stream"] is True
    # What has no meaning for a chat body stays out of it.
    assert not {"reasoning", "include", "metadata", "truncation", "store", "input", "instructions"} & set(body)


def test_items_become_chat_messages_with_calls_on_the_assistant_turn():
    messages = convert_items([
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather"},
                                                         {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"}])
    assert messages == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather\nin Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]


def test_instructions_join_the_system_messages_that_open_the_input():
    # Codex sends instructions and then developer messages; many templates take one system message.
    body = translate(instructions="Rules.", input=[{"role": "developer", "content": "Sandbox."},
                                                   {"role": "user", "content": "Go"}])
    assert body["messages"] == [{"role": "system", "content": "Rules.\n\nSandbox."}, {"role": "user", "content": "Go"}]


def test_function_tools_text_format_and_a_named_tool_choice_map_onto_chat():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = translate(input="x", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                     parallel_tool_calls=False, text={"format": {"type": "json_schema", "name": "n", "schema": schema},
                                                      "verbosity": "low"})
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["parameters"], "description": "The weather in a city."}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["parallel_tool_calls"] is False
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    assert translate(input="x", text={"format": {"type": "json_object"}})["response_format"] == {"type": "json_object"}
    assert "response_format" not in translate(input="x", text={"format": {"type": "text"}})


def test_max_output_tokens_is_an_upper_bound_within_the_context():
    assert translate(input="x", max_output_tokens=10**9)["max_tokens"] == CONTEXT


def test_a_follow_up_puts_the_previous_conversation_first():
    prefix = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    body, turn = translate_request({"input": "Again", "instructions": "New rules."}, CONTEXT, prefix)
    assert body["messages"] == [{"role": "system", "content": "New rules."}, *prefix,
                                {"role": "user", "content": "Again"}]
    # The instructions are not part of what a later follow-up inherits.
    assert turn == [*prefix, {"role": "user", "content": "Again"}]


@pytest.mark.parametrize("tool", ["web_search", "web_search_preview", "file_search", "computer_use_preview",
                                  "code_interpreter", "image_generation", "mcp", "local_shell", "custom"])
def test_a_tool_only_openai_runs_is_left_out_with_a_warning(tool):
    """Codex sends web_search with every request: the model is offered the
    functions, and the answer's Warning header names what was left out."""
    protocol = ResponsesProtocol(ResponseStore(), "me", CONTEXT)
    translated = protocol.translate({"input": "x", "tools": [WEATHER, {"type": tool}]}, JobKind.CHAT)
    assert [t["function"]["name"] for t in translated.body["tools"]] == ["get_weather"]
    assert len(translated.warnings) == 1 and f"tools[1] ({tool})" in translated.warnings[0]


def test_forcing_a_tool_only_openai_runs_is_a_400():
    with pytest.raises(InvalidRequest) as bad:
        translate(input="x", tools=[{"type": "web_search"}], tool_choice={"type": "web_search"})
    assert bad.value.status == 400 and bad.value.code == "unsupported_tool"


@pytest.mark.parametrize("tool", [{"type": "frobnicate"}, {"name": "x"}, "web_search"])
def test_a_tool_of_no_known_type_is_a_400_naming_it(tool):
    with pytest.raises(InvalidRequest) as bad:
        translate(input="x", tools=[WEATHER, tool])
    assert bad.value.status == 400 and bad.value.param == "tools[1]" and bad.value.code == "unsupported_tool"


NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
             "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}},
                       {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]}


def test_a_namespace_tool_is_unpacked_and_its_calls_come_back_under_its_names():
    """What Codex sends: its sub-agent functions grouped in a namespace tool."""
    protocol = ResponsesProtocol(ResponseStore(), "me", CONTEXT)
    translated = protocol.translate({"input": "x", "tools": [WEATHER, NAMESPACE]}, JobKind.CHAT)
    names = [t["function"]["name"] for t in translated.body["tools"]]
    # A name two groups share is told apart for the model.
    assert names == ["get_weather", "spawn_agent", "multi_agent_v1__get_weather"]
    job = finished_job(translated.body)
    answer = protocol.answer({"model": "m", "choices": [{"finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "function": {"name": "spawn_agent", "arguments": "{}"}},
            {"id": "c2", "function": {"name": "multi_agent_v1__get_weather", "arguments": "{}"}},
            {"id": "c3", "function": {"name": "get_weather", "arguments": "{}"}}]}}]}, job)
    calls = [(item.get("namespace"), item["name"]) for item in answer["output"] if item["type"] == "function_call"]
    assert calls == [("multi_agent_v1", "spawn_agent"), ("multi_agent_v1", "get_weather"), (None, "get_weather")]
    # Sent back in the next turn, each call finds its chat name again.
    follow = protocol.translate({"input": [*answer["output"], {"type": "function_call_output", "call_id": "c2",
                                                                "output": "ok"}], "tools": [WEATHER, NAMESPACE]},
                                JobKind.CHAT)
    assistant = next(m for m in follow.body["messages"] if m["role"] == "assistant")
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == [
        "spawn_agent", "multi_agent_v1__get_weather", "get_weather"]


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0]"),
    ({"input": ["hi"]}, "input[0]"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": "9"}, "max_output_tokens"),
    ({"input": "x", "tools": {"type": "function"}}, "tools"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": []}]}, "tools[0].parameters"),
    ({"input": "x", "tool_choice": "always"}, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "x", "text": "json"}, "text"),
    ({"input": "x", "instructions": ["a"]}, "instructions"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "reasoning": "high"}, "reasoning"),
    ({"input": "x", "truncation": "middle"}, "truncation"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
])
def test_bad_fields_are_400s_that_name_them(body, param):
    with pytest.raises(InvalidRequest) as bad:
        translate_request(body, CONTEXT, [])
    assert bad.value.status == 400 and bad.value.param == param, bad.value.message


# ----- the store -------------------------------------------------------------------------------


def stored(response_id, text="x"):
    return {"id": response_id, "output": text}


def test_the_store_drops_the_oldest_past_its_count():
    store = ResponseStore(max_responses=2)
    for name in ("a", "b", "c"):
        store.put("me", stored(name), [])
    assert store.get("me", "a") is None and store.get("me", "b") and store.get("me", "c") and len(store) == 2


def test_the_store_drops_the_oldest_past_its_bytes_and_refuses_one_too_large():
    one = len(json.dumps([stored("a", "x" * 100), []], separators=(",", ":")))
    store = ResponseStore(max_bytes=2 * one)
    for name in ("a", "b", "c"):
        assert store.put("me", stored(name, "x" * 100), [])
    assert store.get("me", "a") is None and len(store) == 2 and store.stored_bytes == 2 * one
    assert not store.put("me", stored("huge", "x" * 3 * one), [])
    assert store.get("me", "huge") is None and store.stored_bytes == 2 * one


def test_the_store_keeps_callers_apart_and_deletes():
    store = ResponseStore()
    store.put("me", stored("a"), [{"role": "user", "content": "hi"}])
    assert store.get("you", "a") is None and not store.delete("you", "a")
    assert store.get("me", "a").conversation == [{"role": "user", "content": "hi"}]
    assert store.delete("me", "a") and store.get("me", "a") is None and store.stored_bytes == 0


def test_the_store_keeps_a_copy():
    store, conversation = ResponseStore(), [{"role": "user", "content": "hi"}]
    store.put("me", stored("a"), conversation)
    conversation[0]["content"] = "changed"
    assert store.get("me", "a").conversation[0]["content"] == "hi"


def request_with(headers: dict[str, str], principal: ApiKey | None = None) -> Request:
    scope = {"type": "http", "headers": [(k.encode(), v.encode()) for k, v in headers.items()], "extensions": {}}
    if principal is not None:
        scope["extensions"][PRINCIPAL_SCOPE_KEY] = principal
    return Request(scope)


def test_without_keys_callers_are_told_apart_by_the_placeholder_key_they_offer():
    def caller(**headers):
        return caller_of(request_with(headers))
    assert caller(authorization="Bearer k1") == caller(**{"x-api-key": "k1"})
    assert caller(authorization="Bearer k1") != caller(authorization="Bearer k2")
    assert "k1" not in caller(authorization="Bearer k1")


def test_with_keys_the_caller_is_the_keys_identity_not_its_name():
    """A web page's session carries no key header: its login's key is the
    caller, so two keys' pages don't share one namespace, and a key made
    again under a revoked key's name doesn't inherit its responses."""
    old, new = ApiKey("phone", "inference", sha256="a" * 64), ApiKey("phone", "inference", sha256="b" * 64)
    assert caller_of(request_with({}, old)) != caller_of(request_with({}, new))
    assert caller_of(request_with({}, old)) == caller_of(request_with({"authorization": "Bearer x"}, old))


def test_one_callers_responses_never_push_out_anothers():
    one = len(json.dumps([stored("a", "x" * 100), []], separators=(",", ":")))
    store = ResponseStore(max_bytes=10 * one, per_caller_bytes=3 * one, per_caller_responses=100)
    store.put("quiet", stored("kept", "x" * 100), [])
    for index in range(50):
        store.put("flood", stored(f"f{index}", "x" * 100), [])
    assert store.get("quiet", "kept") is not None
    # The flood holds what its own bound allows, its newest; the rest went.
    assert store._by_caller["flood"] <= 3 * one < store._by_caller["flood"] + one + 10
    assert store.get("flood", "f49") is not None and store.get("flood", "f45") is None


def test_the_store_holds_text_and_counts_what_it_holds():
    """64 MiB of bound is 64 MiB held: each response is kept as its JSON
    text, not as parsed objects ten times the size."""
    store = ResponseStore()
    big = stored("big", "x" * 1_000_000)
    store.put("me", big, [])
    assert 1_000_000 < store.stored_bytes < 1_000_200
    assert sum(len(text) for text in store._entries.values()) == store.stored_bytes


# ----- the answer ------------------------------------------------------------------------------


def protocol_for(body, store=None):
    protocol = ResponsesProtocol(ResponseStore() if store is None else store, "me", CONTEXT)
    translated = protocol.translate(body, JobKind.CHAT)
    return protocol, finished_job(translated.body)


def test_a_json_answer_is_a_response_object_and_is_stored():
    store = ResponseStore()
    protocol, job = protocol_for({"model": "m", "input": "Hi", "metadata": {"k": "v"}}, store)
    answer = protocol.answer({"model": "m", "choices": [{"message": {"role": "assistant", "content": "Hello"},
                                                          "finish_reason": "stop"}]}, job)
    assert answer["id"].startswith("resp_") and answer["object"] == "response" and answer["status"] == "completed"
    assert answer["output"] == [{"type": "message", "id": answer["output"][0]["id"], "status": "completed",
                                 "role": "assistant", "content": [{"type": "output_text", "text": "Hello",
                                                                   "annotations": [], "logprobs": []}]}]
    assert answer["usage"]["input_tokens"] == 7 and answer["usage"]["output_tokens"] == 3
    assert answer["usage"]["total_tokens"] == 10 and answer["metadata"] == {"k": "v"}
    kept = store.get("me", answer["id"])
    assert kept.response == answer
    assert kept.conversation == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    # The next turn starts from it.
    follow_up, _ = protocol_for({"input": "More", "previous_response_id": answer["id"]}, store)
    assert follow_up.translate({"input": "More", "previous_response_id": answer["id"]}, JobKind.CHAT).body[
        "messages"] == [*kept.conversation, {"role": "user", "content": "More"}]


def test_a_tool_call_answer_has_function_call_items_and_a_length_stop_is_incomplete():
    protocol, job = protocol_for({"input": "Weather?", "tools": [WEATHER], "store": False})
    answer = protocol.answer({"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":"}}]},
        "finish_reason": "length"}]}, job)
    assert [item["type"] for item in answer["output"]] == ["function_call"]
    call = answer["output"][0]
    assert call["call_id"] == "call_9" and call["name"] == "get_weather" and call["arguments"] == "{\"city\":"
    assert answer["status"] == "incomplete" and answer["incomplete_details"] == {"reason": "max_output_tokens"}
    assert answer["store"] is False and answer["tools"] == [WEATHER]


def test_store_false_keeps_nothing():
    store = ResponseStore()
    protocol, job = protocol_for({"input": "Hi", "store": False}, store)
    protocol.answer({"choices": [{"message": {"role": "assistant", "content": "Hello"}, "finish_reason": "stop"}]},
                    job)
    assert len(store) == 0


def test_an_unknown_previous_response_is_a_404():
    with pytest.raises(InvalidRequest) as missing:
        protocol_for({"input": "x", "previous_response_id": "resp_gone"})
    assert missing.value.status == 404 and missing.value.param == "previous_response_id"


# ----- the stream ------------------------------------------------------------------------------


def test_a_text_stream_gives_the_responses_events_in_order():
    store = ResponseStore()
    protocol, job = protocol_for({"input": "Hi"}, store)
    encoder = protocol.encoder(job)
    stream = encoder.event(text_chunk("Hel")) + encoder.event(text_chunk("lo", finish="stop"))
    events = events_of(stream + encoder.done(job, {}))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert events[6]["text"] == "Hello"
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["model"] == "m"
    assert final["output"][0]["content"][0]["text"] == "Hello" and final["usage"]["output_tokens"] == 3
    # The item ids agree across the events, and the whole answer is stored.
    assert {e.get("item_id", e.get("item", {}).get("id")) for e in events[2:-1]} == {final["output"][0]["id"]}
    assert store.get("me", final["id"]).response == final


def test_a_streamed_tool_call_is_a_function_call_item_with_argument_deltas():
    protocol, job = protocol_for({"input": "Weather?", "tools": [WEATHER]})
    encoder = protocol.encoder(job)
    stream = (encoder.event(tool_chunk(0, call_id="call_1", name="get_weather", arguments="{\"city\""))
              + encoder.event(tool_chunk(0, arguments=":\"Oslo\"}", finish="tool_calls")))
    events = events_of(stream + encoder.done(job, {}))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert events[2]["item"]["call_id"] == "call_1" and events[2]["item"]["arguments"] == ""
    assert events[5]["arguments"] == "{\"city\":\"Oslo\"}"
    assert events[-1]["response"]["output"] == [events[6]["item"]]


def test_a_stream_stopped_by_the_limit_ends_incomplete():
    protocol, job = protocol_for({"input": "Hi", "max_output_tokens": 1})
    encoder = protocol.encoder(job)
    events = events_of(encoder.event(text_chunk("A", finish="length")) + encoder.done(job, {}))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_an_empty_answer_still_streams_one_message():
    protocol, job = protocol_for({"input": "Hi"})
    encoder = protocol.encoder(job)
    events = events_of(encoder.done(job, {}))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == ""


def test_a_failure_mid_stream_is_a_failed_response():
    store = ResponseStore()
    protocol, job = protocol_for({"input": "Hi"}, store)
    encoder = protocol.encoder(job)
    stream = encoder.event(text_chunk("Hel"))
    events = events_of(stream + encoder.failed(JobFailed(502, "worker_failed", "the worker died")))
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"] == {"code": "worker_failed", "message": "the worker died"}
    assert len(store) == 0


def test_errors_from_the_chat_checks_name_the_responses_fields():
    protocol, _ = protocol_for({"input": "x"})
    refused = protocol.error(400, "'response_format.json_schema.schema' can't constrain the answer",
                             "invalid_json_schema", "response_format.json_schema.schema")
    error = json.loads(refused.body)["error"]
    assert error["param"] == "text.format.schema" and error["message"].startswith("'text.format.schema'")
    assert json.loads(protocol.error(400, "bad", "x", "temperature").body)["error"]["param"] == "temperature"


def test_the_response_echoes_only_the_fields_text_and_tools_define():
    junk = "x" * 10_000
    protocol, job = protocol_for({"model": "m", "input": "Hi", "tools": [{**WEATHER, "junk": junk}],
                                  "text": {"format": {"type": "json_object", "junk": junk}, "junk": junk}})
    answer = protocol.answer({"model": "m", "choices": [{"message": {"role": "assistant", "content": "{}"},
                                                          "finish_reason": "stop"}]}, job)
    assert answer["tools"] == [WEATHER]
    assert answer["text"] == {"format": {"type": "json_object"}}
    assert junk not in json.dumps(answer)
