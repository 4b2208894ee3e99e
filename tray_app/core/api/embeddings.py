"""POST /v1/embeddings in OpenAI's shape, around the service's EmbeddingPath.

Checking follows OpenAI's rules, each failure a 400 in the envelope naming
its `param`; unknown fields are ignored, as OpenAI does. The worker always
answers floats; base64 (little-endian float32, what the openai package
asks for by default and decodes) is encoded here. `check_inputs` and
`embedding_path` are shared with the other protocols' embedding routes.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from ..dispatch.jobs import JobFailed, new_request_id
from ..embeddings.path import EmbeddingPath, EmbeddingResult
from .errors import error_response
from .openai_request import InvalidRequest
from .protocol import OPENAI
from .llamacpp import MAX_TOKEN_IDS, round_trip_problem, token_ids_problem
from .requests import ModelNames, check_model, clean_request_id, read_json_object, routing_headers

if TYPE_CHECKING:
    from ..service import Service

# OpenAI's limit on inputs per request.
MAX_INPUTS = 2048
# Numbers one request may ask for (inputs x the model's dimensions). A few
# kilobytes of short inputs would otherwise ask for an answer of hundreds of
# megabytes (2048 x 4096 floats is about 170 MB of JSON): this keeps it near
# 20 MB of JSON (5.6 MB as base64): 1820 inputs at 576 dimensions, 256 at 4096.
MAX_VALUES_PER_REQUEST = 1 << 20
ENCODING_FORMATS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingOptions:
    encoding_format: str = "float"


def input_texts(value: Any, param: str = "input") -> list[str | list[int]]:
    """The inputs to embed: a non-empty string, a list of 1..MAX_INPUTS
    non-empty strings, or token ids as OpenAI's API takes them (one list of
    ids, or a list of such lists), which stay lists here: check_inputs turns
    them into text, the worker being handed text."""
    if value is None:
        raise InvalidRequest(400, f"'{param}' is required: a string, or a list of strings", "missing_field", param)
    if isinstance(value, str):
        if not value:
            raise InvalidRequest(400, f"'{param}' is empty; send at least one character", "empty_input", param)
        return [value]
    if not isinstance(value, list):
        raise InvalidRequest(400, f"'{param}' must be a string or a list of strings", "invalid_type", param)
    if not value:
        raise InvalidRequest(400, f"'{param}' is an empty list; send 1 to {MAX_INPUTS} strings", "empty_input", param)
    if len(value) > MAX_INPUTS:
        raise InvalidRequest(400, f"'{param}' has {len(value)} items; the limit is {MAX_INPUTS}", "too_many_inputs",
                             param)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [list(value)]
    if all(isinstance(v, list) for v in value):
        for index, item in enumerate(value):
            if not item:
                raise InvalidRequest(400, f"'{param}[{index}]' is an empty list of token ids", "empty_input",
                                     f"{param}[{index}]")
        return [list(item) for item in value]
    for index, item in enumerate(value):
        where = f"{param}[{index}]"
        if not isinstance(item, str):
            raise InvalidRequest(400, f"'{where}' must be a string", "invalid_type", where)
        if not item:
            raise InvalidRequest(400, f"'{where}' is empty; send at least one character", "empty_input", where)
    return list(value)


def check_body(body: dict[str, Any], models: ModelNames, dimensions: int) -> EmbeddingOptions:
    """Every field of an OpenAI embeddings request but `input` (check_inputs
    counts that, off the loop)."""
    check_model(body.get("model"), models)
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODING_FORMATS:
        raise InvalidRequest(400, "'encoding_format' must be 'float' or 'base64'", "invalid_value", "encoding_format")
    wanted = body.get("dimensions")
    if wanted is not None:
        if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 1:
            raise InvalidRequest(400, "'dimensions' must be a positive whole number", "invalid_value", "dimensions")
        if wanted != dimensions:
            raise InvalidRequest(400, f"'dimensions' {wanted} is not supported: this model's embeddings have "
                                 f"{dimensions} dimensions and can't be shortened", "unsupported_parameter",
                                 "dimensions")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest(400, "'user' must be a string", "invalid_type", "user")
    return EmbeddingOptions(encoding_format=encoding)


def too_many_values(inputs: int, dimensions: int, param: str) -> InvalidRequest | None:
    """The error for a request whose answer would hold more than
    MAX_VALUES_PER_REQUEST numbers, or None."""
    if inputs * dimensions <= MAX_VALUES_PER_REQUEST:
        return None
    most = max(1, MAX_VALUES_PER_REQUEST // dimensions)
    return InvalidRequest(400, f"'{param}' has {inputs} inputs; with this model's {dimensions} dimensions the answer "
                          f"would hold {inputs * dimensions} numbers, over the {MAX_VALUES_PER_REQUEST} one request "
                          f"may have: send at most {most} inputs per request", "too_many_values", param)


def too_long(counts: list[int], limit: int, param: str, single: bool) -> InvalidRequest | None:
    """The error for the first input over `limit` tokens, or None."""
    for index, count in enumerate(counts):
        if count > limit:
            where = param if single else f"{param}[{index}]"
            return InvalidRequest(400, f"'{where}' is {count} tokens; the limit is {limit} per input "
                                  "([embeddings] n_ctx)", "input_too_long", where)
    return None


async def check_inputs(service: "Service", path: EmbeddingPath, value: Any,
                       param: str = "input") -> tuple[list[str], int]:
    """The texts of `value` and their token count, checked against
    [embeddings] n_ctx with the model's own tokenizer. Raises InvalidRequest
    naming `param` (or param[i]), or JobFailed when the lane can't take the
    request: asked before tokenizing, so a refused request costs no CPU."""
    inputs = input_texts(value, param)
    problem = too_many_values(len(inputs), path.dimensions, param)
    if problem is not None:
        raise problem
    path.admit()
    counter = service.counter
    assert counter is not None, "the service counts tokens once started"
    for index, item in enumerate(inputs):
        if isinstance(item, list):
            where = param if len(inputs) == 1 and not isinstance(value[0], list) else f"{param}[{index}]"
            problem = token_ids_problem(item, counter.n_vocab, where) if len(item) <= MAX_TOKEN_IDS else (
                f"'{where}' has {len(item)} token ids; the limit is {MAX_TOKEN_IDS}")
            if problem:
                raise InvalidRequest(400, problem, "invalid_token", where)
    # Tokenizing (and turning token ids back into text) takes a while for
    # up to 2048 inputs: off the loop.
    texts, counts = await asyncio.to_thread(_texts_and_counts, counter, inputs, param)
    problem = too_long(counts, service.config.embeddings.n_ctx, param, isinstance(value, str))
    if problem is not None:
        raise problem
    return texts, sum(counts)


def _texts_and_counts(counter, inputs: list[str | list[int]], param: str) -> tuple[list[str], list[int]]:
    """Each input as text with its token count. Token ids are this model's
    (OpenAI's API takes ids of the model's own vocabulary too): their text
    stands in for them only when it gives back the same ids."""
    texts, counts = [], []
    for index, item in enumerate(inputs):
        if isinstance(item, str):
            texts.append(item)
            counts.append(counter.count_text(item))
            continue
        text = counter.detokenize(item)
        problem = round_trip_problem(item, counter.tokenize(text, add_special=True, parse_special=True),
                                     counter.bos_id)
        if problem:
            raise InvalidRequest(400, f"'{param}[{index}]': {problem} (token ids are this model's vocabulary's; "
                                 "OpenAI's tiktoken ids mean other text here)", "unsupported_token_input",
                                 f"{param}[{index}]")
        texts.append(text)
        counts.append(len(item))
    return texts, counts


def embedding_path(service: "Service") -> EmbeddingPath:
    """The service's embedding path, or a 501 saying why there is none."""
    if service.embeddings is None:
        raise JobFailed(501, "embeddings_unavailable", f"embeddings are not served here: {service.embeddings_off_reason}")
    return service.embeddings


def encode_base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the vector's little-endian float32 bytes."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def json_off_the_loop(build: Callable[[], Any], headers: dict[str, str]) -> Response:
    """A JSON response whose body is built and encoded on a thread, a piece
    at a time (json_in_pieces): an answer of many vectors is megabytes of
    JSON, and encoding it on the event loop would hold up every other
    request (and /health) meanwhile."""
    body = await asyncio.to_thread(lambda: json_in_pieces(build()))
    return Response(body, media_type="application/json", headers=headers)


def json_in_pieces(value: Any) -> bytes:
    """`value` as JSON, byte for byte what starlette's JSONResponse writes,
    encoded one list item or object field at a time down to lists of plain
    values (one vector). One json.dumps call over megabytes holds the GIL to
    its end, on a thread or not, and with it the event loop (1.2 s for
    2048 x 576 floats); between pieces the loop gets its turn."""
    if isinstance(value, dict):
        return b"{" + b",".join(_json(str(key)) + b":" + json_in_pieces(item) for key, item in value.items()) + b"}"
    if isinstance(value, list) and any(isinstance(item, (dict, list)) for item in value):
        return b"[" + b",".join(json_in_pieces(item) for item in value) + b"]"
    return _json(value)


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def response_body(result: EmbeddingResult, options: EmbeddingOptions) -> dict[str, Any]:
    encode = encode_base64 if options.encoding_format == "base64" else (lambda vector: vector)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": index, "embedding": encode(vector)}
                 for index, vector in enumerate(result.vectors)],
        "model": result.model,
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    }


async def openai_embeddings(service: "Service", models: ModelNames, request: Request) -> Response:
    request_id = clean_request_id(request.headers.get("x-request-id")) or new_request_id()
    headers = {"X-Request-Id": request_id, "X-Served-By": "embed"}
    try:
        path = embedding_path(service)
        body = await read_json_object(request)
        options = check_body(body, models, path.dimensions)
        deadline_s = routing_headers(request).deadline_s
        with key_slot(request) as counted_as_used:  # the key's refusal comes before any work
            texts, counted = await check_inputs(service, path, body.get("input"))
            result = await embed_for(request, path, texts, counted, counted_as_used, request_id=request_id,
                                     deadline_s=deadline_s)
    except InvalidRequest as bad:
        if bad.status in (408, 413):
            # The body was not read to its end: the connection can't carry another request.
            headers["Connection"] = "close"
        return error_response(bad.status, bad.message, bad.code, param=bad.param, headers=headers)
    except JobFailed as failure:
        return OPENAI.failed(failure, headers)
    except ClientDisconnect:
        return Response(status_code=499)
    if result is None:
        return Response(status_code=499, headers=headers)
    return await json_off_the_loop(lambda: response_body(result, options), headers)


def key_slot(request: Request) -> ContextManager[Callable[[EmbeddingResult], None]]:
    """An embedding request under its key, every protocol's: raises JobFailed
    when the key may not use the model that embeds (the default model's
    file) or is at its concurrency (api/key_access.py). Entered before the
    inputs are tokenized or the lane is asked, so a refused key costs no
    work; it holds the key's slot until the answer, and what it yields
    counts the embedding in the key's usage."""
    access = request.app.state.key_access
    return access.embedding(request, access.service.default_model_host)


async def embed_for(request: Request, path: EmbeddingPath, texts: list[str], counted: int,
                    counted_as_used: Callable[[EmbeddingResult], None], *, request_id: str,
                    deadline_s: float | None) -> EmbeddingResult | None:
    """Embed for a client, every protocol's way, inside its key_slot: None if
    the client went away first (its slot or queue place goes to the next one
    at once). Raises JobFailed."""
    work = asyncio.create_task(path.embed(texts, request_id=request_id, deadline_s=deadline_s))
    watcher = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            await asyncio.wait({work})
            return None
        result = work.result()
    finally:
        watcher.cancel()
    if not result.prompt_tokens:
        # The worker did not say: our own count, which includes a BOS per input.
        result = EmbeddingResult(result.vectors, counted, result.model)
    counted_as_used(result)
    return result


async def _disconnected(request: Request) -> None:
    # Once the body is read, the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
