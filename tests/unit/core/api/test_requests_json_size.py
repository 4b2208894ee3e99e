"""A body's structure bounded from its bytes, before the parser sees it
(requests.json_size_problem): strings are cut out first, so text full of
commas, quotes and brackets is one value."""

from __future__ import annotations

import json

import pytest

from tray_app.core.api.openai_request import InvalidRequest
from tray_app.core.api.requests import (
    MAX_JSON_CONTAINERS, MAX_JSON_DEPTH, MAX_JSON_SCALARS, MAX_JSON_STRINGS, json_size_problem, parse_json_body,
)


def array_of(item: bytes, count: int) -> bytes:
    return b'{"x":[' + b",".join([item] * count) + b"]}"


@pytest.mark.parametrize("item, bound, words", [
    (b"{}", MAX_JSON_CONTAINERS, "objects and arrays"),
    (b'"a"', MAX_JSON_STRINGS, "strings"),
    (b"1", MAX_JSON_SCALARS, "values"),
])
def test_each_bound_holds_at_its_edge(item, bound, words):
    # The wrapping object and array count too: a little under the bound passes.
    assert json_size_problem(array_of(item, bound - 2)) is None
    assert words in json_size_problem(array_of(item, bound + 2))


def test_text_full_of_json_punctuation_is_one_string():
    text = 'a, "quoted" {b} [c] \\ d, ' * 100_000
    raw = json.dumps({"messages": [{"role": "user", "content": text}]}).encode()
    assert json_size_problem(raw) is None
    assert parse_json_body(raw)["messages"][0]["content"] == text


def test_depth_is_counted_on_brackets_outside_strings():
    assert json_size_problem(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH) is None
    assert "deeper" in json_size_problem(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1))
    assert json_size_problem(b'{"a": "' + b"[" * 1000 + b'"}') is None


def test_an_escaped_quote_does_not_end_a_string():
    raw = b'{"a": "x\\", [[[[, \\\\", "b": [1]}'
    assert json_size_problem(raw) is None and parse_json_body(raw) == {"a": 'x", [[[[, \\', "b": [1]}


def test_a_surrogate_pair_is_text_and_a_lone_one_is_refused():
    assert parse_json_body(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001F600"}
    with pytest.raises(InvalidRequest, match="surrogate"):
        parse_json_body(b'{"a": "\\ud83d"}')
