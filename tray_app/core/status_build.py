"""The /status snapshot, assembled from the service's parts into the
contract's shapes (`status_contract.py`). Reads only: building it changes
nothing, so /status, /metrics, the tray and the CLI may ask as often as they like.

The service-wide parts come through `StatusSource` (what `Service` offers),
one model's through its `ModelHost`; neither imports this module, so the
status is built here and nowhere else.
"""

from __future__ import annotations

import os
import time
from typing import Any, Protocol, cast

from .. import __version__
from .config import Config
from .dispatch.backlog import EXPECTED_ANSWER_TOKENS
from .dispatch.peer import Peers
from .embeddings.path import EmbeddingPath
from .engine.runtime import WorkerRuntime
from .engine.worker import WorkerState
from .model_host import ModelHost
from .memory import estimate
from .memory.telemetry import MemorySnapshot, OffloadSupport, SimulatedGpu
from .observe import Observer
from .engine.rpc import RpcHealth
from .status_contract import (BreakerStatus, DecisionRecord, DegradedStatus, EmbeddingsStatus, EngineStatus, Event,
                              FailoverStatus,
                              GpuStatus, LaneStatus, ModelSummary, PeerStatus, RamStatus, RequestStatus,
                              RpcServerStatus, RpcSplit, Speeds, Status, WorkerStatus)

MIB = 1024 * 1024

# What a "typical" new request is, for the latency estimates /status shows.
TYPICAL_PROMPT_TOKENS = 64

# Decisions /status lists, of all models together: the tray and the web page
# show a screenful, and the drill polls faster than 20 decisions arrive.
RECENT_DECISIONS_SHOWN = 20

# /status has both queues even when there is no GPU worker.
NO_LANE: LaneStatus = {"running": 0, "concurrency": 0, "depth": 0, "limit": 0, "oldest_age_s": 0.0}


class StatusSource(Protocol):
    """What the snapshot reads of the service."""

    config: Config
    runtime: WorkerRuntime
    engine_fallback_reason: str | None
    offload_support: OffloadSupport
    simulated: SimulatedGpu | None
    started_at: float
    observer: Observer
    rpc_health: RpcHealth
    peers: Peers
    model_hosts: dict[str, ModelHost]
    default_model_host: ModelHost
    library_problems: list[str]
    embeddings: EmbeddingPath | None
    embeddings_off_reason: str | None


# ----- the whole ------------------------------------------------------------------------------


def build_status(service: StatusSource) -> Status:
    """The default model's paths at the top level (as before there was a
    library), and every model's line under "models"."""
    snapshot = service.observer.latest()
    model_host = service.default_model_host
    dispatcher = model_host.dispatcher
    healthy, health_reason = health(model_host)
    backends = {path: b for path, b in (("gpu", dispatcher.gpu), ("cpu", dispatcher.cpu)) if b is not None}
    model_hosts = list(service.model_hosts.values())
    return {
        "service": {"pid": os.getpid(), "version": __version__, "started_at": service.started_at,
                    "model": model_host.model_id,
                    "healthy": healthy, "health_reason": health_reason, "gpu_paused": dispatcher.gpu_paused},
        "workers": host_workers(model_host, snapshot),
        "engine": engine_status(service),
        "gpu": gpu_status(service),
        "ram": cast(RamStatus, {**snapshot.host.to_status(), "floor_mib": service.config.cpu.ram_floor_mib}),
        "breaker": cast(BreakerStatus, model_host.breaker.snapshot()),
        "queues": {"gpu": cast(LaneStatus, dispatcher.gpu.lane.snapshot()) if dispatcher.gpu is not None
                   else NO_LANE.copy(),
                   "cpu": cast(LaneStatus, dispatcher.cpu.lane.snapshot())},
        "degraded": host_degraded(model_host),
        "requests": [cast(RequestStatus, r) for h in model_hosts for r in h.dispatcher.request_status()],
        "recent_decisions": recent_decisions(model_hosts),
        "speeds": cast(Speeds, {path: {"tokens_per_s": round(b.speed.tokens_per_s, 2), "samples": b.speed.samples}
                                for path, b in backends.items()}),
        "gpu_recovery_s": model_host.gpu_recovery_s,
        "accounting": {"completed_executions": sum(h.dispatcher.completed_total for h in model_hosts),
                       "duplicate_executions": sum(h.dispatcher.duplicate_executions for h in model_hosts)},
        "events": cast(list[Event], list(service.observer.events)[-20:]),
        "embeddings": embeddings_status(service),
        "models": [model_summary(h) for h in model_hosts],
        "library_problems": list(service.library_problems),
        "peers": cast(list[PeerStatus], service.peers.status()),
        "failover": cast(FailoverStatus, service.observer.failovers.snapshot()),
    }


def recent_decisions(model_hosts: list[ModelHost]) -> list[DecisionRecord]:
    """Every model's latest decisions, each with its model's name, oldest
    first like the event log (the web page and the drill read them so): the
    newest RECENT_DECISIONS_SHOWN of all of them."""
    merged = [cast(DecisionRecord, {**record, "model": model_host.model_id})
              for model_host in model_hosts for record in list(model_host.dispatcher.recent)[-RECENT_DECISIONS_SHOWN:]]
    merged.sort(key=lambda record: record["t"])  # stable: a tie keeps the model hosts' order
    return merged[-RECENT_DECISIONS_SHOWN:]


def health(model_host: ModelHost) -> tuple[bool, str]:
    """Whether the default model can serve a request now, and the sentence
    /health and the tray say it with."""
    out = model_host.dispatcher.gpu_out()
    if out is None:
        return True, "the GPU path can serve"
    if out.quiet:
        return True, out.detail
    gpu_out = out.detail
    cpu = model_host.cpu_worker
    if cpu.state is WorkerState.READY:
        return True, f"the CPU path can serve (degraded: {gpu_out})"
    if model_host.on_demand_cpu is not None and cpu.gave_up is None:
        return True, f"the CPU path loads on demand (degraded: {gpu_out})"
    why = cpu.gave_up or cpu.unhealthy_reason
    return False, f"no path can serve: GPU: {gpu_out}; CPU worker is {cpu.state.value}" + (f" ({why})" if why else "")


def engine_status(service: StatusSource) -> EngineStatus:
    config = service.config
    return {"runtime": service.runtime.name, "version": service.runtime.describe(),
            "configured": config.engine.runtime, "fallback_reason": service.engine_fallback_reason,
            "slots": {"gpu": service.default_model_host.slots["gpu"], "cpu": service.default_model_host.slots["cpu"]},
            "cpu_keep": config.cpu.keep, "fallback_policy": config.routing.fallback}


def gpu_status(service: StatusSource) -> GpuStatus:
    """The device reading and the default model's GPU path (/status["gpu"], POST /admin/gpu's answer)."""
    model_host = service.default_model_host
    gpu = cast(GpuStatus, service.observer.latest().gpu.to_status())
    gpu["path"] = "local" if model_host.dispatcher.gpu is not None else "none"
    gpu["reserve_mib"] = service.config.gpu.reserve_mib
    gpu["path_out_reason"] = model_host.dispatcher.gpu_out_reason()
    gpu["offload_supported"] = service.offload_support.supported
    gpu["offload_message"] = service.offload_support.message
    if service.simulated is not None:
        gpu["pressure_mib"] = service.simulated.pressure_mib
        gpu["simulated_device_dir"] = str(service.simulated.others_dir)
    gpu["residency"] = model_host.sharing.status() if model_host.sharing is not None else None
    gpu["rpc_servers"] = cast(list[RpcServerStatus], service.rpc_health.status())
    gpu["rpc_split"] = rpc_split(model_host)  # the local GPU's share admission charges
    return gpu


def embeddings_status(service: StatusSource) -> EmbeddingsStatus:
    """/status["embeddings"]: kept out of "workers", which readers take to
    be the GPU and CPU paths."""
    path = service.embeddings
    if path is None:
        return {"enabled": False, "reason": service.embeddings_off_reason}
    pid = path.worker.pid
    rss = service.observer.latest().host.rss_mib_by_pid.get(pid) if pid else None
    return cast(EmbeddingsStatus, path.status(rss_mib=round(rss, 1) if rss is not None else None))


# ----- one model --------------------------------------------------------------------------------


def host_workers(model_host: ModelHost, snapshot: MemorySnapshot) -> list[WorkerStatus]:
    """A model's workers, each with its RSS now and its estimated footprint."""
    workers = []
    for worker in model_host.workers():
        footprint = model_host.gpu_footprint if worker.role == "gpu" else model_host.cpu_footprint
        backend = model_host.dispatcher.gpu if worker.role == "gpu" else model_host.dispatcher.cpu
        info: dict[str, Any] = {
            **worker.snapshot(),
            "drafts": backend.draft_acceptance() if backend is not None and worker.spec.spec_type else None,
            # A [gpu] draft_model that isn't used, and why (another vocabulary, no such file).
            "draft_refused": model_host.draft.refused if worker.role == "gpu" else None,
            "rss_mib": snapshot.host.rss_mib_by_pid.get(worker.pid) if worker.pid else None,
            "estimated_vram_mib": round(footprint.gpu.total / MIB, 1),
            "estimated_ram_mib": round(footprint.host.total / MIB, 1),
        }
        workers.append(cast(WorkerStatus, info))
    return workers


def host_degraded(model_host: ModelHost) -> DegradedStatus:
    observer = model_host.service.observer
    dispatcher = model_host.dispatcher
    cause = dispatcher.degraded_cause()
    serving = sorted({job.peer for job in dispatcher.jobs.values() if job.path == "peer" and job.peer is not None})
    default = model_host.model.is_default
    return {
        # The default model's degraded mode is the observer's (with its
        # debounce and history); another model's is its dispatcher's now.
        "active": observer.degraded_since is not None if default else cause is not None,
        "reason": observer.degraded_reason if default else cause,
        "since": observer.degraded_since if default else None,
        "model": model_host.model_id,
        "fallback_model": model_host.fallback_model_id,
        "fallback_equivalent": model_host.equivalence["equivalent"],
        "fallback_detail": model_host.equivalence["detail"],
        # What a typical new request would wait now.
        "estimated_latency_s": round(dispatcher.cpu_wait_s(TYPICAL_PROMPT_TOKENS, EXPECTED_ANSWER_TOKENS), 2),
        "cpu_context_cap": model_host.model.cpu_n_ctx,
        "cpu_queue_depth": len(dispatcher.cpu.lane.waiting_ids),
        # The peers serving this model's requests now (degraded mode names
        # them), and what a typical request takes there (None: not measured yet).
        "peers": serving,
        "peer_latency_s": {name: _peer_estimate_s(model_host, name) for name in serving},
    }


def _peer_estimate_s(model_host: ModelHost, name: str) -> float | None:
    peers = model_host.dispatcher.peers
    peer = peers.get(name) if peers is not None else None
    return peer.estimate_s(TYPICAL_PROMPT_TOKENS, EXPECTED_ANSWER_TOKENS) if peer is not None else None


def location(model_host: ModelHost) -> str:
    """Where the model is loaded now: "gpu", "cpu", "gpu+cpu", "loading" or "unloaded"."""
    places = [w.role for w in model_host.workers() if w.state is WorkerState.READY]
    if places:
        return "+".join(places)
    if any(w.state is WorkerState.STARTING for w in model_host.workers()):
        return "loading"
    return "unloaded"


def model_summary(model_host: ModelHost) -> ModelSummary:
    """A model's line in /status["models"] and /v1/models."""
    model = model_host.model
    sharing = model_host.sharing
    gpu, cpu = model_host.gpu_worker, model_host.cpu_worker
    return {
        "name": model_host.model_id, "aliases": list(model.aliases), "source": model.source,
        "path": str(model.path), "size_bytes": model_host.model_info.file_size,
        "cpu_fallback": None if model.cpu_path is None else model_host.fallback_model_id,
        "location": location(model_host),
        "gpu": sharing.state() if sharing is not None else "unavailable",
        "cpu": cpu.state.value if cpu is not None else None,
        "gpu_pid": gpu.pid if gpu is not None else None,
        "estimated_vram_mib": round(model_host.gpu_footprint.gpu.total / MIB, 1),
        "estimated_ram_mib": round(model_host.cpu_footprint.host.total / MIB, 1),
        "vram_mib": round(model_host.vram_mib(), 1),
        "context": {"gpu": model.gpu_n_ctx, "cpu": model.cpu_n_ctx},
        # Per path: the context, its KV cache type, and whether it was sized from memory.
        "served_context": model_host.served_contexts(),
        # The draft model its GPU worker speculates with ([gpu] draft_model), by file name.
        "draft_model": model_host.draft.info.path.name if model_host.draft.info is not None else None,
        "idle_unload_s": model.idle_unload_s,
        # A wall-clock time from the model host's monotonic one.
        "last_used": round(time.time() - (model_host.service.clock() - model_host.last_used), 3),
        "loads": sharing.loads if sharing is not None else 0,
        "last_load_s": sharing.last_load_s if sharing is not None else None,
        "evictions": sharing.evictions if sharing is not None else 0,
        "requests": dict(model_host.requests_by_path),
        "in_flight": model_host.in_flight(),
        "breaker": model_host.breaker.snapshot()["state"],
        "degraded": model_host.dispatcher.degraded_cause(),
        "logs": {w.role: str(w.log_path) for w in model_host.workers()},
    }


def rpc_split(model_host: ModelHost) -> RpcSplit | None:
    """/status gpu.rpc_split: what admission charges the local GPU with;
    None without [gpu] rpc_servers."""
    if not model_host.rpc_servers:
        return None
    offloaded = estimate.layers_offloaded(model_host.model_info, model_host.gpu_settings.n_gpu_layers)
    layers = model_host.local_gpu_layers()
    return {
        "offloaded_layers": offloaded,
        "local_layers": layers,
        "local_share": round(layers / offloaded, 3) if layers is not None and offloaded else None,
        "local_gpu_mib": round(model_host.gpu_footprint.gpu.total / MIB, 1),
        "all_local_gpu_mib": round(model_host.all_local_gpu_footprint.gpu.total / MIB, 1),
        "basis": ("llama.cpp's default split by free memory: the local GPU's total against the remote "
                  "devices' last reading" if layers is not None else
                  "the remote devices' memory is not known: all layers charged to the local GPU"),
    }
