"""Anthropic's Messages API (/v1/messages) on the same port, for agents and
coding tools that speak only it.

llama-server has a /v1/messages route of its own, but it converts the
request to an OpenAI chat inside; doing that conversion here instead puts
the request through the same admission, replay and degraded-mode rules as
every other route, on either engine, and the response carries the same
route headers. Errors are Anthropic's {"type": "error", "error": {...}};
streams are Anthropic's named SSE events.

Supported: text, system (a string or text blocks), multi-turn, tools
(tool_use / tool_result, tool_choice auto, any, tool, none), stop_sequences,
structured output (output_config.format), temperature, top_p and top_k
(which newer SDKs send only through extra_body), streaming, usage,
/v1/messages/count_tokens, extended thinking (`thinking` enabled with
budget_tokens, adaptive, disabled: see reasoning.py) answered in thinking
blocks (with empty signatures), images as base64 image blocks (for a model
with a projector; a url source is refused unless it is a data: URI).
Not supported: documents, server tools, and stop_sequence in the answer (a matched stop ends as
"end_turn").
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse, Response

from ..dispatch.jobs import Job, JobFailed, JobKind
from . import reasoning
from .errors import anthropic_error_body
from .openai_request import InvalidRequest, assemble_content, image_data_uri, image_part
from .protocol import Protocol, StreamEncoder, Translated

_Invalid = InvalidRequest


_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


error_payload = anthropic_error_body


def _text_of(content: Any, where: str) -> str:
    """A tool_result's or system's content: a string or a list of text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for number, block in enumerate(content):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise _Invalid(400, f"{where}[{number}]: only text blocks are supported here", "invalid_type",
                               f"{where}[{number}]")
            texts.append(block["text"])
        return "\n".join(texts)
    if content is None:
        return ""
    raise _Invalid(400, f"{where} must be a string or a list of text blocks", "invalid_type", where)


def _convert_message(index: int, message: Any) -> list[dict[str, Any]]:
    where = f"messages.{index}"
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise _Invalid(400, f"{where}: each message needs role \"user\" or \"assistant\" and content", "invalid_type",
                       where)
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _Invalid(400, f"{where}.content must be a string or a list of content blocks", "invalid_type",
                       f"{where}.content")
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for number, block in enumerate(content):
        at = f"{where}.content.{number}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user":
            parts.append(image_part(_image_uri(block.get("source"), at), at))
        elif kind == "document":
            raise _Invalid(400, f"{at}: document blocks are not read here; send the text", "unsupported_parameter",
                           at)
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise _Invalid(400, f"{at}: a tool_use block needs a string id and name", "invalid_type", at)
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise _Invalid(400, f"{at}: a tool_result block needs a string tool_use_id", "invalid_type", at)
            text = _text_of(block.get("content"), f"{at}.content")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": ("Error: " + text) if block.get("is_error") else text})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning is not fed back, as Anthropic's own API drops it
        else:
            raise _Invalid(400, f"{at}: unsupported content block type {kind!r} in a {role} message",
                           "invalid_value", at)
    converted: list[dict[str, Any]] = list(results)
    if role == "assistant":
        assistant: dict[str, Any] = {"role": "assistant",
                                     "content": "".join(part["text"] for part in parts) or None}
        if calls:
            assistant["tool_calls"] = calls
        converted.append(assistant)
    elif parts or not results:
        converted.append({"role": "user", "content": assemble_content(parts)})
    return converted


def _image_uri(source: Any, at: str) -> str:
    """An image block's source ({type: base64, media_type, data} or {type: url, url}) as a checked data: URI."""
    if not isinstance(source, dict) or source.get("type") not in ("base64", "url"):
        raise _Invalid(400, f"{at}.source must be {{\"type\": \"base64\", \"media_type\": ..., \"data\": ...}}",
                       "invalid_image", f"{at}.source")
    if source["type"] == "url":
        url = source.get("url")
        return image_data_uri(url if isinstance(url, str) else "", f"{at}.source")
    data = source.get("data")
    if not isinstance(data, str):
        raise _Invalid(400, f"{at}.source.data must be the image as a base64 string", "invalid_image",
                       f"{at}.source.data")
    return image_data_uri(f"data:{source.get('media_type') or 'image/png'};base64,{data}", f"{at}.source.data")


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _Invalid(400, "'tools' must be a list", "invalid_type", "tools")
    converted = []
    for number, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise _Invalid(400, f"tools.{number} needs a string name", "invalid_type", f"tools.{number}")
        if tool.get("type") not in (None, "custom"):
            raise _Invalid(400, f"tools.{number}: server tools ({tool['type']}) are not available here; "
                           "define the tool with name, description and input_schema", "unsupported_parameter",
                           f"tools.{number}")
        schema = tool.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise _Invalid(400, f"tools.{number}.input_schema must be a JSON schema object", "invalid_type",
                           f"tools.{number}.input_schema")
        function = {"name": tool["name"], "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: Any, out: dict[str, Any]) -> None:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        out["tool_choice"] = "auto"
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "none":
        out["tool_choice"] = "none"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise _Invalid(400, "'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or "
                       "{\"type\": \"tool\", \"name\": ...}", "invalid_value", "tool_choice")
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False


def translate_messages(body: dict[str, Any], largest_context: int) -> dict[str, Any]:
    """An Anthropic Messages body as an OpenAI chat body."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _Invalid(400, "model: Field required (a string; GET /v1/models lists them)", "missing_field", "model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _Invalid(400, "messages: a non-empty list of {role, content} is required", "missing_field", "messages")
    # Claude Code sends system reminders as role "system" entries inside
    # messages, which the API's documentation doesn't show: they join the
    # system prompt, in order, since chat templates take one system message,
    # first.
    system_texts = [_text_of(body.get("system"), "system")] if body.get("system") is not None else []
    converted: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "system":
            system_texts.append(_text_of(message.get("content"), f"messages.{index}.content"))
            continue
        converted.extend(_convert_message(index, message))
    if not converted:
        raise _Invalid(400, "messages: at least one user or assistant message is required", "missing_field",
                       "messages")
    system = "\n\n".join(text for text in system_texts if text)
    if system:
        converted.insert(0, {"role": "system", "content": system})
    out: dict[str, Any] = {"model": model, "messages": converted}
    limit = body.get("max_tokens")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise _Invalid(400, "max_tokens: a whole number of at least 1 is required", "missing_field"
                       if limit is None else "invalid_value", "max_tokens")
    # Required by the protocol, so clients send their model's ceiling (Claude
    # Code: 32000): it means "up to", and the answer stops at the context.
    out["max_tokens"] = min(limit, largest_context)
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            out[name] = body[name]
    stops = body.get("stop_sequences")
    if stops is not None:
        out["stop"] = stops
    stream = body.get("stream", False)
    out["stream"] = stream
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], out)
    _output_format(body.get("output_config"), out)
    reasoning.from_anthropic_thinking(body.get("thinking"), out)
    return out


def _output_format(config: Any, out: dict[str, Any]) -> None:
    """output_config.format (structured outputs) as a response_format; its
    effort level has no meaning for these models."""
    if config is None:
        return
    fmt = config.get("format") if isinstance(config, dict) else None
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _Invalid(400, "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                       "invalid_value", "output_config.format")
    out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


class AnthropicMessages(Protocol):
    name = "anthropic"

    def __init__(self, largest_context: int) -> None:
        self._largest_context = largest_context

    def translate(self, body: dict[str, Any], kind: JobKind) -> Translated:
        return Translated(JobKind.CHAT, translate_messages(body, self._largest_context))

    def answer(self, response: dict[str, Any], job: Job) -> dict[str, Any]:
        choice = response["choices"][0]
        message = choice["message"]
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or ():
            content.append(_tool_use_block(call.get("id"), call["function"]["name"], call["function"]["arguments"]))
        return {"id": _message_id(job), "type": "message", "role": "assistant", "model": job.body.get("model"),
                "content": content, "stop_reason": _STOP_REASONS.get(choice.get("finish_reason"), "end_turn"),
                "stop_sequence": None, "usage": _usage(job)}

    def encoder(self, job: Job) -> StreamEncoder:
        return _AnthropicStream(job)

    def error(self, status: int, message: str, code: str, param: str | None = None,
              headers: dict[str, str] | None = None) -> Response:
        return JSONResponse(error_payload(status, message), status_code=status, headers=headers)

    def error_payload(self, failure: JobFailed) -> dict[str, Any]:
        return error_payload(failure.status, failure.message)


def _message_id(job: Job) -> str:
    return f"msg_{job.id}"


def _usage(job: Job) -> dict[str, int]:
    return {"input_tokens": job.prompt_tokens, "output_tokens": job.tokens_out}


def _tool_use_block(call_id: str | None, name: str, arguments: str) -> dict[str, Any]:
    try:
        parsed = json.loads(arguments) if arguments else {}
    except ValueError:
        parsed = None
    return {"type": "tool_use", "id": call_id or "toolu_0", "name": name,
            "input": parsed if isinstance(parsed, dict) else {"arguments": arguments}}


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


class _AnthropicStream(StreamEncoder):
    """OpenAI chunks as Anthropic's events: message_start, then one content
    block at a time (text, or a tool_use whose input streams as JSON
    pieces), then message_delta with the stop reason and message_stop."""

    def __init__(self, job: Job) -> None:
        self._job = job
        self._started = False
        self._block = -1            # index of the open block, -1 = none open
        self._block_kind: str | None = None
        self._tool_index: int | None = None  # the OpenAI tool call the open block is
        self._finish: str | None = None

    def _start(self) -> bytes:
        self._started = True
        return _event("message_start", {"type": "message_start", "message": {
            "id": _message_id(self._job), "type": "message", "role": "assistant", "model": self._job.body.get("model"),
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self._job.prompt_tokens, "output_tokens": 0}}})

    def _open(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self._block += 1
        self._block_kind = kind
        return out + _event("content_block_start", {"type": "content_block_start", "index": self._block,
                                                     "content_block": block})

    def _close(self) -> bytes:
        if self._block_kind is None:
            return b""
        self._block_kind = None
        return _event("content_block_stop", {"type": "content_block_stop", "index": self._block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self._block, "delta": delta})

    def event(self, chunk: dict[str, Any]) -> bytes:
        out = b"" if self._started else self._start()
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self._block_kind != "thinking":
                    out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out += self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
            if delta.get("content"):
                if self._block_kind != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                out += self._delta({"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or ():
                index = call.get("index", 0)
                function = call.get("function") or {}
                if self._block_kind != "tool_use" or self._tool_index != index:
                    self._tool_index = index
                    out += self._open("tool_use", {"type": "tool_use", "id": call.get("id") or f"toolu_{index}",
                                                   "name": function.get("name") or "", "input": {}})
                if function.get("arguments"):
                    out += self._delta({"type": "input_json_delta", "partial_json": function["arguments"]})
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return out

    def done(self, job: Job, last_chunk: dict[str, Any]) -> bytes:
        out = (b"" if self._started else self._start()) + self._close()
        out += _event("message_delta", {"type": "message_delta",
                                        "delta": {"stop_reason": _STOP_REASONS.get(self._finish, "end_turn"),
                                                  "stop_sequence": None},
                                        "usage": {"output_tokens": _usage(job)["output_tokens"]}})
        return out + _event("message_stop", {"type": "message_stop"})

    def failed(self, failure: JobFailed) -> bytes:
        return _event("error", error_payload(failure.status, failure.message))
