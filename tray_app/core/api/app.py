"""The HTTP face: OpenAI-compatible routes on one localhost port.

Handlers read and check the request (requests.py), count its prompt,
register it with the dispatcher and hand it a sink (sinks.py): aggregated
for JSON clients, relayed as SSE for streams. Headers are only
sent once the first token exists, which is what makes a replay on the CPU
invisible to the client when the GPU fails before answering.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import json
import logging
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any, AsyncIterator, Callable, Iterator

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route as HttpRoute

from ..catalog.tokens import Prompt, PromptCounter, short_chat
from ..dispatch.admission import CONTEXT_SAFETY_TOKENS, Reason
from ..dispatch.jobs import Job, JobFailed, JobKind, JobRequest, new_request_id
from ..dispatch.peer import HOP_HEADER
from ..dispatch.quarantine import request_fingerprint
from ..grammar.check import GrammarChecker
from ..model_host import ModelHost
from ..access.keys import ApiKey, KeyStore
from ..service import Service
from ..access.usage import Outcome, UsageStore
from .embeddings import openai_embeddings
from .errors import error_response_for_path
from .admin_routes import AdminRoutes
from .idempotency import IdempotencyStore
from .key_access import KeyAccess, Refusal, model_allowed, model_host_named, usage_name
from .security import effective_api_key, principal_of
from .openai_request import DECODED_BYTES_PER_PIXEL, InvalidRequest, image_parts, text_only
from .anthropic import AnthropicMessages
from .ollama import DEFAULT_TAG
from .llamacpp import LlamaCppRoutes
from .ollama_routes import OllamaRoutes
from .web_page import web_page, worker_logs
from .key_routes import key_routes
from .model_list import openai_model_list
from .protocol import Protocol, Translated
from .remote_images import RemoteImageFetcher
from .responses import ResponsesRoutes
from .service_routes import ServiceRoutes
from .requests import (
    Checked, ModelNames, Routing, check_model, clean_request_id, client_name, read_json_object,
    requested_limit, routing_headers, validate,
)
from .sinks import AggregatingSink, QueueSink, RecordedStream, Write
from . import degraded_note

_Invalid = InvalidRequest

# The key of the request a llama.cpp tokenizer route is answering: the
# route's model lookup (HttpApp.tokenizer_model_host, called by llamacpp.py) is
# given a model name, not the request.
log = logging.getLogger(__name__)

# X-Request-Ids remembered to tell a fresh id from a reused one: as many as
# the execution ledger counts.
REMEMBERED_REQUEST_IDS = 10_000

_TOKENIZING_KEY: ContextVar[ApiKey | None] = ContextVar("tokenizing_key", default=None)


class HttpApp:
    def __init__(self, service: Service, usage: UsageStore | None = None) -> None:
        self.service = service
        self.access = KeyAccess(service, usage or UsageStore(), KeyStore())
        self._names_for: tuple[Any, ModelNames] | None = None
        # The library holds each model's served contexts (sized at start where the config says 0).
        self.largest_context = max(max(m.gpu_n_ctx, m.cpu_n_ctx) for m in service.library)
        self.idempotency = IdempotencyStore()
        # X-Request-Id -> the identity of the key that used it ("" without keys).
        self._id_owners: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.anthropic = AnthropicMessages(self.largest_context)
        self.openai = Protocol()
        self.openai.reasoning_field = service.config.server.reasoning_field
        self._grammars: GrammarChecker | None = None
        self.remote_images = RemoteImageFetcher.from_config(service.config.server)

    @property
    def model_names(self) -> ModelNames:
        """The names requests may use: the library's (it grows when the
        models folder is rescanned), worked out once per library."""
        service = self.service
        if self._names_for is None or self._names_for[0] is not service.library:
            served = frozenset({service.fallback_model_id} | {model_host.model_id for model_host in service.model_hosts.values()})
            accepted = served | {service.model_info.path.name, "default"} | {
                name for model in service.library for name in (*model.names(), model.path.name)}
            # Ollama's clients name models with a tag (GET /api/tags lists ":latest").
            # A model sees when its model host loaded a projector (the runtime reads images).
            seeing_models = [model_host.model for model_host in service.model_hosts.values() if model_host.projector is not None]
            seeing = {name for model in seeing_models for name in (*model.names(), model.path.name)}
            names = ModelNames(service.model_id, served, accepted | {name + DEFAULT_TAG for name in accepted},
                               unknown_is_default=service.config.model.unknown_name == "default",
                               seeing=frozenset(seeing | {name + DEFAULT_TAG for name in seeing}),
                               seeing_models=tuple(model.name for model in seeing_models))
            self._names_for = (service.library, names)
        return self._names_for[1]

    @property
    def grammars(self) -> GrammarChecker:
        """The grammar checker, started with the first structured request."""
        if self._grammars is None:
            self._grammars = GrammarChecker(self.service.model_info.path)
        return self._grammars

    async def _constrain(self, body: dict[str, Any], checked: Checked) -> None:
        """The answer's constraint as the body's GBNF grammar, converted and
        parsed by llama.cpp in the grammar checker's child process: never in
        this process, whose crash would take every request with it."""
        constraint = checked.constraint
        if constraint is None:
            return
        checker = self.grammars
        verdict = await (checker.check_schema(constraint.schema) if constraint.schema is not None
                         else checker.check_grammar(constraint.grammar or ""))
        if verdict.grammar is None:
            status = 503 if verdict.code == "grammar_checker_unavailable" else 400
            raise _Invalid(status, f"'{constraint.param}' can't constrain the answer: {verdict.problem}",
                           verdict.code or "invalid_grammar", constraint.param)
        body["grammar"] = verdict.grammar

    async def models(self, request: Request) -> Response:
        return JSONResponse(openai_model_list(self.service, principal_of(request.scope)))

    # ----- completions ----------------------------------------------------------

    async def messages(self, request: Request) -> Response:
        return await self.complete(request, JobKind.CHAT, self.anthropic)

    async def count_message_tokens(self, request: Request) -> Response:
        """Anthropic's /v1/messages/count_tokens: the prompt as the model's
        template renders it, counted by the same tokenizer admission uses."""
        protocol = self.anthropic
        try:
            body = await read_json_object(request)
            body.setdefault("max_tokens", 1)  # not part of this route's body
            translated = protocol.translate(body, JobKind.CHAT)
            checked = validate(translated.body, JobKind.CHAT, self.model_names, self.largest_context,
                               remote_images=self.remote_images.allowed)
            await self.remote_images.fetch_into(translated.body, checked.remote_images, checked.image_pixels)
            await self._constrain(translated.body, checked)
            job = Job(JobRequest(id=new_request_id(), kind=JobKind.CHAT, body=translated.body, stream=False,
                                 images=checked.images))
            model_host = self._model_host(translated.body.get("model"))
            with self.access.holding(request, model_host):
                await self.service.ensure_started(model_host)
                tokens = await self._count_prompt(job, model_host)
        except _Invalid as bad:
            return protocol.error(bad.status, bad.message, bad.code, param=bad.param)
        except Refusal as refusal:
            return protocol.error(refusal.status, refusal.message, refusal.code, headers=refusal.headers)
        except ClientDisconnect:
            return Response(status_code=499)
        return JSONResponse({"input_tokens": tokens})

    def tokenizer_route(self, handler):
        """A llama.cpp tokenizer route (/tokenize, /detokenize,
        /apply-template, /props) under the request's key: a slot of its
        concurrency while it runs, and the model it names checked by
        tokenizer_model_host."""
        async def route(request: Request) -> Response:
            try:
                with self.access.holding(request):
                    token = _TOKENIZING_KEY.set(principal_of(request.scope))
                    try:
                        return await handler(request)
                    finally:
                        _TOKENIZING_KEY.reset(token)
            except Refusal as refusal:
                answer = error_response_for_path(request.url.path, refusal.status, refusal.message, refusal.code)
                answer.headers.update(refusal.headers)
                return answer
        return route

    def tokenizer_model_host(self, model: Any) -> ModelHost:
        """The model host of a tokenizer route's model, if the request's key may use it."""
        try:
            return self.access.usable_model_host(_TOKENIZING_KEY.get(), self._model_host(model))
        except Refusal as refusal:
            raise _Invalid(refusal.status, refusal.message, refusal.code) from None

    def listing_route(self, handler):
        """An Ollama route listing models ({"models": [{"name": ...}]}:
        /api/tags, /api/ps) with only those the request's key may use."""
        async def route(request: Request) -> Response:
            answer = await handler(request)
            principal = principal_of(request.scope)
            if principal is None or not principal.models or answer.status_code != 200:
                return answer
            listed = json.loads(answer.body)
            listed["models"] = [entry for entry in listed["models"]
                                if model_allowed(principal, self._model_host(entry["name"]))]
            return JSONResponse(listed)
        return route

    async def chat_completions(self, request: Request) -> Response:
        return await self.complete(request, JobKind.CHAT)

    async def completions(self, request: Request) -> Response:
        return await self.complete(request, JobKind.COMPLETION)

    async def embeddings(self, request: Request) -> Response:
        # Its own worker and lane (core.embeddings): not through the dispatcher;
        # the key's limits and usage through key_slot (request.app.state.key_access).
        return await openai_embeddings(self.service, self.model_names, request)

    async def complete(self, request: Request, kind: JobKind, protocol: Protocol | None = None) -> Response:
        """A chat or completion in any protocol (OpenAI's without one): read,
        translate to an OpenAI body, check, then admit and run it (or replay
        an Idempotency-Key's result)."""
        protocol = protocol or self.openai
        request_id = self._request_id(request)
        base_headers = {"X-Request-Id": request_id}
        try:
            body = await read_json_object(request)
            await protocol.prepare(body)
            translated = protocol.translate(body, kind)
            kind, body = translated.kind, translated.body
            if translated.load_only:
                return self._load_only(request, translated, protocol)
            checked = validate(body, kind, self.access.names_seen_by(principal_of(request.scope), self.model_names),
                               self.largest_context, logprobs=self.service.supports_logprobs,
                               remote_images=self.remote_images.allowed)
            await self._constrain(body, checked)
            routing = routing_headers(request)
            request.state.degraded_note = degraded_note.wanted(request.headers.get(degraded_note.NOTE_HEADER),
                                                               self.service.config.server.degraded_note)
        except _Invalid as bad:
            headers = dict(base_headers)
            if bad.status in (408, 413):
                # The body was not read to its end: the connection can't carry another request.
                headers["Connection"] = "close"
            return protocol.error(bad.status, bad.message, bad.code, param=bad.param, headers=headers)
        except ClientDisconnect:
            return Response(status_code=499)

        idempotency_key = request.headers.get("idempotency-key")
        if not idempotency_key:
            checked, unfetched = await self._fetch_images(request, translated, checked, protocol, request_id)
            if unfetched is not None:
                return unfetched
            return await self._admit_and_run(request, translated, request_id, routing, checked, protocol)
        # Each API key's Idempotency-Keys are its own: another key sending the same one (and
        # body) runs its own request, and learns nothing of the first.
        principal = principal_of(request.scope)
        owner = principal.identity if principal is not None else ""
        # The request as the client sent it, image addresses and not their bytes: a retry with
        # its key is answered from the first run's result without fetching anything again.
        fingerprint = hashlib.sha256(json.dumps([protocol.name, kind.value, body, translated.context_cap,
                                                 translated.keep_alive_s], sort_keys=True).encode()).hexdigest()
        try:
            entry = self.idempotency.lookup(idempotency_key, fingerprint, owner)
            if entry is not None:
                return await _replay_idempotent(self.idempotency, entry, base_headers)
        except JobFailed as failure:
            return protocol.failed(failure, base_headers)
        # Claimed before any await: a twin arriving meanwhile finds the claim
        # and waits for this result instead of running again.
        claim = self.idempotency.claim(idempotency_key, fingerprint, request_id, owner)
        try:
            checked, unfetched = await self._fetch_images(request, translated, checked, protocol, request_id)
            if unfetched is not None:
                # Not kept for the key: an image server that was down may be up for the retry.
                self.idempotency.forget(idempotency_key, request_id, owner)
                _resolve(claim, _recorded_json(unfetched))
                return unfetched
            response = await self._admit_and_run(request, translated, request_id, routing, checked, protocol)
        except BaseException:
            self.idempotency.forget(idempotency_key, request_id, owner)
            _resolve(claim, ("json", 500, {}, protocol.error(
                500, "the first request with this Idempotency-Key failed inside the server; retry it",
                "internal_error").body))
            raise
        _settle_claim(self.idempotency, claim, idempotency_key, owner, request_id, response)
        return response

    def _request_id(self, request: Request) -> str:
        """The client's X-Request-Id while it names no other request: one
        never used, or the same key's still in flight (a twin, refused with
        a 409). An id an ended request or another key used gets a new one
        (the answer's X-Request-Id says which): ids stay unique, so no key
        reads another's decisions or cancels its work, and reusing one is
        not taken for a second execution of the first."""
        asked = clean_request_id(request.headers.get("x-request-id"))
        if asked is None or asked not in self._id_owners:
            return asked or new_request_id()
        principal = principal_of(request.scope)
        if self._id_owners[asked] == (principal.identity if principal is not None else "") \
                and self.service.request_in_flight(asked):
            return asked
        return new_request_id()

    def _remember_id(self, request_id: str, principal: ApiKey | None) -> None:
        self._id_owners[request_id] = principal.identity if principal is not None else ""
        self._id_owners.move_to_end(request_id)
        while len(self._id_owners) > REMEMBERED_REQUEST_IDS:
            self._id_owners.popitem(last=False)

    async def _fetch_images(self, request: Request, translated: Translated, checked: Checked, protocol: Protocol,
                            request_id: str) -> tuple[Checked, Response | None]:
        """The request's remote images fetched into its body: the checks with
        their pixels counted, and None when they all came, else the 400
        naming the first that didn't (or the key's refusal). Before
        admission, so a replay after a worker's fault carries the bytes and
        never fetches; after an Idempotency-Key's lookup, so a retry doesn't
        either; under one of the key's slots, so a key limited to one request
        at a time fetches for one at a time."""
        if not checked.remote_images:
            return checked, None
        try:
            with self.access.holding(request, self._model_host(translated.body.get("model"))):
                pixels = await self.remote_images.fetch_into(translated.body, checked.remote_images,
                                                             checked.image_pixels)
        except _Invalid as bad:
            return checked, protocol.error(bad.status, bad.message, bad.code, param=bad.param,
                                           headers={"X-Request-Id": request_id})
        except Refusal as refusal:
            return checked, protocol.error(refusal.status, refusal.message, refusal.code,
                                           headers={"X-Request-Id": request_id, **refusal.headers})
        return dataclasses.replace(checked, image_pixels=pixels), None

    def _load_only(self, request: Request, translated: Translated, protocol: Protocol) -> Response:
        """Ollama's empty prompt: load the model, or with keep_alive 0 unload
        it. It counts as using the model: the key's model list applies."""
        check_model(translated.body.get("model"), self.model_names)
        principal = principal_of(request.scope)
        try:
            model_host = self.access.usable_model_host(principal, self._model_host(translated.body.get("model")))
        except Refusal as refusal:
            return protocol.error(refusal.status, refusal.message, refusal.code, headers=refusal.headers)
        keep_alive = self.access.keep_alive(principal, translated.keep_alive_s)
        if translated.keep_alive_s == 0 and keep_alive != 0:
            return protocol.error(403, "unloading a model takes an admin key: other keys may be using it. It "
                                  "unloads after the server's idle time ([gpu] idle_unload_s)", "insufficient_scope")
        self.service.keep_alive(keep_alive, model_host)
        if keep_alive != 0:
            self.service.preload(model_host)
        return protocol.load_answer(translated)

    def _model_host(self, model: Any) -> ModelHost:
        """The model host of a model name that validation has accepted."""
        return model_host_named(self.service, model)

    async def _admit_and_run(self, request: Request, translated: Translated, request_id: str,
                             routing: Routing, checked: Checked, protocol: Protocol) -> Response:
        base_headers = {"X-Request-Id": request_id}
        kind, body = translated.kind, translated.body
        model_host = self._model_host(body.get("model"))
        dispatcher = model_host.dispatcher
        principal = principal_of(request.scope)
        job = Job(JobRequest(
            id=request_id, kind=kind, body=body, stream=bool(body.get("stream")), force_cpu=routing.force_cpu,
            deadline_s=routing.deadline_s, prefer_gpu=routing.prefer_gpu, no_fallback=routing.no_fallback,
            resume=routing.resume if routing.resume is not None else self.service.config.routing.resume_answers,
            forced_tool=checked.forced_tool, top_logprobs=checked.top_logprobs, images=checked.images,
            image_decode_mib=checked.image_pixels * DECODED_BYTES_PER_PIXEL / 2**20,
            prompt_cache=principal is None or principal.prompt_cache, warnings=translated.warnings,
            client=client_name(request.headers.get("x-client-name"), request.headers.get("user-agent")),
            fingerprint=request_fingerprint(kind.value, body),
            model="" if model_host is self.service.default_model_host else model_host.name,
            # A request a peer forwarded is served here or refused, never sent on.
            from_peer=HOP_HEADER.lower() in request.headers,
            idempotency_key=request.headers.get("idempotency-key")))
        # Registered before the first await, so a twin with the same id that
        # arrives while this one's prompt is counted finds it taken.
        if self.service.request_in_flight(request_id) or not dispatcher.register(job):
            return protocol.error(409, f"a request with X-Request-Id {request_id!r} is already in flight; "
                                  "send a new id, or an Idempotency-Key to share its result", "duplicate_request_id",
                                  headers=base_headers)
        self._remember_id(request_id, principal)
        request.state.usage_name = usage_name(principal, job.client)
        try:
            self.access.admit(request, job, model_host)
        except Refusal as refusal:
            dispatcher.unregister(job)
            self.access.count(request.state.usage_name, Outcome(refused=True))
            return protocol.error(refusal.status, refusal.message, refusal.code,
                                  headers={**base_headers, **refusal.headers})
        try:
            await self.service.ensure_started(model_host)
            prompt_tokens = await self._count_prompt(job, model_host)
        except BaseException as exc:
            dispatcher.unregister(job)
            if isinstance(exc, _Invalid):
                return protocol.error(exc.status, exc.message, exc.code, param=exc.param, headers=base_headers)
            raise
        if translated.truncates_history:
            try:
                prompt_tokens = await self._fit_history(job, model_host, prompt_tokens, translated.context_cap)
            except BaseException as exc:
                dispatcher.unregister(job)
                if isinstance(exc, _Invalid):
                    return protocol.error(exc.status, exc.message, exc.code, param=exc.param, headers=base_headers)
                raise
        max_tokens = dispatcher.token_limit(prompt_tokens, requested_limit(body),
                                            job.kind is JobKind.CHAT or translated.fills_context)
        if translated.context_cap is not None:
            room = translated.context_cap - prompt_tokens
            if room < 1:
                dispatcher.unregister(job)
                return protocol.error(400, f"the prompt is {prompt_tokens} tokens, which leaves no room for an "
                                      f"answer within num_ctx {translated.context_cap}", "context_length_exceeded",
                                      param="options.num_ctx", headers=base_headers)
            max_tokens = min(max_tokens, room)
        job.sized(prompt_tokens, max_tokens)
        # Every request sets how long its model stays loaded after it, as in
        # Ollama: its own keep_alive, or (None) the configured idle time.
        self.service.keep_alive(self.access.keep_alive(principal_of(request.scope), translated.keep_alive_s),
                                model_host)
        model_host.last_used = self.service.clock()
        # From here the dispatcher owns the job: it decides, runs, and unregisters it.
        if job.stream:
            return await self._stream(request, job, protocol, model_host)
        return await self._aggregate(request, job, protocol, model_host)

    async def _count_prompt(self, job: Job, model_host: ModelHost) -> int:
        if job.kind is JobKind.CHAT:
            return await self._count_chat(model_host, job.body["messages"], job.body.get("tools"))
        counter = model_host.counter
        assert counter is not None
        with _rendering_errors():
            return await _counted(counter, counter.text_prompt(job.body["prompt"]))

    async def _count_chat(self, model_host: ModelHost, messages: list[dict[str, Any]], tools: Any) -> int:
        counter = model_host.counter
        assert counter is not None
        with _rendering_errors():
            text = text_only(messages)
            # A short chat is rendered right here: a worker thread's
            # hand-off costs more than the render (tokens.QUICK_COUNT_BYTES).
            prompt = (counter.chat_prompt(text) if tools is None and short_chat(text)
                      else await asyncio.to_thread(counter.chat_prompt, text, tools))
            # An image is as many tokens as its projector makes of one (model_host.image_tokens).
            return await _counted(counter, prompt) + image_parts(messages) * model_host.image_tokens

    async def _fit_history(self, job: Job, model_host: ModelHost, prompt_tokens: int, context_cap: int | None) -> int:
        """Ollama's truncation: a chat longer than the context keeps its system
        messages and the newest others that fit, leaving room for an answer
        (the limit asked for, else a quarter of the context). Found by
        halving, a few counts at most; the kept messages replace the body's.
        Returns the prompt's tokens as it now stands."""
        dispatcher = model_host.dispatcher
        context = context_cap or dispatcher.largest_context()
        reserve = min(requested_limit(job.body) or context // 4, context // 2)
        budget = context - CONTEXT_SAFETY_TOKENS - reserve
        messages, tools = job.body["messages"], job.body.get("tools")
        if prompt_tokens <= budget or len(messages) < 2:
            return prompt_tokens
        others = [index for index, message in enumerate(messages) if message.get("role") != "system"]

        def newest(count: int) -> list[dict[str, Any]]:
            kept = set(others[len(others) - count:])
            chosen = [m for i, m in enumerate(messages) if i in kept or m.get("role") == "system"]
            # A tool's result whose call was dropped means nothing on its own.
            first = next((i for i, m in enumerate(chosen) if m.get("role") not in ("system", "tool")), len(chosen))
            return [m for i, m in enumerate(chosen) if i >= first or m.get("role") == "system"]

        fits, fitting_tokens = 0, None
        low, high = 1, len(others) - 1
        while low <= high:
            middle = (low + high) // 2
            tokens = await self._count_chat(model_host, newest(middle), tools)
            if tokens <= budget:
                fits, fitting_tokens, low = middle, tokens, middle + 1
            else:
                high = middle - 1
        if fitting_tokens is None:
            return prompt_tokens  # not even the last message fits: admission says so
        kept = newest(fits)
        job.truncated_messages = len(messages) - len(kept)
        log.info("request %s: dropped the %d oldest messages of %d to fit its %d-token context, as Ollama does",
                 job.id, job.truncated_messages, len(messages), context)
        messages[:] = kept
        return fitting_tokens

    async def _aggregate(self, request: Request, job: Job, protocol: Protocol, model_host: ModelHost) -> Response:
        # Estimated again at the first token, as a stream is: the banner's time left and
        # X-Estimated-Latency then count the requests that came after admission.
        sink = AggregatingSink(on_first_event=lambda: model_host.dispatcher.refresh_estimate(job))
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
        try:
            await self.access.run_counted(model_host, job, sink, request.state.usage_name)
        except JobFailed as failure:
            return protocol.failed(failure, _route_headers(job, model_host))
        finally:
            watcher.cancel()
        _note_resume(request, job)
        note = self._degraded_note(request, job, model_host)
        if note is not None and sink.events:
            sink.events.insert(0, degraded_note.note_chunk(note, sink.events[0]))
        body = sink.chat_response(job) if job.kind is JobKind.CHAT else sink.completion_response(job)
        return JSONResponse(protocol.answer(body, job), headers=_route_headers(job, model_host))

    async def _stream(self, request: Request, job: Job, protocol: Protocol, model_host: ModelHost) -> Response:
        sink = QueueSink(job)
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job))

        async def run() -> None:
            try:
                await self.access.run_counted(model_host, job, sink, request.state.usage_name)
                _note_resume(request, job)
                sink.queue.put_nowait(("done", None))
            except JobFailed as failure:
                sink.queue.put_nowait(("failed", failure))
            except Exception as exc:  # never leave the client hanging
                sink.queue.put_nowait(("failed", JobFailed(500, "internal_error", f"internal error: {exc!r}")))

        task = asyncio.create_task(run())
        first_kind, first_value = await sink.queue.get()
        if first_kind == "failed":
            watcher.cancel()
            return protocol.failed(first_value, _route_headers(job, model_host))
        model_host.dispatcher.refresh_estimate(job)
        headers = _route_headers(job, model_host)
        stream = RecordedStream(headers, protocol.stream_media_type)
        # Decided now, with the first event: a replay before the first byte is already done.
        note = self._degraded_note(request, job, model_host)
        lead = degraded_note.note_chunk(note, first_value) if note is not None else None
        wants_note = getattr(request.state, "degraded_note", False)
        seam_note = (lambda: degraded_note.seam_note_text(job, model_host.fallback_model_id)) if wants_note else None
        stream.relay(lambda write: _relay(write, job, sink, task, watcher, (first_kind, first_value), protocol,
                                          stream, lead, seam_note))
        return stream

    def _degraded_note(self, request: Request, job: Job, model_host: ModelHost) -> str | None:
        if not getattr(request.state, "degraded_note", False):
            return None
        return degraded_note.note_text(job, model_host.model_id, model_host.fallback_model_id)



@contextlib.contextmanager
def _rendering_errors() -> Iterator[None]:
    """A prompt the template or the tokenizer can't take, as the client's 400."""
    try:
        yield
    except _Invalid:  # the tokenizer's child refused it (prompt_not_tokenizable): say so, not "messages"
        raise
    except Exception as exc:  # a template can reject odd message shapes
        raise _Invalid(400, f"the messages can't be rendered with the model's chat template: {exc}",
                       "invalid_messages", "messages") from None


async def _counted(counter: PromptCounter, prompt: Prompt) -> int:
    """The prompt's tokens: a short one counted on the event loop (about a
    quarter of a millisecond, where a thread's hand-off cost more and, with
    several requests arriving together, staggered their arrival at the
    worker), a long one, or one that finds the tokenizer busy, in a thread."""
    if prompt.quick:
        count = counter.count_if_free(prompt)
        if count is not None:
            return count
    return await asyncio.to_thread(counter.count, prompt)


def _route_headers(job: Job, model_host: ModelHost) -> dict[str, str]:
    headers = {
        "X-Request-Id": job.id,
        "X-Served-By": job.path or "none",
        # The library model that answered: the one named, or the default
        # model for a name it doesn't know ([model] unknown_name).
        "X-Model": model_host.model_id,
        "X-Route-Reason": job.reason.value if job.reason else "none",
    }
    estimated = job.estimated_latency_s
    if job.path == "cpu":
        if job.reason is not Reason.CPU_ONLY:  # on a machine with no GPU path the CPU's model is no fallback
            headers["X-Fallback-Model"] = model_host.fallback_model_id
        headers["X-Estimated-Latency"] = f"{estimated:.2f}" if estimated is not None else "unknown"
    elif job.path == "peer" and job.peer is not None:
        headers["X-Peer"] = job.peer
        headers["X-Estimated-Latency"] = f"{estimated:.2f}" if estimated is not None else "unknown"
    elif estimated is not None:  # refused at admission: what the CPU would have taken
        headers["X-Estimated-Latency"] = f"{estimated:.2f}"
    if job.queue_wait_s:
        headers["X-Queue-Wait"] = f"{job.queue_wait_s:.3f}"
    if job.truncated_messages:
        headers["X-Messages-Dropped"] = str(job.truncated_messages)
    if job.warnings:
        # HTTP's Warning header (RFC 7234's 299, "miscellaneous persistent
        # warning"): what every client library shows or logs as it is.
        headers["Warning"] = ", ".join('299 tray-app "{}"'.format(w.replace('"', "'")) for w in job.warnings)
    return headers


def _settle_claim(store: IdempotencyStore, claim: asyncio.Future, key: str, owner: str, request_id: str,
                  response: Response) -> None:
    """Keep a result (an answer, or a client error that would repeat); let
    go of the key after a failure, so a retry with it runs for real."""
    if isinstance(response, RecordedStream):
        def finished(recorded, completed: bool) -> None:
            if not completed:
                store.forget(key, request_id, owner)
            _resolve(claim, recorded)
        response.on_finish = finished
        return
    if response.status_code >= 500 or response.status_code in (408, 409, 499):
        store.forget(key, request_id, owner)
    _resolve(claim, _recorded_json(response))


def _recorded_json(response: Response) -> tuple[str, int, dict[str, str], bytes]:
    """A whole answer as the idempotency store keeps it for a key's twins."""
    return "json", response.status_code, dict(response.headers), response.body


async def _replay_idempotent(store: IdempotencyStore, entry, base_headers: dict[str, str]) -> Response:
    recorded = await store.wait(entry)
    kind = recorded[0]
    if kind == "json":
        _, status, headers, body = recorded
        headers = {k: v for k, v in headers.items() if k.lower() not in ("content-length", "content-type")}
        headers["X-Idempotent-Replay"] = "true"
        return Response(body, status_code=status, headers=headers, media_type="application/json")
    _, headers, chunks, media_type = recorded
    headers = {**headers, "X-Idempotent-Replay": "true"}

    async def replay() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk
    return StreamingResponse(replay(), media_type=media_type, headers=headers)


async def _relay(write: Write, job: Job, sink: QueueSink, task: asyncio.Task, watcher: asyncio.Task,
                 first: tuple[str, Any], protocol: Protocol, stream: RecordedStream,
                 lead: dict[str, Any] | None = None, seam_note: Callable[[], str | None] | None = None) -> None:
    """Write the job's events to the client as they come, in its protocol's
    framing, until the job is done or failed."""
    kind, value = first
    finished = False
    last_event: dict[str, Any] = {}
    encoder = protocol.encoder(job)
    try:
        if lead is not None:
            await write(encoder.event(lead))
        while True:
            if kind == "event":
                last_event = value
                await write(encoder.event(value))
            elif kind == "seam":
                # The answer goes on from another path: told in the protocol's own way.
                await write(encoder.seam(value))
                note = seam_note() if seam_note is not None and last_event else None
                if note:
                    await write(encoder.event(degraded_note.note_chunk(note, last_event)))
            elif kind == "done":
                stream.completed = True
                finished = True
                await write(encoder.done(job, last_event))
                return
            else:
                finished = True
                await write(encoder.failed(value))
                return
            kind, value = await sink.queue.get()
    finally:
        watcher.cancel()
        if not finished:
            # The client went away mid-stream (or the server is stopping): stop the worker generating.
            job.cancel("the client disconnected")
        await asyncio.shield(task)


def _note_resume(request: Request, job: Job) -> None:
    """For the access log: where a continued answer was cut, and what the new path added."""
    continuation = job.continuation
    if continuation is not None and job.attempts:
        request.state.resumed = {"from": continuation.failed_on, "on": job.attempts[-1].path,
                                 "cut_at_tokens": continuation.tokens, "tokens_added": job.attempts[-1].tokens}


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


def create_app(service: Service, *, manage_lifecycle: bool = True) -> Starlette:
    http_app = HttpApp(service)
    info = ServiceRoutes(service, http_app.access)
    admin = AdminRoutes(service, http_app.access, lambda: http_app.model_names)
    service.metrics.count_usage(http_app.access.usage.book)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        if manage_lifecycle:
            await service.start()
        try:
            yield
        finally:
            await http_app.access.close()
            if http_app._grammars is not None:
                await http_app._grammars.close()
            if manage_lifecycle:
                await service.stop()

    ollama = OllamaRoutes(service, http_app.complete, lambda: http_app.model_names, http_app.largest_context)
    responses = ResponsesRoutes(http_app.complete, http_app.largest_context)
    llamacpp = LlamaCppRoutes(service, http_app.complete, lambda: http_app.model_names, http_app.tokenizer_model_host,
                              http_app.largest_context)
    routes = [
        HttpRoute("/", ollama.root, methods=["GET", "HEAD"]),
        HttpRoute("/health", info.health, methods=["GET"]),
        HttpRoute("/status", info.status, methods=["GET"]),
        HttpRoute("/v1/models", http_app.models, methods=["GET"]),
        HttpRoute("/openapi.json", info.openapi, methods=["GET"]),
        HttpRoute("/metrics", info.metrics, methods=["GET"]),
        HttpRoute("/v1/chat/completions", http_app.chat_completions, methods=["POST"]),
        HttpRoute("/v1/completions", http_app.completions, methods=["POST"]),
        # The same routes without /v1, as llama.cpp's server offers them, for
        # clients configured with a base URL that lacks it.
        HttpRoute("/models", http_app.models, methods=["GET"]),
        HttpRoute("/chat/completions", http_app.chat_completions, methods=["POST"]),
        HttpRoute("/completions", http_app.completions, methods=["POST"]),
        HttpRoute("/v1/embeddings", http_app.embeddings, methods=["POST"]),
        HttpRoute("/embeddings", http_app.embeddings, methods=["POST"]),
        HttpRoute("/v1/requests/{request_id}", admin.cancel, methods=["DELETE"]),
        # Anthropic's Messages API (see anthropic.py).
        HttpRoute("/v1/messages", http_app.messages, methods=["POST"]),
        HttpRoute("/v1/messages/count_tokens", http_app.count_message_tokens, methods=["POST"]),
        # OpenAI's Responses API (see responses.py), with and without /v1.
        *(route for prefix in ("/v1", "") for route in (
            HttpRoute(f"{prefix}/responses", responses.create, methods=["POST"]),
            HttpRoute(f"{prefix}/responses/{{response_id}}", responses.retrieve, methods=["GET"]),
            HttpRoute(f"{prefix}/responses/{{response_id}}", responses.delete, methods=["DELETE"]))),
        # llama.cpp's own server routes (see llamacpp.py), for apps built on llama-server.
        HttpRoute("/completion", llamacpp.completion, methods=["POST"]),
        HttpRoute("/tokenize", http_app.tokenizer_route(llamacpp.tokenize), methods=["POST"]),
        HttpRoute("/detokenize", http_app.tokenizer_route(llamacpp.detokenize), methods=["POST"]),
        HttpRoute("/apply-template", http_app.tokenizer_route(llamacpp.apply_template), methods=["POST"]),
        HttpRoute("/props", http_app.tokenizer_route(llamacpp.props), methods=["GET"]),
        # The web page (web_page.py); POST /ui/login is answered by the access guard.
        HttpRoute("/ui", web_page, methods=["GET", "HEAD"]),
        HttpRoute("/ui/{name}", web_page, methods=["GET", "HEAD"]),
        HttpRoute("/admin/gpu", admin.gpu, methods=["POST"]),
        HttpRoute("/admin/restart", admin.restart, methods=["POST"]),
        HttpRoute("/admin/models/{name:path}", admin.model, methods=["POST"]),
        HttpRoute("/admin/library/rescan", admin.rescan, methods=["POST"]),
        HttpRoute("/admin/logs", worker_logs(service), methods=["GET"]),
        *key_routes(legacy_key_set=bool(effective_api_key(service.config.server.api_key))),
        # Ollama's API (see ollama.py), for apps that speak only it.
        HttpRoute("/api/chat", ollama.chat, methods=["POST"]),
        HttpRoute("/api/generate", ollama.generate, methods=["POST"]),
        HttpRoute("/api/embed", ollama.embed, methods=["POST"]),
        HttpRoute("/api/embeddings", ollama.embeddings, methods=["POST"]),
        HttpRoute("/api/tags", http_app.listing_route(ollama.tags), methods=["GET"]),
        HttpRoute("/api/ps", http_app.listing_route(ollama.ps), methods=["GET"]),
        HttpRoute("/api/show", ollama.show, methods=["POST"]),
        HttpRoute("/api/version", ollama.version, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        404: _not_found, 405: _method_not_allowed, 500: _internal_error,
    })
    app.state.service = service
    # The embedding routes (embeddings.py's key_slot) put each request under its key's limits and usage.
    app.state.key_access = http_app.access
    return app


async def _not_found(request: Request, exc: Exception) -> Response:
    path = request.url.path
    if path.startswith("/api/"):
        routes = ("Ollama's routes here: /api/chat, /api/generate, /api/embed, /api/embeddings, /api/tags, "
                  "/api/ps, /api/show, /api/version")
    elif path.startswith("/v1/messages"):
        routes = "Anthropic's routes here: POST /v1/messages, POST /v1/messages/count_tokens"
    elif path.startswith(("/v1/responses", "/responses")):
        routes = "the Responses routes here: POST /v1/responses, GET and DELETE /v1/responses/{id}"
    else:
        routes = "see GET /v1/models, POST /v1/chat/completions, POST /v1/completions, GET /status"
    return error_response_for_path(path, 404, f"no route {request.method} {path}; {routes}", "not_found")


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    path = request.url.path
    return error_response_for_path(path, 405, f"{request.method} is not allowed on {path}", "method_not_allowed")


async def _internal_error(request: Request, exc: Exception) -> Response:
    # A sentence only: an exception's text can name files and internals. The
    # detail is in the server's log, since Starlette re-raises to uvicorn,
    # which logs the traceback.
    return error_response_for_path(request.url.path, 500, "internal error: the server failed on this request; "
                                   "its log has the details", "internal_error")
