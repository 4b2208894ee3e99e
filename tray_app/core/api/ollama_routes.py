"""Ollama's routes: the generating ones run through the HTTP app like every
other chat (see ollama.py for the mapping); the rest describe the models
from what the service knows."""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from ..dispatch.jobs import JobFailed, JobKind, new_request_id
from ..engine.worker import WorkerState
from .ollama import (
    DEFAULT_TAG, OLLAMA_API_VERSION, OllamaChat, OllamaGenerate, check_model_field, error, model_details,
    model_capabilities, model_entry, model_info_fields, rfc3339,
)
from .openai_request import InvalidRequest
from .embeddings import check_inputs, embed_for, embedding_path, json_off_the_loop, key_slot
from .key_access import model_host_named, model_refusal
from .requests import ModelNames, check_model, clean_request_id, read_json_object, routing_headers
from .security import principal_of

MIB = 1024 * 1024
# Ollama's expires_at for a model kept loaded until told otherwise.
_FOREVER_S = 10 * 365 * 86400.0


# The HTTP app's way in for a chat in any protocol (HttpApp.complete).
Complete = Callable[[Request, JobKind, Any], Awaitable[Response]]


class OllamaRoutes:
    def __init__(self, service: Any, complete: Complete, models: Callable[[], ModelNames],
                 largest_context: int) -> None:
        self.service = service
        self._complete = complete
        self._model_names = models
        self.chat_protocol = OllamaChat(largest_context)
        self.generate_protocol = OllamaGenerate(largest_context)

    async def root(self, request: Request) -> Response:
        # Ollama's clients check that the base URL answers before anything else.
        return PlainTextResponse("tray-app is running (OpenAI, Ollama and Anthropic APIs)")

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, JobKind.CHAT, self.chat_protocol)

    async def generate(self, request: Request) -> Response:
        return await self._complete(request, JobKind.CHAT, self.generate_protocol)

    async def embed(self, request: Request) -> Response:
        """/api/embed: {"model", "input": text or [texts]} -> {"embeddings": [...]}."""
        return await self._embed(request, "input", lambda result, started: {
            "model": result.model + DEFAULT_TAG, "embeddings": result.vectors,
            "total_duration": int((time.monotonic() - started) * 1e9), "load_duration": 0,
            "prompt_eval_count": result.prompt_tokens})

    async def embeddings(self, request: Request) -> Response:
        """/api/embeddings, Ollama's older route: {"model", "prompt"} -> {"embedding": [...]}.
        One text, as Ollama's: a list is refused, not embedded whole for one vector."""
        return await self._embed(request, "prompt", lambda result, started: {"embedding": result.vectors[0]})

    async def _embed(self, request: Request, field: str, shape) -> Response:
        started = time.monotonic()
        request_id = clean_request_id(request.headers.get("x-request-id")) or new_request_id()
        headers = {"X-Request-Id": request_id, "X-Served-By": "embed"}
        try:
            path = embedding_path(self.service)
            body = await read_json_object(request)
            check_model(check_model_field(body), self._model_names())
            # `truncate` changes nothing: an input over [embeddings] n_ctx is a 400 either way.
            dimensions = body.get("dimensions")
            if dimensions is not None and dimensions != path.dimensions:
                raise InvalidRequest(400, f"'dimensions' {dimensions!r} is not supported: this model's embeddings "
                                     f"have {path.dimensions}", "unsupported_parameter", "dimensions")
            if field == "prompt":
                prompt = body.get("prompt")
                if prompt is not None and not isinstance(prompt, str):
                    raise InvalidRequest(400, "'prompt' must be a string: this older route embeds one text "
                                         "(POST /api/embed takes a list as 'input')", "invalid_type", "prompt")
            with key_slot(request) as counted_as_used:  # the key's refusal comes before any work
                if field == "prompt" and body.get("prompt") == "":
                    # Ollama's old route answers an empty prompt with an empty vector.
                    return JSONResponse({"embedding": []}, headers=headers)
                texts, counted = await check_inputs(self.service, path, body.get(field), field)
                result = await embed_for(request, path, texts, counted, counted_as_used, request_id=request_id,
                                         deadline_s=routing_headers(request).deadline_s)
        except InvalidRequest as bad:
            return error(bad.status, bad.message, headers)
        except JobFailed as failure:
            return self.chat_protocol.failed(failure, headers)
        except ClientDisconnect:
            return Response(status_code=499)
        if result is None:
            return Response(status_code=499, headers=headers)
        return await json_off_the_loop(lambda: shape(result, started), headers)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_API_VERSION})

    def _models(self) -> list[tuple[str, Any, bool, bool]]:
        """(Ollama name, ModelInfo, whether it reads images, whether /api/embed
        runs it) of each model in the library, and the default model's CPU
        fallback when it is another file."""
        service = self.service
        embedding = service.embeddings.model if service.embeddings is not None else None
        models = [(model_host.model_id + DEFAULT_TAG, model_host.model_info, model_host.projector is not None,
                   model_host.model_id == embedding)
                  for model_host in service.model_hosts.values()]
        if service.fallback_info.path != service.model_info.path:
            models.insert(1, (service.fallback_model_id + DEFAULT_TAG, service.fallback_info,
                              service.default_model_host.cpu_projector is not None, False))
        return models

    async def tags(self, request: Request) -> Response:
        return JSONResponse({"models": [model_entry(*model) for model in self._models()]})

    async def ps(self, request: Request) -> Response:
        """The models loaded now, with what each holds: VRAM from the GPU
        worker's estimate, the whole size adding its model_host memory."""
        loaded = []
        for model_host in self.service.model_hosts.values():
            vram = ram = 0.0
            context = 0
            expires_in: float | None = None
            gpu = model_host.gpu_worker
            if gpu is not None and gpu.state is WorkerState.READY:
                vram += model_host.gpu_footprint.gpu.total
                ram += model_host.gpu_footprint.host.total
                context = max(context, model_host.model.gpu_n_ctx)
                expires_in = model_host.sharing.unload_in_s() if model_host.sharing is not None else None
                expires_in = _FOREVER_S if expires_in is None else expires_in
            if model_host.cpu_worker.state is WorkerState.READY:
                ram += model_host.cpu_footprint.host.total + model_host.cpu_footprint.gpu.total
                context = max(context, model_host.model.cpu_n_ctx)
                expires_in = expires_in if expires_in is not None else _FOREVER_S
            if expires_in is None:
                continue
            name, info = model_host.model_id + DEFAULT_TAG, model_host.model_info
            embeds = self.service.embeddings is not None and self.service.embeddings.model == model_host.model_id
            entry = model_entry(name, info, model_host.projector is not None, embeds)
            entry.pop("modified_at")
            loaded.append({**entry, "size": int(vram + ram), "size_vram": int(vram),
                           "expires_at": rfc3339(time.time() + expires_in), "context_length": context})
        return JSONResponse({"models": loaded})

    async def show(self, request: Request) -> Response:
        try:
            name = check_model_field(await read_json_object(request))
        except InvalidRequest as bad:
            return error(bad.status, bad.message)
        except ClientDisconnect:
            return Response(status_code=499)
        found = [model for model in self._models() if name in (model[0], model[0][: -len(DEFAULT_TAG)],
                                                                model[1].path.name)]
        if not found and name == "default":
            found = self._models()[:1]
        if not found:
            return error(404, f"model {name!r} not found; GET /api/tags lists the models here")
        listed_name, info, sees_images, embeds = found[0]
        # A key limited to other models learns nothing of this one: the
        # refusal a chat with it gets (/api/tags doesn't list it either).
        principal = principal_of(request.scope)
        refusal = model_refusal(principal, model_host_named(self.service, listed_name))
        if refusal is not None:
            return error(refusal.status, refusal.message)
        service = self.service
        capabilities = model_capabilities(sees_images, embeds)
        # What a request can hold here, not the model's training length: an
        # app sizing its history by it would be refused, or truncated.
        served_context = model_host_named(service, listed_name).dispatcher.largest_context()
        # The file's folder is the machine's layout: an admin's to see.
        source = info.path if principal is None or principal.is_admin else info.path.name
        return JSONResponse({
            "license": "", "modelfile": f"# served by tray-app from {info.path.name}\nFROM {source}\n",
            "parameters": f"num_ctx {served_context}",
            "template": info.chat_template or "", "details": model_details(info),
            "model_info": model_info_fields(info, served_context),
            "capabilities": capabilities, "modified_at": rfc3339(info.modified),
            # Not Ollama's: each path's context and KV cache type (clients ignore unknown keys).
            "tray_app": {"context_by_path": model_host_named(service, listed_name).served_contexts()},
        })
