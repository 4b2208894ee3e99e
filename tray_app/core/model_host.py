"""One model of the library, served: its GPU and CPU workers, their lanes,
its breaker, its dispatcher and its GPU residency.

Each model has its own admission, breaker and degraded state, so a model
whose GPU worker crashed does not send another model's requests to the CPU.
The default model's GPU worker (and CPU worker, unless [cpu] keep =
"on_demand") load at start; every other model's load on its first request
and unload when idle or when another model needs the memory (see the
residency package). The Service owns the hosts and the parts they share:
the memory observer, the HTTP client, the device reader and the metrics.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from .dispatch.admission import Decision, Reason, Route
from .dispatch.backend import Backend, Deadlines
from .dispatch.breaker import CircuitBreaker
from .dispatch.dispatcher import Costs, Dispatcher, Limits
from .dispatch.jobs import Attempt, Job, PathSpeed
from .dispatch.lanes import Lane
from .engine.exits import ExitKind
from .engine.runtime import IMAGE_MAX_TOKENS, WorkerRuntime
from .engine.draft import DRAFT_SPEC_TYPE, choose_draft
from .engine.speculation import speculation_for
from .engine.launch_env import worker_threads, workers_oversubscribe, workers_share_cores
from .engine.worker import LaunchExtras, Worker, WorkerEvent, WorkerHooks, WorkerSpec, WorkerState
from .catalog.library import LibraryModel
from .memory import estimate
from .memory.context_size import choose_context
from .memory.gguf_info import ModelInfo, ProjectorInfo, read_model_info, read_paired_projector
from .memory.telemetry import gpu_too_small_reason, read_host, usable_cores, wait_for_vram_recovery
from .residency.coordinator import ResidencyCoordinator
from .residency.gpu import GpuSharing, prior_load_s
from .residency.on_demand import OnDemandWorker
from .residency.policy import Residency, SharingPolicy
from .catalog.tokens import PromptCounter

MIB = 1024 * 1024
CPU_FIRST_TOKEN_TIMEOUT_S = 600.0
# The GPU's first-token deadline: this much slack plus this many times the
# prefill time its measured speed predicts (a busy host, a cold cache).
FIRST_TOKEN_SLACK_S = 15.0
FIRST_TOKEN_FACTOR = 5.0
# What the default model's GPU worker is called on a simulated device; the
# others add their name.
GPU_FOOTPRINT_OWNER = "gpu-worker"
# The share of available RAM (above the floor) a CPU worker's automatic
# context may fill. Its KV cache is committed as requests fill it, but
# admission and residency charge it whole.
CPU_CONTEXT_RAM_SHARE = 0.5


class HostOwner(Protocol):
    """What a model host uses of the service that owns it: the parts all models share."""

    config: Any
    clock: Callable[[], float]
    log_dir: Path
    http: Any
    observer: Any
    metrics: Any
    simulated: Any
    gpu_reader: Any
    rpc_health: Any  # rpc.RpcHealth: the remote devices' memory, for the local GPU's share
    peers: Any
    residency: ResidencyCoordinator  # room in VRAM and RAM, made across models
    worker_factory: Any  # engine.handle.WorkerFactory: Worker, or a test's stand-in

    def worker_pids(self) -> list[int]: ...


@dataclass(frozen=True)
class ModelFiles:
    """All a model host reads from the disk: both paths' GGUF headers and system
    fingerprints. Read apart from building the model host, so that a rescan reads
    them in a thread and builds the model host on the event loop."""

    model_info: ModelInfo
    fallback_info: ModelInfo
    gpu_fingerprint: str
    cpu_fingerprint: str
    # Each path's multimodal projector, when the model has one and the runtime reads images.
    projector: ProjectorInfo | None = None
    cpu_projector: ProjectorInfo | None = None


def read_model_files(model: LibraryModel, runtime: WorkerRuntime, gpu_runtime: WorkerRuntime) -> ModelFiles:
    """Blocking I/O only (no service state): safe in a worker thread.
    ModelFileError when a file is not a readable GGUF."""
    model_info = read_model_info(model.path)
    cpu_path = model.cpu_path or model.path
    fallback_info = model_info if cpu_path == model.path else read_model_info(cpu_path)
    projector = (read_paired_projector(model.mmproj, model_info)
                 if model.mmproj is not None and getattr(gpu_runtime, "supports_images", False) else None)
    cpu_projector = (read_paired_projector(model.cpu_mmproj, fallback_info)
                     if model.cpu_mmproj is not None and getattr(runtime, "supports_images", False) else None)
    return ModelFiles(model_info, fallback_info, system_fingerprint(gpu_runtime.describe(), model_info.path),
                      system_fingerprint(runtime.describe(), fallback_info.path), projector, cpu_projector)


class ModelHost:
    def __init__(self, service: HostOwner, model: LibraryModel, *, runtime: WorkerRuntime,
                 gpu_runtime: WorkerRuntime, gpu_missing_reason: str | None, files: ModelFiles | None = None) -> None:
        config = service.config
        self.service = service
        self.model = model
        self._clock = service.clock
        self.name = model.name
        files = files or read_model_files(model, runtime, gpu_runtime)
        self.model_info: ModelInfo = files.model_info
        self.projector, self.cpu_projector = files.projector, files.cpu_projector
        # What one image counts for in a prompt: the most tokens the projector makes of it.
        self.image_tokens = (estimate.image_tokens_bound(self.projector, IMAGE_MAX_TOKENS)
                             if self.projector is not None else 0)
        cpu_path = model.cpu_path or model.path
        self.fallback_info: ModelInfo = files.fallback_info
        self.model_id = self.model_info.path.stem if model.is_default else model.name
        self.fallback_model_id = (self.fallback_info.path.stem if model.is_default or cpu_path != model.path
                                  else model.name)
        self.counter: PromptCounter | None = None
        self.equivalence: dict[str, Any] = {"equivalent": True, "detail": "same model file on both paths"}
        self.footprint_owner = GPU_FOOTPRINT_OWNER if model.is_default else f"{GPU_FOOTPRINT_OWNER}:{model.name}"
        # llama.cpp's RPC server serves one client: only the default model's
        # GPU worker is given the servers (a second model's worker would wait
        # on the busy server until its ready timeout, and again on each retry).
        self.rpc_servers: tuple[str, ...] = config.gpu.rpc_servers if model.is_default else ()
        # [gpu] draft_model: the default model's GPU worker speculates with it,
        # when it shares the model's vocabulary (engine/draft.py).
        self.draft = choose_draft(config.gpu.draft_model if model.is_default else "", self.model_info,
                                  resolve=self._draft_file, read=read_model_info,
                                  runtime_drafts=getattr(gpu_runtime, "drafts_with_model", False))
        self.slots = {"gpu": min(model.slots, gpu_runtime.max_parallel),
                      "cpu": min(config.cpu.max_concurrency, runtime.max_parallel)}
        # Where the config leaves a context at 0, it is sized from memory now,
        # once: admission, the model list and the workers all use the result.
        self.contexts = {
            "gpu": choose_context(configured=model.gpu_n_ctx, trained=self.model_info.n_ctx_train,
                                  room_mib=self._gpu_context_room_mib(),
                                  need_mib=lambda n_ctx, kv: self._settled("gpu", n_ctx, kv).gpu.total / MIB,
                                  kv_types=getattr(gpu_runtime, "kv_types", ("f16",)), where="the GPU"),
            "cpu": choose_context(configured=model.cpu_n_ctx, trained=self.fallback_info.n_ctx_train,
                                  room_mib=self._cpu_context_room_mib(),
                                  need_mib=lambda n_ctx, kv: self._settled("cpu", n_ctx, kv).host.total / MIB,
                                  kv_types=getattr(runtime, "kv_types", ("f16",)), where="the CPU"),
        }
        model = self.model = dataclasses.replace(model, gpu_n_ctx=self.contexts["gpu"].n_ctx,
                                                 cpu_n_ctx=self.contexts["cpu"].n_ctx)
        self.gpu_settings = self._worker_settings("gpu", model.gpu_n_ctx, self.contexts["gpu"].kv_type)
        self.cpu_settings = self._worker_settings("cpu", model.cpu_n_ctx, self.contexts["cpu"].kv_type)
        # Every offloaded layer on the local GPU. What it is charged is
        # gpu_footprint: less when [gpu] rpc_servers lend devices.
        self.all_local_gpu_footprint = estimate.estimate_worker(self.model_info, self.gpu_settings)
        self.cpu_footprint = estimate.estimate_worker(self.fallback_info, self.cpu_settings)
        if gpu_missing_reason is None and not self.rpc_servers:
            # Said once, at start, in /status's path_out_reason, the tray and tray-app status.
            gpu_missing_reason = gpu_too_small_reason(service.gpu_reader.read().total_mib, self.model_id,
                                                      self.all_local_gpu_footprint.gpu.total / MIB,
                                                      config.gpu.reserve_mib)
        self.gpu_recovery_s: float | None = None
        self._gpu_failed_at: float | None = None
        self.last_used = self._clock()
        self.requests_by_path: collections.Counter[str] = collections.Counter()

        # Whether this model's GPU and CPU workers compute on the same cores
        # (then their OpenMP threads spin briefly; see engine/launch_env.py).
        self.workers_share_cores = workers_share_cores(
            gpu_worker=gpu_missing_reason is None, simulated=service.simulated is not None,
            layers_offloaded=estimate.layers_offloaded(self.model_info, model.gpu_layers),
            layers_total=self.model_info.n_layer + 1)
        self.worker_threads = worker_threads(config.cpu.n_threads, self.workers_share_cores, usable_cores())
        hooks = _ModelHostHooks(self)
        backends = {"cpu": self._backend("cpu", runtime, hooks, files.cpu_fingerprint)}
        if gpu_missing_reason is None:
            backends["gpu"] = self._backend("gpu", gpu_runtime, hooks, files.gpu_fingerprint)
        self.breaker = CircuitBreaker(config.breaker, self._clock)
        observer = service.observer
        self.dispatcher = Dispatcher(
            Limits(model.gpu_n_ctx, model.cpu_n_ctx, config.gpu.reserve_mib, config.cpu.ram_floor_mib,
                   queue_budget_s=config.server.queue_timeout_s,
                   cpu_load_prior_s=prior_load_s(self.fallback_info.file_size / MIB),
                   cpu_slows_gpu=workers_oversubscribe(self.workers_share_cores, self.worker_threads, usable_cores())),
            backends, self.breaker, observer.latest,
            Costs(gpu_mib=lambda tokens: estimate.request_vram_bytes(self.model_info, self.local_gpu_settings(),
                                                                     tokens) / MIB,
                  cpu_mib=lambda tokens: estimate.kv_bytes_per_token(self.fallback_info) * tokens / MIB,
                  cpu_load_mib=self.cpu_load_ram_mib,
                  cpu_evictable_mib=lambda: service.residency.evictable_cpu_ram_mib(self)),
            _DispatchEvents(self), gpu_missing_reason=gpu_missing_reason, clock=self._clock,
            # A model without a CPU fallback answers 503 when its GPU can't serve.
            no_fallback=config.routing.fallback == "never" or model.cpu_path is None,
            peers=service.peers,
            model_names=tuple(dict.fromkeys((self.model_info.path.stem, self.model_id, *model.names()))),
            cpu_reads_images=self.cpu_projector is not None,
        )
        self.sharing: GpuSharing | None = None
        if self.dispatcher.gpu is not None:
            self.sharing = self._gpu_sharing(self.dispatcher.gpu)
            self.dispatcher.residency = self.sharing
        cpu_on_demand = config.cpu.keep == "on_demand" or not model.is_default
        self.on_demand_cpu = (OnDemandWorker(self.dispatcher.cpu, config.cpu.idle_unload_s, self.note,
                                             self._clock) if cpu_on_demand else None)

    def served_contexts(self) -> dict[str, dict[str, object]]:
        """Each path's context of one request, its KV cache type and how it
        was chosen, for /status, the model lists and /props."""
        return {path: choice.to_status() for path, choice in self.contexts.items()
                if path == "cpu" or self.dispatcher.gpu is not None}

    def _worker_settings(self, path: str, n_ctx: int, kv_type: str) -> estimate.WorkerSettings:
        """How the worker on `path` is launched, as the estimator prices it:
        every slot has its own n_ctx of KV cache; logits_all=False."""
        slots = self.slots[path]
        return estimate.WorkerSettings(
            n_ctx=n_ctx * slots, n_gpu_layers=self.model.gpu_layers if path == "gpu" else 0,
            n_batch=self.service.config.worker.n_batch, n_parallel=slots, logits_all=False, kv_type=kv_type,
            projector=self.projector if path == "gpu" else self.cpu_projector, image_max_tokens=IMAGE_MAX_TOKENS,
            draft=self.draft.info if path == "gpu" else None,
        )

    def _draft_file(self, name: str) -> Path | None:
        """A library model's file by its name or alias, or a .gguf path."""
        listed = self.service.library.resolve(name)
        if listed is not None:
            return listed.path
        path = Path(name).expanduser()
        return path if path.is_file() else None

    def _settled(self, path: str, n_ctx: int, kv_type: str) -> estimate.Footprint:
        info = self.model_info if path == "gpu" else self.fallback_info
        return estimate.estimate_worker(info, self._worker_settings(path, n_ctx, kv_type))

    def _gpu_context_room_mib(self) -> float | None:
        """What the GPU worker may hold when its context is sized: the card,
        less the reserve kept for other apps, less what they hold now (so it
        loads now; a game started later is the give-back's to answer). Other
        models' workers don't count: residency moves them out to make room."""
        reading = self.service.gpu_reader.read()
        total, used = reading.total_mib, reading.used_mib
        if total is None:
            return None
        others = max(0.0, (used or 0.0) - self.service.residency.vram_of_other_models(self, reading))
        return total - self.service.config.gpu.reserve_mib - others

    def _cpu_context_room_mib(self) -> float:
        """What the CPU worker may hold at full context: a share of the RAM
        available above the floor, so the GPU worker's host side, other
        models and the person's own apps keep the rest."""
        available = read_host(()).available_mib
        return max(0.0, available - self.service.config.cpu.ram_floor_mib) * CPU_CONTEXT_RAM_SHARE

    def _gpu_sharing(self, backend: Backend) -> GpuSharing:
        config = self.service.config
        policy = SharingPolicy(yield_to_other_apps=config.gpu.yield_to_other_apps,
                               reload_settle_s=config.gpu.reload_settle_s, idle_unload_s=self.model.idle_unload_s)
        service = self.service
        return GpuSharing(
            # Every model but the default one is loaded by its first request, not at start.
            Residency(policy, self._clock, loads_on_demand=not self.model.is_default), backend,
            # What the worker holds here: its local share when RPC devices lend memory.
            need_mib=lambda: self.gpu_footprint.gpu.total / MIB, reserve_mib=config.gpu.reserve_mib,
            model_mib=self.model_info.file_size / MIB, drain_s=config.gpu.yield_drain_s,
            ours_mib=self.vram_mib, our_pids=lambda: set(service.worker_pids()),
            note=self.note, changed=service.observer.advance,
            read_gpu=service.gpu_reader.read, clock=self._clock,
            make_room=lambda: service.residency.make_vram_room(self),
            ours_elsewhere_mib=lambda reading: service.residency.vram_of_other_models(self, reading),
        )

    def _backend(self, path: str, runtime: WorkerRuntime, hooks: WorkerHooks, fingerprint: str) -> Backend:
        service = self.service
        config = service.config
        model = self.model
        info = self.model_info if path == "gpu" else self.fallback_info
        slots = self.slots[path]
        settings = config.gpu if path == "gpu" else config.cpu
        spec = WorkerSpec(path, info.path, info.path.stem, model.gpu_n_ctx if path == "gpu" else model.cpu_n_ctx,
                          model.gpu_layers if path == "gpu" else 0, config.worker.n_batch,
                          self.worker_threads,
                          parallel=slots,
                          rpc_servers=self.rpc_servers if path == "gpu" else (),
                          shares_cores=self.workers_share_cores,
                          mmproj=self.projector_path(path), kv_type=self.contexts[path].kv_type,
                          spec_type=(DRAFT_SPEC_TYPE if path == "gpu" and self.draft.info is not None else
                                     speculation_for(path, settings.speculative, getattr(runtime, "spec_types", ()))),
                          draft_model=self.draft.path if path == "gpu" else None)
        worker = service.worker_factory(spec, runtime, service.log_dir, config.worker, hooks, self._clock,
                        log_name=None if model.is_default else f"{path}-{model.name}")
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
        return Backend(path, worker, lane, speed, service.hop, deadlines, clock=self._clock,
                       fingerprint=fingerprint,
                       on_change=lambda: service.observer.advance())

    def _gpu_first_token_timeout_s(self, job: Job, speed: PathSpeed) -> float:
        """How long the GPU may take to its first token before we call it hung:
        generous against the prefill time its measured speed predicts, and
        never more than the configured ceiling."""
        expected_s = job.prompt_tokens / max(1.0, speed.prompt_tokens_per_s)
        return min(self.service.config.gpu.first_token_timeout_s,
                   FIRST_TOKEN_SLACK_S + FIRST_TOKEN_FACTOR * expected_s)

    def projector_path(self, path: str) -> Path | None:
        """The projector the worker on `path` loads, None when it reads no images."""
        projector = self.projector if path == "gpu" else self.cpu_projector
        return projector.path if projector is not None else None

    def note(self, kind: str, **data: Any) -> None:
        """An event in the log, naming this model unless it is the default one."""
        if not self.model.is_default:
            data.setdefault("model", self.model_id)
        self.service.observer.note(kind, **data)

    # ----- the parts, by name ------------------------------------------------------

    @property
    def gpu_worker(self) -> Worker | None:
        return self.dispatcher.gpu.worker if self.dispatcher.gpu is not None else None

    @property
    def cpu_worker(self) -> Worker:
        return self.dispatcher.cpu.worker

    def workers(self) -> list[Worker]:
        return [w for w in (self.gpu_worker, self.cpu_worker) if w is not None]

    def resident_workers(self) -> list[Worker]:
        """The workers loaded from the start: the default model's GPU worker,
        and its CPU worker unless that loads on demand."""
        if not self.model.is_default:
            return []
        return [w for w in self.workers() if not (w.role == "cpu" and self.on_demand_cpu is not None)]

    def cpu_load_ram_mib(self) -> float:
        """The RAM loading this model's CPU worker takes; 0 once it is loaded
        (a warm worker's RAM is already out of the available figure)."""
        if self.on_demand_cpu is None or self.cpu_worker.state is not WorkerState.STOPPED:
            return 0.0
        return self.cpu_footprint.host.total / MIB

    def cpu_idle(self) -> bool:
        """An on-demand CPU worker that is loaded with nothing queued or running: evictable."""
        lane = self.dispatcher.cpu.lane
        return (self.on_demand_cpu is not None and self.cpu_worker.state is WorkerState.READY
                and not lane.running_ids and not lane.waiting_ids)

    def cpu_ram_mib(self, snapshot=None) -> float:
        """What this model's CPU worker holds in RAM: its RSS, else the estimate."""
        worker = self.cpu_worker
        if not worker.pid:
            return 0.0
        snapshot = snapshot or self.service.observer.latest()
        rss = snapshot.host.rss_mib_by_pid.get(worker.pid)
        return rss if rss else self.cpu_footprint.host.total / MIB

    def in_flight(self) -> int:
        """Requests queued or running on this model's GPU path."""
        gpu = self.dispatcher.gpu
        return len(gpu.lane.running_ids) + len(gpu.lane.waiting_ids) if gpu is not None else 0

    def gpu_loaded(self) -> bool:
        worker = self.gpu_worker
        return worker is not None and worker.state is not WorkerState.STOPPED

    def rest_tokenizer_if_cold(self) -> None:
        """A library model with no worker loaded and no request gives its
        tokenizer child's memory back; its next request, which loads a worker
        anyway, starts one again. The default model keeps its own."""
        if (self.model.is_default or self.counter is None or self.dispatcher.jobs
                or any(worker.state is not WorkerState.STOPPED for worker in self.workers())):
            return
        if self.counter.rest():
            self.note("tokenizer_rested")

    # ----- the local GPU's share, with llama.cpp RPC devices ---------------------------

    @property
    def gpu_footprint(self) -> estimate.Footprint:
        """What the GPU worker holds on the local GPU: with [gpu] rpc_servers
        whose memory has been read, only the layers llama.cpp's split leaves
        here (estimate.local_gpu_layers); otherwise all of them, as if there
        were no remote device (conservative)."""
        layers = self.local_gpu_layers()
        if layers is None:
            return self.all_local_gpu_footprint
        return estimate.local_footprint(self.model_info, self.gpu_settings, layers)

    def local_gpu_settings(self) -> estimate.WorkerSettings:
        """The GPU worker's settings as the local GPU sees them: its layers only."""
        layers = self.local_gpu_layers()
        return self.gpu_settings if layers is None else estimate.with_gpu_layers(self.gpu_settings, layers)

    def local_gpu_layers(self) -> int | None:
        """The offloaded layers on the local GPU; None when there are no RPC
        servers or their memory is not known yet. llama.cpp weighs the local
        GPU by its free memory at load; its total stands in for that here:
        never less, so the local share is never underestimated, and steady,
        where free memory moves with other apps and with our own load."""
        if not self.rpc_servers:
            return None
        remote = self.service.rpc_health.free_mib()
        if remote is None:
            return None
        local_total = self.service.observer.latest().gpu.total_mib
        if local_total is None:
            return None
        offloaded = estimate.layers_offloaded(self.model_info, self.gpu_settings.n_gpu_layers)
        return estimate.local_gpu_layers(offloaded, local_total, remote)

    def vram_mib(self, reading=None) -> float:
        """What this model's GPU worker holds on the device: NVML's
        per-process number where it reports one, else the estimate while the
        worker is up (on a simulated device, what it registered)."""
        service = self.service
        if service.simulated is not None:
            return service.simulated.footprint(self.footprint_owner)
        worker = self.gpu_worker
        if worker is None or not worker.pid:
            return 0.0
        reading = reading or service.observer.latest().gpu
        device = reading.devices[0] if reading.devices else None
        if device is not None and device.processes_reported:
            mine = [p.used_mib for p in device.processes if p.pid == worker.pid and p.used_mib is not None]
            if mine:
                return sum(mine)
        return self.gpu_footprint.gpu.total / MIB

    # ----- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        self.counter = await asyncio.to_thread(PromptCounter, self.model_info.path)
        if self.fallback_info is not self.model_info:
            self.equivalence = await asyncio.to_thread(self._check_fallback_equivalence)

    async def close_keepers(self) -> None:
        for keeper in (self.sharing, self.on_demand_cpu):
            if keeper is not None:
                await keeper.close()

    def close_counter(self) -> None:
        if self.counter is not None:
            self.counter.close()

    def _check_fallback_equivalence(self) -> dict[str, Any]:
        fallback = PromptCounter(self.fallback_info.path, tokenizes=False)
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

    def restart_workers(self) -> list[Worker]:
        """Restart the loaded workers, and say which. A GPU worker that was given
        away or unloaded stays so, and so does an on-demand CPU worker at rest."""
        restarted = [worker for worker in self.workers()
                     if not (worker.role == "gpu" and self.sharing is not None
                             and self.sharing.residency.hold is not None)
                     and not (worker.role == "cpu" and self.on_demand_cpu is not None
                              and worker.state is WorkerState.STOPPED)]
        for worker in restarted:
            worker.restart("restart requested by the user")
        return restarted

    # ----- worker hooks ---------------------------------------------------------------

    async def before_spawn(self, worker: Worker) -> LaunchExtras:
        if worker.role == "cpu" and self.on_demand_cpu is not None:
            await self.service.residency.make_ram_room(self)
        if worker.role != "gpu":
            return LaunchExtras()
        service = self.service
        if self.rpc_servers:
            # No process of ours holds the servers now: read their memory
            # afresh, as llama.cpp will at this load. What was free when the
            # service started may be taken since (the lending PC's own apps);
            # a server that can't answer leaves the whole model charged here.
            await service.rpc_health.reread_memory()
        need = self.gpu_footprint.gpu.total / MIB
        if service.simulated is not None:
            simulated = service.simulated
            simulated.set_footprint(self.footprint_owner, 0)
            free = simulated.read().free_mib or 0.0
            if need <= free:
                simulated.set_footprint(self.footprint_owner, need)
            return LaunchExtras(simulated_vram_need_mib=need, simulated_vram_free_mib=free)
        if worker.last_exit is not None and worker.last_exit.kind is not ExitKind.CLEAN_STOP:
            # NVML lags a process exit: let the old worker's memory come back
            # before the new one allocates, or it fails for no real reason.
            # (A worker we stopped was waited for: GpuSharing saw it released.)
            baseline = service.gpu_reader.read().free_mib
            if baseline is not None:
                await wait_for_vram_recovery(lambda: service.gpu_reader.read().free_mib, baseline, need)
        return LaunchExtras()

    def on_worker_event(self, event: WorkerEvent) -> None:
        service = self.service
        if event.role == "gpu":
            if event.state is not WorkerState.READY:
                self.dispatcher.redirect_gpu_waiting(f"the GPU worker is {event.state.value}")
            if event.exit is not None and service.simulated is not None:
                service.simulated.set_footprint(self.footprint_owner, 0)
            if event.exit is not None and event.exit.kind is ExitKind.OUT_OF_MEMORY:
                self.breaker.trip(f"GPU worker out of memory: {event.exit.evidence or event.exit.describe()}")
            if event.state is WorkerState.READY and self._gpu_failed_at is not None:
                self.gpu_recovery_s = round(self._clock() - self._gpu_failed_at, 3)
                self._gpu_failed_at = None
            if event.exit is not None and event.exit.kind is not ExitKind.CLEAN_STOP and self._gpu_failed_at is None:
                self._gpu_failed_at = self._clock()
        self.note("worker", role=event.role, state=event.state.value,
                  exit=event.exit.describe() if event.exit else None)
        service.observer.advance()


class _ModelHostHooks(WorkerHooks):
    def __init__(self, model_host: ModelHost) -> None:
        self._model_host = model_host

    async def before_spawn(self, worker: Worker) -> LaunchExtras:
        return await self._model_host.before_spawn(worker)

    def on_event(self, event: WorkerEvent) -> None:
        self._model_host.on_worker_event(event)


class _DispatchEvents:
    """The dispatcher's effects on the rest of the service: the event log,
    degraded mode, the metrics and the GPU recovery clock."""

    def __init__(self, model_host: ModelHost) -> None:
        self._model_host = model_host

    def note(self, kind: str, **data: Any) -> None:
        self._model_host.note(kind, **data)

    def changed(self) -> None:
        self._model_host.service.observer.advance()

    def decided(self, job: Job, decision: Decision) -> None:
        path = {Route.GPU: "gpu", Route.GPU_QUEUE: "gpu", Route.CPU: "cpu", Route.PEER: "peer"}.get(
            decision.route, "rejected")
        metrics = self._model_host.service.metrics
        metrics.requests.labels(path, decision.reason.value).inc()
        metrics.model_requests.labels(self._model_host.model_id, path).inc()
        self._model_host.requests_by_path[path] += 1
        if decision.reason in (Reason.GPU_FAILED_REPLAYED, Reason.PEER_FAILED_REPLAYED):
            metrics.replays.inc()

    def completed(self, job: Job, attempt: Attempt) -> None:
        metrics = self._model_host.service.metrics
        first = attempt.first_token_at or attempt.ended_at
        assert first is not None and attempt.ended_at is not None
        metrics.ttft.labels(attempt.path).observe(first - attempt.started_at)
        if attempt.tokens > 1 and attempt.ended_at > first:
            metrics.tokens_per_second.labels(attempt.path).observe((attempt.tokens - 1) / (attempt.ended_at - first))
        continuation = job.continuation
        if continuation is not None and attempt.path != "gpu":
            metrics.resumes.labels("yes" if continuation.streamed else "no").inc()
            self.note("resumed", id=job.id, cut_at_tokens=continuation.tokens, cut_at_chars=len(continuation.text),
                      tokens_added=attempt.tokens, streamed=continuation.streamed)
        if job.fault is not None and attempt.path != "gpu" and attempt.first_token_at is not None:
            # A replay's first token: the client's first byte after the GPU's fault
            # (a continued answer's first new token: the seam).
            seconds = attempt.first_token_at - job.fault.at
            metrics.failover_seconds.labels(job.fault.kind).observe(seconds)
            self._model_host.service.observer.failed_over(job.fault.kind, seconds, resumed=continuation is not None,
                                                          id=job.id)

    def gpu_failed(self, job: Job, reason: str) -> None:
        self._model_host._gpu_failed_at = self._model_host._clock()
        self._model_host.service.metrics.gpu_failures.labels("yes" if job.committed else "no").inc()


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
