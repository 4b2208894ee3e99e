"""Ollama's API on the same port: what Home Assistant, Obsidian plugins and
many small tools speak.

/api/chat and /api/generate run through the same admission, routing,
replay and degraded-mode machinery as OpenAI's routes (see protocol.py);
the route headers (X-Served-By, X-Route-Reason, X-Fallback-Model...) are
on these responses too. Streams are NDJSON, one object per line, and a
stream is the default, as in Ollama. Errors are Ollama's {"error": "..."}.

What maps where (Ollama's options -> the OpenAI body the workers run):
num_predict -> max_tokens (-1, -2, absent or null: until the context is full); num_ctx ->
prompt and answer stay within it (it never grows the server's context);
temperature, top_p, top_k, min_p, typical_p, seed, stop, repeat_penalty,
presence_penalty, frequency_penalty -> the same names; format "json" or a
schema -> response_format; keep_alive -> how long the GPU model stays
loaded after the request; think (true, false, "low", "medium", "high") ->
reasoning_effort (see reasoning.py), the thinking in `thinking`. Options
that configure a model load in Ollama
(num_gpu, num_thread, use_mmap...) are the server's settings here and are
ignored, as Ollama ignores options it doesn't know.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from datetime import datetime, timezone
from typing import Any

from starlette.responses import JSONResponse, Response

from ..dispatch.jobs import Job, JobFailed, JobKind
from . import bounds, reasoning
from .openai_request import InvalidRequest, assemble_content, base64_image_uri, image_part
from .protocol import Protocol, StreamEncoder, Translated, answer_timings_ns

_Invalid = InvalidRequest

# The Ollama release whose API shapes these routes follow (GET /api/version).
# The Ollama API version whose behaviour the routes follow, not this
# project's version: clients gate features on it (`codex --oss` needs 0.13.4).
OLLAMA_API_VERSION = "0.13.4"
# Ollama's model names carry a tag; ours are files, so every one is ":latest".
DEFAULT_TAG = ":latest"

# Ollama option -> OpenAI body field, for the options passed through as they are.
_SAME_NAME_OPTIONS = ("temperature", "top_p", "top_k", "min_p", "typical_p", "seed", "repeat_penalty",
                      "presence_penalty", "frequency_penalty")


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def rfc3339(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


# Go's time.ParseDuration: a sign, then number-unit pairs ("1h30m", "5m0s"),
# or a bare number of seconds (Ollama's own reading of a plain number).
_DURATION = re.compile(r"^(-?)((?:\d+(?:\.\d*)?(?:ns|us|µs|ms|s|m|h))+)$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)")
_BARE_SECONDS = re.compile(r"^-?\d+(?:\.\d+)?$")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_KEEP_ALIVE_CAP_S = 10 * 365 * 86400.0


def parse_keep_alive(value: Any) -> float:
    """Ollama's keep_alive: seconds as a number, or a Go duration string
    ("5m", "1h", "30s", "-1"). Negative = keep loaded, 0 = unload when done."""
    if isinstance(value, bool):
        raise _Invalid(400, "'keep_alive' must be a duration such as \"5m\" or a number of seconds",
                       "invalid_value", "keep_alive")
    if isinstance(value, int):
        # Past the cap it means the same as the cap (float() of a 400-digit number would overflow).
        seconds = float(max(-1, min(value, int(_KEEP_ALIVE_CAP_S))))
    elif isinstance(value, float):
        seconds = value
    elif isinstance(value, str):
        text = value.strip()
        match = _DURATION.match(text)
        if _BARE_SECONDS.match(text):
            seconds = float(text)
        elif match is not None:
            seconds = sum(float(number) * _UNIT_S[unit] for number, unit in _DURATION_PART.findall(match.group(2)))
            seconds = -seconds if match.group(1) else seconds
        else:
            raise _Invalid(400, f"'keep_alive' {value!r} is not a duration; send e.g. \"5m\", \"1h30m\", \"-1\" "
                           "or a number of seconds", "invalid_value", "keep_alive")
    else:
        raise _Invalid(400, "'keep_alive' must be a duration such as \"5m\" or a number of seconds",
                       "invalid_value", "keep_alive")
    if not math.isfinite(seconds):
        raise _Invalid(400, "'keep_alive' must be finite", "invalid_value", "keep_alive")
    return -1.0 if seconds < 0 else min(seconds, _KEEP_ALIVE_CAP_S)


def _options(body: dict[str, Any], out: dict[str, Any], largest_context: int) -> int | None:
    """Map Ollama's options onto the OpenAI body; returns num_ctx, if given."""
    options = body.get("options")
    if options is None:
        return None
    if not isinstance(options, dict):
        raise _Invalid(400, "'options' must be an object", "invalid_type", "options")
    for name in _SAME_NAME_OPTIONS:
        if options.get(name) is not None:
            out[name] = options[name]
    stop = options.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and stop != []:
        out["stop"] = stop  # checked with OpenAI's rules once translated
    predict = options.get("num_predict")
    # null is absent, as in Ollama (Options.FromMap skips null values), so a
    # client that writes every unset option as null is served as Ollama
    # serves it: until the context is full, which the context bounds.
    if predict is not None:
        if isinstance(predict, bool) or not isinstance(predict, int) or predict == 0 or predict < -2:
            raise _Invalid(400, "'options.num_predict' must be a positive whole number, or -1 / -2 for "
                           "\"until the context is full\"", "invalid_value", "options.num_predict")
        if predict > 0:
            # Past the largest context it means "as much as fits", as -1 does.
            out["max_tokens"] = min(predict, largest_context)
    num_ctx = options.get("num_ctx")
    if num_ctx is not None:
        if isinstance(num_ctx, bool) or not isinstance(num_ctx, int) or num_ctx < 1:
            raise _Invalid(400, "'options.num_ctx' must be a positive whole number", "invalid_value",
                           "options.num_ctx")
        return num_ctx
    return None


def _common(body: dict[str, Any], out: dict[str, Any], largest_context: int) -> Translated:
    """The fields /api/chat and /api/generate share."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _Invalid(400, "'model' is required (GET /api/tags lists the models)", "missing_field", "model")
    out["model"] = model
    stream = body.get("stream", True)
    if stream is None:
        stream = True
    if not isinstance(stream, bool):
        raise _Invalid(400, "'stream' must be true or false", "invalid_type", "stream")
    out["stream"] = stream
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise _Invalid(400, "'format' must be \"json\" or a JSON schema object", "invalid_value", "format")
    context_cap = _options(body, out, largest_context)
    reasoning.from_ollama_think(body.get("think"), out)
    keep_alive = parse_keep_alive(body["keep_alive"]) if body.get("keep_alive") is not None else None
    return Translated(JobKind.CHAT, out, context_cap=context_cap, keep_alive_s=keep_alive)


def _tool_calls_to_openai(calls: Any, index: int) -> list[dict[str, Any]]:
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise _Invalid(400, f"'{where}' must be a list", "invalid_type", where)
    converted = []
    for number, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _Invalid(400, f"'{where}[{number}]' must be {{\"function\": {{\"name\", \"arguments\"}}}}",
                           "invalid_type", f"{where}[{number}]")
        arguments = function.get("arguments", {})
        converted.append({"id": f"call_{index}_{number}", "type": "function",
                          "function": {"name": function["name"],
                                       "arguments": arguments if isinstance(arguments, str)
                                       else json.dumps(arguments)}})
    return converted


def _with_images(text: str, images: Any, where: str) -> str | list[dict[str, Any]]:
    """Ollama's text and images[] (base64 strings) as one OpenAI content, the
    images first, as Ollama puts them in the prompt before the text."""
    if images is None or images == []:
        return text
    if not isinstance(images, list):
        raise _Invalid(400, f"'{where}' must be a list of base64-encoded images", "invalid_type", where)
    parts: list[dict[str, Any]] = []
    for number, image in enumerate(images):
        if not isinstance(image, str):
            raise _Invalid(400, f"'{where}[{number}]' must be a base64 string", "invalid_image",
                           f"{where}[{number}]")
        parts.append(image_part(base64_image_uri(image, f"{where}[{number}]"), f"{where}[{number}]"))
    return assemble_content(parts + ([{"type": "text", "text": text}] if text else []))


def _chat_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise _Invalid(400, "'messages' must be a non-empty list of {role, content}", "invalid_type", "messages")
    out: list[dict[str, Any]] = []
    # Ollama's tool results name the function, OpenAI's the call: each
    # result answers the oldest unanswered call of that name, in order.
    call_ids: dict[str, list[str]] = {}
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _Invalid(400, f"messages[{index}] must be an object", "invalid_type", f"messages[{index}]")
        content = message.get("content", "")
        if content is not None and not isinstance(content, str):
            raise _Invalid(400, f"messages[{index}].content must be a string", "invalid_type",
                           f"messages[{index}].content")
        converted: dict[str, Any] = {"role": message.get("role"),
                                     "content": _with_images(content or "", message.get("images"),
                                                             f"messages[{index}].images")}
        if message.get("tool_calls"):
            converted["tool_calls"] = _tool_calls_to_openai(message["tool_calls"], index)
            for call in converted["tool_calls"]:
                call_ids.setdefault(call["function"]["name"], []).append(call["id"])
        if converted["role"] == "tool":
            given = message.get("tool_call_id")
            name = message.get("tool_name") or message.get("name")
            waiting = call_ids.get(name) if isinstance(name, str) else None
            if isinstance(given, str) and given:
                converted["tool_call_id"] = given
            elif waiting:
                converted["tool_call_id"] = waiting.pop(0)
            else:
                converted["tool_call_id"] = f"call_{index}"
        out.append(converted)
    return out


class OllamaChat(Protocol):
    name = "ollama-chat"
    stream_media_type = "application/x-ndjson"
    # Answers carry a "message" (/api/chat) rather than a "response" (/api/generate).
    chat_shape = True

    def __init__(self, largest_context: int) -> None:
        self._largest_context = largest_context

    def translate(self, body: dict[str, Any], kind: JobKind) -> Translated:
        messages = body.get("messages")
        out: dict[str, Any] = {}
        translated = _common(body, out, self._largest_context)
        if body.get("images"):
            raise _Invalid(400, "'images' belong on each message in /api/chat (messages[i].images)",
                           "invalid_value", "images")
        if messages is None or messages == []:
            # Ollama's way to load a model without asking anything.
            translated.load_only = True
            return translated
        out["messages"] = _chat_messages(messages)
        if body.get("tools") is not None:
            out["tools"] = body["tools"]
        translated.truncates_history = True
        return translated

    def answer(self, response: dict[str, Any], job: Job) -> dict[str, Any]:
        choice = response["choices"][0]
        message = choice["message"]
        reply: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("reasoning_content"):
            reply["thinking"] = message["reasoning_content"]
        if message.get("tool_calls"):
            reply["tool_calls"] = [_ollama_call(call) for call in message["tool_calls"]]
        return {"model": job.body.get("model"), "created_at": now_rfc3339(), "message": reply,
                **_final_fields(job, choice.get("finish_reason"))}

    def encoder(self, job: Job) -> StreamEncoder:
        return _OllamaStream(job, chat=self.chat_shape)

    def load_answer(self, translated: Translated) -> Response:
        """The answer to a request that only loads (or, with keep_alive 0, unloads) the model."""
        answer: dict[str, Any] = {"model": translated.body["model"], "created_at": now_rfc3339()}
        if self.chat_shape:
            answer["message"] = {"role": "assistant", "content": ""}
        else:
            answer["response"] = ""
        answer.update(done=True, done_reason="unload" if translated.keep_alive_s == 0 else "load")
        if translated.body.get("stream", True):
            return Response(_line(answer), media_type=self.stream_media_type)
        return JSONResponse(answer)

    def error(self, status: int, message: str, code: str, param: str | None = None,
              headers: dict[str, str] | None = None) -> Response:
        return error(status, message, headers)

    def error_payload(self, failure: JobFailed) -> dict[str, Any]:
        return {"error": failure.message}


class OllamaGenerate(OllamaChat):
    """/api/generate: the prompt goes through the model's chat template (with
    `system`) unless `raw` is true, as in Ollama."""

    name = "ollama-generate"
    chat_shape = False

    def translate(self, body: dict[str, Any], kind: JobKind) -> Translated:
        prompt = body.get("prompt", "")
        if not isinstance(prompt, str):
            raise _Invalid(400, "'prompt' must be a string", "invalid_type", "prompt")
        for unsupported, why in (("suffix", "fill-in-the-middle is not supported"),
                                 ("template", "the model's own chat template is always used"),
                                 ("context", "send the conversation to /api/chat as messages instead")):
            if body.get(unsupported):
                raise _Invalid(400, f"'{unsupported}': {why}", "unsupported_parameter", unsupported)
        system = body.get("system")
        if system is not None and not isinstance(system, str):
            raise _Invalid(400, "'system' must be a string", "invalid_type", "system")
        raw = body.get("raw", False)
        if not isinstance(raw, bool):
            raise _Invalid(400, "'raw' must be true or false", "invalid_type", "raw")
        out: dict[str, Any] = {}
        translated = _common(body, out, self._largest_context)
        if not prompt:
            translated.load_only = True
            return translated
        if raw and body.get("images"):
            raise _Invalid(400, "'images' need the model's chat template, which raw skips; send raw false",
                           "invalid_value", "images")
        if raw:
            translated.kind = JobKind.COMPLETION
            out["prompt"] = prompt
            # A completion defaults to 16 tokens (OpenAI's rule); Ollama's
            # raw generate runs until the model stops or the context is full.
            out.setdefault("max_tokens", self._largest_context)
        else:
            out["messages"] = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": _with_images(prompt, body.get("images"), "images")}]
        return translated

    def answer(self, response: dict[str, Any], job: Job) -> dict[str, Any]:
        choice = response["choices"][0]
        text = choice.get("text") if job.kind is JobKind.COMPLETION else choice["message"].get("content")
        reply = {"model": job.body.get("model"), "created_at": now_rfc3339(), "response": text or ""}
        if job.kind is JobKind.CHAT and choice["message"].get("reasoning_content"):
            reply["thinking"] = choice["message"]["reasoning_content"]
        return {**reply, **_final_fields(job, choice.get("finish_reason"))}


def _ollama_call(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call as Ollama's: arguments as an object, not a string."""
    function = call.get("function") or {}
    raw = function.get("arguments") or ""
    try:
        arguments = json.loads(raw) if raw else {}
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        # Ollama's clients require an object; keep what the model wrote.
        arguments = {"arguments": raw}
    return {"function": {"name": function.get("name") or "", "arguments": arguments}}


def _done_reason(finish_reason: str | None) -> str:
    return "length" if finish_reason == "length" else "stop"


def _final_fields(job: Job, finish_reason: str | None) -> dict[str, Any]:
    eval_count = job.tokens_out
    return {"done": True, "done_reason": _done_reason(finish_reason),
            "total_duration": int((time.monotonic() - job.created_at) * 1e9), "load_duration": 0,
            "prompt_eval_count": job.prompt_tokens, "eval_count": eval_count, **answer_timings_ns(job)}


def _line(payload: dict[str, Any]) -> bytes:
    return (json.dumps(payload, separators=(",", ":")) + "\n").encode()


class _OllamaStream(StreamEncoder):
    """OpenAI chunks as Ollama's NDJSON lines. Tool calls stream in pieces
    from the worker but Ollama sends each call whole: they are gathered and
    sent in one line before the last."""

    def __init__(self, job: Job, *, chat: bool) -> None:
        self._job = job
        self._chat = chat
        self._calls: dict[int, dict[str, Any]] = {}
        self._finish: str | None = None
        self._resumed: dict[str, Any] | None = None

    def _piece(self, text: str = "", thinking: str = "", calls: list[dict[str, Any]] | None = None) -> bytes:
        base: dict[str, Any] = {"model": self._job.body.get("model"), "created_at": now_rfc3339()}
        if self._chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            base["message"] = message
        else:
            base["response"] = text
            if thinking:
                base["thinking"] = thinking
        return _line({**base, "done": False})

    def event(self, chunk: dict[str, Any]) -> bytes:
        out = b""
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            text = delta.get("content") or choice.get("text") or ""
            thinking = delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or ():
                slot = self._calls.setdefault(call.get("index", 0), {"function": {"name": "", "arguments": ""}})
                function = call.get("function") or {}
                slot["function"]["name"] += function.get("name") or ""
                slot["function"]["arguments"] += function.get("arguments") or ""
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
            if text or thinking:
                out += self._piece(text, thinking)
        return out

    def done(self, job: Job, last_chunk: dict[str, Any]) -> bytes:
        out = b""
        if self._calls:
            out += self._piece(calls=[_ollama_call(self._calls[i]) for i in sorted(self._calls)])
        final: dict[str, Any] = {"model": job.body.get("model"), "created_at": now_rfc3339()}
        if self._chat:
            final["message"] = {"role": "assistant", "content": ""}
        else:
            final["response"] = ""
        resumed = last_chunk.get("resumed") or self._resumed
        if resumed is not None:
            # Not Ollama's: where the answer went on from the text already sent (Ollama's clients ignore it).
            final["resumed"] = resumed
        return out + _line({**final, **_final_fields(job, self._finish)})

    def failed(self, failure: JobFailed) -> bytes:
        return _line({"error": failure.message})

    def seam(self, note: dict[str, Any]) -> bytes:
        # NDJSON has no comments: the last line says it.
        self._resumed = note
        return b""


# ----- what the model list routes say -----------------------------------------------------


def model_digest(path, size: int, mtime: float) -> str:
    """A stable id for /api/tags, cheap for a 40 GB file: not the file's
    SHA-256 (that would read all of it), a hash of where it is, its size and
    its modification time."""
    return hashlib.sha256(f"{path}\0{size}\0{mtime}".encode()).hexdigest()


def parameter_size(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}".rstrip("0").rstrip(".") + unit
    return str(count)


def model_details(info) -> dict[str, Any]:
    return {"parent_model": "", "format": "gguf", "family": info.architecture, "families": [info.architecture],
            "parameter_size": parameter_size(info.parameter_count), "quantization_level": info.file_type}


def model_entry(name: str, info, sees_images: bool = False, embeds: bool = False) -> dict[str, Any]:
    # The file as it was read at load (gguf_info.ModelInfo), not stat'ed
    # again: a model file deleted while the service runs must not turn the
    # whole list into an error.
    return {"name": name, "model": name, "modified_at": rfc3339(info.modified), "size": info.file_size,
            "digest": model_digest(info.path, info.file_size, info.modified), "details": model_details(info),
            "capabilities": model_capabilities(sees_images, embeds)}


def model_capabilities(sees_images: bool, embeds: bool = False) -> list[str]:
    """Ollama's capability names for a chat model here: vision with a
    projector, embedding for the model /api/embed runs (llm-ollama and
    others look for it before they embed with a model)."""
    return ["completion", "tools", *(["vision"] if sees_images else []), *(["embedding"] if embeds else [])]


def model_info_fields(info, context_length: int) -> dict[str, Any]:
    """GGUF metadata under Ollama's /api/show keys."""
    arch = info.architecture
    return {"general.architecture": arch, "general.name": info.name, "general.parameter_count": info.parameter_count,
            "general.file_type": info.file_type, f"{arch}.context_length": context_length,
            f"{arch}.embedding_length": info.n_embd, f"{arch}.block_count": info.n_layer,
            f"{arch}.attention.head_count": info.n_head, f"{arch}.attention.head_count_kv": info.n_head_kv,
            "tokenizer.ggml.model": info.tokenizer_model}


def strip_tag(name: str) -> str:
    return name[: -len(DEFAULT_TAG)] if name.endswith(DEFAULT_TAG) else name


def check_model_field(body: dict[str, Any], field: str = "model") -> str:
    """/api/show and the embedding routes: Ollama's older clients say "name"."""
    value = body.get(field) if body.get(field) is not None else body.get("name")
    if not isinstance(value, str) or not value:
        raise _Invalid(400, f"'{field}' is required (GET /api/tags lists the models)", "missing_field", field)
    return value


# Ollama's bounds on sampling match OpenAI's for the shared names; the rest
# are checked by the same table (bounds.SAMPLING) once translated.
assert set(_SAME_NAME_OPTIONS) <= set(bounds.SAMPLING)
