"""How large a JSON schema or a GBNF grammar may be, checked before anything
converts or parses it.

llama.cpp's grammar parser recurses once per nested group and has no depth
limit (upstream #26600), and llama-cpp-python's schema converter writes
`maxLength: N` as N nested groups and `a{N}` as N copies: a 200-byte request
once overflowed the service's stack, and `minLength: 100000000` builds
gigabytes of text. These pure functions walk what the client sent, without
recursion of their own, and say which bound (api/bounds.py) it passes and how
to stay under it. They are the first line; the grammar check's child process
(core/grammar/check.py) is the second, for whatever these don't foresee.
"""

from __future__ import annotations

import re
from typing import Any

from . import bounds

_REPEATING_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems")
_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_HOW_TO_STAY_UNDER = "lower minLength, maxLength, minItems, maxItems and {m,n} quantifiers in patterns"


def schema_problem(schema: Any, counts: bool = True) -> str | None:
    """Why this JSON schema is too large to turn into a grammar, or None.
    `counts=False`: its size and depth only, for a schema llama.cpp's own
    converter (C++, in a worker) turns into a grammar: that one writes a
    count as {m,n} and a number range by its digits, so neither grows with
    the value (a tool's maxLength of 524288, as Claude Code's have, converts
    in a tenth of a second), where llama-cpp-python's converter, the
    service's, unrolls them."""
    repetition = 0
    nodes = 0
    stack: list[tuple[Any, int, str]] = [(schema, 1, "$")]
    while stack:
        value, depth, where = stack.pop()
        nodes += 1
        if nodes > bounds.MAX_SCHEMA_NODES:
            return (f"it has more than {bounds.MAX_SCHEMA_NODES} values; the limit is {bounds.MAX_SCHEMA_NODES}. "
                    "Split it, or describe repeated parts once with $defs and $ref")
        if isinstance(value, (dict, list)) and depth > bounds.MAX_SCHEMA_DEPTH:
            return (f"it nests objects and arrays more than {bounds.MAX_SCHEMA_DEPTH} deep (at {where}); "
                    f"the limit is {bounds.MAX_SCHEMA_DEPTH}")
        if isinstance(value, list):
            stack.extend((item, depth + 1, f"{where}[{index}]") for index, item in enumerate(value))
            continue
        if not isinstance(value, dict):
            continue
        if not counts:
            pattern = value.get("pattern")
            if isinstance(pattern, str) and len(pattern) > bounds.MAX_PATTERN_CHARS:
                return (f"{where}.pattern has {len(pattern)} characters; the limit is "
                        f"{bounds.MAX_PATTERN_CHARS}")
            stack.extend((item, depth + 1, f"{where}.{key}") for key, item in value.items())
            continue
        for keyword in _REPEATING_KEYWORDS:
            count = value.get(keyword)
            if isinstance(count, bool) or count is None:
                continue
            if not isinstance(count, int) or count < 0:
                return f"{where}.{keyword} must be a whole number >= 0"
            repetition += count
            if count > bounds.MAX_SCHEMA_COUNT or repetition > bounds.MAX_SCHEMA_REPETITION:
                return _too_repetitive(f"{where}.{keyword} is {_shown(count)}", repetition)
        for keyword in _NUMBER_KEYWORDS:
            number = value.get(keyword)
            if isinstance(number, (int, float)) and not isinstance(number, bool) and not (
                    abs(number) <= bounds.MAX_SCHEMA_NUMBER):  # NaN fails this too
                return (f"{where}.{keyword} is {number!r}; numbers in a schema must be within "
                        f"±{bounds.MAX_SCHEMA_NUMBER:.0e}")
        pattern = value.get("pattern")
        if isinstance(pattern, str):
            if len(pattern) > bounds.MAX_PATTERN_CHARS:
                return (f"{where}.pattern has {len(pattern)} characters; the limit is "
                        f"{bounds.MAX_PATTERN_CHARS}")
            largest, repeats = quantifier_counts(pattern)
            repetition += repeats
            if largest > bounds.MAX_SCHEMA_COUNT or repetition > bounds.MAX_SCHEMA_REPETITION:
                return _too_repetitive(f"{where}.pattern repeats {_shown(repeats)} times", repetition)
        stack.extend((item, depth + 1, f"{where}.{key}") for key, item in value.items())
    return None


def _too_repetitive(culprit: str, total: int) -> str:
    return (f"{culprit}; each count may be at most {bounds.MAX_SCHEMA_COUNT} and all of them "
            f"{bounds.MAX_SCHEMA_REPETITION} together (this schema: {_shown(total)}): {_HOW_TO_STAY_UNDER}, "
            "or leave them out and bound the answer with max_tokens")


def _shown(count: int) -> str:
    return str(count) if count < 10**9 else "over 10^9"


_QUANTIFIER = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


def quantifier_counts(text: str) -> tuple[int, int]:
    """The largest count, and the sum of the counts, of every {m}, {m,} and
    {m,n} in a regular expression or a grammar: what the converter and
    llama.cpp unroll. Counted without looking at escapes, so it errs on the
    safe side."""
    largest = total = 0
    for match in _QUANTIFIER.finditer(text):
        count = max(_count(match.group(1)), _count(match.group(2)))
        largest, total = max(largest, count), total + count
    return largest, total


def _count(digits: str | None) -> int:
    if not digits:
        return 0
    return int(digits) if len(digits) <= 9 else 10**9


def grammar_problem(grammar: str) -> str | None:
    """Why this GBNF grammar is too large for llama.cpp to parse safely, or None.
    Walks it once, skipping string literals, character classes and comments,
    to find how deep its groups nest and how much its {m,n} quantifiers unroll."""
    size = len(grammar.encode("utf-8", "surrogatepass"))
    if size > bounds.MAX_GRAMMAR_BYTES:
        return f"it is {size} bytes; the limit is {bounds.MAX_GRAMMAR_BYTES // 1024} KiB"
    depth = deepest = repetition = largest = 0
    index, length = 0, len(grammar)
    while index < length:
        char = grammar[index]
        if char in "\"[":
            index = _end_of_literal(grammar, index, '"' if char == '"' else "]")
            continue
        if char == "#":
            newline = grammar.find("\n", index)
            index = length if newline < 0 else newline
            continue
        if char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth = max(0, depth - 1)
        elif char == "{":
            match = _QUANTIFIER.match(grammar, index)
            if match:
                count = max(_count(match.group(1)), _count(match.group(2)))
                largest, repetition = max(largest, count), repetition + count
                index = match.end()
                continue
        index += 1
    if deepest > bounds.MAX_GRAMMAR_NESTING:
        return (f"its groups nest {deepest} deep; the limit is {bounds.MAX_GRAMMAR_NESTING}: "
                "use a rule that refers to itself, or a {m,n} quantifier, instead of nested groups")
    if largest > bounds.MAX_SCHEMA_COUNT or repetition > bounds.MAX_GRAMMAR_REPETITION:
        return (f"its {{m,n}} quantifiers repeat {_shown(repetition)} times in all; each may repeat at most "
                f"{bounds.MAX_SCHEMA_COUNT} times and all of them {bounds.MAX_GRAMMAR_REPETITION}: use * or + "
                "where the exact count doesn't matter")
    return None


def _end_of_literal(text: str, start: int, closing: str) -> int:
    """The index just past a "..." literal or a [...] class that opens at start."""
    index = start + 1
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == closing:
            return index + 1
        if char == "\n":  # llama.cpp ends a literal at the line, with an error it reports itself
            return index
        index += 1
    return index
