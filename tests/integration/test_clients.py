"""What real clients send (issue 19), through the `openai` package where it
can say it, and raw httpx where it can't, against the real service."""

from __future__ import annotations

import json

import openai
import pydantic
import pytest

pytestmark = pytest.mark.integration

HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def client(service):
    with openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def test_typed_text_parts_are_read_as_text(fresh, client):
    answer = client.chat.completions.create(model="default", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "the best book?"}]}])
    assert answer.choices[0].message.content
    # Counted the way the template renders the joined text, not as an empty message.
    plain = fresh.http.post("/v1/chat/completions", json={"max_tokens": 1, "messages": [
        {"role": "user", "content": "What is\nthe best book?"}]}).json()
    assert answer.usage.prompt_tokens == plain["usage"]["prompt_tokens"]


def test_an_assistant_turn_with_null_content_and_tool_calls_is_accepted(fresh, client):
    answer = client.chat.completions.create(model="default", max_tokens=4, messages=[
        {"role": "user", "content": "What's the weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_an_image_part_gets_a_clear_no_vision_error(fresh, client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="default", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}])
    error = refused.value.body
    assert error["code"] == "model_has_no_vision" and "no vision" in error["message"]
    assert error["param"] == "messages[0].content[1]"


class Person(pydantic.BaseModel):
    name: str
    age: int


def test_structured_output_with_parse_returns_the_schema(fresh, client):
    completion = client.chat.completions.parse(
        model="default", max_tokens=60, temperature=0, response_format=Person,
        messages=[{"role": "user", "content": "Alice is 30 years old. Give her name and age as JSON."}])
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person)


def test_json_object_mode_returns_json(fresh, client):
    answer = client.chat.completions.create(
        model="default", max_tokens=40, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give a JSON object with a key 'ok'."}])
    if answer.choices[0].finish_reason == "stop":
        json.loads(answer.choices[0].message.content)
    else:  # cut off by max_tokens: still JSON so far
        assert answer.choices[0].message.content.lstrip().startswith("{")


def test_a_grammar_llama_cpp_cannot_parse_is_a_400_and_no_worker_dies(fresh):
    pids = fresh.worker_pids()
    response = fresh.http.post("/v1/chat/completions", json={
        "messages": HELLO, "max_tokens": 4, "grammar": "root ::= this is (not valid GBNF"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_grammar"
    assert fresh.worker_pids() == pids
    assert fresh.http.get("/health").status_code == 200


def test_a_schema_that_cannot_become_a_grammar_is_a_400(fresh):
    response = fresh.http.post("/v1/chat/completions", json={
        "messages": HELLO, "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json_schema"


@pytest.mark.parametrize("force", ["auto", "cpu"])
def test_include_usage_sends_a_final_usage_chunk_on_both_paths(fresh, client, force):
    stream = client.chat.completions.create(
        model="default", max_tokens=6, temperature=0, messages=HELLO, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Force-Path": force})
    chunks = list(stream)
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens > 0 and 0 < last.usage.completion_tokens <= 6
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_without_include_usage_there_is_no_usage_chunk(fresh, client):
    chunks = list(client.chat.completions.create(model="default", max_tokens=4, messages=HELLO, stream=True))
    assert all(chunk.choices for chunk in chunks)


def test_logprobs_come_back_for_every_token_with_the_alternatives_asked_for(fresh, client):
    answer = client.chat.completions.create(model="default", max_tokens=5, temperature=0, messages=HELLO,
                                            logprobs=True, top_logprobs=2)
    tokens = answer.choices[0].logprobs.content
    assert len(tokens) == answer.usage.completion_tokens
    assert "".join(t.token for t in tokens) == answer.choices[0].message.content
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens)
    assert fresh.http.get("/v1/models").json()["data"][0]["capabilities"]["logprobs"] is True


def test_streamed_logprobs_arrive_with_their_tokens(fresh, client):
    chunks = list(client.chat.completions.create(model="default", max_tokens=4, temperature=0, messages=HELLO,
                                                 stream=True, logprobs=True, top_logprobs=1))
    with_tokens = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert with_tokens and all(c.choices[0].logprobs.content for c in with_tokens)


@pytest.mark.parametrize("body, param", [
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
])
def test_bad_logprobs_fields_are_400s_naming_the_field(fresh, body, param):
    response = fresh.http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_n_over_the_bound_is_refused_and_said_in_the_model_list(fresh, client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="default", max_tokens=4, messages=HELLO, n=5)
    assert "max_choices" in refused.value.body["message"]
    listed = fresh.http.get("/v1/models").json()["data"][0]
    assert listed["capabilities"]["max_choices"] == 4


def test_an_unknown_reasoning_format_is_a_400_not_a_worker_failure(fresh):
    response = fresh.http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2,
                                                             "reasoning_format": "bogus"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "reasoning_format"


def test_routes_without_v1_serve_the_same(fresh):
    with openai.OpenAI(base_url=fresh.url, api_key="unused", max_retries=0) as bare:
        answer = bare.chat.completions.create(model="default", max_tokens=3, messages=HELLO)
        assert answer.choices[0].message.content is not None
        assert bare.completions.create(model="default", prompt="Once", max_tokens=3).choices[0].text is not None
        assert [m.id for m in bare.models.list()] == [m["id"] for m in fresh.http.get("/v1/models").json()["data"]]
    refused = fresh.http.post("/chat/completions", json={"messages": HELLO, "n": 5})
    assert refused.status_code == 400


def test_system_fingerprint_is_stable_and_in_every_chunk(fresh, client):
    first = client.chat.completions.create(model="default", max_tokens=2, messages=HELLO)
    second = client.chat.completions.create(model="default", max_tokens=2, messages=HELLO)
    assert first.system_fingerprint and first.system_fingerprint == second.system_fingerprint
    chunks = list(client.chat.completions.create(model="default", max_tokens=2, messages=HELLO, stream=True))
    assert {chunk.system_fingerprint for chunk in chunks} == {first.system_fingerprint}


def test_a_worker_error_reaches_the_client_without_paths_or_tracebacks(fresh):
    # A pass-through field the worker's own validation refuses (llama-server's t_max_predict_ms).
    response = fresh.http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2,
                                                             "t_max_predict_ms": "not-a-number"})
    assert 400 <= response.status_code < 500
    message = response.json()["error"]["message"]
    assert "Traceback" not in message and "site-packages" not in message and "/work" not in message


REFUND = [{"type": "function", "function": {
    "name": "refund_order", "description": "Refund an order",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}}]
ASK_REFUND = [{"role": "user", "content": "Refund order A-1001."}]


@pytest.mark.parametrize("force", ["auto", "cpu"])
def test_a_named_tool_choice_comes_back_as_that_tool_call_on_both_paths(fresh, client, force):
    answer = client.chat.completions.create(
        model="default", max_tokens=60, temperature=0, messages=ASK_REFUND, tools=REFUND,
        tool_choice={"type": "function", "function": {"name": "refund_order"}}, extra_headers={"X-Force-Path": force})
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "refund_order" and call.id == f"call_{answer.id.removeprefix('chatcmpl-')}"
    assert set(json.loads(call.function.arguments)) == {"order_id"}


def test_a_streamed_named_tool_call_names_the_function_once_and_its_arguments_parse(fresh, client):
    chunks = list(client.chat.completions.create(
        model="default", max_tokens=60, temperature=0, messages=ASK_REFUND, tools=REFUND, stream=True,
        tool_choice={"type": "function", "function": {"name": "refund_order"}}))
    calls = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert [c.function.name for c in calls if c.function.name] == ["refund_order"]
    assert json.loads("".join(c.function.arguments or "" for c in calls))["order_id"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_calls_one_of_the_tools(fresh, client, stream):
    """What the agent frameworks send (the Agents SDK's "required", LangChain's
    "any"): OpenAI's contract is a call, and SmolLM2's template alone answers
    in plain text."""
    asked = dict(model="default", max_tokens=80, temperature=0, messages=ASK_REFUND, tools=[WEATHER, *REFUND],
                 tool_choice="required")
    if stream:
        chunks = list(client.chat.completions.create(**asked, stream=True))
        calls = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
        name, arguments = calls[0].function.name, "".join(c.function.arguments or "" for c in calls)
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.chat.completions.create(**asked).choices[0]
        (call,) = choice.message.tool_calls
        name, arguments, finish = call.function.name, call.function.arguments, choice.finish_reason
    assert finish == "tool_calls" and name in ("get_weather", "refund_order")
    assert set(json.loads(arguments)) == ({"city"} if name == "get_weather" else {"order_id"})


@pytest.mark.parametrize("tool_choice, message", [
    ({"type": "function", "function": {"name": "nope"}}, "not in 'tools'"),
    ({"type": "function"}, "must be"),
    ("sometimes", "must be"),
])
def test_a_bad_tool_choice_is_a_400_naming_it(fresh, tool_choice, message):
    response = fresh.http.post("/v1/chat/completions", json={"messages": ASK_REFUND, "max_tokens": 4,
                                                             "tools": REFUND, "tool_choice": tool_choice})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "tool_choice" and message in error["message"]


@pytest.mark.parametrize("field, value", [("n_predict", 5), ("n_cmpl", 2), ("id_slot", 0), ("n_probs", 3),
                                          ("json_schema", {"type": "object"}), ("response_fields", ["content"])])
def test_fields_that_would_override_the_routers_decisions_are_400s(fresh, field, value):
    response = fresh.http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2, field: value})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == field and error["code"] == "unsupported_parameter"


def test_logprobs_with_tools_is_a_400_not_a_worker_error(fresh):
    response = fresh.http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2, "tools": REFUND,
                                                             "logprobs": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs"


def test_logprobs_without_top_logprobs_has_no_alternatives_as_openai(fresh, client):
    answer = client.chat.completions.create(model="default", max_tokens=3, temperature=0, messages=HELLO,
                                            logprobs=True)
    tokens = answer.choices[0].logprobs.content
    assert tokens and all(t.top_logprobs == [] for t in tokens)
