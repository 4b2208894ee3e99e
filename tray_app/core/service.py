"""The service: the model library's model hosts, the embedding path and the
observer, wired together.

It runs on one asyncio loop. Each piece has one job:
- `engine.Worker`: owns one llama.cpp process (one task is the only writer of its state);
- `dispatch.Backend`: one path (worker + lane + speed) and how a request streams through it;
- `dispatch.Dispatcher`: where a request runs, replay and the breaker, through the backends;
- `model_host.ModelHost`: one library model's workers, dispatcher, breaker and GPU residency;
- `observe.Observer`: memory readings, the event log and degraded mode;
- `embeddings.EmbeddingPath`: the embedding worker, its own lane, loaded on demand.
This module builds them, carries out the commands (pause, restart, cancel)
and assembles the /status snapshot; making room across models before a load
is `residency.coordinator`'s. Reading the snapshot changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import httpx

from .api.metrics import ServiceMetrics
from .config import Config, ConfigError, log_dir as default_log_dir, peer_base_url, simulated_device_dir
from .dispatch.loopback_http import LoopbackHop, LoopbackTransport
from .dispatch.upstream import Hop, HttpxHop
from .dispatch.peer import Peer, Peers
from .embeddings.setup import build_embedding_path
from .embeddings.path import EmbeddingPath
from .engine.handle import WorkerFactory
from .engine.offload_probe import workers_gpu_offload_support
from .engine.runtime import RuntimeChoice, WorkerRuntime, choose_runtime, rpc_runtime_problem
from .engine.worker import Worker, WorkerState
from .model_host import ModelFiles, ModelHost, read_model_files
from .catalog.library import Library, LibraryError, build_library
from .memory.gguf_info import ModelFileError
from .memory.gpu_readers import detect_gpu_reader
from .memory.telemetry import GpuReader, MemorySnapshot, SimulatedGpu, gpu_path_missing_reason
from .observe import Observer
from .residency.coordinator import ResidencyCoordinator
from .engine.rpc import RpcHealth
from .status_build import build_status, gpu_status, health
from .status_contract import GpuStatus, Status


log = logging.getLogger(__name__)


def needs_full_rate(model_hosts: Iterable[ModelHost]) -> bool:
    """Whether memory must be read every second even with nobody looking:
    a request is in flight, or a GPU worker holds VRAM that another app
    (a game starting) may need back. Giving the GPU back waits on the
    sampler, so it can't wait 5 s."""
    return any(model_host.dispatcher.jobs
               or (model_host.gpu_loaded() and model_host.sharing is not None
                   and model_host.sharing.residency.policy.yield_to_other_apps)
               for model_host in model_hosts)


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
        library: Library | None = None,
        worker_factory: WorkerFactory = Worker,
        http_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.log_dir = log_dir or default_log_dir()
        self.library = library or build_library(config)
        # The seam tests run the service in-process through (tests/fakes/):
        # workers without a process, and an upstream behind the HTTP client.
        self.worker_factory = worker_factory

        self.simulated: SimulatedGpu | None = None
        if config.gpu.simulate_mib > 0:
            self.simulated = SimulatedGpu(config.gpu.simulate_mib, others_dir=simulated_device_dir(config))
            self.gpu_reader: GpuReader = self.simulated
        else:
            self.gpu_reader = gpu_reader or detect_gpu_reader(config.engine.llama_server)
        if runtime is None:
            choice = choose_runtime(config.engine.runtime, config.engine.llama_server)
            runtime, self.engine_fallback_reason = choice.runtime, choice.fallback_reason
        else:
            self.engine_fallback_reason = None
        self.runtime = runtime
        gpu_runtime = gpu_runtime or runtime
        # The GPU worker's answer, not this process's own llama.cpp's: the
        # service hides the GPUs from it, and the worker may be another build.
        self.offload_support = workers_gpu_offload_support(gpu_runtime, config.engine.llama_server)
        problem = rpc_runtime_problem(config.gpu.rpc_servers, RuntimeChoice(gpu_runtime, self.engine_fallback_reason))
        if problem:
            raise ConfigError(problem)
        # A request may run on either path, so both must offer what it asks.
        self.supports_logprobs = runtime.supports_logprobs and gpu_runtime.supports_logprobs
        self.started_at = time.time()
        # trust_env=False: no HTTP_PROXY from the environment, so a peer's Bearer key can't pass through a proxy.
        # A relay's hop to a worker is loopback_http's, with no httpx objects (they cost a third of the
        # relay's CPU per request); a test's, its transport.
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=5.0),
                                      limits=httpx.Limits(max_connections=64, max_keepalive_connections=0),
                                      trust_env=False, transport=http_transport,
                                      mounts=None if http_transport else {"http://127.0.0.1": LoopbackTransport()})
        self.hop: Hop = HttpxHop(self.http) if http_transport else LoopbackHop()
        gpu_missing_reason = gpu_path_missing_reason(config.gpu.enabled, self.simulated is not None,
                                                     self.gpu_reader.read, self.offload_support)
        # Kept for the model hosts of models added later (rescan_models).
        self._gpu_runtime, self._gpu_missing_reason = gpu_runtime, gpu_missing_reason
        self.observer = Observer(self.gpu_reader, self.worker_pids, self._degraded_cause, on_sample=self._on_sample,
                                 needs_full_rate=self._needs_full_rate)
        # A GPU worker of ours that is up holds each RPC server's one client slot.
        self.rpc_health = RpcHealth(config.gpu.rpc_servers, in_use=lambda: self.default_model_host.gpu_loaded())
        self.metrics = ServiceMetrics(self.status)
        # Other servers on the LAN that take what this one can't ([[peers]]).
        self.peers = Peers([Peer(entry, peer_base_url(entry.url), self.http, config.breaker, clock)
                            for entry in config.peers])
        self.model_hosts: dict[str, ModelHost] = {}
        self.residency = ResidencyCoordinator(
            self.model_hosts, read_gpu=self.gpu_reader.read, sample=self.observer.sample, latest=self.observer.latest,
            note=self.observer.note, evicted=lambda model_id: self.metrics.model_evictions.labels(model_id).inc(),
            reserve_mib=config.gpu.reserve_mib, ram_floor_mib=config.cpu.ram_floor_mib)
        # Files in the library that can't be served (not a readable GGUF), with why.
        self.library_problems: list[str] = []
        for model in self.library:
            try:
                self.model_hosts[model.name] = ModelHost(self, model, runtime=runtime, gpu_runtime=gpu_runtime,
                                                   gpu_missing_reason=gpu_missing_reason)
            except (ModelFileError, OSError) as exc:
                if model.is_default:
                    raise  # the default model is what the service is for: say so at start
                # One bad download in the models folder must not keep the others from being served.
                self.library_problems.append(f"{model.path}: {exc}")
        # Each host sized its contexts from memory where the config left them
        # at 0: the library says what is served.
        self.library = Library([self.model_hosts[m.name].model for m in self.library if m.name in self.model_hosts])
        self.default_model_host = self.model_hosts[self.library.default.name]
        # Rescans too: each reads the folder in a thread, and two at once
        # would both add the same new file.
        self._rescan_lock = asyncio.Lock()
        # None when off; embeddings_off_reason says why (the config, or the engine).
        self.embeddings: EmbeddingPath | None = None
        self.embeddings_off_reason: str | None = None
        if config.embeddings.enabled:
            path = build_embedding_path(config, runtime, self.model_info, self.model_id,
                                        worker_factory=worker_factory, log_dir=self.log_dir,
                                        observer=self.observer, http=self.http, clock=clock)
            if isinstance(path, EmbeddingPath):
                self.embeddings = path
            else:
                self.embeddings_off_reason = path
        else:
            self.embeddings_off_reason = "embeddings are disabled in the config ([embeddings] enabled = false)"
        self.observer.sample()

    # ----- the default model's parts, by the names the API, the UI and the tests use ------

    @property
    def model_info(self):
        return self.default_model_host.model_info

    @property
    def fallback_info(self):
        return self.default_model_host.fallback_info

    @property
    def model_id(self) -> str:
        return self.default_model_host.model_id

    @property
    def fallback_model_id(self) -> str:
        return self.default_model_host.fallback_model_id

    @property
    def counter(self):
        return self.default_model_host.counter

    @property
    def dispatcher(self):
        return self.default_model_host.dispatcher

    @property
    def gpu_paused(self) -> bool:
        return self.dispatcher.gpu_paused

    async def rescan_models(self) -> dict[str, list[str]]:
        """Read the models folder again: a file downloaded since the start
        becomes a model at once. Models already served stay as they are; a
        file whose name another model already has is skipped and named.

        The folder and the new files' headers are read in a thread (a big
        folder, a slow disk); the library and the model hosts are changed only
        here, on the loop, one rescan at a time. The answer names each
        skipped file with a sentence; the log has the full detail."""
        async with self._rescan_lock:
            found = await asyncio.to_thread(_read_new_models, self.config, self.library, set(self.model_hosts),
                                            self.runtime, self._gpu_runtime)
            added, skipped = [], []
            for model, files in found:
                if isinstance(files, str):
                    skipped.append(f"{model.path.name}: {files}")
                    continue
                try:
                    # Checked again here: two files of this scan may want one name.
                    Library([*self.library.models, model])
                except LibraryError as exc:
                    skipped.append(f"{model.path.name}: {_name_taken(model, exc)}")
                    continue
                model_host = ModelHost(self, model, runtime=self.runtime, gpu_runtime=self._gpu_runtime,
                                 gpu_missing_reason=self._gpu_missing_reason, files=files)
                self.library = Library([*self.library.models, model_host.model])
                self.model_hosts[model.name] = model_host
                added.append(model.name)
            if added or skipped:
                self.observer.note("models_rescanned", added=added, skipped=skipped)
            return {"added": added, "skipped": skipped}

    def model_host_for(self, name: str | None) -> ModelHost | None:
        """The model host of the model a request names; None for an unknown name."""
        model = self.library.resolve(name)
        return self.model_hosts[model.name] if model is not None else None

    def _on_sample(self, snapshot: MemorySnapshot) -> None:
        self.residency.on_sample(snapshot)
        if self.embeddings is not None:
            self.embeddings.on_sample()

    def _degraded_cause(self) -> str | None:
        """Degraded mode: the default model's cause, else the first other
        model's, named (the banner must say which model it concerns)."""
        cause = self.default_model_host.dispatcher.degraded_cause()
        if cause is not None:
            return cause
        for model_host in self.model_hosts.values():
            if model_host is not self.default_model_host:
                cause = model_host.dispatcher.degraded_cause()
                if cause is not None:
                    return f"{model_host.model_id}: {cause}"
        return None

    def _workers(self) -> list[Worker]:
        return [w for model_host in self.model_hosts.values() for w in model_host.workers()]

    def worker_pids(self) -> list[int]:
        # The embedding worker's too: its memory is ours in the telemetry.
        embed = self.embeddings.worker.pid if self.embeddings is not None else None
        return [w.pid for w in self._workers() if w.pid] + ([embed] if embed else [])

    def latest_snapshot(self) -> MemorySnapshot:
        return self.observer.latest()

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        self.observer.add_listener(listener)

    # ----- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        # First, while the RPC servers are free to answer: their memory, before a GPU worker takes them.
        await self.rpc_health.start()
        await self.default_model_host.start()
        if self.engine_fallback_reason:
            self.observer.note("engine_fallback", reason=self.engine_fallback_reason)
        for worker in reversed(self.default_model_host.resident_workers()):
            worker.start()
        self.observer.sample()
        self.observer.advance()
        self.observer.start()
        self.peers.start()

    async def ensure_started(self, model_host: ModelHost) -> None:
        """A library model's tokenizer, read on its first request (reading
        every model's at start would make a big folder slow to start)."""
        if model_host.counter is None:
            await model_host.start()

    async def wait_ready(self, timeout: float) -> bool:
        results = await asyncio.gather(*(w.ensure_ready(timeout) for w in self.default_model_host.resident_workers()))
        return all(results)

    async def stop(self) -> None:
        self.observer.stop()
        await self.peers.stop()
        await self.rpc_health.stop()
        for model_host in self.model_hosts.values():
            await model_host.close_keepers()
            model_host.dispatcher.cancel_all("the service is shutting down")
        closing = [w.close() for w in self._workers()]
        if self.embeddings is not None:
            closing.append(self.embeddings.close())
        await asyncio.gather(*closing, return_exceptions=True)
        await self.http.aclose()
        self.gpu_reader.close()
        for model_host in self.model_hosts.values():
            model_host.close_counter()

    # ----- commands -------------------------------------------------------------

    def set_gpu_paused(self, paused: bool) -> None:
        for model_host in self.model_hosts.values():
            model_host.dispatcher.set_gpu_paused(paused)
        self.observer.note("gpu_paused" if paused else "gpu_resumed")
        self.observer.advance()

    def give_gpu_back(self, given: bool) -> None:
        """The tray's "Give the GPU back now" (True): every loaded model's
        GPU worker unloads; "Use the GPU again" (False): those come back."""
        if self.default_model_host.sharing is None:
            raise ValueError(self.dispatcher.gpu_missing_reason or "there is no GPU path")
        for model_host in self.model_hosts.values():
            sharing = model_host.sharing
            if sharing is None:
                continue
            if given and (model_host is self.default_model_host or model_host.gpu_loaded()):
                sharing.give_back()
            elif not given and sharing.given_back_by_user():
                sharing.take_again()

    def preload(self, model_host: ModelHost | None = None) -> None:
        """Load a model's GPU worker if it is unloaded for idleness (Ollama's
        empty prompt); a GPU given to another app or by the user stays given."""
        model_host = model_host or self.default_model_host
        model_host.last_used = self.clock()
        if model_host.sharing is not None:
            model_host.sharing.request_arrived()

    async def unload_model(self, model_host: ModelHost) -> None:
        """The tray's "Unload": give a model's memory back now, the GPU
        worker's and (when it loads on demand) the CPU worker's. Raises
        ValueError while it has requests, which an unload would cut short."""
        cpu_lane = model_host.dispatcher.cpu.lane
        busy = model_host.in_flight() + len(cpu_lane.running_ids) + len(cpu_lane.waiting_ids)
        if busy:
            raise ValueError(f"{model_host.model_id} has {busy} request(s) queued or running; unload it when they are done")
        cpu = model_host.cpu_worker
        # Decided now: a request that arrives during the GPU's unload may be
        # starting the CPU worker, which must not be stopped under it.
        stop_cpu = model_host.on_demand_cpu is not None and cpu.state is not WorkerState.STOPPED
        if stop_cpu:
            cpu.request_stop()
        if model_host.sharing is not None and model_host.gpu_loaded():
            await model_host.sharing.evict("unloaded by the user")
        if stop_cpu:
            # Waits for the stop asked above, not a new one (that could stop a
            # worker a new request has started meanwhile).
            await cpu.wait_for_state(WorkerState.STOPPED, WorkerState.STARTING, WorkerState.READY)
        self.observer.note("model_unloaded", model=model_host.model_id)
        self.observer.advance()

    def keep_alive(self, seconds: float | None, model_host: ModelHost | None = None) -> None:
        """A request's keep_alive (Ollama's): how long the model's GPU worker
        stays loaded after it; negative = until told otherwise, 0 = unload once
        idle, None = the configured idle time."""
        model_host = model_host or self.default_model_host
        if model_host.sharing is not None:
            model_host.sharing.keep_alive(seconds)

    def _needs_full_rate(self) -> bool:
        return needs_full_rate(self.model_hosts.values())

    def set_yield_to_other_apps(self, enabled: bool) -> None:
        if self.default_model_host.sharing is None:
            raise ValueError(self.dispatcher.gpu_missing_reason or "there is no GPU path")
        for model_host in self.model_hosts.values():
            if model_host.sharing is not None:
                model_host.sharing.set_yield_to_other_apps(enabled)
        self.observer.note("yield_to_other_apps", enabled=enabled)

    def restart_workers(self) -> list[Worker]:
        """Restart the loaded workers; the models' workers restarted. A GPU worker
        that was given away or unloaded stays so, and so does an on-demand worker at rest."""
        restarted = [worker for host in self.model_hosts.values() for worker in host.restart_workers()]
        if self.embeddings is not None:
            self.embeddings.restart("restart requested by the user")
        self.observer.note("workers_restarted")
        return restarted

    def set_simulated_pressure(self, mib: float) -> None:
        if self.simulated is None:
            raise ValueError("VRAM pressure can only be injected on a simulated GPU (--simulate-gpu-mib)")
        self.simulated.set_pressure(mib)
        self.observer.note("simulated_pressure", mib=mib)
        self.observer.sample()
        self.observer.advance()

    def cancel(self, request_id: str, why: str = "canceled by DELETE /v1/requests/{id}") -> dict[str, Any] | None:
        for model_host in self.model_hosts.values():
            result = model_host.dispatcher.cancel(request_id, why.replace("{id}", request_id))
            if result is not None:
                return result
        return None

    def request_in_flight(self, request_id: str) -> bool:
        """Whether any model has a request with this id (X-Request-Id is unique across models)."""
        return any(request_id in model_host.dispatcher.jobs for model_host in self.model_hosts.values())

    # ----- the snapshot (reads only) ---------------------------------------------------

    def health(self) -> tuple[bool, str]:
        return health(self.default_model_host)

    def gpu_status(self) -> GpuStatus:
        return gpu_status(self)

    def status(self) -> Status:
        return build_status(self)


_CANT_SERVE = "not a readable GGUF model file; the server's log says why"


def _name_taken(model, problem: LibraryError) -> str:
    """The client's sentence for a name clash; the log gets both files' paths."""
    log.warning("rescan: %s", problem)
    return (f"another model already has the name {model.name!r}; rename the file, or give the other model "
            "another name in its [[models]] entry")


def _read_new_models(config: Config, library: Library, served: set[str], runtime: WorkerRuntime,
                     gpu_runtime: WorkerRuntime) -> list[tuple[Any, ModelFiles | str]]:
    """A rescan's disk work, in a worker thread: each model in the folder
    that `library` does not serve yet, with its files read, or a sentence
    saying why it can't be served (the detail goes to the log). It reads
    only its arguments, so it races with nothing on the loop."""
    found: list[tuple[Any, ModelFiles | str]] = []
    for model in build_library(config):
        if model.name in served or any(model.path == m.path for m in library):
            continue
        try:
            Library([*library.models, model])
        except LibraryError as exc:
            found.append((model, _name_taken(model, exc)))
            continue
        try:
            found.append((model, read_model_files(model, runtime, gpu_runtime)))
        except (ModelFileError, OSError) as exc:
            log.warning("rescan: %s is not served: %s", model.path, exc)
            found.append((model, _CANT_SERVE))
    return found

