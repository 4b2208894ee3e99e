"""OpenAI's Responses API (/v1/responses) on the same port, for Codex CLI,
the OpenAI Agents SDK and newer OpenAI SDK examples.

A Responses body is translated into an OpenAI chat body through the
`Protocol` seam, like Ollama's and Anthropic's, so admission, replay before
the first byte, idempotency, route headers and the degraded banner apply
unchanged. What is the Responses API's own: the answer's shape (a Response
object with output items), the stream's named events with sequence numbers,
and a store of past responses, so a follow-up can name the last one
(previous_response_id) instead of resending the conversation.

Supported: `input` as a string or a list of items (messages with text
parts, function_call and function_call_output items; earlier reasoning
items are skipped), `instructions`, `max_output_tokens`, temperature and
top_p, function tools and `tool_choice` (auto, none, required, or a named
function), `text.format` (json_object, json_schema), `stream`, `store`,
`previous_response_id`, `metadata`, `parallel_tool_calls`, `user`,
`truncation`, `reasoning.effort` (see reasoning.py); `reasoning.summary`,
`include` and `text.verbosity` are accepted and have no effect. GET and
DELETE /v1/responses/{id}.
Not supported (a 400 that names it): tools this server can't run
(web_search, file_search, computer_use, code_interpreter, mcp, ...),
images and files, `background`, `conversation`, stored `prompt`s, and
item references.
"""

from __future__ import annotations

import collections
import hashlib
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..dispatch.jobs import Job, JobFailed, JobKind
from . import bounds
from .errors import error_response
from .ollama_routes import Complete
from .openai_request import IMAGE_PART_TYPES, InvalidRequest, assemble_content, image_data_uri, image_part
from .protocol import Protocol, StreamEncoder, Translated
from .security import principal_of

_Invalid = InvalidRequest

# Past responses kept for previous_response_id and GET /v1/responses/{id}:
# bounded by count and by bytes, per caller and in all. A caller past its own
# bound drops its own oldest; past the whole store's, the caller holding the
# most drops its oldest, so one key's traffic can't push out another's. A
# follow-up whose previous response was dropped gets a 404 and resends the
# conversation.
MAX_STORED_RESPONSES = 512
MAX_STORED_BYTES = 64 * 1024 * 1024
MAX_STORED_RESPONSES_PER_CALLER = 128
MAX_STORED_BYTES_PER_CALLER = 16 * 1024 * 1024

# Why a stored response may be gone, for the 404s.
_WHY_GONE = "it was sent with store false, deleted, dropped to make room, or made before a restart"

# OpenAI's own limits on metadata.
MAX_METADATA_ENTRIES = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512

TRUNCATION_MODES = ("auto", "disabled")


# ----- the store -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]           # the Response object as it was answered
    conversation: list[dict[str, Any]]  # its input and output as chat messages, for a follow-up


class ResponseStore:
    """Past responses, keyed by (caller, id) so one caller can't read or
    continue another's. Each is held as its JSON text, the size counted:
    parsed objects take ten times their text, and a bound on text must be a
    bound on memory. In memory only: a restart forgets them."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES,
                 per_caller_responses: int = MAX_STORED_RESPONSES_PER_CALLER,
                 per_caller_bytes: int = MAX_STORED_BYTES_PER_CALLER) -> None:
        self._max_responses = max_responses
        self._max_bytes = max_bytes
        self._per_caller_responses = per_caller_responses
        self._per_caller_bytes = per_caller_bytes
        # (caller, id) -> the JSON text of [response, conversation]; insertion order is age.
        self._entries: collections.OrderedDict[tuple[str, str], bytes] = collections.OrderedDict()
        self._bytes = 0
        self._by_caller: collections.Counter[str] = collections.Counter()        # bytes held per caller
        self._count_by_caller: collections.Counter[str] = collections.Counter()  # responses per caller

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    def put(self, caller: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep a response; False when it alone is over the caller's byte cap
        (it is then not kept: a follow-up naming it gets a 404)."""
        text = json.dumps([response, conversation], separators=(",", ":")).encode()
        if len(text) > min(self._per_caller_bytes, self._max_bytes):
            return False
        self.delete(caller, response["id"])
        self._entries[(caller, response["id"])] = text
        self._held(caller, len(text), 1)
        while (self._by_caller[caller] > self._per_caller_bytes
               or self._count_by_caller[caller] > self._per_caller_responses):
            self._drop_oldest_of(caller)
        while len(self._entries) > self._max_responses or self._bytes > self._max_bytes:
            self._drop_oldest_of(self._by_caller.most_common(1)[0][0])
        return True

    def get(self, caller: str, response_id: str) -> StoredResponse | None:
        text = self._entries.get((caller, response_id))
        if text is None:
            return None
        response, conversation = json.loads(text)
        return StoredResponse(response, conversation)

    def delete(self, caller: str, response_id: str) -> bool:
        text = self._entries.pop((caller, response_id), None)
        if text is None:
            return False
        self._held(caller, -len(text), -1)
        return True

    def _held(self, caller: str, size: int, count: int) -> None:
        self._bytes += size
        self._by_caller[caller] += size
        self._count_by_caller[caller] += count
        if not self._count_by_caller[caller]:
            del self._by_caller[caller], self._count_by_caller[caller]

    def _drop_oldest_of(self, caller: str) -> None:
        oldest = next(key for key in self._entries if key[0] == caller)
        self.delete(*oldest)


def caller_of(request: Request) -> str:
    """Whose stored responses a request may use: its key's identity (a web
    page's session is its login's key), so each key, and each key made
    again under an old name, has its own. With no keys, a hash of the
    placeholder key the client sent, so clients that send different ones
    are kept apart."""
    principal = principal_of(request.scope)
    if principal is not None:
        return f"key:{principal.identity}"
    headers = request.headers
    authorization = headers.get("authorization") or ""
    offered = (authorization[7:] if authorization.lower().startswith("bearer ") else headers.get("x-api-key")) or ""
    return hashlib.sha256(offered.strip().encode()).hexdigest()


# ----- request: Responses body -> chat body ----------------------------------------------------


def _text_parts(content: Any, where: str, kinds: frozenset[str]) -> str | list[dict[str, Any]]:
    """A message's or a tool output's content: a string, or a list of parts
    as assemble_content makes them (a message's input_image parts become
    image_url parts; whether the model can see them is validation's to say)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _Invalid(400, f"'{where}' must be a string or a list of content parts", "invalid_type", where)
    parts = []
    for number, part in enumerate(content):
        at = f"{where}[{number}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and "input_image" in kinds:
            url = part.get("image_url")
            if not isinstance(url, str):
                raise _Invalid(400, f"'{at}' needs 'image_url' as a data: URI (a file_id can't be read here)",
                               "invalid_image", at)
            parts.append(image_part(image_data_uri(url, at), at))
            continue
        if kind in IMAGE_PART_TYPES or kind in ("input_file", "input_audio"):
            raise _Invalid(400, f"'{at}' is {kind!r}, which is not read here; send the text instead",
                           "unsupported_content_part", at)
        if kind not in kinds:
            raise _Invalid(400, f"'{at}' has type {kind!r}; this server reads "
                           + ", ".join(repr(k) for k in sorted(kinds)) + " parts here", "unsupported_content_part", at)
        field = "refusal" if kind == "refusal" else "text"
        if not isinstance(part.get(field), str):
            raise _Invalid(400, f"'{at}' of type {kind!r} needs a string '{field}'", "invalid_type", at)
        parts.append({"type": "text", "text": part[field]})
    return assemble_content(parts)


_MESSAGE_PARTS = frozenset({"input_text", "output_text", "refusal", "text", "input_image"})
_TOOL_OUTPUT_PARTS = frozenset({"input_text", "output_text", "text"})
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def _string_field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise _Invalid(400, f"'{where}.{name}' must be a non-empty string", "invalid_type", f"{where}.{name}")
    return value


def convert_items(items: list[Any], where: str = "input", tools: ResponseTools | None = None) -> list[dict[str, Any]]:
    """Responses items (a request's input, or a response's output) as chat
    messages. A function_call joins the assistant message before it, as a
    chat template expects the calls on the turn that made them."""
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        at = f"{where}[{index}]"
        if not isinstance(item, dict):
            raise _Invalid(400, f"'{at}' must be an object", "invalid_type", at)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise _Invalid(400, f"'{at}.role' must be one of 'user', 'assistant', 'system', 'developer'",
                               "invalid_value", f"{at}.role")
            messages.append({"role": role, "content": _text_parts(item.get("content"), f"{at}.content",
                                                                  _MESSAGE_PARTS)})
        elif kind == "function_call":
            name = _string_field(item, "name", at)
            if tools is not None:
                name = tools.chat_name(name, item.get("namespace"))
            call = {"id": _string_field(item, "call_id", at), "type": "function",
                    "function": {"name": name, "arguments": item.get("arguments", "")}}
            if not isinstance(call["function"]["arguments"], str):
                raise _Invalid(400, f"'{at}.arguments' must be a string of JSON", "invalid_type", f"{at}.arguments")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string_field(item, "call_id", at),
                             "content": _text_parts(item.get("output"), f"{at}.output", _TOOL_OUTPUT_PARTS)})
        elif kind == "reasoning":
            continue  # earlier reasoning is not fed back to these models
        elif kind == "item_reference":
            raise _Invalid(400, f"'{at}' is an item_reference, which this server can't resolve; send the item "
                           "itself, or previous_response_id", "unsupported_input_item", at)
        else:
            raise _Invalid(400, f"'{at}' has type {kind!r}; this server takes 'message', 'function_call', "
                           "'function_call_output' and 'reasoning' items", "unsupported_input_item", at)
    return messages


# Tools OpenAI runs on its own servers: a local model can't. They are left
# out of the model's tools with a warning (Codex sends web_search on every
# request); a request that forces one is refused (_tool_choice).
HOSTED_TOOLS = frozenset({"web_search", "web_search_preview", "file_search", "computer_use", "computer_use_preview",
                          "code_interpreter", "image_generation", "mcp", "local_shell", "shell", "apply_patch",
                          "custom"})


@dataclass
class ResponseTools:
    """A request's tools as chat's function tools. A `namespace` tool (Codex
    groups tools in one) is unpacked into its functions; each call comes back
    under its own name with its namespace (`names`). Hosted tools are left out
    and named in `skipped`."""

    chat: list[dict[str, Any]] = field(default_factory=list)
    names: dict[str, tuple[str | None, str]] = field(default_factory=dict)  # chat name -> (namespace, name)
    skipped: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, tools: Any) -> ResponseTools:
        found = cls()
        if tools is None:
            return found
        if not isinstance(tools, list):
            raise _Invalid(400, "'tools' must be a list", "invalid_type", "tools")
        for number, tool in enumerate(tools):
            at = f"tools[{number}]"
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind == "namespace":
                namespace = _string_field(tool, "name", at)
                inner = tool.get("tools")
                if not isinstance(inner, list):
                    raise _Invalid(400, f"'{at}.tools' must be a list of function tools", "invalid_type",
                                   f"{at}.tools")
                for index, function in enumerate(inner):
                    found._function(function, f"{at}.tools[{index}]", namespace)
            elif kind in HOSTED_TOOLS:
                found.skipped.append(f"{at} ({kind}) is a tool OpenAI runs on its servers; this server can't, "
                                     "so the model was not offered it")
            else:
                found._function(tool, at, None)
        return found

    def _function(self, tool: Any, at: str, namespace: str | None) -> None:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _Invalid(400, f"'{at}' is a {kind!r} tool, which this server can't run: it offers function "
                           "tools only (type 'function'), which the client runs. Remove it from 'tools'.",
                           "unsupported_tool", at)
        name = _string_field(tool, "name", at)
        # A name two namespaces share is told apart for the model; the client
        # gets the name it sent back, with its namespace.
        chat_name = name if name not in self.names else f"{namespace}__{name}"
        function: dict[str, Any] = {"name": chat_name}
        parameters = tool.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise _Invalid(400, f"'{at}.parameters' must be a JSON schema object", "invalid_type",
                               f"{at}.parameters")
            function["parameters"] = parameters
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        self.chat.append({"type": "function", "function": function})
        self.names[chat_name] = (namespace, name)

    def chat_name(self, name: str, namespace: Any) -> str:
        """The chat name of a call the client sends back (a function_call item)."""
        if isinstance(namespace, str):
            return next((chat for chat, (ns, plain) in self.names.items() if (ns, plain) == (namespace, name)), name)
        return name

    def client_name(self, chat_name: str) -> tuple[str | None, str]:
        """(namespace, name) of a call the model made."""
        return self.names.get(chat_name, (None, chat_name))


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind is not None and kind != "function":
        raise _Invalid(400, f"'tool_choice' names the {kind!r} tool type, which this server can't run; "
                       "name a function ({\"type\": \"function\", \"name\": ...}) or send 'auto', 'none' "
                       "or 'required'", "unsupported_tool", "tool_choice")
    raise _Invalid(400, "'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                   "\"name\": ...}", "invalid_value", "tool_choice")


def _response_format(text: Any) -> dict[str, Any] | None:
    """text.format as chat's response_format, so structured output takes
    the same grammar path; text.verbosity means nothing to these models."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _Invalid(400, "'text' must be an object", "invalid_type", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _Invalid(400, "'text.format.schema' must be a JSON schema object", "invalid_value",
                           "text.format.schema")
        name = fmt.get("name") if isinstance(fmt.get("name"), str) else "output"
        return {"type": "json_schema", "json_schema": {"name": name, "schema": fmt["schema"]}}
    raise _Invalid(400, "'text.format.type' must be 'text', 'json_object' or 'json_schema'", "invalid_value",
                   "text.format.type")


# What a Response object echoes of the request's text and tools: the fields
# they define, not whatever else a client put in them (it would be stored,
# and sent back on every GET).
_FORMAT_FIELDS = ("type", "name", "description", "schema", "strict")
_TOOL_FIELDS = ("type", "name", "description", "parameters", "strict", "tools")


def _echoed_text(text: Any) -> dict[str, Any]:
    fmt = text.get("format") if isinstance(text, dict) else None
    echoed: dict[str, Any] = {"format": {k: fmt[k] for k in _FORMAT_FIELDS if k in fmt}
                              if isinstance(fmt, dict) else {"type": "text"}}
    if isinstance(text, dict) and isinstance(text.get("verbosity"), str):
        echoed["verbosity"] = text["verbosity"]
    return echoed


def _echoed_tools(tools: Any) -> list[dict[str, Any]]:
    return [{k: _echoed_tools(tool[k]) if k == "tools" else tool[k] for k in _TOOL_FIELDS if k in tool}
            for tool in (tools if isinstance(tools, list) else []) if isinstance(tool, dict)]


# Fields that ask for something this server does not do, with what to do instead.
_REFUSED_FIELDS = {
    "background": "background responses are not run here; send the request and wait for it (or stream)",
    "conversation": "the Conversations API is not offered here; use previous_response_id",
    "prompt": "stored prompts are OpenAI's; send instructions and input",
}


def _check_fields(body: dict[str, Any]) -> None:
    for field, instead in _REFUSED_FIELDS.items():
        if body.get(field) not in (None, False):
            raise _Invalid(400, f"'{field}' is not supported here: {instead}", "unsupported_parameter", field)
    for field, kind, name in (("instructions", str, "a string"), ("previous_response_id", str, "a string"),
                              ("store", bool, "true or false"), ("reasoning", dict, "an object"),
                              ("parallel_tool_calls", bool, "true or false"), ("include", list, "a list")):
        if body.get(field) is not None and not isinstance(body[field], kind):
            raise _Invalid(400, f"'{field}' must be {name}", "invalid_type", field)
    truncation = body.get("truncation")
    if truncation is not None and truncation not in TRUNCATION_MODES:
        raise _Invalid(400, "'truncation' must be 'auto' or 'disabled'", "invalid_value", "truncation")
    metadata = body.get("metadata")
    if metadata is not None and (
            not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_ENTRIES
            or not all(isinstance(k, str) and len(k) <= MAX_METADATA_KEY and isinstance(v, str)
                       and len(v) <= MAX_METADATA_VALUE for k, v in metadata.items())):
        raise _Invalid(400, f"'metadata' must be an object of up to {MAX_METADATA_ENTRIES} string values, keys of "
                       f"at most {MAX_METADATA_KEY} characters and values of at most {MAX_METADATA_VALUE}",
                       "invalid_value", "metadata")


def _with_instructions(instructions: str | None, turn: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The instructions as the system message, joined with the system and
    developer messages that open the input: many chat templates take one
    system message, first. A new copy: `turn` stays as it is, for the store."""
    leading = 0
    while leading < len(turn) and turn[leading]["role"] == "system":
        leading += 1
    system = [text for text in [instructions or ""] + [m["content"] for m in turn[:leading]] if text]
    head = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    return head + [dict(message) for message in turn[leading:]]


def translate_request(body: dict[str, Any], largest_context: int, prefix: list[dict[str, Any]],
                      tools: ResponseTools | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A Responses body as a chat body, and this turn's conversation (the
    previous response's `prefix` and this input, without the instructions,
    which OpenAI does not carry over to a follow-up). `tools` are the
    body's, read already (ResponseTools.read)."""
    _check_fields(body)
    tools = tools if tools is not None else ResponseTools.read(body.get("tools"))
    raw_input = body.get("input")
    if raw_input is None and not prefix:
        raise _Invalid(400, "'input' is required: a string, or a list of message and function_call_output items",
                       "missing_field", "input")
    if isinstance(raw_input, str):
        items: list[Any] = [{"type": "message", "role": "user", "content": raw_input}]
    elif isinstance(raw_input, list) or raw_input is None:
        items = raw_input or []
    else:
        raise _Invalid(400, "'input' must be a string or a list of items", "invalid_type", "input")
    turn = prefix + convert_items(items, tools=tools)
    if not turn:
        raise _Invalid(400, "'input' is empty; send at least one message", "missing_field", "input")
    out: dict[str, Any] = {"messages": _with_instructions(body.get("instructions"), turn),
                           "stream": body.get("stream", False)}
    if body.get("model") is not None:
        out["model"] = body["model"]
    limit = body.get("max_output_tokens")
    if limit is not None:
        problem = bounds.TOKENS.problem(limit)
        if problem:
            raise _Invalid(400, f"'max_output_tokens' {problem}", "invalid_value", "max_output_tokens")
        # An upper bound, as OpenAI's: the answer stops at the context anyway.
        out["max_tokens"] = min(limit, largest_context)
    for name in ("temperature", "top_p", "user", "parallel_tool_calls"):
        if body.get(name) is not None:
            out[name] = body[name]
    if tools.chat:
        out["tools"] = tools.chat
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        out["response_format"] = response_format
    if (body.get("reasoning") or {}).get("effort") is not None:
        # Chat's knob, mapped onto the workers' thinking controls with every
        # other dialect's (reasoning.py); `summary` has no meaning here.
        out["reasoning_effort"] = body["reasoning"]["effort"]
    return out, turn


# ----- answer: chat -> Response object ---------------------------------------------------------


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [_text_part("message", text)] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [_text_part("reasoning", text)] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [], "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed",
                       namespace: str | None = None) -> dict[str, Any]:
    item = {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}
    if namespace is not None:
        item["namespace"] = namespace
    return item


def _text_part(item_kind: str, text: str) -> dict[str, Any]:
    if item_kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def output_items(message: dict[str, Any], item_id, tools: ResponseTools | None = None) -> list[dict[str, Any]]:
    """An aggregated chat message as output items, in the order a stream
    gives them: reasoning, text, then the calls (named as the client named
    them, `tools`). `item_id(kind, index)` names each."""
    tools = tools or ResponseTools()
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(item_id("rs", len(items)), message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(item_id("msg", len(items)), message.get("content") or ""))
    for call in calls:
        index = len(items)
        namespace, name = tools.client_name(call["function"]["name"])
        items.append(function_call_item(item_id("fc", index), call.get("id") or f"call_{index}", name,
                                        call["function"]["arguments"], namespace=namespace))
    return items


def usage_of(job: Job) -> dict[str, Any]:
    output = job.tokens_out
    return {"input_tokens": job.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": job.prompt_tokens + output}


def status_of(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """A response's status and incomplete_details from the chat finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


# Chat fields that checks after the translation name, as this API calls them.
_RESPONSES_NAMES = {"response_format.json_schema.schema": "text.format.schema", "response_format": "text.format",
                    "tools.function.parameters": "tools.parameters", "max_tokens": "max_output_tokens",
                    "messages": "input", "reasoning_effort": "reasoning.effort"}


class ResponsesProtocol(Protocol):
    """One request's edge: it knows the request's id, its caller and what
    it asked, since a Response object echoes them and is stored under them."""

    name = "responses"

    def __init__(self, store: ResponseStore, caller: str, largest_context: int) -> None:
        self._store = store
        self._caller = caller
        self._largest_context = largest_context
        self._hex = secrets.token_hex(12)
        self.response_id = f"resp_{self._hex}"
        self._request: dict[str, Any] = {}
        self.tools = ResponseTools()
        self._turn: list[dict[str, Any]] = []
        self._created_at = int(time.time())
        # The model that answers, as the worker names it, for a request that named none.
        self.answering_model = ""

    def translate(self, body: dict[str, Any], kind: JobKind) -> Translated:
        previous = body.get("previous_response_id")
        prefix: list[dict[str, Any]] = []
        if previous is not None:
            if not isinstance(previous, str):
                raise _Invalid(400, "'previous_response_id' must be a string", "invalid_type", "previous_response_id")
            stored = self._store.get(self._caller, previous)
            if stored is None:
                raise _Invalid(404, f"no stored response has id {previous!r}: {_WHY_GONE}; resend the conversation "
                               "as input", "previous_response_not_found", "previous_response_id")
            prefix = stored.conversation  # parsed anew from the store's text: this request's own
        self.tools = ResponseTools.read(body.get("tools"))
        chat, self._turn = translate_request(body, self._largest_context, prefix, self.tools)
        self._request = body
        return Translated(JobKind.CHAT, chat, warnings=tuple(self.tools.skipped))

    def error(self, status: int, message: str, code: str, param: str | None = None,
              headers: dict[str, str] | None = None) -> Response:
        ours = _RESPONSES_NAMES.get(param or "")
        if ours is not None:
            message, param = message.replace(f"'{param}'", f"'{ours}'"), ours
        return super().error(status, message, code, param, headers)

    def item_id(self, kind: str, index: int) -> str:
        return f"{kind}_{self._hex}_{index}"

    def response_object(self, job: Job, status: str, output: list[dict[str, Any]], *,
                        incomplete: dict[str, str] | None = None, error: dict[str, str] | None = None,
                        usage: dict[str, Any] | None = None) -> dict[str, Any]:
        request = self._request
        return {
            "id": self.response_id, "object": "response", "created_at": self._created_at, "status": status,
            "background": False, "error": error, "incomplete_details": incomplete,
            "instructions": request.get("instructions"), "max_output_tokens": request.get("max_output_tokens"),
            "model": job.body.get("model") or self.answering_model, "output": output,
            "parallel_tool_calls": request.get("parallel_tool_calls", True),
            "previous_response_id": request.get("previous_response_id"),
            "reasoning": {"effort": (request.get("reasoning") or {}).get("effort"), "summary": None},
            "store": request.get("store", True) is not False,
            "temperature": request.get("temperature"), "text": _echoed_text(request.get("text")),
            "tool_choice": request.get("tool_choice", "auto"), "tools": _echoed_tools(request.get("tools")),
            "top_p": request.get("top_p"), "truncation": request.get("truncation") or "disabled",
            "usage": usage, "user": request.get("user"), "metadata": request.get("metadata") or {},
        }

    def finish(self, job: Job, output: list[dict[str, Any]], finish_reason: str | None) -> dict[str, Any]:
        """The finished Response object, kept in the store unless store is false."""
        status, incomplete = status_of(finish_reason)
        response = self.response_object(job, status, output, incomplete=incomplete, usage=usage_of(job))
        if response["store"]:
            self._store.put(self._caller, response, self._turn + convert_items(output, "output", self.tools))
        return response

    def answer(self, response: dict[str, Any], job: Job) -> dict[str, Any]:
        choice = response["choices"][0]
        self.answering_model = response.get("model") or ""
        return self.finish(job, output_items(choice["message"], self.item_id, self.tools), choice.get("finish_reason"))

    def encoder(self, job: Job) -> StreamEncoder:
        return _ResponsesStream(self, job)


def _event(payload: dict[str, Any]) -> bytes:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


class _ResponsesStream(StreamEncoder):
    """OpenAI chunks as the Responses stream: response.created and
    .in_progress, then one output item at a time (a reasoning or message
    item whose one text part streams as deltas, or a function_call whose
    arguments do), then response.completed (or .incomplete) with the whole
    Response. Every event carries the next sequence_number."""

    def __init__(self, protocol: ResponsesProtocol, job: Job) -> None:
        self._protocol = protocol
        self._job = job
        self._sequence = 0
        self._started = False
        self._items: list[dict[str, Any]] = []  # finished output items
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._open_text: list[str] = []
        self._tool_index: int | None = None  # the chat tool call the open item is
        self._finish: str | None = None

    def _emit(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return _event(payload)

    def _start(self) -> bytes:
        self._started = True
        response = self._protocol.response_object(self._job, "in_progress", [])
        return (self._emit("response.created", response=response)
                + self._emit("response.in_progress", response=response))

    def _open_item(self, item: dict[str, Any]) -> bytes:
        out = self._close()
        self._open, self._open_text = item, []
        out += self._emit("response.output_item.added", output_index=len(self._items), item=item)
        if item["type"] in ("message", "reasoning"):
            out += self._emit("response.content_part.added", **self._where(),
                              part=_text_part(item["type"], ""))
        return out

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        where = {"item_id": self._open["id"], "output_index": len(self._items)}
        return where if self._open["type"] == "function_call" else {**where, "content_index": 0}

    def _delta(self, text: str) -> bytes:
        assert self._open is not None
        self._open_text.append(text)
        kind = self._open["type"]
        if kind == "function_call":
            return self._emit("response.function_call_arguments.delta", **self._where(), delta=text)
        if kind == "reasoning":
            return self._emit("response.reasoning_text.delta", **self._where(), delta=text)
        return self._emit("response.output_text.delta", **self._where(), delta=text, logprobs=[])

    def _close(self) -> bytes:
        item = self._open
        if item is None:
            return b""
        text, where = "".join(self._open_text), self._where()
        if item["type"] == "function_call":
            done = function_call_item(item["id"], item["call_id"], item["name"], text,
                                      namespace=item.get("namespace"))
            out = self._emit("response.function_call_arguments.done", **where, name=item["name"], arguments=text)
        else:
            done = (message_item if item["type"] == "message" else reasoning_item)(item["id"], text)
            part = done["content"][0]
            out = (self._emit("response.output_text.done", **where, text=text, logprobs=[])
                   if item["type"] == "message" else self._emit("response.reasoning_text.done", **where, text=text))
            out += self._emit("response.content_part.done", **where, part=part)
        out += self._emit("response.output_item.done", output_index=where["output_index"], item=done)
        self._items.append(done)
        self._open = None
        return out

    def _open_kind(self) -> str | None:
        return self._open["type"] if self._open is not None else None

    def event(self, chunk: dict[str, Any]) -> bytes:
        if not self._started:
            self._protocol.answering_model = chunk.get("model") or ""
        out = b"" if self._started else self._start()
        item_id = self._protocol.item_id
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self._open_kind() != "reasoning":
                    out += self._open_item(reasoning_item(item_id("rs", len(self._items)), "", "in_progress"))
                out += self._delta(delta["reasoning_content"])
            if delta.get("content"):
                if self._open_kind() != "message":
                    out += self._open_item(message_item(item_id("msg", len(self._items)), "", "in_progress"))
                out += self._delta(delta["content"])
            for call in delta.get("tool_calls") or ():
                index = call.get("index", 0)
                function = call.get("function") or {}
                if self._open_kind() != "function_call" or self._tool_index != index:
                    out += self._close()
                    self._tool_index = index
                    position = len(self._items)
                    namespace, name = self._protocol.tools.client_name(function.get("name") or "")
                    out += self._open_item(function_call_item(
                        item_id("fc", position), call.get("id") or f"call_{position}", name, "", "in_progress",
                        namespace))
                if function.get("arguments"):
                    out += self._delta(function["arguments"])
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return out

    def done(self, job: Job, last_chunk: dict[str, Any]) -> bytes:
        out = (b"" if self._started else self._start()) + self._close()
        if not self._items:
            # Nothing was generated: still one (empty) message, as the JSON answer has.
            out += self._open_item(message_item(self._protocol.item_id("msg", 0), "", "in_progress")) + self._close()
        response = self._protocol.finish(job, self._items, self._finish)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return out + self._emit(kind, response=response)

    def failed(self, failure: JobFailed) -> bytes:
        out = b"" if self._started else self._start()
        response = self._protocol.response_object(self._job, "failed", self._items,
                                                   error={"code": failure.code, "message": failure.message})
        return out + self._emit("response.failed", response=response)


# ----- routes ----------------------------------------------------------------------------------


class ResponsesRoutes:
    """POST /v1/responses runs through the HTTP app like every other chat;
    GET and DELETE /v1/responses/{id} read the store."""

    def __init__(self, complete: Complete, largest_context: int, store: ResponseStore | None = None) -> None:
        self._complete = complete
        self._largest_context = largest_context
        self.store = store if store is not None else ResponseStore()

    async def create(self, request: Request) -> Response:
        protocol = ResponsesProtocol(self.store, caller_of(request), self._largest_context)
        return await self._complete(request, JobKind.CHAT, protocol)

    async def retrieve(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        stored = self.store.get(caller_of(request), response_id)
        if stored is None:
            return _not_stored(response_id)
        return JSONResponse(stored.response)

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not self.store.delete(caller_of(request), response_id):
            return _not_stored(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _not_stored(response_id: str) -> Response:
    return error_response(404, f"no stored response has id {response_id!r}: {_WHY_GONE}", "response_not_found",
                          "response_id")
