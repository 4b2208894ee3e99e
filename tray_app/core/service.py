"""The service: workers, backends, the dispatcher and the observer, wired together.

It runs on one asyncio loop. Each piece has one job:
- `engine.Worker`: owns one llama.cpp process (one task is the only writer of its state);
- `dispatch.Backend`: one path (worker + lane + speed) and how a request streams through it;
- `dispatch.Dispatcher`: where a request runs, replay and the breaker, through the backends;
- `observe.Observer`: memory readings, the event log and degraded mode;
- `embeddings.EmbeddingPath`: the embedding worker, its own lane, loaded on demand.
This module builds them, carries out the commands (pause, restart, cancel)
and the worker hooks, and assembles the /status snapshot. Reading the
snapshot changes nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from .api.metrics import ServiceMetrics
from .config import Config, log_dir as default_log_dir, simulated_device_dir
from .dispatch.admission import Decision, Reason, Route
from .dispatch.backend import Backend, Deadlines
from .dispatch.breaker import CircuitBreaker
from .dispatch.dispatcher import EXPECTED_ANSWER_TOKENS, Costs, Dispatcher, Limits
from .dispatch.jobs import Attempt, Job, PathSpeed
from .dispatch.lanes import Lane
from .dispatch.residency import HoldKind, Residency, SharingPolicy
from .embeddings import SPECIAL_TOKEN_MARGIN, EmbeddingPath, embedding_runtime
from .engine.exits import ExitKind
from .engine.runtime import WorkerRuntime, choose_runtime
from .engine.worker import LaunchExtras, Worker, WorkerEvent, WorkerHooks, WorkerSpec, WorkerState
from .memory import estimate
from .memory.gguf_info import ModelInfo, read_model_info
from .memory.telemetry import (
    GpuReader, MemorySnapshot, NvmlGpuReader, SimulatedGpu, detect_gpu_offload_support, wait_for_vram_recovery,
)
from .observe import Observer
from .sharing import GpuSharing, OnDemandWorker, prior_load_s
from .tokens import PromptCounter

MIB = 1024 * 1024
GPU_FOOTPRINT_OWNER = "gpu-worker"
CPU_FIRST_TOKEN_TIMEOUT_S = 600.0
# The GPU's first-token deadline: this much slack plus this many times the
# prefill time its measured speed predicts (a busy host, a cold cache).
FIRST_TOKEN_SLACK_S = 15.0
FIRST_TOKEN_FACTOR = 5.0


class Service:
    def __init__(
        self,
        config: Config,
        *,
        runtime: WorkerRuntime | None = None,
        gpu_runtime: WorkerRuntime | None = None,
        gpu_reader: GpuReader | None = None,
        log_dir: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._clock = clock
        self._log_dir = log_dir or default_log_dir()
        self.model_info: ModelInfo = read_model_info(config.model_path())
        fallback_path = config.fallback_model_path()
        self.fallback_info: ModelInfo = (
            self.model_info if fallback_path == config.model_path() else read_model_info(fallback_path)
        )
        self.model_id = self.model_info.path.stem
        self.fallback_model_id = self.fallback_info.path.stem
        self.counter: PromptCounter | None = None
        self.equivalence: dict[str, Any] = {"equivalent": True, "detail": "same model file on both paths"}

        self.simulated: SimulatedGpu | None = None
        if config.gpu.simulate_mib > 0:
            self.simulated = SimulatedGpu(config.gpu.simulate_mib, others_dir=simulated_device_dir(config))
            self._gpu_reader: GpuReader = self.simulated
        else:
            self._gpu_reader = gpu_reader or NvmlGpuReader()
        self.offload_support = detect_gpu_offload_support()
        if runtime is None:
            choice = choose_runtime(config.engine.runtime, config.engine.llama_server)
            runtime, self.engine_fallback_reason = choice.runtime, choice.fallback_reason
        else:
            self.engine_fallback_reason = None
        self.runtime = runtime
        gpu_runtime = gpu_runtime or runtime
        # A request may run on either path, so both must offer what it asks.
        self.supports_logprobs = runtime.supports_logprobs and gpu_runtime.supports_logprobs
        self.slots = {"gpu": min(config.gpu.max_concurrency, gpu_runtime.max_parallel),
                      "cpu": min(config.cpu.max_concurrency, runtime.max_parallel)}
        # Every slot has its own n_ctx of KV cache; logits_all=False: that is
        # how the runtimes launch workers.
        self.gpu_settings = estimate.WorkerSettings(
            n_ctx=config.gpu.n_ctx * self.slots["gpu"], n_gpu_layers=config.gpu.n_gpu_layers,
            n_batch=config.worker.n_batch, n_parallel=self.slots["gpu"], logits_all=False,
        )
        self.cpu_settings = estimate.WorkerSettings(
            n_ctx=config.cpu.n_ctx * self.slots["cpu"], n_gpu_layers=0, n_batch=config.worker.n_batch,
            n_parallel=self.slots["cpu"], logits_all=False,
        )
        self.gpu_footprint = estimate.estimate_worker(self.model_info, self.gpu_settings)
        self.cpu_footprint = estimate.estimate_worker(self.fallback_info, self.cpu_settings)

        self.gpu_recovery_s: float | None = None
        self._gpu_failed_at: float | None = None
        self.started_at = time.time()
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=5.0),
                                       limits=httpx.Limits(max_connections=64, max_keepalive_connections=0))
        gpu_missing_reason = self._gpu_disabled_reason()
        backends = {"cpu": self._backend("cpu", runtime)}
        if gpu_missing_reason is None:
            backends["gpu"] = self._backend("gpu", gpu_runtime)
        self.breaker = CircuitBreaker(config.breaker, clock)
        self.observer = Observer(self._gpu_reader, self._worker_pids, lambda: self.dispatcher.degraded_cause(),
                                 on_sample=self._on_sample)
        self.metrics = ServiceMetrics(self.status)
        self.dispatcher = Dispatcher(
            Limits(config.gpu.n_ctx, config.cpu.n_ctx, config.gpu.reserve_mib, config.cpu.ram_floor_mib,
                   queue_budget_s=config.server.queue_timeout_s,
                   cpu_load_prior_s=prior_load_s(self.fallback_info.path.stat().st_size / MIB)),
            backends, self.breaker, self.observer.latest,
            Costs(gpu_mib=lambda tokens: estimate.request_vram_bytes(self.model_info, self.gpu_settings, tokens) / MIB,
                  cpu_mib=lambda tokens: estimate.kv_bytes_per_token(self.fallback_info) * tokens / MIB),
            _DispatchEvents(self), gpu_missing_reason=gpu_missing_reason, clock=clock,
            no_fallback=config.routing.fallback == "never",
        )
        self.sharing: GpuSharing | None = None
        if self.dispatcher.gpu is not None:
            self.sharing = self._gpu_sharing(self.dispatcher.gpu)
            self.dispatcher.residency = self.sharing
        self.on_demand_cpu = (OnDemandWorker(self.dispatcher.cpu, config.cpu.idle_unload_s, self.observer.note, clock)
                              if config.cpu.keep == "on_demand" else None)
        # None when off; embeddings_off_reason says why (the config, or the engine).
        self.embeddings: EmbeddingPath | None = None
        self.embeddings_off_reason: str | None = None
        if config.embeddings.enabled:
            self.embeddings = self._embedding_path(runtime)
        else:
            self.embeddings_off_reason = "embeddings are disabled in the config ([embeddings] enabled = false)"
        self.observer.sample()

    def _gpu_sharing(self, backend: Backend) -> GpuSharing:
        config = self.config
        policy = SharingPolicy(yield_to_other_apps=config.gpu.yield_to_other_apps,
                               reload_settle_s=config.gpu.reload_settle_s, idle_unload_s=config.gpu.idle_unload_s)
        return GpuSharing(
            Residency(policy, self._clock), backend,
            need_mib=self.gpu_footprint.gpu.total / MIB, reserve_mib=config.gpu.reserve_mib,
            model_mib=self.model_info.path.stat().st_size / MIB, drain_s=config.gpu.yield_drain_s,
            ours_mib=self._our_vram_mib, our_pids=lambda: set(self._worker_pids()),
            note=self.observer.note, changed=self.observer.advance,
            read_gpu=self._gpu_reader.read, clock=self._clock,
        )

    def _embedding_path(self, runtime: WorkerRuntime) -> EmbeddingPath | None:
        """The embedding worker on the main model file, CPU only (it must not
        take VRAM the GPU worker's admission counts on), or None with the
        reason when the engine can't serve embeddings."""
        config = self.config
        settings = config.embeddings
        slots = min(settings.max_concurrency, runtime.max_parallel)
        # A slot holds the longest accepted input plus the special tokens the server may add.
        slot_ctx = settings.n_ctx + SPECIAL_TOKEN_MARGIN
        chosen = embedding_runtime(runtime, settings.pooling, slot_ctx)
        if isinstance(chosen, str):
            self.embeddings_off_reason = chosen
            return None
        info = self.model_info
        spec = WorkerSpec("embed", info.path, info.path.stem, slot_ctx, 0, slot_ctx, settings.n_threads,
                          parallel=slots)
        worker = Worker(spec, chosen, self._log_dir, config.worker, _ServiceHooks(self), self._clock)
        footprint = estimate.estimate_worker(info, estimate.WorkerSettings(
            n_ctx=slot_ctx * slots, n_gpu_layers=0, n_batch=slot_ctx, n_ubatch=slot_ctx, n_parallel=slots,
            logits_all=False))
        return EmbeddingPath(
            worker, Lane("embed", slots, settings.queue_limit, self._clock), self._http,
            model=self.model_id, pooling=settings.pooling, n_ctx=settings.n_ctx, dimensions=info.n_embd,
            idle_unload_s=settings.idle_unload_s, ready_timeout_s=config.worker.ready_timeout_s,
            ram_floor_mib=config.cpu.ram_floor_mib, load_ram_mib=footprint.host.total / MIB,
            available_ram_mib=lambda: self.observer.latest().host.available_mib,
            note=self.observer.note, changed=self.observer.advance, clock=self._clock,
        )

    def _our_vram_mib(self, reading) -> float:
        """What our own workers hold on the device: NVML's per-process numbers
        where it reports them, else what the loaded GPU worker is estimated
        to hold."""
        if self.simulated is not None:
            return self.simulated.footprint(GPU_FOOTPRINT_OWNER)
        pids = set(self._worker_pids())
        device = reading.devices[0] if reading.devices else None
        if device is not None and device.processes_reported:
            mine = [p.used_mib for p in device.processes if p.pid in pids and p.used_mib is not None]
            if mine:
                return sum(mine)
        gpu = self.gpu_worker
        return self.gpu_footprint.gpu.total / MIB if gpu is not None and gpu.pid else 0.0

    def _on_sample(self, snapshot: MemorySnapshot) -> None:
        if self.sharing is not None:
            self.sharing.on_sample(snapshot)
        if self.on_demand_cpu is not None:
            self.on_demand_cpu.on_sample()
        if self.embeddings is not None:
            self.embeddings.on_sample()

    def _backend(self, path: str, runtime: WorkerRuntime) -> Backend:
        config = self.config
        info = self.model_info if path == "gpu" else self.fallback_info
        slots = self.slots[path]
        spec = WorkerSpec(path, info.path, info.path.stem, config.gpu.n_ctx if path == "gpu" else config.cpu.n_ctx,
                          config.gpu.n_gpu_layers if path == "gpu" else 0, config.worker.n_batch,
                          config.cpu.n_threads, parallel=slots)
        worker = Worker(spec, runtime, self._log_dir, config.worker, _ServiceHooks(self), self._clock)
        settings = config.gpu if path == "gpu" else config.cpu
        lane = Lane(path, slots, settings.queue_limit, self._clock)
        speed = (PathSpeed(tokens_per_s=config.cpu.assumed_tokens_per_s * 5, prompt_tokens_per_s=2000.0)
                 if path == "gpu" else
                 PathSpeed(tokens_per_s=config.cpu.assumed_tokens_per_s, prompt_tokens_per_s=200.0))
        if path == "gpu":
            deadlines = Deadlines(lambda job: self._gpu_first_token_timeout_s(job, speed), config.gpu.token_timeout_s,
                                  config.worker.ready_timeout_s)
        else:
            deadlines = Deadlines(lambda job: CPU_FIRST_TOKEN_TIMEOUT_S, CPU_FIRST_TOKEN_TIMEOUT_S,
                                  config.worker.ready_timeout_s)
        return Backend(path, worker, lane, speed, self._http, deadlines, clock=self._clock,
                       fingerprint=system_fingerprint(runtime.describe(), info.path),
                       on_change=lambda: self.observer.advance())

    def _gpu_first_token_timeout_s(self, job: Job, speed: PathSpeed) -> float:
        """How long the GPU may take to its first token before we call it hung:
        generous against the prefill time its measured speed predicts, and
        never more than the configured ceiling."""
        expected_s = job.prompt_tokens / max(1.0, speed.prompt_tokens_per_s)
        return min(self.config.gpu.first_token_timeout_s, FIRST_TOKEN_SLACK_S + FIRST_TOKEN_FACTOR * expected_s)

    # ----- the parts, by name ------------------------------------------------------

    @property
    def gpu_worker(self) -> Worker | None:
        return self.dispatcher.gpu.worker if self.dispatcher.gpu is not None else None

    @property
    def cpu_worker(self) -> Worker:
        return self.dispatcher.cpu.worker

    @property
    def gpu_paused(self) -> bool:
        return self.dispatcher.gpu_paused

    def _workers(self) -> list[Worker]:
        return [w for w in (self.gpu_worker, self.cpu_worker) if w is not None]

    def _worker_pids(self) -> list[int]:
        # The embedding worker's too: its memory is ours in the telemetry.
        embed = self.embeddings.worker.pid if self.embeddings is not None else None
        return [w.pid for w in self._workers() if w.pid] + ([embed] if embed else [])

    def latest_snapshot(self) -> MemorySnapshot:
        return self.observer.latest()

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        self.observer.add_listener(listener)

    # ----- lifecycle ----------------------------------------------------------

    def _gpu_disabled_reason(self) -> str | None:
        if not self.config.gpu.enabled:
            return "the GPU path is disabled in the config ([gpu] enabled = false)"
        if self.simulated is not None:
            return None
        reading = self._gpu_reader.read()
        if not reading.available:
            return f"no usable GPU: {reading.reason}; serving CPU-only"
        if self.offload_support.supported is False:
            return f"GPU found, but {self.offload_support.message}; serving CPU-only"
        return None

    async def start(self) -> None:
        self.counter = await asyncio.to_thread(PromptCounter, self.model_info.path)
        if self.fallback_info is not self.model_info:
            self.equivalence = await asyncio.to_thread(self._check_fallback_equivalence)
        if self.engine_fallback_reason:
            self.observer.note("engine_fallback", reason=self.engine_fallback_reason)
        for worker in reversed(self._resident_workers()):
            worker.start()
        self.observer.sample()
        self.observer.advance()
        self.observer.start()

    def _resident_workers(self) -> list[Worker]:
        """The workers that are loaded from the start: not a CPU worker that loads on demand."""
        return [w for w in self._workers() if not (w.role == "cpu" and self.on_demand_cpu is not None)]

    async def wait_ready(self, timeout: float) -> bool:
        results = await asyncio.gather(*(w.ensure_ready(timeout) for w in self._resident_workers()))
        return all(results)

    async def stop(self) -> None:
        self.observer.stop()
        for keeper in (self.sharing, self.on_demand_cpu):
            if keeper is not None:
                await keeper.close()
        self.dispatcher.cancel_all("the service is shutting down")
        closing = [w.close() for w in self._workers()]
        if self.embeddings is not None:
            closing.append(self.embeddings.close())
        await asyncio.gather(*closing, return_exceptions=True)
        await self._http.aclose()
        self._gpu_reader.close()
        if self.counter is not None:
            self.counter.close()

    def _check_fallback_equivalence(self) -> dict[str, Any]:
        fallback = PromptCounter(self.fallback_info.path)
        try:
            assert self.counter is not None
            differences = []
            if fallback.chat_template != self.counter.chat_template:
                differences.append("chat template differs")
            if fallback.vocabulary_fingerprint() != self.counter.vocabulary_fingerprint():
                differences.append("tokenizer vocabulary differs")
        finally:
            fallback.close()
        if differences:
            return {"equivalent": False, "detail": "not equivalent: " + ", ".join(differences)}
        return {"equivalent": True, "detail": "same tokenizer and chat template as the main model"}

    # ----- commands -------------------------------------------------------------

    def set_gpu_paused(self, paused: bool) -> None:
        self.dispatcher.set_gpu_paused(paused)
        self.observer.note("gpu_paused" if paused else "gpu_resumed")
        self.observer.advance()

    def give_gpu_back(self, given: bool) -> None:
        """The tray's "Give the GPU back now" (True) and "Use the GPU again" (False)."""
        if self.sharing is None:
            raise ValueError(self.dispatcher.gpu_missing_reason or "there is no GPU path")
        if given:
            self.sharing.give_back()
        else:
            self.sharing.take_again()

    def preload(self) -> None:
        """Load the GPU model if it is unloaded for idleness (Ollama's empty
        prompt); a GPU given to another app or by the user stays given."""
        if self.sharing is not None:
            self.sharing.request_arrived()

    def keep_alive(self, seconds: float) -> None:
        """A request's keep_alive (Ollama's): how long the GPU model stays
        loaded after it; negative = until told otherwise, 0 = unload once idle."""
        if self.sharing is not None:
            self.sharing.residency.keep_alive_s = seconds

    def set_yield_to_other_apps(self, enabled: bool) -> None:
        if self.sharing is None:
            raise ValueError(self.dispatcher.gpu_missing_reason or "there is no GPU path")
        residency = self.sharing.residency
        residency.policy = dataclasses.replace(residency.policy, yield_to_other_apps=enabled)
        self.observer.note("yield_to_other_apps", enabled=enabled)
        if not enabled and residency.hold is not None and residency.hold.kind is HoldKind.YIELDED:
            self.sharing.take_again()

    def restart_workers(self) -> None:
        """Restart the loaded workers. A GPU worker that was given away or
        unloaded stays so, and so does an on-demand CPU worker at rest."""
        for worker in self._workers():
            if worker.role == "gpu" and self.sharing is not None and self.sharing.residency.hold is not None:
                continue
            if worker.role == "cpu" and self.on_demand_cpu is not None and worker.state is WorkerState.STOPPED:
                continue
            worker.restart("restart requested by the user")
        if self.embeddings is not None:
            self.embeddings.restart("restart requested by the user")
        self.observer.note("workers_restarted")

    def set_simulated_pressure(self, mib: float) -> None:
        if self.simulated is None:
            raise ValueError("VRAM pressure can only be injected on a simulated GPU (--simulate-gpu-mib)")
        self.simulated.set_pressure(mib)
        self.observer.note("simulated_pressure", mib=mib)
        self.observer.sample()
        self.observer.advance()

    def cancel(self, request_id: str, why: str = "canceled by DELETE /v1/requests/{id}") -> dict[str, Any] | None:
        return self.dispatcher.cancel(request_id, why.replace("{id}", request_id))

    # ----- the snapshot (reads only) ---------------------------------------------------

    def degraded(self) -> dict[str, Any]:
        observer = self.observer
        return {
            "active": observer.degraded_since is not None,
            "reason": observer.degraded_reason,
            "since": observer.degraded_since,
            "fallback_model": self.fallback_model_id,
            "fallback_equivalent": self.equivalence["equivalent"],
            "fallback_detail": self.equivalence["detail"],
            # What a typical new request (64 prompt tokens) would wait now.
            "estimated_latency_s": round(self.dispatcher.cpu_wait_s(64, EXPECTED_ANSWER_TOKENS), 2),
            "cpu_context_cap": self.config.cpu.n_ctx,
            "cpu_queue_depth": len(self.dispatcher.cpu.lane.waiting_ids),
        }

    def health(self) -> tuple[bool, str]:
        out = self.dispatcher.gpu_out()
        if out is None:
            return True, "the GPU path can serve"
        if out.quiet:
            return True, out.detail
        gpu_out = out.detail
        cpu = self.cpu_worker
        if cpu.state is WorkerState.READY:
            return True, f"the CPU path can serve (degraded: {gpu_out})"
        if self.on_demand_cpu is not None and cpu.gave_up is None:
            return True, f"the CPU path loads on demand (degraded: {gpu_out})"
        why = cpu.gave_up or cpu.unhealthy_reason
        return False, f"no path can serve: GPU: {gpu_out}; CPU worker is {cpu.state.value}" + (f" ({why})" if why else "")

    def engine_status(self) -> dict[str, Any]:
        return {"runtime": self.runtime.name, "version": self.runtime.describe(),
                "configured": self.config.engine.runtime, "fallback_reason": self.engine_fallback_reason,
                "slots": dict(self.slots), "cpu_keep": self.config.cpu.keep,
                "fallback_policy": self.config.routing.fallback}

    def gpu_status(self) -> dict[str, Any]:
        gpu_status = self.observer.latest().gpu.to_status()
        gpu_status["reserve_mib"] = self.config.gpu.reserve_mib
        gpu_status["path_out_reason"] = self.dispatcher.gpu_out_reason()
        gpu_status["offload_supported"] = self.offload_support.supported
        gpu_status["offload_message"] = self.offload_support.message
        if self.simulated is not None:
            gpu_status["pressure_mib"] = self.simulated.pressure_mib
            gpu_status["simulated_device_dir"] = str(self.simulated.others_dir)
        gpu_status["residency"] = self.sharing.status() if self.sharing is not None else None
        return gpu_status

    def status(self) -> dict[str, Any]:
        snapshot = self.observer.latest()
        dispatcher = self.dispatcher
        workers = []
        for worker in self._workers():
            info = worker.snapshot()
            info["rss_mib"] = snapshot.host.rss_mib_by_pid.get(worker.pid) if worker.pid else None
            footprint = self.gpu_footprint if worker.role == "gpu" else self.cpu_footprint
            info["estimated_vram_mib"] = round(footprint.gpu.total / MIB, 1)
            info["estimated_ram_mib"] = round(footprint.host.total / MIB, 1)
            workers.append(info)
        healthy, health_reason = self.health()
        backends = {path: b for path, b in (("gpu", dispatcher.gpu), ("cpu", dispatcher.cpu)) if b is not None}
        return {
            "service": {"pid": os.getpid(), "started_at": self.started_at, "model": self.model_id, "healthy": healthy,
                        "health_reason": health_reason, "gpu_paused": dispatcher.gpu_paused},
            "workers": workers,
            "engine": self.engine_status(),
            "gpu": self.gpu_status(),
            "ram": {**snapshot.host.to_status(), "floor_mib": self.config.cpu.ram_floor_mib},
            "breaker": self.breaker.snapshot(),
            "queues": {"gpu": dispatcher.gpu.lane.snapshot() if dispatcher.gpu is not None else _NO_LANE,
                       "cpu": dispatcher.cpu.lane.snapshot()},
            "degraded": self.degraded(),
            "requests": dispatcher.request_status(),
            "recent_decisions": list(dispatcher.recent)[-20:],
            "speeds": {path: {"tokens_per_s": round(b.speed.tokens_per_s, 2), "samples": b.speed.samples}
                       for path, b in backends.items()},
            "gpu_recovery_s": self.gpu_recovery_s,
            "accounting": {"completed_executions": dispatcher.completed_total,
                           "duplicate_executions": dispatcher.duplicate_executions},
            "events": list(self.observer.events)[-20:],
            "embeddings": self.embeddings_status(),
        }

    def embeddings_status(self) -> dict[str, Any]:
        """/status["embeddings"]: kept out of "workers", which readers take to
        be the GPU and CPU paths."""
        path = self.embeddings
        if path is None:
            return {"enabled": False, "reason": self.embeddings_off_reason}
        pid = path.worker.pid
        rss = self.observer.latest().host.rss_mib_by_pid.get(pid) if pid else None
        return path.status(rss_mib=round(rss, 1) if rss is not None else None)

    # ----- worker hooks ---------------------------------------------------------------

    async def _before_spawn(self, worker: Worker) -> LaunchExtras:
        if worker.role != "gpu":
            return LaunchExtras()
        if self.simulated is not None:
            self.simulated.set_footprint(GPU_FOOTPRINT_OWNER, 0)
            free = self.simulated.read().free_mib or 0.0
            need = self.gpu_footprint.gpu.total / MIB
            if need <= free:
                self.simulated.set_footprint(GPU_FOOTPRINT_OWNER, need)
            return LaunchExtras(simulated_vram_need_mib=need, simulated_vram_free_mib=free)
        if worker.last_exit is not None and worker.last_exit.kind is not ExitKind.CLEAN_STOP:
            # NVML lags a process exit: let the old worker's memory come back
            # before the new one allocates, or it fails for no real reason.
            # (A worker we stopped was waited for: GpuSharing saw it released.)
            baseline = self._gpu_reader.read().free_mib
            if baseline is not None:
                await wait_for_vram_recovery(
                    lambda: self._gpu_reader.read().free_mib, baseline, self.gpu_footprint.gpu.total / MIB,
                )
        return LaunchExtras()

    def _on_worker_event(self, event: WorkerEvent) -> None:
        if event.role == "gpu":
            if event.state is not WorkerState.READY:
                self.dispatcher.redirect_gpu_waiting(f"the GPU worker is {event.state.value}")
            if event.exit is not None and self.simulated is not None:
                self.simulated.set_footprint(GPU_FOOTPRINT_OWNER, 0)
            if event.exit is not None and event.exit.kind is ExitKind.OUT_OF_MEMORY:
                self.breaker.trip(f"GPU worker out of memory: {event.exit.evidence or event.exit.describe()}")
            if event.state is WorkerState.READY and self._gpu_failed_at is not None:
                self.gpu_recovery_s = round(self._clock() - self._gpu_failed_at, 3)
                self._gpu_failed_at = None
            if event.exit is not None and event.exit.kind is not ExitKind.CLEAN_STOP and self._gpu_failed_at is None:
                self._gpu_failed_at = self._clock()
        self.observer.note("worker", role=event.role, state=event.state.value,
                           exit=event.exit.describe() if event.exit else None)
        self.observer.advance()


class _ServiceHooks(WorkerHooks):
    def __init__(self, service: Service) -> None:
        self._service = service

    async def before_spawn(self, worker: Worker) -> LaunchExtras:
        return await self._service._before_spawn(worker)

    def on_event(self, event: WorkerEvent) -> None:
        self._service._on_worker_event(event)


class _DispatchEvents:
    """The dispatcher's effects on the rest of the service: the event log,
    degraded mode, the metrics and the GPU recovery clock."""

    def __init__(self, service: Service) -> None:
        self._service = service

    def note(self, kind: str, **data: Any) -> None:
        self._service.observer.note(kind, **data)

    def changed(self) -> None:
        self._service.observer.advance()

    def decided(self, job: Job, decision: Decision) -> None:
        path = {Route.GPU: "gpu", Route.GPU_QUEUE: "gpu", Route.CPU: "cpu"}.get(decision.route, "rejected")
        metrics = self._service.metrics
        metrics.requests.labels(path, decision.reason.value).inc()
        if decision.reason is Reason.GPU_FAILED_REPLAYED:
            metrics.replays.inc()

    def completed(self, job: Job, attempt: Attempt) -> None:
        metrics = self._service.metrics
        first = attempt.first_token_at or attempt.ended_at
        assert first is not None and attempt.ended_at is not None
        metrics.ttft.labels(attempt.path).observe(first - attempt.started_at)
        if attempt.tokens > 1 and attempt.ended_at > first:
            metrics.tokens_per_second.labels(attempt.path).observe((attempt.tokens - 1) / (attempt.ended_at - first))

    def gpu_failed(self, job: Job, reason: str) -> None:
        self._service._gpu_failed_at = self._service._clock()
        self._service.metrics.gpu_failures.labels("yes" if job.committed else "no").inc()


# /status has both queues even when there is no GPU worker.
_NO_LANE = {"running": 0, "concurrency": 0, "depth": 0, "limit": 0, "oldest_age_s": 0.0}


def system_fingerprint(engine: str, model_path: Path) -> str:
    """A stable id of engine build plus model file, cheap for a 40 GB file:
    its size and its first and last MiB (the GGUF header, the last tensors)."""
    digest = hashlib.sha256(engine.encode())
    size = model_path.stat().st_size
    digest.update(str(size).encode())
    with open(model_path, "rb") as handle:
        digest.update(handle.read(MIB))
        if size > 2 * MIB:
            handle.seek(-MIB, os.SEEK_END)
            digest.update(handle.read(MIB))
    return "fp_" + digest.hexdigest()[:12]
