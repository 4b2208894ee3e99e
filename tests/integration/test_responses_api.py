"""OpenAI's Responses API (/v1/responses), through the official `openai`
package's responses.create and responses.stream, against the real service
on the real small model (issue 30, part 2)."""

from __future__ import annotations

import json

import openai
import pytest

pytestmark = pytest.mark.integration

# An enum keeps a forced call (and a schema-constrained answer) a few tokens long.
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}
FORCE_WEATHER = {"type": "function", "name": "get_weather"}
YES_NO = {"type": "json_schema", "name": "verdict", "strict": True,
          "schema": {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
                     "required": ["answer"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(service):
    with openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


def test_a_response_without_streaming(fresh, client):
    raw = client.responses.with_raw_response.create(model="default", input="Say hello.", instructions="Be terse.",
                                                    max_output_tokens=4, temperature=0, metadata={"run": "1"})
    response = raw.parse()
    assert raw.headers["x-served-by"] in ("gpu", "cpu") and raw.headers["x-request-id"]
    assert response.object == "response" and response.id.startswith("resp_") and response.model == "default"
    assert response.status in ("completed", "incomplete") and response.metadata == {"run": "1"}
    assert response.output[0].type == "message" and response.output_text
    assert response.usage.input_tokens > 5 and 1 <= response.usage.output_tokens <= 4
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def test_a_stream_gives_the_responses_events_in_order(fresh, client):
    with client.responses.create(model="default", input="Write a long story about the sea.", max_output_tokens=4,
                                 temperature=0, stream=True) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    # Four tokens, and the story is longer: the limit ends it.
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert final.output_text == text and text
    assert final.incomplete_details.reason == "max_output_tokens" and final.usage.output_tokens == 4


def test_responses_stream_with_a_schema_gives_a_final_response(fresh, client):
    with client.responses.stream(model="default", input="Is the sky blue? Answer as JSON.", max_output_tokens=40,
                                 temperature=0, text={"format": YES_NO}) as stream:
        final = stream.get_final_response()
    assert final.status == "completed"
    assert json.loads(final.output_text)["answer"] in ("yes", "no")


def test_a_forced_function_call_and_its_output_in_a_follow_up(fresh, client):
    call_response = client.responses.create(model="default", input="What is the weather in Paris?", tools=[WEATHER],
                                            tool_choice=FORCE_WEATHER, max_output_tokens=40, temperature=0)
    calls = [item for item in call_response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo")
    # The tool's result goes back as a function_call_output, on top of the stored conversation.
    answer = client.responses.create(model="default", previous_response_id=call_response.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "Sunny, 21 C"}], max_output_tokens=4, temperature=0)
    assert answer.previous_response_id == call_response.id and answer.output_text
    # Its prompt is the first one's, then the call and its output.
    assert answer.usage.input_tokens > call_response.usage.input_tokens


def test_a_streamed_function_call(fresh, client):
    with client.responses.stream(model="default", input="Weather in Oslo?", tools=[WEATHER],
                                 tool_choice=FORCE_WEATHER, max_output_tokens=40, temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    call = final.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    # strict tools' arguments are parsed by the SDK: they must be the JSON the schema asks for.
    assert call.parsed_arguments["city"] in ("Paris", "Oslo")


def test_a_follow_up_by_previous_response_id_carries_the_conversation(fresh, client):
    first = client.responses.create(model="default", input="My name is Ada.", max_output_tokens=3, temperature=0)
    second = client.responses.create(model="default", previous_response_id=first.id, input="What is my name?",
                                     max_output_tokens=3, temperature=0)
    alone = client.responses.create(model="default", input="What is my name?", max_output_tokens=1)
    # The second turn was given the first turn's input and output before its own.
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(model="default", previous_response_id="resp_unknown", input="x", max_output_tokens=1)
    assert unknown.value.body["code"] == "previous_response_not_found"
    assert unknown.value.body["param"] == "previous_response_id"


def test_get_and_delete_a_stored_response(fresh, client, service):
    created = client.responses.create(model="default", input="Hi", max_output_tokens=2)
    fetched = client.responses.retrieve(created.id)
    assert fetched.id == created.id and fetched.output_text == created.output_text
    assert fetched.usage.output_tokens == created.usage.output_tokens
    # Another API key's store is another namespace.
    with openai.OpenAI(base_url=f"{service.url}/v1", api_key="someone-else", max_retries=0) as other:
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(created.id)
    client.responses.delete(created.id)
    for attempt in (lambda: client.responses.retrieve(created.id), lambda: client.responses.delete(created.id)):
        with pytest.raises(openai.NotFoundError) as gone:
            attempt()
        assert gone.value.body["code"] == "response_not_found"
    # store: false keeps nothing to fetch, or to follow up on.
    unstored = client.responses.create(model="default", input="Hi", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_an_idempotency_key_answers_a_retry_with_the_same_response(fresh, client):
    first = client.responses.with_raw_response.create(model="default", input="Hi", max_output_tokens=2,
                                                      extra_headers={"Idempotency-Key": "responses-retry-1"})
    retry = client.responses.with_raw_response.create(model="default", input="Hi", max_output_tokens=2,
                                                      extra_headers={"Idempotency-Key": "responses-retry-1"})
    assert retry.headers["x-idempotent-replay"] == "true" and retry.parse().id == first.parse().id


def test_a_tool_only_openai_runs_is_left_out_with_a_warning_and_forcing_it_is_a_400(fresh, client):
    raw = client.responses.with_raw_response.create(model="default", input="Search the web for news.",
                                                    max_output_tokens=4, tools=[WEATHER, {"type": "web_search"}])
    assert raw.parse().status in ("completed", "incomplete")
    assert "tools[1] (web_search)" in raw.headers["warning"] and raw.headers["warning"].startswith("299 tray-app")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="default", input="Search.", max_output_tokens=4,
                                tools=[WEATHER, {"type": "web_search"}], tool_choice={"type": "web_search"})
    assert refused.value.body["code"] == "unsupported_tool"


def codex_request(tools):
    """What Codex CLI sends to a Responses provider (its wire_api "responses"),
    trimmed; max_output_tokens is ours, to keep the answer short (Codex sends none)."""
    return {
        "model": "default", "instructions": "You are Codex, a coding agent. Keep answers short.",
        "input": [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "<permissions>sandbox: read-only</permissions>"}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "<environment_context><cwd>/tmp</cwd></environment_context>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
        ],
        "tools": tools, "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"}, "store": False, "stream": True,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0b7e6a1c-codex-session",
        "text": {"verbosity": "medium"}, "max_output_tokens": 6,
    }


SHELL = {"type": "function", "name": "shell", "description": "Runs a shell command and returns its output.",
         "strict": False, "parameters": {"type": "object", "properties": {
             "command": {"type": "array", "items": {"type": "string"}}, "workdir": {"type": "string"}},
             "required": ["command"], "additionalProperties": False}}


def test_a_codex_shaped_request_streams_and_a_built_in_tool_is_named(fresh):
    with fresh.http.stream("POST", "/v1/responses", json=codex_request([SHELL])) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        names = [line.removeprefix("event: ") for line in response.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] in ("response.completed", "response.incomplete") and "response.failed" not in names
    # Codex 0.171 sends web_search and a namespace tool with every request: answered, the
    # namespace's functions offered to the model, web_search named in the Warning header.
    namespace = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
                 "tools": [{**SHELL, "name": "spawn_agent"}]}
    with fresh.http.stream("POST", "/v1/responses",
                           json=codex_request([SHELL, namespace, {"type": "web_search"}])) as response:
        assert response.status_code == 200 and "web_search" in response.headers["warning"]
        names = [line.removeprefix("event: ") for line in response.iter_lines() if line.startswith("event: ")]
    assert names[-1] in ("response.completed", "response.incomplete")


def test_the_route_without_v1_and_errors_in_the_openai_envelope(fresh):
    plain = fresh.http.post("/responses", json={"input": "Hi", "max_output_tokens": 1})
    assert plain.status_code == 200 and plain.json()["object"] == "response"
    for body, status, param in (({"input": "Hi", "model": "no-such-model"}, 404, "model"),
                                ({"input": "Hi", "temperature": 9}, 400, "temperature"),
                                ({"max_output_tokens": 1}, 400, "input"),
                                # Checked by the grammar checker, after the translation: still named as sent.
                                ({"input": "Hi", "text": {"format": {"type": "json_schema",
                                                                     "schema": {"type": "nonsense"}}}},
                                 400, "text.format.schema")):
        response = fresh.http.post("/v1/responses", json=body)
        assert response.status_code == status and response.json()["error"]["param"] == param, response.text
    # A route under /v1/responses that isn't served names the Responses routes.
    missing = fresh.http.get("/v1/responses/resp_x/input_items")
    assert missing.status_code == 404 and "POST /v1/responses" in missing.json()["error"]["message"]


def test_gpu_death_before_the_first_event_replays_once_on_the_cpu(fresh, service):
    """A stream whose GPU worker dies before any event reached the client is
    run again on the CPU; the client sees one clean Responses stream."""
    prompt = "word " * 900 + "\nSay ok."

    def run():
        with service.http.stream("POST", "/v1/responses", headers={"X-Request-Id": "responses-replay"}, json={
                "model": "default", "max_output_tokens": 8, "temperature": 0, "stream": True,
                "input": prompt}) as response:
            return response.headers, [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                                      if line.startswith("data: ")]

    headers, events = fresh.kill_gpu_before_first_token("responses-replay", run)
    assert headers["x-route-reason"] == "gpu_failed_replayed" and headers["x-served-by"] == "cpu"
    kinds = [event["type"] for event in events]
    assert kinds[0] == "response.created" and kinds.count("response.created") == 1
    assert kinds[-1] in ("response.completed", "response.incomplete") and "response.failed" not in kinds
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert events[-1]["response"]["output"][0]["type"] == "message"
    status = fresh.wait_workers_ready()
    assert status["accounting"]["duplicate_executions"] == 0
