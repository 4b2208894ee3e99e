"""The HTTP face: OpenAI-compatible routes on one localhost port.

Handlers validate, ask the service to admit, then either aggregate the
worker's stream (non-streaming clients) or relay it (SSE). Headers are only
sent once the first token exists, which is what makes a replay on the CPU
invisible to the client when the GPU fails before answering.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_CONTENT_TYPE
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route as HttpRoute

from ..dispatch.jobs import Job, JobFailed, JobKind, new_request_id
from ..dispatch.quarantine import request_fingerprint
from ..service import Service
from . import bounds
from .errors import error_bytes, error_response, failed_response, failure_body
from .idempotency import IdempotencyStore
from .openai_request import InvalidRequest, constrain_output, flatten_content
from .openapi import build_openapi

MAX_MESSAGES = 1024


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


# Fields passed through to the worker: checked here so a bad value is a 400
# that names the field, not an exception inside the model server.
SAMPLING_RULES = {
    **{field: rule.problem for field, rule in bounds.SAMPLING.items()},
    "stop": bounds.stop_problem,
    "logit_bias": _logit_bias,
    "user": _of_type(str, "a string"),
    "response_format": _of_type(dict, "an object"),
    "tools": _of_type(list, "a list"),
    "stream_options": _of_type(dict, "an object"),
}


# More memory than any GPU has: a bigger number is a typo or an attack.
PRESSURE_RULE = bounds.Range(False, 0, 16 * 1024 * 1024).problem


_Invalid = InvalidRequest


class AggregatingSink:
    """Collects a worker's stream into one OpenAI response object."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def emit(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def reset(self) -> None:
        self.events.clear()

    def chat_response(self, job: Job) -> dict[str, Any]:
        content: list[str] = []
        tool_calls: dict[int, dict[str, Any]] = {}
        finish_reason = None
        created = int(time.time())
        for event in self.events:
            created = event.get("created", created)
            for choice in event.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    content.append(delta["content"])
                for call in delta.get("tool_calls") or ():
                    slot = tool_calls.setdefault(call.get("index", 0), {
                        "id": call.get("id"), "type": "function", "function": {"name": "", "arguments": ""}})
                    function = call.get("function") or {}
                    slot["id"] = slot["id"] or call.get("id")
                    slot["function"]["name"] += function.get("name") or ""
                    slot["function"]["arguments"] += function.get("arguments") or ""
                if choice.get("finish_reason"):
                    finish_reason = choice["finish_reason"]
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content) if content or not tool_calls else None}
        if tool_calls:
            message["tool_calls"] = [tool_calls[i] for i in sorted(tool_calls)]
        completion_tokens = job.attempts[-1].tokens if job.attempts else 0
        return {
            "id": f"chatcmpl-{job.id}",
            "object": "chat.completion",
            "created": created,
            "model": self._model(job),
            "system_fingerprint": self._fingerprint(),
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
            "usage": _usage(job.prompt_tokens, completion_tokens),
        }

    def completion_response(self, job: Job) -> dict[str, Any]:
        text: list[str] = []
        finish_reason = None
        created = int(time.time())
        for event in self.events:
            created = event.get("created", created)
            for choice in event.get("choices") or ():
                text.append(choice.get("text") or "")
                if choice.get("finish_reason"):
                    finish_reason = choice["finish_reason"]
        completion_tokens = job.attempts[-1].tokens if job.attempts else 0
        return {
            "id": f"cmpl-{job.id}",
            "object": "text_completion",
            "created": created,
            "model": self._model(job),
            "system_fingerprint": self._fingerprint(),
            "choices": [{"index": 0, "text": "".join(text), "logprobs": None, "finish_reason": finish_reason}],
            "usage": _usage(job.prompt_tokens, completion_tokens),
        }

    def _model(self, job: Job) -> str:
        return self.events[0].get("model", "") if self.events else ""

    def _fingerprint(self) -> str | None:
        return self.events[0].get("system_fingerprint") if self.events else None


def _wants_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _usage_chunk(job: Job, last_event: dict[str, Any]) -> dict[str, Any]:
    """The last chunk OpenAI sends for stream_options.include_usage: no
    choices, the usage of the whole request (of its one execution, after a
    replay too: the replay started from nothing)."""
    completion_tokens = job.attempts[-1].tokens if job.attempts else 0
    return {
        "id": last_event.get("id"),
        "object": "chat.completion.chunk" if job.kind is JobKind.CHAT else "text_completion",
        "created": last_event.get("created", int(time.time())),
        "model": last_event.get("model"),
        "system_fingerprint": last_event.get("system_fingerprint"),
        "choices": [],
        "usage": _usage(job.prompt_tokens, completion_tokens),
    }


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class QueueSink:
    """Hands events to the SSE relay; the first emit commits the job."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def emit(self, event: dict[str, Any]) -> None:
        self.job.committed = True
        self.queue.put_nowait(("event", event))

    def reset(self) -> None:
        assert not self.job.committed, "a committed stream can't be reset"


def _sse(payload: Any) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


class Router:
    def __init__(self, service: Service) -> None:
        self.service = service
        self.dispatcher = service.dispatcher
        self.idempotency = IdempotencyStore()

    # ----- small routes -----------------------------------------------------

    async def health(self, request: Request) -> Response:
        ok, reason = self.service.health()
        return JSONResponse({"status": "ok" if ok else "unavailable", "reason": reason}, status_code=200 if ok else 503)

    async def status(self, request: Request) -> Response:
        return JSONResponse(self.service.status())

    async def metrics(self, request: Request) -> Response:
        return Response(self.service.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    async def openapi(self, request: Request) -> Response:
        config = self.service.config
        return JSONResponse(build_openapi(max(config.gpu.n_ctx, config.cpu.n_ctx), MAX_MESSAGES))

    async def models(self, request: Request) -> Response:
        ids = [self.service.model_id]
        if self.service.fallback_model_id not in ids:
            ids.append(self.service.fallback_model_id)
        created = int(self.service.started_at)
        config = self.service.config
        # What a client may ask of each model here, so it can adapt rather
        # than learn from a 400.
        capabilities = {
            "max_choices": bounds.MAX_N, "logprobs": False, "vision": False, "tools": True,
            "structured_output": ["json_object", "json_schema", "grammar"],
            "context_length": max(config.gpu.n_ctx, config.cpu.n_ctx),
        }
        return JSONResponse({"object": "list", "data": [
            {"id": model_id, "object": "model", "created": created, "owned_by": "local",
             "capabilities": capabilities} for model_id in ids]})

    async def cancel(self, request: Request) -> Response:
        request_id = request.path_params["request_id"]
        result = self.service.cancel(request_id)
        if result is None:
            return error_response(404, f"no queued or running request has id {request_id!r}; "
                                  "it may have finished already", "request_not_found")
        return JSONResponse(result)

    async def admin_gpu(self, request: Request) -> Response:
        try:
            body = await _json_object(request)
        except _Invalid as bad:
            return error_response(bad.status, bad.message, bad.code)
        if "paused" in body:
            if not isinstance(body["paused"], bool):
                return error_response(400, "'paused' must be true or false", "invalid_value", param="paused")
            self.service.set_gpu_paused(body["paused"])
        if "simulated_pressure_mib" in body:
            problem = PRESSURE_RULE(body["simulated_pressure_mib"])
            if problem:
                return error_response(400, f"'simulated_pressure_mib' {problem}", "invalid_value",
                                      param="simulated_pressure_mib")
            value = body["simulated_pressure_mib"]
            try:
                self.service.set_simulated_pressure(float(value))
            except ValueError as exc:
                return error_response(409, str(exc), "not_simulated")
        return JSONResponse({"gpu_paused": self.service.gpu_paused, "gpu": self.service.gpu_status()})

    async def admin_restart(self, request: Request) -> Response:
        self.service.restart_workers()
        return JSONResponse({"restarting": True})

    # ----- completions ----------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, JobKind.CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, JobKind.COMPLETION)

    async def _complete(self, request: Request, kind: JobKind) -> Response:
        request_id = _clean_request_id(request.headers.get("x-request-id")) or new_request_id()
        base_headers = {"X-Request-Id": request_id}
        try:
            body = await _json_object(request)
            self._validate(body, kind)
            force_cpu, deadline_s = _routing_headers(request)
        except _Invalid as bad:
            headers = dict(base_headers)
            if bad.status in (408, 413):
                # The body was not read to its end: the connection can't carry another request.
                headers["Connection"] = "close"
            return error_response(bad.status, bad.message, bad.code, param=bad.param, headers=headers)
        except ClientDisconnect:
            return Response(status_code=499)

        idempotency_key = request.headers.get("idempotency-key")
        if not idempotency_key:
            return await self._admit_and_run(request, kind, body, request_id, force_cpu, deadline_s)
        fingerprint = hashlib.sha256(json.dumps([kind.value, body], sort_keys=True).encode()).hexdigest()
        try:
            entry = self.idempotency.lookup(idempotency_key, fingerprint)
            if entry is not None:
                return await self._replay_idempotent(entry, base_headers)
        except JobFailed as failure:
            return failed_response(failure, base_headers)
        # Claimed before any await: a twin arriving meanwhile finds the claim
        # and waits for this result instead of running again.
        claim = self.idempotency.claim(idempotency_key, fingerprint, request_id)
        try:
            response = await self._admit_and_run(request, kind, body, request_id, force_cpu, deadline_s)
        except BaseException:
            self.idempotency.forget(idempotency_key, request_id)
            _resolve(claim, ("json", 500, {}, error_bytes(
                500, "the first request with this Idempotency-Key failed inside the server; retry it",
                "internal_error")))
            raise
        self._settle_claim(claim, idempotency_key, request_id, response)
        return response

    async def _admit_and_run(self, request: Request, kind: JobKind, body: dict[str, Any], request_id: str,
                             force_cpu: bool, deadline_s: float | None) -> Response:
        base_headers = {"X-Request-Id": request_id}
        job = Job(id=request_id, kind=kind, body=body, stream=bool(body.get("stream")),
                  force_cpu=force_cpu, deadline_s=deadline_s)
        job.fingerprint = request_fingerprint(kind.value, body)
        # Registered before the first await, so a twin with the same id that
        # arrives while this one's prompt is counted finds it taken.
        if not self.dispatcher.register(job):
            return error_response(409, f"a request with X-Request-Id {request_id!r} is already in flight; "
                                  "send a new id, or an Idempotency-Key to share its result", "duplicate_request_id",
                                  headers=base_headers)
        try:
            job.prompt_tokens = await self._count_prompt(job)
        except BaseException as exc:
            self.dispatcher.unregister(job)
            if isinstance(exc, _Invalid):
                return error_response(exc.status, exc.message, exc.code, param=exc.param, headers=base_headers)
            raise
        job.max_tokens = self.dispatcher.token_limit(job.prompt_tokens, _requested_limit(body),
                                                     job.kind is JobKind.CHAT)
        # From here the dispatcher owns the job: it decides, runs, and unregisters it.
        if job.stream:
            return await self._stream(request, job)
        return await self._aggregate(request, job)

    def _settle_claim(self, claim: asyncio.Future, key: str, request_id: str, response: Response) -> None:
        """Keep a result (an answer, or a client error that would repeat); let
        go of the key after a failure, so a retry with it runs for real."""
        if isinstance(response, _RecordedStream):
            def finished(recorded) -> None:
                chunks = recorded[2]
                if not chunks or chunks[-1] != b"data: [DONE]\n\n":
                    self.idempotency.forget(key, request_id)
                _resolve(claim, recorded)
            response.on_finish = finished
            return
        if response.status_code >= 500 or response.status_code in (408, 409, 499):
            self.idempotency.forget(key, request_id)
        _resolve(claim, ("json", response.status_code, dict(response.headers), response.body))

    async def _replay_idempotent(self, entry, base_headers: dict[str, str]) -> Response:
        recorded = await self.idempotency.wait(entry)
        kind = recorded[0]
        if kind == "json":
            _, status, headers, body = recorded
            headers = {k: v for k, v in headers.items() if k.lower() not in ("content-length", "content-type")}
            headers["X-Idempotent-Replay"] = "true"
            return Response(body, status_code=status, headers=headers, media_type="application/json")
        _, headers, chunks = recorded
        headers = {**headers, "X-Idempotent-Replay": "true"}

        async def replay() -> AsyncIterator[bytes]:
            for chunk in chunks:
                yield chunk
        return StreamingResponse(replay(), media_type="text/event-stream", headers=headers)

    def _validate(self, body: dict[str, Any], kind: JobKind) -> None:
        model = body.get("model")
        if model is not None:
            if not isinstance(model, str):
                raise _Invalid(400, "'model' must be a string", "invalid_type", "model")
            known = {self.service.model_id, self.service.fallback_model_id, self.service.model_info.path.name, "default"}
            if model not in known:
                raise _Invalid(404, f"the model {model!r} does not exist here; available: "
                               f"{', '.join(sorted({self.service.model_id, self.service.fallback_model_id}))}",
                               "model_not_found", "model")
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
            flatten_content(messages, self.service.model_id)
        else:
            prompt = body.get("prompt")
            if prompt is None:
                raise _Invalid(400, "'prompt' is required", "missing_field", "prompt")
            if not isinstance(prompt, str):
                raise _Invalid(400, "'prompt' must be a string (token arrays and batches are not supported)",
                               "invalid_type", "prompt")
            if not prompt:
                raise _Invalid(400, "'prompt' is empty; send at least one character", "empty_prompt", "prompt")
        largest_context = max(self.service.config.gpu.n_ctx, self.service.config.cpu.n_ctx)
        for field in bounds.TOKEN_LIMIT_FIELDS:
            value = body.get(field)
            problem = bounds.TOKENS.problem(value) if value is not None else None
            if problem:
                raise _Invalid(400, f"'{field}' {problem}", "invalid_value", field)
            if value is not None and value > largest_context:
                raise _Invalid(400, f"'{field}' is {value}; the limit is {largest_context}, the largest context "
                               "this server offers", "max_tokens_too_large", field)
        n = body.get("n", 1)
        if n is not None and bounds.N.problem(n):
            raise _Invalid(400, f"'n' must be {bounds.MAX_N}: this server generates one choice per request "
                           "(capabilities.max_choices in GET /v1/models); send several requests instead",
                           "invalid_value", "n")
        stream = body.get("stream", False)
        if stream is not None and not isinstance(stream, bool):
            raise _Invalid(400, "'stream' must be true or false", "invalid_type", "stream")
        if body.get("logprobs") or body.get("top_logprobs"):
            raise _Invalid(400, "logprobs are not available here: the llama-cpp-python workers would have to keep "
                           "the logits of every context position (about 1.5 GiB at 8k context for a 135M model), "
                           "so they run without them (capabilities.logprobs in GET /v1/models)",
                           "unsupported_parameter", "logprobs")
        for field, rule in SAMPLING_RULES.items():
            if body.get(field) is not None:
                problem = rule(body[field])
                if problem:
                    raise _Invalid(400, f"'{field}' {problem}", "invalid_value", field)
        counter = self.service.counter
        assert counter is not None
        constrain_output(body, counter.grammar_problem)

    async def _count_prompt(self, job: Job) -> int:
        counter = self.service.counter
        assert counter is not None
        try:
            if job.kind is JobKind.CHAT:
                return await asyncio.to_thread(counter.count_chat, job.body["messages"], job.body.get("tools"))
            return await asyncio.to_thread(counter.count_text, job.body["prompt"])
        except Exception as exc:  # a template can reject odd message shapes
            raise _Invalid(400, f"the messages can't be rendered with the model's chat template: {exc}",
                           "invalid_messages", "messages") from None

    def _route_headers(self, job: Job) -> dict[str, str]:
        headers = {
            "X-Request-Id": job.id,
            "X-Served-By": job.path or "none",
            "X-Route-Reason": job.reason.value if job.reason else "none",
        }
        estimated = job.estimated_latency_s
        if job.path == "cpu":
            headers["X-Fallback-Model"] = self.service.fallback_model_id
            headers["X-Estimated-Latency"] = f"{estimated:.2f}" if estimated is not None else "unknown"
        elif estimated is not None:  # refused at admission: what the CPU would have taken
            headers["X-Estimated-Latency"] = f"{estimated:.2f}"
        if job.queue_wait_s:
            headers["X-Queue-Wait"] = f"{job.queue_wait_s:.3f}"
        return headers

    async def _aggregate(self, request: Request, job: Job) -> Response:
        sink = AggregatingSink()
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
        try:
            await self.dispatcher.run(job, sink)
        except JobFailed as failure:
            return failed_response(failure, self._route_headers(job))
        finally:
            watcher.cancel()
        body = sink.chat_response(job) if job.kind is JobKind.CHAT else sink.completion_response(job)
        return JSONResponse(body, headers=self._route_headers(job))

    async def _stream(self, request: Request, job: Job) -> Response:
        sink = QueueSink(job)
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job))

        async def run() -> None:
            try:
                await self.dispatcher.run(job, sink)
                sink.queue.put_nowait(("done", None))
            except JobFailed as failure:
                sink.queue.put_nowait(("failed", failure))
            except Exception as exc:  # never leave the client hanging
                sink.queue.put_nowait(("failed", JobFailed(500, "internal_error", f"internal error: {exc!r}")))

        task = asyncio.create_task(run())
        first_kind, first_value = await sink.queue.get()
        if first_kind == "failed":
            watcher.cancel()
            return failed_response(first_value, self._route_headers(job))
        headers = self._route_headers(job)
        return _RecordedStream(self._relay(job, sink, task, watcher, (first_kind, first_value)), headers)

    async def _relay(self, job: Job, sink: QueueSink, task: asyncio.Task, watcher: asyncio.Task,
                     first: tuple[str, Any]) -> AsyncIterator[bytes]:
        kind, value = first
        finished = False
        last_event: dict[str, Any] = {}
        try:
            while True:
                if kind == "event":
                    last_event = value
                    yield _sse(value)
                elif kind == "done":
                    if _wants_usage(job.body):
                        yield _sse(_usage_chunk(job, last_event))
                    yield b"data: [DONE]\n\n"
                    finished = True
                    return
                else:
                    failure: JobFailed = value
                    yield _sse(failure_body(failure))
                    finished = True
                    return
                kind, value = await sink.queue.get()
        finally:
            watcher.cancel()
            if not finished:
                # The client went away mid-stream: stop the worker generating.
                job.cancel("the client disconnected")
            await asyncio.shield(task)


class _RecordedStream(StreamingResponse):
    """An SSE response that keeps what it sent, for Idempotency-Key replays."""

    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str]) -> None:
        self.chunks: list[bytes] = []
        self.on_finish = None
        self._route_headers = headers

        async def recording() -> AsyncIterator[bytes]:
            try:
                async for chunk in content:
                    self.chunks.append(chunk)
                    yield chunk
            finally:
                if self.on_finish is not None:
                    self.on_finish(("stream", self._route_headers, list(self.chunks)))

        super().__init__(recording(), media_type="text/event-stream", headers=headers)


def _resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    # Once the body is read, the next ASGI message is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel("the client disconnected")
            return


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
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise _Invalid(408, f"the request body did not arrive within {timeout:g} s "
                       "([server] body_timeout_s)", "request_timeout") from None
    return b"".join(chunks)


async def _json_object(request: Request) -> dict[str, Any]:
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


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; send a finite number")


def parse_json_body(raw: bytes) -> Any:
    """Strict JSON: no NaN/Infinity (they can't be sent back in a response,
    and no sampling field means anything with them), bounded nesting, and
    every failure a 400 in the envelope rather than a 500 from a parser."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise _Invalid(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", "invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise _Invalid(400, f"the request body is not valid JSON: {exc}", "invalid_json") from None
    if _depth_over(body, MAX_JSON_DEPTH):
        raise _Invalid(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", "invalid_json")
    return body


def _depth_over(value: Any, limit: int) -> bool:
    # Iterative, so the check itself can't be what overflows the stack.
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False


def _requested_limit(body: dict[str, Any]) -> int | None:
    """The client's generation limit under either name; the smaller if both."""
    limits = [body[f] for f in ("max_tokens", "max_completion_tokens") if body.get(f) is not None]
    return min(limits) if limits else None


def _routing_headers(request: Request) -> tuple[bool, float | None]:
    force = request.headers.get("x-force-path", "").strip().lower()
    if force not in ("", "cpu", "auto"):
        raise _Invalid(400, "X-Force-Path must be 'cpu' or 'auto'", "invalid_header", "X-Force-Path")
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
    return force == "cpu", deadline


def _clean_request_id(raw: str | None) -> str | None:
    if not raw:
        return None
    cleaned = raw.strip()
    if not cleaned or len(cleaned) > 128 or not all(c.isalnum() or c in "-_.:" for c in cleaned):
        return None
    return cleaned


def create_app(service: Service, *, manage_lifecycle: bool = True) -> Starlette:
    router = Router(service)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        if manage_lifecycle:
            await service.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                await service.stop()

    routes = [
        HttpRoute("/health", router.health, methods=["GET"]),
        HttpRoute("/status", router.status, methods=["GET"]),
        HttpRoute("/v1/models", router.models, methods=["GET"]),
        HttpRoute("/openapi.json", router.openapi, methods=["GET"]),
        HttpRoute("/metrics", router.metrics, methods=["GET"]),
        HttpRoute("/v1/chat/completions", router.chat_completions, methods=["POST"]),
        HttpRoute("/v1/completions", router.completions, methods=["POST"]),
        # The same routes without /v1, as llama.cpp's server offers them, for
        # clients configured with a base URL that lacks it.
        HttpRoute("/models", router.models, methods=["GET"]),
        HttpRoute("/chat/completions", router.chat_completions, methods=["POST"]),
        HttpRoute("/completions", router.completions, methods=["POST"]),
        HttpRoute("/v1/requests/{request_id}", router.cancel, methods=["DELETE"]),
        HttpRoute("/admin/gpu", router.admin_gpu, methods=["POST"]),
        HttpRoute("/admin/restart", router.admin_restart, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        404: _not_found, 405: _method_not_allowed, 500: _internal_error,
    })
    app.state.service = service
    return app


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(404, f"no route {request.method} {request.url.path}; see GET /v1/models, "
                          "POST /v1/chat/completions, POST /v1/completions, GET /status", "not_found")


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(405, f"{request.method} is not allowed on {request.url.path}", "method_not_allowed")


async def _internal_error(request: Request, exc: Exception) -> Response:
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")
