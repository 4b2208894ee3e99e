"""Reading a request: the body (strictly), the routing headers, and every
field of a chat or completion checked against one table of bounds, so a bad
value is a 400 that names the field rather than an exception in a worker."""

from __future__ import annotations

import asyncio
import difflib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from starlette.requests import Request

from ..dispatch.jobs import JobKind
from ..engine import request_fields
from . import bounds, grammar_bounds, reasoning
from .openai_request import (Constraint, InvalidRequest, RemoteImage, Vision, constrain_output, flatten_content,
                             force_named_tool)

_Invalid = InvalidRequest


@dataclass(frozen=True)
class ModelNames:
    main: str
    served: frozenset[str]    # what /v1/models lists
    accepted: frozenset[str]  # what the `model` field may say (also the file name, "default")
    # [model] unknown_name = "default": any other name is the default model's.
    unknown_is_default: bool = False
    # The accepted names of models that read images, and the names to suggest.
    seeing: frozenset[str] = frozenset()
    seeing_models: tuple[str, ...] = ()

    def vision(self, model: Any, remote_images: bool = False) -> Vision:
        """What the model a request names can do with images."""
        named = model if isinstance(model, str) and model in self.accepted else None
        return Vision(named or self.main, sees=(named or "default") in self.seeing,
                      seeing_models=self.seeing_models, remote_images=remote_images)


MAX_MESSAGES = 1024


def unknown_model_message(model: Any, models: ModelNames) -> str:
    """The 404's text: what is served, and the names closest to the one sent."""
    names = sorted(models.served)
    close = difflib.get_close_matches(str(model).lower(), [n.lower() for n in models.accepted], n=3, cutoff=0.5)
    by_lower = {n.lower(): n for n in sorted(models.accepted, key=len, reverse=True)}
    suggestions = list(dict.fromkeys(by_lower[c].removesuffix(":latest") for c in close))
    hint = f"; did you mean {' or '.join(repr(s) for s in suggestions)}?" if suggestions else ""
    return f"the model {model!r} does not exist here{hint} Available: {', '.join(names)} (GET /v1/models)"


def check_model(model: Any, models: ModelNames) -> None:
    """A request's `model` field: absent (the default model), or a name served here."""
    if model is None:
        return
    if not isinstance(model, str):
        raise _Invalid(400, "'model' must be a string", "invalid_type", "model")
    if model not in models.accepted and not models.unknown_is_default:
        raise _Invalid(404, unknown_model_message(model, models), "model_not_found", "model")



def _logit_bias(value: Any) -> str | None:
    problem = (f"must be an object mapping token ids to a bias from {bounds.LOGIT_BIAS.low:g} "
               f"to {bounds.LOGIT_BIAS.high:g}")
    if not isinstance(value, dict) or len(value) > bounds.MAX_LOGIT_BIAS_ENTRIES:
        return problem + f" (at most {bounds.MAX_LOGIT_BIAS_ENTRIES} entries)"
    for token, bias in value.items():
        if not token.isdigit() or len(token) > 9 or bounds.LOGIT_BIAS.problem(bias):
            return problem
    return None


def _of_type(kind: type, name: str):
    return lambda value: None if isinstance(value, kind) else f"must be {name}"


# Tools: the worker turns each one's parameters into a grammar with
# llama.cpp's own converter, natively and recursively, so they are held to
# the size and depth bounds of any schema (grammar_bounds; not its count
# bounds, which only the service's own converter needs). A forced tool's
# parameters, which the service converts, meet all of them.
MAX_TOOLS = 128
MAX_TOOL_NAME_CHARS = 128
MAX_TOOL_DESCRIPTION_CHARS = 16 * 1024


def tools_problem(tools: Any) -> str | None:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        return f"must be a list of at most {MAX_TOOLS} tools"
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            return f"item {index} must be {{\"type\": \"function\", \"function\": {{\"name\", \"parameters\"}}}}"
        name, description = function.get("name"), function.get("description")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_TOOL_NAME_CHARS:
            return f"item {index}: function.name must be a string of 1 to {MAX_TOOL_NAME_CHARS} characters"
        if description is not None and (not isinstance(description, str)
                                        or len(description) > MAX_TOOL_DESCRIPTION_CHARS):
            return f"item {index}: function.description must be a string of at most {MAX_TOOL_DESCRIPTION_CHARS} characters"
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                return f"item {index}: function.parameters must be a JSON schema (an object)"
            problem = grammar_bounds.schema_problem(parameters, counts=False)
            if problem:
                return f"item {index}: function.parameters is too large to constrain the answer: {problem}"
    return None


# Fields passed through to the worker: checked here so a bad value is a 400
# that names the field, not an exception inside the model server.
SAMPLING_RULES = {
    **{field: rule.problem for field, rule in (bounds.SAMPLING | bounds.LLAMA_SAMPLING).items()},
    "dry_sequence_breakers": bounds.dry_breakers_problem,
    "samplers": bounds.samplers_problem,
    "ignore_eos": _of_type(bool, "true or false"),
    "parallel_tool_calls": _of_type(bool, "true or false"),
    "chat_template_kwargs": bounds.template_kwargs_problem,
    "stop": bounds.stop_problem,
    "logit_bias": _logit_bias,
    "user": _of_type(str, "a string"),
    "response_format": _of_type(dict, "an object"),
    "tools": lambda value: tools_problem(value),
    "stream_options": _of_type(dict, "an object"),
    # llama-server answers an unknown name with a 500, as if it had failed.
    "reasoning_format": lambda value: None if value in bounds.REASONING_FORMATS else (
        "must be one of " + ", ".join(repr(f) for f in bounds.REASONING_FORMATS)),
}


# More memory than any GPU has: a bigger number is a typo or an attack.
PRESSURE_RULE = bounds.Range(False, 0, 16 * 1024 * 1024).problem


@dataclass(frozen=True)
class Checked:
    """What validation learned that the job, not the body, carries."""

    top_logprobs: int | None = None  # alternatives per token; None = no logprobs
    # What the answer must match (response_format, grammar, a named
    # tool_choice); the service turns it into the body's grammar off the loop.
    constraint: Constraint | None = None
    images: int = 0  # image parts: only a worker with a projector can run the request
    # http(s) image URLs the service fetches before admission ([server] allow_remote_images).
    remote_images: tuple[RemoteImage, ...] = ()
    # The images' pixels once decoded, read from their headers (the remote
    # ones' added once fetched): the worker's decode memory.
    image_pixels: int = 0

    @property
    def forced_tool(self) -> str | None:
        """The function a named tool_choice forces."""
        return self.constraint.tool if self.constraint is not None else None


def screen_llama_server_fields(body: dict[str, Any]) -> None:
    """Rule 2 of engine/request_fields.py: a llama-server field the service
    doesn't pass on is dropped at its neutral value and refused at any other."""
    for field in [f for f in body if f in request_fields.LLAMA_SERVER_ONLY]:
        if not request_fields.is_neutral(field, body[field]):
            raise _Invalid(400, request_fields.refusal(field), "unsupported_parameter", field)
        del body[field]


def validate(body: dict[str, Any], kind: JobKind, models: ModelNames, largest_context: int, *,
             logprobs: bool = False, remote_images: bool = False) -> Checked:
    """Check a chat or completion body field by field, in place turning
    what clients send into what a worker runs (content parts, structured
    output). Raises InvalidRequest naming the field."""
    screen_llama_server_fields(body)
    check_model(body.get("model"), models)
    images, remote, pixels = 0, (), 0
    if kind is JobKind.CHAT:
        messages = body.get("messages")
        if messages is None:
            raise _Invalid(400, "'messages' is required: a list of {role, content} objects", "missing_field", "messages")
        if not isinstance(messages, list) or not messages:
            raise _Invalid(400, "'messages' must be a non-empty list", "invalid_type", "messages")
        if len(messages) > MAX_MESSAGES:
            raise _Invalid(400, f"'messages' has {len(messages)} items; the limit is {MAX_MESSAGES}",
                           "too_many_messages", "messages")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise _Invalid(400, f"messages[{index}] must be an object with a string 'role'",
                               "invalid_type", f"messages[{index}]")
            if message["role"] not in ("system", "user", "assistant", "tool", "function", "developer"):
                raise _Invalid(400, f"messages[{index}].role {message['role']!r} is not a known role",
                               "invalid_value", f"messages[{index}].role")
            content = message.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise _Invalid(400, f"messages[{index}].content must be a string or a list of parts",
                               "invalid_type", f"messages[{index}].content")
        found = flatten_content(messages, models.vision(body.get("model"), remote_images))
        images, remote, pixels = found.count, tuple(found.remote), found.pixels
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise _Invalid(400, "'prompt' is required", "missing_field", "prompt")
        if not isinstance(prompt, str):
            raise _Invalid(400, "'prompt' must be a string (token arrays and batches are not supported)",
                           "invalid_type", "prompt")
        if not prompt:
            raise _Invalid(400, "'prompt' is empty; send at least one character", "empty_prompt", "prompt")
    for field in bounds.TOKEN_LIMIT_FIELDS:
        value = body.get(field)
        problem = bounds.TOKENS.problem(value) if value is not None else None
        if problem:
            raise _Invalid(400, f"'{field}' {problem}", "invalid_value", field)
        if value is not None and value > largest_context:
            raise _Invalid(400, f"'{field}' is {value}; the limit is {largest_context}, the largest context "
                           "this server offers", "max_tokens_too_large", field)
    n = body.get("n", 1)
    problem = bounds.N.problem(n) if n is not None else None
    if problem:
        raise _Invalid(400, f"'n' {problem}: this server runs at most {bounds.MAX_N} choices per request, "
                       "as parallel slots (capabilities.max_choices in GET /v1/models)", "invalid_value", "n")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _Invalid(400, "'stream' must be true or false", "invalid_type", "stream")
    top_logprobs = _check_logprobs(body, kind, logprobs)
    for field, rule in SAMPLING_RULES.items():
        if body.get(field) is not None:
            problem = rule(body[field])
            if problem:
                raise _Invalid(400, f"'{field}' {problem}", "invalid_value", field)
    reasoning.check_fields(body)
    constraint = constrain_output(body)
    if kind is JobKind.CHAT:
        constraint = force_named_tool(body, constraint)
        reasoning.apply_to_chat(body, min(requested_limit(body) or largest_context, largest_context))
    return Checked(top_logprobs=top_logprobs, constraint=constraint, images=images, remote_images=remote,
                   image_pixels=pixels)


def _check_logprobs(body: dict[str, Any], kind: JobKind, supported: bool) -> int | None:
    """OpenAI's shapes: chat takes logprobs true/false and top_logprobs 0-20;
    the legacy completions API takes logprobs as a count, 0-5. Returns the
    alternatives per token asked for, None without logprobs."""
    if kind is JobKind.CHAT:
        wanted, top = body.get("logprobs"), body.get("top_logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise _Invalid(400, "'logprobs' must be true or false", "invalid_type", "logprobs")
        if top is not None and bounds.TOP_LOGPROBS.problem(top):
            raise _Invalid(400, f"'top_logprobs' {bounds.TOP_LOGPROBS.problem(top)}", "invalid_value", "top_logprobs")
        if top and not wanted:
            raise _Invalid(400, "'top_logprobs' needs 'logprobs': true", "invalid_value", "top_logprobs")
        asked = bool(wanted)
        alternatives = top or 0
    else:
        count = body.get("logprobs")
        if count is not None and bounds.COMPLETION_LOGPROBS.problem(count):
            raise _Invalid(400, f"'logprobs' {bounds.COMPLETION_LOGPROBS.problem(count)}", "invalid_value", "logprobs")
        asked = count is not None
        alternatives = count or 0
    if not asked:
        return None
    if body.get("tools"):
        # The service always streams from the worker, and llama-server streams
        # no logprobs with tools.
        raise _Invalid(400, "logprobs can't be combined with tools here", "unsupported_parameter", "logprobs")
    if not supported:
        raise _Invalid(400, "logprobs are not available with the llama-cpp-python engine: its workers would have "
                       "to keep the logits of every context position (about 1.5 GiB at 8k context for a 135M "
                       "model); the llama-server engine offers them (capabilities.logprobs in GET /v1/models)",
                       "unsupported_parameter", "logprobs")
    return alternatives


async def _read_limited(request: Request, limit: int, timeout: float) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _Invalid(413, f"the request body is {int(declared)} bytes; the limit is {limit} bytes "
                       "([server] max_body_bytes)", "body_too_large")
    chunks, size = [], 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _Invalid(413, f"the request body is over the {limit}-byte limit ([server] max_body_bytes)",
                               "body_too_large")
            chunks.append(chunk)

    try:
        # asyncio.timeout, not wait_for: the read stays in the request's task (no task per request).
        async with asyncio.timeout(timeout):
            await read()
    except TimeoutError:
        raise _Invalid(408, f"the request body did not arrive within {timeout:g} s "
                       "([server] body_timeout_s)", "request_timeout") from None
    return b"".join(chunks)


async def read_json_object(request: Request) -> dict[str, Any]:
    server = request.app.state.service.config.server
    raw = await _read_limited(request, server.max_body_bytes, server.body_timeout_s)
    if not raw:
        raise _Invalid(400, "the request body is empty; send a JSON object", "invalid_json")
    body = parse_json_body(raw)
    if not isinstance(body, dict):
        raise _Invalid(400, "the request body must be a JSON object", "invalid_json")
    return body


# Deeper than any real request (tool schemas nest a dozen levels at most);
# deeper structures only exist to exhaust a recursive walker somewhere.
MAX_JSON_DEPTH = 64
# What a body may hold, counted on its bytes before anything is parsed: the
# parser runs on the event loop, holding every other client while it works,
# and objects cost it ten times what their bytes suggest (4 MB of "{}," is
# 1.3 million dicts). Each bound is far past a real request (1024 messages,
# tool schemas of 20,000 values, 500,000 token ids) and keeps the parse of
# any body to a few tens of milliseconds.
MAX_JSON_CONTAINERS = 100_000   # objects and arrays
MAX_JSON_STRINGS = 200_000      # strings, object keys included
MAX_JSON_SCALARS = 500_000      # items of objects and arrays (commas, roughly)
_BRACKETS_ONLY = bytes(c for c in range(256) if c not in b"{}[]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; send a finite number")


def parse_json_body(raw: bytes) -> Any:
    """Strict JSON: no NaN/Infinity (they can't be sent back in a response,
    and no sampling field means anything with them), bounded size of
    structure and nesting, and every failure a 400 in the envelope rather
    than a 500 from a parser."""
    problem = json_size_problem(raw)
    if problem:
        raise _Invalid(400, f"the request body {problem}", "invalid_json")
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise _Invalid(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", "invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise _Invalid(400, f"the request body is not valid JSON: {exc}", "invalid_json") from None
    if _SURROGATE_ESCAPE.search(raw):
        # JSON's "\ud800" escape parses to a lone surrogate, which would fail
        # later, when the body is encoded for the worker (a 500 from inside,
        # not a 400 from here). A pair (an emoji) parses to one character.
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise _Invalid(400, "the request body holds an unpaired UTF-16 surrogate escape (such as \\ud800), "
                           "which is not text", "invalid_json") from None
    return body


def json_size_problem(raw: bytes) -> str | None:
    """How a body's structure is over the bounds, read off its bytes in C
    speed without parsing it (None when within them). Strings are cut out
    first, so text full of commas and braces counts as one value."""
    # With escaped backslashes and quotes gone, every quote left opens or
    # closes a string (outside strings JSON has no backslash: such a body
    # fails to parse anyway).
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    strings = unescaped.count(b'"') // 2
    if strings > MAX_JSON_STRINGS:
        return f"holds more than {MAX_JSON_STRINGS} strings"
    outside = b"".join(unescaped.split(b'"')[0::2])
    brackets = outside.translate(None, _BRACKETS_ONLY)
    if (len(brackets) + 1) // 2 > MAX_JSON_CONTAINERS:
        return f"holds more than {MAX_JSON_CONTAINERS} objects and arrays"
    if outside.count(b",") > MAX_JSON_SCALARS:
        return f"holds more than {MAX_JSON_SCALARS} values"
    # Each pass takes out the innermost pairs: a body still holding
    # brackets after MAX_JSON_DEPTH passes nests deeper than that.
    for _ in range(MAX_JSON_DEPTH):
        if not brackets:
            return None
        brackets = brackets.replace(b"[]", b"").replace(b"{}", b"")
    return f"nests deeper than {MAX_JSON_DEPTH} levels" if brackets else None


def requested_limit(body: dict[str, Any]) -> int | None:
    """The client's generation limit under either name; the smaller if both."""
    limits = [body[f] for f in ("max_tokens", "max_completion_tokens") if body.get(f) is not None]
    return min(limits) if limits else None


@dataclass(frozen=True)
class Routing:
    """What a request asks of routing, from its headers."""

    force_cpu: bool = False            # X-Force-Path: cpu
    deadline_s: float | None = None    # X-Request-Timeout
    prefer_gpu: bool = False           # X-Prefer-Path: gpu (wait for a loading GPU)
    no_fallback: bool | None = None    # X-Fallback: never / cpu; None = the config's
    resume: bool | None = None         # X-Resume: never / auto; None = the config's


def _choice(request: Request, header: str, allowed: tuple[str, ...]) -> str:
    value = request.headers.get(header.lower(), "").strip().lower()
    if value not in ("",) + allowed:
        raise _Invalid(400, f"{header} must be one of {', '.join(repr(a) for a in allowed)}", "invalid_header",
                       header)
    return value


def routing_headers(request: Request) -> Routing:
    force = _choice(request, "X-Force-Path", ("cpu", "auto"))
    prefer = _choice(request, "X-Prefer-Path", ("gpu", "auto"))
    fallback = _choice(request, "X-Fallback", ("never", "cpu", "auto"))
    resume = _choice(request, "X-Resume", ("never", "auto"))
    raw = request.headers.get("x-request-timeout")
    deadline = None
    if raw is not None:
        try:
            deadline = float(raw)
        except ValueError:
            raise _Invalid(400, "X-Request-Timeout must be a number of seconds", "invalid_header",
                           "X-Request-Timeout") from None
        if not math.isfinite(deadline) or deadline <= 0:
            raise _Invalid(400, "X-Request-Timeout must be a positive number of seconds", "invalid_header",
                           "X-Request-Timeout")
    return Routing(force_cpu=force == "cpu", deadline_s=deadline, prefer_gpu=prefer == "gpu",
                   no_fallback={"never": True, "cpu": False}.get(fallback),
                   resume={"never": False, "auto": True}.get(resume))


_CLIENT_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ._/:+()-")
MAX_CLIENT_NAME = 64


def client_name(x_client_name: str | None, user_agent: str | None) -> str | None:
    """Who sent a request, for the tray's rows: the X-Client-Name header, else
    the User-Agent's first product ("OpenAI/Python", "curl/8.5.0"). Only
    plain characters, so a name can't carry markup into a label or a log."""
    raw = (x_client_name or "").strip() or (user_agent or "").strip().split(" ")[0]
    cleaned = "".join(c for c in raw if c in _CLIENT_NAME_CHARS).strip()[:MAX_CLIENT_NAME]
    return cleaned or None


def clean_request_id(raw: str | None) -> str | None:
    if not raw:
        return None
    cleaned = raw.strip()
    # ASCII only (str.isalnum() takes any script's letters): the id is
    # forwarded to peers as a header, which must encode as ASCII.
    if not cleaned or len(cleaned) > 128 or not all(c.isascii() and (c.isalnum() or c in "-_.:") for c in cleaned):
        return None
    return cleaned
