"""Issue 27.1: a 191-byte JSON schema once killed the whole service (llama.cpp's
recursive grammar parser, inside the router). Every door that takes a schema
or a grammar gets the bomb and its memory variant: each is a 400 in the
route's own envelope, /health answers throughout, and the workers keep their
pids. Then a fuzz run with a fresh random seed over the same doors."""

from __future__ import annotations

import copy
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.test_protocol_hostile import in_its_shape

pytestmark = pytest.mark.integration

HELLO = [{"role": "user", "content": "hi"}]

SCHEMA_BOMBS = {
    "nesting": {"type": "string", "maxLength": 200_000},           # the 191-byte crash
    "memory": {"type": "string", "minLength": 100_000_000},       # gigabytes of grammar text
    "items": {"type": "array", "items": {"type": "integer"}, "minItems": 100_000_000},
    "pattern": {"type": "string", "pattern": "a{0,200000}"},
}
GRAMMAR_BOMBS = {
    "nesting": "root ::= " + "(" * 100_000 + '"a"' + ")" * 100_000,
    "memory": 'root ::= "a"{100000000}',
}


def schema_doors(schema: dict) -> list[tuple[str, dict]]:
    """(route, body) for every way a client can send a JSON schema."""
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    anthropic_tool = {"name": "f", "input_schema": schema}
    return [
        ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 1,
                                  "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
        ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 1,
                                  "response_format": {"type": "json_object", "schema": schema}}),
        ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 1, "tools": [tool],
                                  "tool_choice": {"type": "function", "function": {"name": "f"}}}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1,
                             "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
        ("/api/chat", {"model": "default", "messages": HELLO, "stream": False, "format": schema,
                       "options": {"num_predict": 1}}),
        ("/api/generate", {"model": "default", "prompt": "hi", "stream": False, "format": schema,
                           "options": {"num_predict": 1}}),
        ("/v1/messages", {"model": "default", "max_tokens": 1, "messages": HELLO,
                          "output_config": {"format": {"type": "json_schema", "schema": schema}}}),
        ("/v1/messages", {"model": "default", "max_tokens": 1, "messages": HELLO, "tools": [anthropic_tool],
                          "tool_choice": {"type": "tool", "name": "f"}}),
        ("/v1/messages/count_tokens", {"model": "default", "messages": HELLO,
                                       "output_config": {"format": {"type": "json_schema", "schema": schema}}}),
        ("/v1/messages/count_tokens", {"model": "default", "messages": HELLO, "tools": [anthropic_tool],
                                       "tool_choice": {"type": "tool", "name": "f"}}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 1,
                           "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 1, "tools": [{"type": "function", "name": "f",
                                                                            "parameters": schema}],
                           "tool_choice": {"type": "function", "name": "f"}}),
        ("/completion", {"prompt": "hi", "n_predict": 1, "json_schema": schema}),
    ]


def grammar_doors(grammar: str) -> list[tuple[str, dict]]:
    return [
        ("/v1/chat/completions", {"messages": HELLO, "max_tokens": 1, "grammar": grammar}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "grammar": grammar}),
        ("/completion", {"prompt": "hi", "n_predict": 1, "grammar": grammar}),
    ]


class HealthWatch:
    """/health asked every 50 ms from another thread while a test runs."""

    def __init__(self, url: str) -> None:
        self.url, self.answers, self.failures = url, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=5.0) as client:
            while not self._stop.is_set():
                try:
                    response = client.get("/health")
                    self.answers += 1
                    if response.status_code != 200:
                        self.failures.append(response.status_code)
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                self._stop.wait(0.05)

    def _wait_for_answers(self, count: int) -> None:
        deadline = time.monotonic() + 10
        while self.answers < count and time.monotonic() < deadline:
            time.sleep(0.01)

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        self._wait_for_answers(1)
        return self

    def __exit__(self, *exc) -> None:
        # One more answer after the last bomb: the service is still there.
        self._wait_for_answers(self.answers + 1)
        self._stop.set()
        self._thread.join(10)


def pids(service) -> dict[str, int]:
    return {w["role"]: w["pid"] for w in service.status()["workers"] if w["pid"]}


def refused_while_the_service_lives_on(service, doors: list[tuple[str, dict]]) -> list[str]:
    """Send each door's body: every one must be a 400 in its route's shape,
    with /health answering throughout and no worker replaced. Returns the
    error texts."""
    before = pids(service)
    texts = []
    with HealthWatch(service.url) as watch:
        for route, body in doors:
            response = service.http.post(route, json=body, timeout=30)
            assert response.status_code == 400, (route, response.text)
            assert in_its_shape(route, response), (route, response.text)
            texts.append(response.text)
    assert watch.answers > 0 and watch.failures == []
    assert pids(service) == before
    assert service.process.poll() is None
    return texts


@pytest.mark.parametrize("bomb", sorted(SCHEMA_BOMBS))
def test_every_schema_door_refuses_the_bomb_and_the_service_lives_on(fresh, bomb):
    for text in refused_while_the_service_lives_on(fresh, schema_doors(SCHEMA_BOMBS[bomb])):
        assert "4096" in text and "lower minLength" in text, text


@pytest.mark.parametrize("bomb", sorted(GRAMMAR_BOMBS))
def test_every_grammar_door_refuses_the_bomb_and_the_service_lives_on(fresh, bomb):
    for text in refused_while_the_service_lives_on(fresh, grammar_doors(GRAMMAR_BOMBS[bomb])):
        assert "grammar_too_complex" in text or "too large for llama.cpp" in text, text


def test_a_real_schema_still_constrains_the_answer(fresh):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"]}
    response = fresh.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Is the sky blue?"}], "max_tokens": 30, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"].replace(" ", "").startswith('{"answer":"')


def test_a_grammar_llama_cpp_cant_parse_is_refused_in_its_words(fresh):
    response = fresh.http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 1,
                                                              "grammar": "root ::= missing"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_grammar" and error["param"] == "grammar" and "missing" in error["message"]


# ----- a fuzz run with a fresh random seed ----------------------------------

_KEYWORDS = st.sampled_from(["type", "properties", "items", "minLength", "maxLength", "minItems", "maxItems",
                             "pattern", "enum", "const", "required", "anyOf", "oneOf", "allOf", "$ref", "$defs",
                             "minimum", "maximum", "additionalProperties", "format", "prefixItems", "not"])
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(10**12), 10**12), st.integers(0, 300_000),
                     st.floats(allow_nan=False, allow_infinity=False),
                     st.sampled_from(["string", "integer", "number", "object", "array", "boolean", "null",
                                      "date", "uuid", "#/$defs/x", "#", "a{0,9999}", "^[a-z]+$", "((((", "\\",
                                      "(a|b){2,3}", "x"]),
                     st.text(max_size=12))
_SCHEMAS = st.recursive(
    _SCALARS,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.one_of(_KEYWORDS, st.text(max_size=6)), children, max_size=5)),
    max_leaves=25,
)
_GRAMMARS = st.one_of(
    st.text(alphabet='root:=|()[]{}"*+?ab-0123456789, \n\\^.', max_size=80).map(lambda text: "root ::= " + text),
    st.text(max_size=60),
)


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=_SCHEMAS, door=st.integers(0, 12), grammar=_GRAMMARS, use_grammar=st.booleans())
def test_fuzzed_schemas_and_grammars_are_never_a_server_error(service, schema, door, grammar, use_grammar):
    if use_grammar:
        route, body = grammar_doors(grammar)[door % 3]
    else:
        route, body = schema_doors(schema)[door]
    response = service.http.post(route, json=copy.deepcopy(body), timeout=60)
    assert response.status_code < 500, (route, body, response.text)
    assert in_its_shape(route, response), (route, body, response.text)
    assert service.http.get("/health", timeout=10).status_code == 200
