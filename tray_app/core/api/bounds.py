"""The bounds of the request fields the service checks, written once.

The request validator (app.py) and the OpenAPI schema (openapi.py) are both
built from these, so what the server accepts and what it documents can't
drift apart (the fuzz test holds the server to the schema).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple


class Range(NamedTuple):
    """A number from low to high, both included; None is no bound."""

    whole: bool
    low: float | None = None
    high: float | None = None

    def problem(self, value: Any) -> str | None:
        """What is wrong with value, for the message after the field's name; None if it is in range."""
        ok_type = isinstance(value, int) if self.whole else isinstance(value, (int, float))
        if (isinstance(value, bool) or not ok_type
                # Compared as they are: a 400-digit integer is a valid JSON number
                # that overflows float(), so it must not be converted to be checked.
                or (isinstance(value, float) and not math.isfinite(value))
                or (self.low is not None and value < self.low)
                or (self.high is not None and value > self.high)):
            return f"must be {self.describe()}"
        return None

    def describe(self) -> str:
        kind = "a whole number" if self.whole else "a number"
        if self.low is not None and self.high is not None:
            return f"{kind} from {self.low:g} to {self.high:g}"
        return f"{kind} >= {self.low:g}" if self.low is not None else kind

    def schema(self) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "integer" if self.whole else "number"}
        if self.low is not None:
            schema["minimum"] = self.low
        if self.high is not None:
            schema["maximum"] = self.high
        return schema


# Numeric sampling fields passed through to the worker: checked first so a bad
# value is a 400 that names the field, not an exception inside the model server.
SAMPLING = {
    "temperature": Range(False, 0, 2),
    "top_p": Range(False, 0, 1),
    "min_p": Range(False, 0, 1),
    "typical_p": Range(False, 0, 1),
    "top_k": Range(True, 0),
    "seed": Range(True, 0, 2**32 - 1),
    "frequency_penalty": Range(False, -2, 2),
    "presence_penalty": Range(False, -2, 2),
    "repeat_penalty": Range(False, 0),
}

# llama.cpp's own samplers (SillyTavern and other llama.cpp front ends send
# them). Each bound is llama.cpp's own where it has one, and otherwise far
# past any useful setting but short of what hurts a worker: the penalty
# windows are ring buffers allocated at their full size (2^31 tokens would be
# 8 GiB), and a value llama.cpp only clamps is a typo worth a 400.
MAX_PENALTY_WINDOW = 1 << 20
LLAMA_SAMPLING = {
    "repeat_last_n": Range(True, 0, MAX_PENALTY_WINDOW),
    "dry_penalty_last_n": Range(True, 0, MAX_PENALTY_WINDOW),
    "dry_allowed_length": Range(True, 0, MAX_PENALTY_WINDOW),
    "dry_multiplier": Range(False, 0, 100),
    "dry_base": Range(False, 0, 10),
    "mirostat": Range(True, 0, 2),
    "mirostat_tau": Range(False, 0, 100),
    "mirostat_eta": Range(False, 0, 1),
    "dynatemp_range": Range(False, 0, 2),
    "dynatemp_exponent": Range(False, 0, 10),
    "xtc_probability": Range(False, 0, 1),
    "xtc_threshold": Range(False, 0, 1),
    "top_n_sigma": Range(False, -1, 100),
    "min_keep": Range(True, 0, 1024),
}

# DRY's sequence breakers: llama.cpp tokenizes each one and matches it
# after every token.
MAX_DRY_BREAKERS = 32
MAX_DRY_BREAKER_CHARS = 64

# The sampler chain's order, by llama.cpp's names (common/sampling.cpp) or
# its one-letter codes. Not "infill" (a fill-in-the-middle sampler for FIM
# prompts, which this server doesn't serve) nor "adaptive_p" (its settings
# are not passed on).
SAMPLER_NAMES = ("dry", "top_k", "top_p", "top_n_sigma", "typ_p", "min_p", "temperature", "xtc", "penalties")
_SAMPLER_ALIASES = frozenset(
    {name for canonical in SAMPLER_NAMES
     for name in (canonical, canonical.replace("_", "-"), canonical.replace("_", ""))}
    | {"nucleus", "temp", "typ"})
SAMPLER_CODES = "dkpsymtxe"
MAX_SAMPLERS = 16


def dry_breakers_problem(value: Any) -> str | None:
    if (not isinstance(value, list) or not 0 < len(value) <= MAX_DRY_BREAKERS
            or not all(isinstance(i, str) and 0 < len(i) <= MAX_DRY_BREAKER_CHARS for i in value)):
        return (f"must be a list of 1 to {MAX_DRY_BREAKERS} non-empty strings of at most "
                f"{MAX_DRY_BREAKER_CHARS} characters")
    return None


def samplers_problem(value: Any) -> str | None:
    if isinstance(value, str):
        if 0 < len(value) <= MAX_SAMPLERS and all(c in SAMPLER_CODES for c in value):
            return None
    elif (isinstance(value, list) and 0 < len(value) <= MAX_SAMPLERS
          and all(isinstance(i, str) and i.lower() in _SAMPLER_ALIASES for i in value)):
        return None
    return (f"must be a list of 1 to {MAX_SAMPLERS} sampler names ({', '.join(SAMPLER_NAMES)}), "
            f"or a string of their letters ({SAMPLER_CODES})")


# chat_template_kwargs: extra variables for the model's chat template
# (enable_thinking and the like): plain values only, a few of them.
MAX_TEMPLATE_KWARGS = 16
MAX_TEMPLATE_KWARG_CHARS = 1000


def template_kwargs_problem(value: Any) -> str | None:
    problem = (f"must be an object of at most {MAX_TEMPLATE_KWARGS} names, each a string, a number, "
               f"true or false (strings up to {MAX_TEMPLATE_KWARG_CHARS} characters)")
    if not isinstance(value, dict) or len(value) > MAX_TEMPLATE_KWARGS:
        return problem
    for name, item in value.items():
        if len(name) > 64 or not (item is None or isinstance(item, (bool, int, float))
                                  or (isinstance(item, str) and len(item) <= MAX_TEMPLATE_KWARG_CHARS)):
            return problem
        if isinstance(item, float) and not math.isfinite(item):
            return problem
    return None


# max_tokens and max_completion_tokens; the top is the largest context the
# server offers, known only at run time (Range._replace(high=...)).
TOKEN_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens")
TOKENS = Range(True, 1)

# Choices per request (n). llama-server runs a request's choices as parallel
# slots and refuses n above its --parallel; 4 is its default slot count, and
# a bound keeps one request from taking a whole lane. A path with fewer slots
# than n refuses the request with a capacity error (Backend.run).
MAX_N = 4
N = Range(True, 1, MAX_N)

# logprobs: OpenAI's bounds. Chat: top_logprobs alternatives per token (with
# logprobs true); legacy completions: logprobs is itself the count.
TOP_LOGPROBS = Range(True, 0, 20)
COMPLETION_LOGPROBS = Range(True, 0, 5)

# llama-server's names for where a model's thinking goes (common/chat.cpp).
REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")
# OpenAI's reasoning_effort levels (see reasoning.py for what each runs as),
# and llama-server's thinking budget in tokens (-1: none).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
REASONING_BUDGET = Range(True, -1, 2**31 - 1)

# Stop sequences: a string, or a list of up to MAX_STOP strings. Longer than
# any real stop sequence; the worker searches the answer for every stop string
# after every token, so a huge one only costs CPU. More than OpenAI's 4:
# llama-server takes any number, and front ends built on it (SillyTavern)
# send one per character name and chat-template marker, often over 10.
MAX_STOP = 32
MAX_STOP_CHARS = 1000

# logit_bias: token id -> bias.
LOGIT_BIAS = Range(False, -100, 100)
MAX_LOGIT_BIAS_ENTRIES = 1024


def stop_problem(value: Any) -> str | None:
    items = [value] if isinstance(value, str) else value
    if (not isinstance(items, list) or len(items) > MAX_STOP
            or not all(isinstance(i, str) and 0 < len(i) <= MAX_STOP_CHARS for i in items)):
        return (f"must be a non-empty string or a list of up to {MAX_STOP} non-empty strings "
                f"of at most {MAX_STOP_CHARS} characters")
    return None


def request_properties(max_tokens: int) -> dict[str, Any]:
    """The OpenAPI schema of the checked fields that both completion routes take."""
    return {
        **{field: TOKENS._replace(high=max_tokens).schema() for field in TOKEN_LIMIT_FIELDS},
        **{field: bounds.schema() for field, bounds in (SAMPLING | LLAMA_SAMPLING).items()},
        "n": N.schema(),
        "stop": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                 "maxItems": MAX_STOP},
        "reasoning_format": {"type": "string", "enum": list(REASONING_FORMATS)},
        "reasoning_effort": {"type": "string", "enum": list(REASONING_EFFORTS)},
        "reasoning_budget_tokens": REASONING_BUDGET.schema(),
    }


# Structured output: a JSON schema (response_format, Ollama's format, a forced
# tool's parameters) becomes a GBNF grammar, and llama.cpp parses grammars
# recursively with no depth limit (upstream #26600): llama-cpp-python's
# converter writes maxLength N as N nested groups, so one 200-byte schema
# overflowed the stack. These bounds are checked before anything converts or
# parses, and again on the grammar the conversion writes. Each is far above
# what a real schema asks (OpenAI's strict mode allows 10 levels of nesting
# and 5000 properties) and below what the parser survives: measured with the
# vendored llama.cpp, it takes about 400 bytes of stack per nested group, so
# about 2,500 levels on the checker's 1 MiB stack (GRAMMAR_CHECK_STACK_BYTES)
# and 20,000 on a worker's 8 MiB.
MAX_SCHEMA_DEPTH = 64           # nested objects and arrays in the schema's JSON
MAX_SCHEMA_NODES = 20_000       # values of any kind in the schema's JSON
MAX_SCHEMA_COUNT = 1_000        # any one minLength, maxLength, minItems, maxItems or pattern {m,n}
MAX_SCHEMA_REPETITION = 4_096   # all of them summed
# |minimum|, |maximum| and the like: digit rules grow with them. 2^53:
# TypeScript tools (Claude Code's) put Number.MAX_SAFE_INTEGER, 2^53 - 1, in
# "maximum", and a tool schema must pass as its client wrote it.
MAX_SCHEMA_NUMBER = 2**53
MAX_PATTERN_CHARS = 1_000
MAX_GRAMMAR_BYTES = 512 * 1024
MAX_GRAMMAR_NESTING = 1_200     # a schema within the bounds converts to less (about MAX_SCHEMA_COUNT)
MAX_GRAMMAR_REPETITION = MAX_SCHEMA_REPETITION  # a raw grammar's {m,n} quantifiers, summed
# The grammar check runs in a child process (core/grammar/check.py) with these limits.
GRAMMAR_CHECK_TIMEOUT_S = 10.0
GRAMMAR_CHECK_MEMORY_MIB = 1024
GRAMMAR_CHECK_STACK_BYTES = 1024 * 1024
