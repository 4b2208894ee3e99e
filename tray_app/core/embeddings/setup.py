"""The embedding path, built from the config and the default model: its
worker (CPU only: it must not take VRAM the GPU worker's admission counts
on), its own lane and its RAM estimate. Wiring only; what the path does is
`path.py`'s."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import httpx

from ..config import Config
from ..dispatch.lanes import Lane
from .path import SPECIAL_TOKEN_MARGIN, EmbeddingPath, embedding_runtime
from ..engine.handle import WorkerFactory
from ..engine.runtime import WorkerRuntime
from ..engine.worker import LaunchExtras, Worker, WorkerEvent, WorkerHooks, WorkerSpec
from ..memory import estimate
from ..memory.gguf_info import ModelInfo
from ..observe import Observer

MIB = 1024 * 1024


def build_embedding_path(config: Config, runtime: WorkerRuntime, info: ModelInfo, model_id: str, *,
                         worker_factory: WorkerFactory, log_dir: Path, observer: Observer,
                         http: httpx.AsyncClient, clock: Callable[[], float]) -> EmbeddingPath | str:
    """The embedding worker on the main model file, or the sentence saying
    why the engine can't serve embeddings."""
    settings = config.embeddings
    slots = min(settings.max_concurrency, runtime.max_parallel)
    # A slot holds the longest accepted input plus the special tokens the server may add.
    slot_ctx = settings.n_ctx + SPECIAL_TOKEN_MARGIN
    chosen = embedding_runtime(runtime, settings.pooling, slot_ctx)
    if isinstance(chosen, str):
        return chosen
    spec = WorkerSpec("embed", info.path, info.path.stem, slot_ctx, 0, slot_ctx, settings.n_threads,
                      parallel=slots)
    worker = worker_factory(spec, chosen, log_dir, config.worker, _EmbedHooks(observer), clock)
    footprint = estimate.estimate_worker(info, estimate.WorkerSettings(
        n_ctx=slot_ctx * slots, n_gpu_layers=0, n_batch=slot_ctx, n_ubatch=slot_ctx, n_parallel=slots,
        logits_all=False))
    return EmbeddingPath(
        worker, Lane("embed", slots, settings.queue_limit, clock), http,
        model=model_id, pooling=settings.pooling, n_ctx=settings.n_ctx, dimensions=info.n_embd,
        idle_unload_s=settings.idle_unload_s, ready_timeout_s=config.worker.ready_timeout_s,
        ram_floor_mib=config.cpu.ram_floor_mib, load_ram_mib=footprint.host.total / MIB,
        available_ram_mib=lambda: observer.latest().host.available_mib,
        note=observer.note, changed=observer.advance, clock=clock,
    )


class _EmbedHooks(WorkerHooks):
    """The embedding worker's events go to the event log; it needs nothing before it starts."""

    def __init__(self, observer: Observer) -> None:
        self._observer = observer

    async def before_spawn(self, worker: Worker) -> LaunchExtras:
        return LaunchExtras()

    def on_event(self, event: WorkerEvent) -> None:
        self._observer.note("worker", role=event.role, state=event.state.value,
                            exit=event.exit.describe() if event.exit else None)
        self._observer.advance()
