"""`GET /v1/models`: every model in the library, where it is loaded now and
what a client may ask of it, as a key may see them."""

from __future__ import annotations

from typing import Any

from ..access.keys import ApiKey
from ..model_host import ModelHost
from ..service import Service
from ..status_build import model_summary
from . import bounds
from .key_access import model_allowed


def openai_model_list(service: Service, principal: ApiKey | None) -> dict[str, Any]:
    """Every model in the library, with where it is loaded now (gpu, cpu,
    unloaded) and how large it is; the default model's CPU fallback too
    when it is another file."""
    model_hosts = list(service.model_hosts.values())
    listed = [(model_host.model_id, model_host) for model_host in model_hosts]
    if service.fallback_model_id not in {name for name, _ in listed}:
        listed.insert(1, (service.fallback_model_id, None))
    # A key limited to some models sees those only (the fallback file is
    # the default model's, as a request naming it is).
    listed = [(name, model_host) for name, model_host in listed
              if model_allowed(principal, model_host or service.default_model_host)]
    created = int(service.started_at)

    def capabilities(model_host: ModelHost | None) -> dict[str, Any]:
        # What a client may ask of each model here, so it can adapt rather
        # than learn from a 400.
        model = (model_host or service.default_model_host).model
        sees = (model_host.projector if model_host is not None else service.default_model_host.cpu_projector) is not None
        return {
            # (A request naming the fallback file is the default model's, as its context_length is.)
            "max_choices": max_choices(model_host or service.default_model_host),
            "logprobs": service.supports_logprobs, "vision": sees, "tools": True,
            "input_modalities": ["text", "image"] if sees else ["text"],
            "structured_output": ["json_object", "json_schema", "grammar"],
            "context_length": max(model.gpu_n_ctx, model.cpu_n_ctx),
            # Each path's context and KV cache type (q8_0 where that is what let it grow).
            "context_by_path": (model_host or service.default_model_host).served_contexts(),
        }

    def where(model_host: ModelHost | None) -> dict[str, Any]:
        if model_host is None:
            return {"role": "cpu_fallback", "fallback_of": service.model_id}
        summary = model_summary(model_host)
        return {key: summary[key] for key in ("location", "gpu", "cpu", "size_bytes", "estimated_vram_mib",
                                              "aliases", "source", "cpu_fallback")}

    embeddings = service.embeddings
    # Which model answers /v1/embeddings, and how: there is no separate
    # embedding model yet, so the chat model, pooled.
    embedding_info = ({"embeddings": True, "embeddings_pooling": embeddings.pooling,
                       "embeddings_dimensions": embeddings.dimensions,
                       "embeddings_max_input_tokens": embeddings.n_ctx}
                      if embeddings is not None else {"embeddings": False})
    return {"object": "list", "data": [
        {"id": model_id, "object": "model", "created": created, "owned_by": "local",
         "capabilities": {**capabilities(model_host), **(embedding_info if model_id == service.model_id
                                                   else {"embeddings": False})}, **where(model_host)}
        for model_id, model_host in listed]}


def max_choices(model_host: ModelHost) -> int:
    """The most choices (n) a request for this model can get: n runs as n
    parallel slots of one path, so its larger path's slots (a path with
    fewer than n refuses it, too_many_choices; a machine with no GPU path
    has only the CPU's), within the bound every request has (bounds.MAX_N)."""
    dispatcher = model_host.dispatcher
    paths = [path for path in (dispatcher.gpu, dispatcher.cpu) if path is not None]
    return min(bounds.MAX_N, max(path.lane.concurrency for path in paths))
