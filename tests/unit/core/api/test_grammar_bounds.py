"""The bounds on a JSON schema or a GBNF grammar, checked before anything
converts or parses it (api/grammar_bounds.py): each bomb a client can send is
named with the limit it passes, and real schemas pass."""

from __future__ import annotations

import json

import pytest

from tray_app.core.api import bounds
from tray_app.core.api.grammar_bounds import grammar_problem, quantifier_counts, schema_problem


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize("schema, named", [
    ({"type": "string", "maxLength": 200_000}, "$.maxLength is 200000"),
    ({"type": "string", "minLength": 100_000_000}, "$.minLength is 100000000"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 5_000}, "$.minItems is 5000"),
    ({"type": "array", "maxItems": 10**40}, "$.maxItems is over 10^9"),
    ({"type": "string", "pattern": "a{0,200000}"}, "$.pattern repeats 200000 times"),
    ({"type": "string", "pattern": "(ab){3000}c{2000}"}, "$.pattern repeats 5000 times"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 100} for i in range(50)}},
     "maxLength is 100"),
])
def test_repetition_bombs_are_named_with_the_limit(schema, named):
    problem = schema_problem(schema)
    assert problem is not None and named in problem
    assert str(bounds.MAX_SCHEMA_REPETITION) in problem and "lower minLength" in problem


def test_depth_nodes_numbers_and_pattern_length_are_bounded():
    assert "nests objects and arrays more than" in schema_problem(nested(bounds.MAX_SCHEMA_DEPTH))
    assert schema_problem(nested(bounds.MAX_SCHEMA_DEPTH // 2 - 2)) is None
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(bounds.MAX_SCHEMA_NODES)}}
    assert "more than" in schema_problem(wide) and "values" in schema_problem(wide)
    assert "within" in schema_problem({"type": "integer", "minimum": 10**400})
    assert "within" in schema_problem({"type": "number", "maximum": float("nan")})
    assert "within" in schema_problem({"type": "number", "maximum": float("-inf")})
    assert "characters" in schema_problem({"type": "string", "pattern": "a" * (bounds.MAX_PATTERN_CHARS + 1)})
    assert "whole number" in schema_problem({"type": "string", "maxLength": -1})
    assert "whole number" in schema_problem({"type": "string", "maxLength": 2.5})


def test_real_schemas_pass():
    # What agents and apps send: an OpenAI strict-mode shape, an enum, a $ref.
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 200},
            "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,20}$"}, "maxItems": 10},
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "kind": {"enum": ["a", "b", "c"]},
            "address": {"$ref": "#/$defs/address"},
        },
        "required": ["name", "rating"],
        "additionalProperties": False,
        "$defs": {"address": {"type": "object", "properties": {"city": {"type": "string"}}}},
    }
    assert schema_problem(schema) is None
    assert schema_problem(True) is None and schema_problem({}) is None


def test_quantifiers_are_summed_and_huge_counts_do_not_take_time():
    assert quantifier_counts("a{3}b{2,5}c{4,}") == (5, 3 + 5 + 4)
    assert quantifier_counts("no quantifiers, {not one} either") == (0, 0)
    assert quantifier_counts("a{" + "9" * 5000 + "}")[0] > bounds.MAX_SCHEMA_REPETITION


def test_one_count_over_its_own_bound_is_refused_even_when_the_sum_is_small():
    assert "$.maxLength is 1001" in schema_problem({"type": "string", "maxLength": bounds.MAX_SCHEMA_COUNT + 1})
    assert schema_problem({"type": "string", "maxLength": bounds.MAX_SCHEMA_COUNT}) is None
    assert "each may repeat at most" in grammar_problem('root ::= "a"{0,1001}')
    assert grammar_problem('root ::= "a"{0,1000}') is None


def test_grammar_nesting_repetition_and_size_are_bounded():
    deep = "root ::= " + "(" * (bounds.MAX_GRAMMAR_NESTING + 1) + '"a"' + ")" * (bounds.MAX_GRAMMAR_NESTING + 1)
    assert "nest" in grammar_problem(deep) and str(bounds.MAX_GRAMMAR_NESTING) in grammar_problem(deep)
    assert "quantifiers repeat 200000" in grammar_problem('root ::= "a"{0,200000}')
    assert "KiB" in grammar_problem("root ::= " + '"a" ' * (bounds.MAX_GRAMMAR_BYTES // 4 + 1))


def test_parentheses_and_braces_inside_literals_classes_and_comments_do_not_count():
    noise = '"((((({999999}" [(((\\]{99999}] # (((((( {999999}\n'
    grammar = "root ::= " + noise * (bounds.MAX_GRAMMAR_NESTING // 5 + 10) + '"a"'
    assert grammar_problem(grammar) is None


def test_the_json_grammar_and_a_converted_schema_pass():
    from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

    assert grammar_problem(JSON_GBNF) is None
    # The deepest a schema under the bounds converts to: maxLength at the limit.
    converted = json_schema_to_gbnf(json.dumps({"type": "string", "maxLength": bounds.MAX_SCHEMA_COUNT}))
    assert grammar_problem(converted) is None


def test_a_tool_schema_is_held_to_size_and_depth_not_to_counts():
    """Claude Code's tools carry maxLength 524288 and maximum 2^53 - 1, which
    llama.cpp's own converter (the worker's) takes in its stride."""
    claude_like = {"type": "object", "properties": {"script": {"type": "string", "maxLength": 524288},
                                                    "limit": {"type": "integer", "maximum": 9007199254740991}}}
    assert schema_problem(claude_like, counts=False) is None
    assert schema_problem(claude_like) is not None  # the service's converter would unroll it
    deep: dict = {"type": "object"}
    for _ in range(100):
        deep = {"type": "object", "properties": {"x": deep}}
    assert "deep" in schema_problem(deep, counts=False)
