"""llama.cpp's own server routes, for apps built on llama-server (SillyTavern
and other front ends that count tokens and build prompts themselves).

POST /completion runs through the `Protocol` seam like Ollama's and
Anthropic's routes: its native body becomes an OpenAI completion body, so
admission, replay before the first byte, idempotency and the route headers
apply unchanged; only the answer's shape (content, stop, stop_type,
tokens_predicted...), the stream's framing (`data: {"content", "stop"}`
lines, no [DONE]) and the error envelope ({"error": {"code", "message",
"type"}}, code being the HTTP status) are llama.cpp's.

/tokenize, /detokenize and /apply-template are answered by the service with
the model's own tokenizer and chat template (core/catalog/tokens.py), the ones
admission counts with. That is native code in this process: every token id
is checked against the vocabulary and every input is bounded before
llama.cpp sees it, and the work runs in a thread.

Supported on /completion: `prompt` as a string or as token ids (turned back
into text, refused when the text would not give back the same tokens),
`n_predict` (or `max_tokens`; -1 and -2: until the context is full), `stop`,
`grammar`, `json_schema`, the sampling fields (temperature, top_k, top_p,
min_p, seed, repeat_penalty, presence_penalty, frequency_penalty, and
llama.cpp's own: mirostat, dry_*, xtc_*, dynatemp_*, repeat_last_n,
top_n_sigma, min_keep, samplers, ignore_eos; each bounded), `cache_prompt` (accepted; the
workers cache prompts anyway), `stream`.
Not supported (a 400 naming the field): llama-server's other fields, at any
value but their default (engine/request_fields.py has the one list and the
rule: `id_slot` other than -1, `n_probs` other than 0, `grammar_triggers`,
`lora`, `n_keep`...), several prompts in one request, prompts mixing text
and token ids, images (`multimodal_data`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from ... import __version__
from ..dispatch.jobs import Job, JobFailed, JobKind
from . import bounds
from .errors import llamacpp_error_body
from .openai_request import InvalidRequest
from .protocol import Protocol, StreamEncoder, Translated
from .requests import ModelNames, check_model, read_json_object, validate

_Invalid = InvalidRequest

# Inputs of the tokenizer routes: a quarter MiB of text is about 64k tokens,
# more than any context here, and tokenizes in well under a second; the
# tokenizer's lock is shared with admission's counting, so a bigger input
# would hold every request's admission back.
MAX_TOKENIZE_BYTES = 256 * 1024
MAX_TOKEN_IDS = 128 * 1024

# llama.cpp's "a random seed", its default; the service's seed field is 0
# to 2^32-1, and no seed is a random one there too.
_RANDOM_SEED = -1

# Names the checks after the translation use, as this route calls them.
_NATIVE_NAMES = {"response_format.json_schema.schema": "json_schema", "response_format": "json_schema",
                 "max_tokens": "n_predict"}


error_body = llamacpp_error_body


def error(status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


# ----- request: /completion body -> OpenAI completion body -------------------------------------


def prompt_token_ids(prompt: Any) -> list[int] | None:
    """The prompt's token ids when it is given as tokens (a list of ids, or
    llama.cpp's one-element list holding them); None for a string. Refuses
    what this route doesn't take: several prompts, text mixed with ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # one prompt, in llama.cpp's list-of-prompts form
    if isinstance(prompt, str) or prompt is None:
        return None
    if not isinstance(prompt, list) or not prompt:
        raise _Invalid(400, "'prompt' must be a string or a non-empty list of token ids", "invalid_type", "prompt")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise _Invalid(400, "'prompt' as a list must hold token ids only: several prompts in one request, and "
                       "prompts mixing text and token ids, are not supported here; send one string or one list "
                       "of ids", "invalid_type", "prompt")
    if len(prompt) > MAX_TOKEN_IDS:
        raise _Invalid(400, f"'prompt' has {len(prompt)} token ids; the limit is {MAX_TOKEN_IDS}", "invalid_value",
                       "prompt")
    return prompt


def token_ids_problem(tokens: list[Any], n_vocab: int, field: str) -> str | None:
    """Why a list from a client is not token ids of this vocabulary, or None."""
    for index, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < n_vocab:
            return f"'{field}[{index}]' is {token!r}; token ids are whole numbers from 0 to {n_vocab - 1}"
    return None


def round_trip_problem(tokens: list[int], retokenized: list[int], bos: int) -> str | None:
    """Why the text of `tokens` is not a faithful stand-in for them, or None.
    The worker tokenizes the text again (adding BOS when the model's
    tokenizer says so, as llama-server does for a string prompt), so the
    text is sound when that gives back the same ids, BOS aside."""
    if retokenized and retokenized[0] == bos and (not tokens or tokens[0] != bos):
        retokenized = retokenized[1:]
    if retokenized == tokens:
        return None
    at = next((i for i, (a, b) in enumerate(zip(tokens, retokenized)) if a != b), min(len(tokens), len(retokenized)))
    return (f"these token ids don't come back from their text (they differ from position {at}), so the model "
            "would not read the same tokens; send the prompt as a string")


def _limit(body: dict[str, Any], largest_context: int) -> int | None:
    """n_predict (or its alias max_tokens) as the service's limit; None for
    -1 and -2 (llama.cpp's "until the context is full") and for absent, its
    default: the service then lets the answer fill the context (Translated.fills_context)."""
    field = "n_predict" if body.get("n_predict") is not None else "max_tokens"
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value == 0 or value < -2:
        raise _Invalid(400, f"'{field}' must be a positive whole number, or -1 for \"until the context is full\"",
                       "invalid_value", field)
    return None if value < 0 else min(value, largest_context)


def translate_completion(body: dict[str, Any], largest_context: int) -> dict[str, Any]:
    """A /completion body (its prompt already text) as an OpenAI completion body."""
    out = {key: value for key, value in body.items()
           if key not in ("n_predict", "max_tokens", "json_schema", "cache_prompt")}
    if out.get("seed") == _RANDOM_SEED and type(out["seed"]) is int:
        del out["seed"]
    if not isinstance(body.get("prompt"), str):
        raise _Invalid(400, "'prompt' is required: a string, or a list of token ids", "missing_field", "prompt")
    if body.get("n", 1) != 1 or isinstance(body.get("n"), bool):
        # The native answer has one content: several choices would be mixed into it.
        raise _Invalid(400, "'n': this route answers one completion; send n to /v1/completions for several",
                       "unsupported_parameter", "n")
    out.pop("n", None)
    if body.get("multimodal_data") is not None:
        raise _Invalid(400, "'multimodal_data': the models here have no vision; send text only",
                       "unsupported_parameter", "multimodal_data")
    cache_prompt = body.get("cache_prompt")
    if cache_prompt is not None and not isinstance(cache_prompt, bool):
        raise _Invalid(400, "'cache_prompt' must be true or false", "invalid_type", "cache_prompt")
    limit = _limit(body, largest_context)
    if limit is not None:
        out["max_tokens"] = limit
    out["stream"] = body.get("stream", False)
    if "logit_bias" in out:
        bias = _logit_bias(out.pop("logit_bias"))
        if bias:
            out["logit_bias"] = bias
    # An empty grammar is no grammar, to llama-server; clients that write
    # every field send one.
    if out.get("grammar") == "":
        del out["grammar"]
    schema = body.get("json_schema")
    if schema is not None:
        if out.get("grammar") is not None:
            raise _Invalid(400, "send either 'json_schema' or 'grammar', not both", "invalid_value", "json_schema")
        if not isinstance(schema, dict):
            raise _Invalid(400, "'json_schema' must be a JSON schema (an object)", "invalid_json_schema",
                           "json_schema")
        # The structured-output path: a schema checked and converted to a
        # grammar in the grammar checker's child process (HttpApp._constrain).
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}
    return out


def _logit_bias(value: Any) -> Any:
    """llama.cpp's list form, [[token id, bias or false], ...], as OpenAI's
    {"id": bias} (false bans the token: the lowest bias); the object form
    as it is, for the service's check. Token strings in place of ids would
    need the tokenizer and are refused."""
    if not isinstance(value, list):
        return value
    bias: dict[str, Any] = {}
    for index, pair in enumerate(value):
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int)
                and not isinstance(pair[0], bool) and pair[0] >= 0):
            raise _Invalid(400, f"'logit_bias[{index}]' must be a [token id, bias] pair (token ids, not strings, "
                           "here)", "invalid_value", "logit_bias")
        bias[str(pair[0])] = bounds.LOGIT_BIAS.low if pair[1] is False else pair[1]
    return bias


# ----- answer: OpenAI completion -> llama.cpp's shape -------------------------------------------


def _stop_fields(finish_reason: str | None) -> dict[str, Any]:
    """How the answer ended, in both of llama-server's spellings. The workers'
    OpenAI stream says "stop" for both an end-of-sequence token and a stop
    string, so a stop string is reported as "eos" (and stopping_word empty)."""
    limit = finish_reason == "length"
    return {"stop_type": "limit" if limit else "eos", "stopping_word": "", "stopped_eos": not limit,
            "stopped_limit": limit, "stopped_word": False}


def _timings(job: Job) -> dict[str, Any]:
    """llama-server's timings of the attempt that answered, from the service's clock."""
    attempt = job.attempts[-1] if job.attempts else None
    if attempt is None or attempt.ended_at is None:
        return {}
    first = attempt.first_token_at or attempt.ended_at
    prompt_ms = (first - attempt.started_at) * 1000
    predicted_ms = (attempt.ended_at - first) * 1000
    prompt_n, predicted_n = job.prompt_tokens, attempt.tokens

    def rates(ms: float, n: int) -> tuple[float, float]:
        return (ms / n if n else 0.0), (n * 1000 / ms if ms > 0 else 0.0)

    prompt_per_token, prompt_per_second = rates(prompt_ms, prompt_n)
    predicted_per_token, predicted_per_second = rates(predicted_ms, predicted_n)
    return {"prompt_n": prompt_n, "prompt_ms": prompt_ms, "prompt_per_token_ms": prompt_per_token,
            "prompt_per_second": prompt_per_second, "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_per_token, "predicted_per_second": predicted_per_second}


def final_fields(job: Job, model: str, content: str, finish_reason: str | None) -> dict[str, Any]:
    """The last object of an answer, streamed or not."""
    return {"index": 0, "content": content, "tokens": [], "stop": True, "model": model,
            "tokens_predicted": job.tokens_out,
            "tokens_evaluated": job.prompt_tokens, "has_new_line": "\n" in content, "truncated": False,
            **_stop_fields(finish_reason), "tokens_cached": 0, "timings": _timings(job)}


class LlamaCppCompletion(Protocol):
    name = "llamacpp"

    def __init__(self, largest_context: int,
                 prompt_from_tokens: Callable[[Any, list[int]], Awaitable[str]]) -> None:
        self._largest_context = largest_context
        self._prompt_from_tokens = prompt_from_tokens

    async def prepare(self, body: dict[str, Any]) -> None:
        tokens = prompt_token_ids(body.get("prompt"))
        if tokens is not None:
            body["prompt"] = await self._prompt_from_tokens(body.get("model"), tokens)
        elif isinstance(body.get("prompt"), list):
            body["prompt"] = body["prompt"][0]  # one string in a list

    def translate(self, body: dict[str, Any], kind: JobKind) -> Translated:
        completion = translate_completion(body, self._largest_context)
        return Translated(JobKind.COMPLETION, completion, fills_context="max_tokens" not in completion)

    def answer(self, response: dict[str, Any], job: Job) -> dict[str, Any]:
        choice = response["choices"][0]
        return final_fields(job, response.get("model") or "", choice.get("text") or "", choice.get("finish_reason"))

    def encoder(self, job: Job) -> StreamEncoder:
        return _LlamaCppStream(job)

    def error(self, status: int, message: str, code: str, param: str | None = None,
              headers: dict[str, str] | None = None) -> Response:
        ours = _NATIVE_NAMES.get(param or "")
        if ours is not None:
            message, param = message.replace(f"'{param}'", f"'{ours}'"), ours
        return error(status, message, param, headers)

    def error_payload(self, failure: JobFailed) -> dict[str, Any]:
        return error_body(failure.status, failure.message, failure.param)


def _data(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


class _LlamaCppStream(StreamEncoder):
    """OpenAI completion chunks as llama-server's native stream: a
    `{"content", "stop": false}` line per piece, then one with `stop: true`
    and the totals. No [DONE]: llama-server sends none on this route."""

    def __init__(self, job: Job) -> None:
        self._job = job
        self._finish: str | None = None
        self._model = ""
        self._pieces = 0

    def event(self, chunk: dict[str, Any]) -> bytes:
        self._model = chunk.get("model") or self._model
        out = b""
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
            text = choice.get("text")
            if text:
                self._pieces += 1
                out += _data({"index": 0, "content": text, "tokens": [], "stop": False,
                              "tokens_predicted": self._pieces, "tokens_evaluated": self._job.prompt_tokens})
        return out

    def done(self, job: Job, last_chunk: dict[str, Any]) -> bytes:
        return _data(final_fields(job, self._model, "", self._finish))

    def failed(self, failure: JobFailed) -> bytes:
        return _data(error_body(failure.status, failure.message, failure.param))


# ----- the routes ------------------------------------------------------------------------------


class LlamaCppRoutes:
    """POST /completion through the HTTP app; /tokenize, /detokenize,
    /apply-template and GET /props answered here, from the model's own
    tokenizer and chat template."""

    def __init__(self, service: Any, complete: Callable[[Request, JobKind, Any], Awaitable[Response]],
                 model_names: Callable[[], ModelNames], host_of: Callable[[Any], Any], largest_context: int) -> None:
        self.service = service
        self._complete = complete
        self._model_names = model_names
        self._model_host_of = host_of
        self._largest_context = largest_context
        self.protocol = LlamaCppCompletion(largest_context, self._prompt_from_tokens)

    async def completion(self, request: Request) -> Response:
        return await self._complete(request, JobKind.COMPLETION, self.protocol)

    async def _counter(self, model: Any) -> Any:
        """The tokenizer of the model a request names (or the default model)."""
        check_model(model, self._model_names())
        model_host = self._model_host_of(model)
        await self.service.ensure_started(model_host)
        return model_host.counter

    async def _prompt_from_tokens(self, model: Any, tokens: list[int]) -> str:
        counter = await self._counter(model)
        problem = token_ids_problem(tokens, counter.n_vocab, "prompt")
        if problem:
            raise _Invalid(400, problem, "invalid_token", "prompt")

        def text_and_check() -> tuple[str, str | None]:
            text = counter.detokenize(tokens)
            again = counter.tokenize(text, add_special=True, parse_special=True)
            return text, round_trip_problem(tokens, again, counter.bos_id)

        text, problem = await asyncio.to_thread(text_and_check)
        if problem:
            raise _Invalid(400, f"'prompt': {problem}", "unsupported_token_prompt", "prompt")
        return text

    async def _answer(self, request: Request, work: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> Response:
        try:
            body = await read_json_object(request)
            return JSONResponse(await work(body))
        except _Invalid as bad:
            return error(bad.status, bad.message, bad.param)
        except ClientDisconnect:
            return Response(status_code=499)

    async def tokenize(self, request: Request) -> Response:
        """{"content", "add_special", "parse_special", "with_pieces"} -> {"tokens"}."""
        async def work(body: dict[str, Any]) -> dict[str, Any]:
            content = body.get("content")
            if not isinstance(content, str):
                raise _Invalid(400, "'content' is required: the text to tokenize, as a string", "invalid_type",
                               "content")
            size = len(content.encode("utf-8"))
            if size > MAX_TOKENIZE_BYTES:
                raise _Invalid(400, f"'content' is {size} bytes; the limit is {MAX_TOKENIZE_BYTES}", "invalid_value",
                               "content")
            flags = {name: _flag(body, name, default) for name, default in
                     (("add_special", False), ("parse_special", True), ("with_pieces", False))}
            counter = await self._counter(body.get("model"))

            def run() -> list[Any]:
                tokens = counter.tokenize(content, add_special=flags["add_special"],
                                          parse_special=flags["parse_special"])
                if not flags["with_pieces"]:
                    return tokens
                return [{"id": token, "piece": _piece_json(piece)}
                        for token, piece in zip(tokens, counter.pieces(tokens))]

            return {"tokens": await asyncio.to_thread(run)}

        return await self._answer(request, work)

    async def detokenize(self, request: Request) -> Response:
        """{"tokens": [ids]} -> {"content"}."""
        async def work(body: dict[str, Any]) -> dict[str, Any]:
            tokens = body.get("tokens")
            if not isinstance(tokens, list):
                raise _Invalid(400, "'tokens' is required: a list of token ids", "invalid_type", "tokens")
            if len(tokens) > MAX_TOKEN_IDS:
                raise _Invalid(400, f"'tokens' has {len(tokens)} ids; the limit is {MAX_TOKEN_IDS}", "invalid_value",
                               "tokens")
            counter = await self._counter(body.get("model"))
            problem = token_ids_problem(tokens, counter.n_vocab, "tokens")
            if problem:
                raise _Invalid(400, problem, "invalid_token", "tokens")
            return {"content": await asyncio.to_thread(counter.detokenize, tokens)}

        return await self._answer(request, work)

    async def apply_template(self, request: Request) -> Response:
        """{"messages", "tools"} -> {"prompt"}: the model's chat template
        applied as the workers apply it, ready for the answer."""
        async def work(body: dict[str, Any]) -> dict[str, Any]:
            chat = {key: body[key] for key in ("model", "messages", "tools") if key in body}
            # The chat routes' checks (roles, content parts, bounds), in place.
            validate(chat, JobKind.CHAT, self._model_names(), self._largest_context)
            counter = await self._counter(body.get("model"))
            try:
                prompt = await asyncio.to_thread(counter.render_chat, chat["messages"], chat.get("tools"))
            except LookupError as exc:
                raise _Invalid(501, f"{exc}: there is no template to apply", "no_chat_template") from None
            except Exception as exc:  # a template can refuse odd message shapes
                raise _Invalid(400, f"the messages can't be rendered with the model's chat template: {exc}",
                               "invalid_messages", "messages") from None
            return {"prompt": prompt}

        return await self._answer(request, work)

    async def props(self, request: Request) -> Response:
        """What this server is, in llama-server's field names: the default
        model (or ?model=), its context, its chat template and what it can take."""
        model = request.query_params.get("model")
        try:
            counter = await self._counter(model)
        except _Invalid as bad:
            return error(bad.status, bad.message, bad.param)
        model_host = self._model_host_of(model)
        library_model = model_host.model
        service = self.service
        return JSONResponse({
            # The context a request may use: the larger of the GPU's and the CPU's.
            "default_generation_settings": {"n_ctx": max(library_model.gpu_n_ctx, library_model.cpu_n_ctx),
                                            "params": {"n_predict": -1}},
            "total_slots": library_model.slots,
            # Not llama-server's: each path's context and KV cache type.
            "context_by_path": model_host.served_contexts(),
            "model_alias": model_host.model_id,
            "model_path": model_host.model_info.path.name,
            "modalities": {"vision": model_host.projector is not None, "video": False, "audio": False},
            "chat_template": counter.chat_template or "",
            "bos_token": counter.bos_token,
            "eos_token": counter.eos_token,
            "build_info": f"tray-app {__version__} ({service.runtime.name})",
            "endpoint_slots": False, "endpoint_props": False, "endpoint_metrics": True,
            "is_sleeping": False,
        })


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise _Invalid(400, f"'{name}' must be true or false", "invalid_type", name)
    return value


def _piece_json(piece: bytes) -> str | list[int]:
    """A token's bytes as llama-server writes them: text when they are UTF-8,
    else the list of byte values (a piece of a multi-byte character)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)
