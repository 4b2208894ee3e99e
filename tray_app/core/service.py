"""The service: workers, telemetry, admission, dispatch and failover, wired together.

It runs on one asyncio loop. Pure decisions (admission, breaker, estimates)
come from their modules; this file gathers their inputs and carries out the
effects: spawn, proxy, replay, notify. The UI and the HTTP layer read
`status()` snapshots and call the command methods; they never touch workers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import httpx
import llama_cpp

from .api.metrics import ServiceMetrics
from .config import Config, log_dir as default_log_dir
from .dispatch.admission import (
    GPU_OUT_REASONS, CpuView, Decision, GpuView, Reason, RequestShape, Route, decide, token_limit,
)
from .dispatch.breaker import BreakerPolicy, BreakerState, CircuitBreaker
from .dispatch.jobs import Attempt, Job, JobFailed, JobState, PathSpeed, WorkerFailure, WorkerRequestError
from .dispatch.lanes import Lane, Redirected
from .dispatch.quarantine import Quarantine
from .engine.exits import ExitKind, is_input_crash, mentions_out_of_memory
from .engine.runtime import LlamaCppPythonRuntime, WorkerRuntime
from .engine.worker import LaunchExtras, RestartPolicy, Worker, WorkerEvent, WorkerHooks, WorkerSpec, WorkerState
from .memory import estimate
from .memory.gguf_info import ModelInfo, read_model_info
from .memory.telemetry import (
    GpuReader, MemorySnapshot, NvmlGpuReader, SimulatedGpu, TelemetryHistory, detect_gpu_offload_support, read_host,
    wait_for_vram_recovery,
)
from .tokens import PromptCounter

log = logging.getLogger(__name__)

MIB = 1024 * 1024
GPU_FOOTPRINT_OWNER = "gpu-worker"
# The answer length of "a typical new request", for the degraded banner's estimate.
TYPICAL_ANSWER_TOKENS = 256
SAMPLE_INTERVAL_S = 1.0
CPU_FIRST_TOKEN_TIMEOUT_S = 600.0
# How often a request that waits on a worker asks whether the process can
# still make progress at all (see Worker.liveness_problem).
LIVENESS_INTERVAL_S = 1.0
# After a connection breaks, how long to wait for the worker's exit status,
# which says whether the request crashed it (SIGSEGV) or something else did.
INPUT_CRASH_WAIT_S = 3.0
STREAM_END_EXIT_WAIT_S = 1.0
# The GPU's first-token deadline: this much slack plus this many times the
# prefill time its measured speed predicts (a busy host, a cold cache).
FIRST_TOKEN_SLACK_S = 15.0
FIRST_TOKEN_FACTOR = 5.0
EXECUTION_LEDGER_SIZE = 10_000


class Sink(Protocol):
    """Where a job's output goes. `emit` hands an event towards the client."""

    def emit(self, event: dict[str, Any]) -> None: ...

    def reset(self) -> None: ...


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
        engine = f"llama-cpp-python {llama_cpp.__version__}"
        # OpenAI's system_fingerprint: the same value means the same engine
        # build and model file, so same-seed answers are comparable.
        self.fingerprints = {"gpu": system_fingerprint(engine, self.model_info.path),
                             "cpu": system_fingerprint(engine, self.fallback_info.path)}
        self.counter: PromptCounter | None = None
        self.equivalence: dict[str, Any] = {"equivalent": True, "detail": "same model file on both paths"}

        self.simulated: SimulatedGpu | None = None
        if config.gpu.simulate_mib > 0:
            self.simulated = SimulatedGpu(config.gpu.simulate_mib)
            self._gpu_reader: GpuReader = self.simulated
        else:
            self._gpu_reader = gpu_reader or NvmlGpuReader()
        self.offload_support = detect_gpu_offload_support()
        # logits_all=False: that is how the runtime launches workers.
        self.gpu_settings = estimate.WorkerSettings(
            n_ctx=config.gpu.n_ctx, n_gpu_layers=config.gpu.n_gpu_layers, n_batch=config.worker.n_batch,
            logits_all=False,
        )
        self.cpu_settings = estimate.WorkerSettings(
            n_ctx=config.cpu.n_ctx, n_gpu_layers=0, n_batch=config.worker.n_batch, logits_all=False,
        )
        self.gpu_footprint = estimate.estimate_worker(self.model_info, self.gpu_settings)
        self.cpu_footprint = estimate.estimate_worker(self.fallback_info, self.cpu_settings)

        policy = RestartPolicy(
            backoff_base_s=config.worker.backoff_base_s, backoff_cap_s=config.worker.backoff_cap_s,
            ready_timeout_s=config.worker.ready_timeout_s, stop_timeout_s=config.worker.stop_timeout_s,
        )
        runtime = runtime or LlamaCppPythonRuntime()
        hooks = _ServiceHooks(self)
        self.gpu_disabled_reason = self._gpu_disabled_reason()
        self.gpu_worker: Worker | None = None
        if self.gpu_disabled_reason is None:
            self.gpu_worker = Worker(
                WorkerSpec("gpu", self.model_info.path, self.model_id, config.gpu.n_ctx, config.gpu.n_gpu_layers,
                           config.worker.n_batch, config.cpu.n_threads),
                gpu_runtime or runtime, self._log_dir, policy, hooks, clock,
            )
        self.cpu_worker = Worker(
            WorkerSpec("cpu", self.fallback_info.path, self.fallback_model_id, config.cpu.n_ctx, 0,
                       config.worker.n_batch, config.cpu.n_threads),
            runtime, self._log_dir, policy, hooks, clock,
        )
        gpu_parallel = min(config.gpu.max_concurrency, (gpu_runtime or runtime).max_parallel)
        cpu_parallel = min(config.cpu.max_concurrency, runtime.max_parallel)
        self.lanes = {
            "gpu": Lane("gpu", gpu_parallel, config.gpu.queue_limit, clock),
            "cpu": Lane("cpu", cpu_parallel, config.cpu.queue_limit, clock),
        }
        self.breaker = CircuitBreaker(
            BreakerPolicy(config.breaker.failure_threshold, config.breaker.window_s, config.breaker.cooldown_s), clock,
        )
        self.speeds = {
            "gpu": PathSpeed(tokens_per_s=config.cpu.assumed_tokens_per_s * 5, prompt_tokens_per_s=2000.0),
            "cpu": PathSpeed(tokens_per_s=config.cpu.assumed_tokens_per_s, prompt_tokens_per_s=200.0),
        }
        self.history = TelemetryHistory()
        self.metrics = ServiceMetrics(self)
        self.jobs: dict[str, Job] = {}
        self.quarantine = Quarantine(clock)
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=50)
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=100)
        # Completed executions per request id (bounded): the evidence that no
        # request ran twice, for /status, the drill and the soak.
        self._executions: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.completed_total = 0
        self.duplicate_executions = 0
        self.gpu_paused = False
        self.gpu_recovery_s: float | None = None
        self._gpu_failed_at: float | None = None
        self._degraded_since: float | None = None
        self._degraded_reason: str | None = None
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=5.0),
                                       limits=httpx.Limits(max_connections=64, max_keepalive_connections=0))
        self._sampler: asyncio.Task | None = None
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self.started_at = time.time()

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
        self.cpu_worker.start()
        if self.gpu_worker is not None:
            self.gpu_worker.start()
        self._sample_once()
        self._sampler = asyncio.create_task(self._sample_forever(), name="telemetry")

    async def wait_ready(self, timeout: float) -> bool:
        workers = [w for w in (self.gpu_worker, self.cpu_worker) if w is not None]
        results = await asyncio.gather(*(w.ensure_ready(timeout) for w in workers))
        return all(results)

    async def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
        for job in list(self.jobs.values()):
            job.cancel("the service is shutting down")
        workers = [w for w in (self.gpu_worker, self.cpu_worker) if w is not None]
        await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)
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

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        self._listeners.append(listener)

    def _note(self, kind: str, **data: Any) -> None:
        event = {"t": round(time.time(), 3), "kind": kind, **data}
        self.events.append(event)
        for listener in self._listeners:
            listener(event)

    # ----- telemetry ------------------------------------------------------------

    def _sample_once(self) -> MemorySnapshot:
        pids = [w.pid for w in (self.gpu_worker, self.cpu_worker) if w is not None and w.pid]
        snapshot = MemorySnapshot(time.time(), self._gpu_reader.read(), read_host(pids))
        self.history.append(snapshot)
        self._refresh_degraded()
        return snapshot

    async def _sample_forever(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_INTERVAL_S)
            try:
                await asyncio.to_thread(self._sample_once)
            except Exception:  # a sampler that dies would freeze every gauge
                log.exception("telemetry sample failed")

    def latest_snapshot(self) -> MemorySnapshot:
        return self.history.latest() or self._sample_once()

    # ----- commands -------------------------------------------------------------

    def set_gpu_paused(self, paused: bool) -> None:
        self.gpu_paused = paused
        if paused:
            self.lanes["gpu"].redirect_waiting("the GPU path was paused")
        self._note("gpu_paused" if paused else "gpu_resumed")
        self._refresh_degraded()

    def restart_workers(self) -> None:
        for worker in (self.gpu_worker, self.cpu_worker):
            if worker is not None:
                worker.restart("restart requested by the user")
        self._note("workers_restarted")

    def set_simulated_pressure(self, mib: float) -> None:
        if self.simulated is None:
            raise ValueError("VRAM pressure can only be injected on a simulated GPU (--simulate-gpu-mib)")
        self.simulated.set_pressure(mib)
        self._note("simulated_pressure", mib=mib)
        self._sample_once()

    def cancel(self, request_id: str, why: str = "canceled by DELETE /v1/requests/{id}") -> dict[str, Any] | None:
        job = self.jobs.get(request_id)
        if job is None or job.state is JobState.DONE:
            return None
        state_was = job.state.value
        job.cancel(why.replace("{id}", request_id))
        self._note("canceled", id=request_id, state=state_was)
        return {"id": request_id, "object": "request.cancel", "canceled": True, "state_was": state_was}

    def register(self, job: Job) -> bool:
        """Take the job's id for as long as it lives; False if the id is in use."""
        if job.id in self.jobs:
            return False
        self.jobs[job.id] = job
        return True

    def quarantined(self, job: Job) -> JobFailed | None:
        """The refusal for a request that recently crashed a worker, or None."""
        return self.quarantine.refusal(job.fingerprint, job.id)

    def unregister(self, job: Job) -> None:
        if self.jobs.get(job.id) is job:
            del self.jobs[job.id]

    # ----- admission ------------------------------------------------------------

    def shape_of(self, job: Job, force_cpu: bool, deadline_s: float | None) -> RequestShape:
        return RequestShape(
            prompt_tokens=job.prompt_tokens, max_tokens=job.max_tokens,
            force_cpu=force_cpu or self.gpu_paused, deadline_s=deadline_s, is_replay=job.replayed,
        )

    def token_limit(self, prompt_tokens: int, requested: int | None, chat: bool) -> int:
        caps = [self.config.cpu.n_ctx] + ([self.config.gpu.n_ctx] if self.gpu_worker is not None else [])
        return token_limit(prompt_tokens, requested, caps, chat=chat)

    def gpu_out_reason(self) -> str | None:
        """Why the GPU path can't take work right now, or None if it can."""
        if self.gpu_worker is None:
            return self.gpu_disabled_reason
        if self.gpu_paused:
            return "the GPU path is paused (force CPU)"
        worker = self.gpu_worker
        if worker.state is not WorkerState.READY:
            detail = worker.unhealthy_reason or (worker.last_exit.describe() if worker.last_exit else None)
            return f"the GPU worker is {worker.state.value}" + (f": {detail}" if detail else "")
        state = self.breaker.state
        if state is BreakerState.OPEN:
            snap = self.breaker.snapshot()
            return (f"the circuit breaker is open after repeated GPU failures "
                    f"({snap.get('last_failure_reason')}); retrying in {snap.get('retry_in_s')} s")
        reading = self.latest_snapshot().gpu
        if not reading.available:
            return f"GPU memory can't be read: {reading.reason}"
        return None

    def _gpu_view(self, job: Job) -> GpuView | None:
        if self.gpu_worker is None:
            return None
        reading = self.latest_snapshot().gpu
        need = estimate.request_vram_bytes(self.model_info, self.gpu_settings, job.prompt_tokens + job.max_tokens)
        return GpuView(
            lane=self.lanes["gpu"].state(self.config.gpu.n_ctx),
            out_reason=self.gpu_out_reason(),
            free_vram_mib=reading.free_mib,
            reserve_mib=self.config.gpu.reserve_mib,
            request_vram_mib=need / MIB,
        )

    def _cpu_view(self, job: Job) -> CpuView:
        worker = self.cpu_worker
        # A starting or restarting worker can take requests: they wait in its queue.
        can_serve = worker.gave_up is None and worker.state is not WorkerState.STOPPED
        host = self.latest_snapshot().host
        speed = self.speeds["cpu"]
        tokens = job.prompt_tokens + job.max_tokens
        return CpuView(
            lane=self.lanes["cpu"].state(self.config.cpu.n_ctx),
            can_serve=can_serve,
            out_reason=worker.gave_up or worker.unhealthy_reason,
            host_available_mib=host.available_mib,
            ram_floor_mib=self.config.cpu.ram_floor_mib,
            request_ram_mib=estimate.kv_bytes_per_token(self.fallback_info) * tokens / MIB,
            tokens_per_s=speed.tokens_per_s,
            prompt_tokens_per_s=speed.prompt_tokens_per_s,
            backlog_s=self._cpu_backlog_s(),
        )

    def _cpu_backlog_s(self) -> float:
        lane = self.lanes["cpu"]
        total = 0.0
        for job_id in lane.running_ids + lane.waiting_ids:
            job = self.jobs.get(job_id)
            if job is None:
                continue
            estimate_s = self._service_time_s(job.prompt_tokens, job.max_tokens, "cpu")
            if job.state is JobState.RUNNING and job.attempts:
                estimate_s = max(0.0, estimate_s - (self._clock() - job.attempts[-1].started_at))
            total += estimate_s
        return total / max(1, lane.concurrency)

    def _service_time_s(self, prompt_tokens: int, max_tokens: int, path: str) -> float:
        speed = self.speeds[path]
        return max_tokens / speed.tokens_per_s + prompt_tokens / speed.prompt_tokens_per_s

    def decide(self, job: Job, force_cpu: bool = False, deadline_s: float | None = None) -> Decision:
        """Gather the inputs and ask the pure admission function. No await in
        here, so nothing can change between what we read and what we decide."""
        # A fresh decision starts without a probe: one this job took earlier
        # (before a redirect) goes back, or the breaker would wait for it forever.
        self._release_probe(job)
        gpu = self._gpu_view(job)
        half_open_probe = False
        if gpu is not None and gpu.out_reason is None and self.breaker.state is BreakerState.HALF_OPEN:
            if self.breaker.try_acquire():
                half_open_probe = True
            else:
                gpu = GpuView(gpu.lane, "the circuit breaker is half-open and a probe request is testing the GPU",
                              gpu.free_vram_mib, gpu.reserve_mib, gpu.request_vram_mib)
        decision = decide(self.shape_of(job, force_cpu, deadline_s), gpu, self._cpu_view(job))
        if half_open_probe and decision.route not in (Route.GPU, Route.GPU_QUEUE):
            self.breaker.release_probe()
        job.half_open_probe = half_open_probe and decision.route in (Route.GPU, Route.GPU_QUEUE)
        self._apply_decision(job, decision)
        return decision

    def _apply_decision(self, job: Job, decision: Decision) -> None:
        job.reason = decision.reason
        job.reason_detail = decision.detail
        if decision.estimated_latency_s is not None:
            job.estimated_latency_s = decision.estimated_latency_s
        path = {Route.GPU: "gpu", Route.GPU_QUEUE: "gpu", Route.CPU: "cpu"}.get(decision.route, "rejected")
        self.metrics.requests.labels(path, decision.reason.value).inc()
        self.recent.append({
            "t": round(time.time(), 3), "id": job.id, "route": decision.route.value,
            "reason": decision.reason.value, "detail": decision.detail,
        })

    # ----- execution ------------------------------------------------------------

    async def execute(self, job: Job, sink: Sink, decision: Decision, force_cpu: bool = False,
                      deadline_s: float | None = None) -> None:
        """Run an admitted job to the end, replaying once on the CPU if the GPU
        fails before anything reached the client. Raises JobFailed for errors
        the client should see."""
        self.jobs[job.id] = job
        try:
            if decision.route in (Route.GPU, Route.GPU_QUEUE):
                try:
                    await self._run_on(job, "gpu", sink)
                    return
                except Redirected as redirected:
                    # Nothing ran yet; decide again with what we know now.
                    decision = self.decide(job, force_cpu=force_cpu, deadline_s=deadline_s)
                    if decision.reason is Reason.ADMITTED:
                        decision = Decision(Route.CPU, Reason.GPU_UNAVAILABLE, redirected.reason)
                        self._apply_decision(job, decision)
                    if not decision.accepted:
                        raise _rejection(decision)
                except WorkerFailure as failure:
                    crashed_by_input = await self._crashed_by_input(job, "gpu", failure)
                    if crashed_by_input is not None:
                        raise crashed_by_input from None
                    self._on_gpu_failure(job, str(failure))
                    if job.committed:
                        raise JobFailed(
                            502, "gpu_worker_failed",
                            f"the GPU worker failed after part of the answer was sent ({failure}); "
                            "nothing was re-run. It is safe to retry this request.",
                        ) from None
                    sink.reset()
                    job.replayed = True
                    decision = self.decide(job, force_cpu=force_cpu)
                    if not decision.accepted:
                        raise _rejection(decision)
                    self.metrics.replays.inc()
                    self._note("replay", id=job.id, reason=str(failure))
            try:
                await self._run_on(job, "cpu", sink)
            except WorkerFailure as failure:
                crashed_by_input = await self._crashed_by_input(job, "cpu", failure)
                if crashed_by_input is not None:
                    raise crashed_by_input from None
                job.first_failure = job.first_failure or str(failure)
                self.cpu_worker.report_failure(str(failure))
                self._note("cpu_failure", id=job.id, reason=str(failure))
                raise JobFailed(502, "cpu_worker_failed",
                                f"the CPU worker failed while serving this request ({failure}); "
                                "nothing was re-run. It is safe to retry this request.") from None
        except WorkerRequestError as error:
            self._release_probe(job)
            raise JobFailed(502, "worker_error", f"the model server failed on this request: {error}") from None
        finally:
            # Every way out passes here, so a probe the job still holds (a
            # cancel, a client error, an unexpected exception) is given back;
            # success and GPU failure have already settled theirs.
            self._release_probe(job)
            job.state = JobState.DONE
            self.unregister(job)
            self._refresh_degraded()

    async def _crashed_by_input(self, job: Job, path: str, failure: WorkerFailure) -> JobFailed | None:
        """The error for a request that crashed its worker, or None when the
        worker failed for reasons of its own (memory, a kill, a hang).

        A replay is for failures of the path, not of the request: a request
        that segfaults a healthy worker would segfault the other one too. So
        it is quarantined (a retry gets this same answer without reaching a
        worker) and never re-run."""
        worker = self.gpu_worker if path == "gpu" else self.cpu_worker
        if not failure.process_may_have_died or worker is None or not job.attempts:
            return None
        if not job.attempts[-1].reached_worker:
            return None  # it never got in: a worker that was already dying refused it
        report = await worker.exit_after(job.attempts[-1].worker_exits, INPUT_CRASH_WAIT_S)
        if report is None or not is_input_crash(report):
            return None
        detail = f"it crashed the {path} model server ({report.signal_name})"
        job.first_failure = job.first_failure or detail
        self.quarantine.add(job.fingerprint, detail)
        self._note("request_crashed_worker", id=job.id, path=path, signal=report.signal_name,
                   committed=job.committed)
        return self.quarantine.refusal(job.fingerprint, job.id)

    async def _run_on(self, job: Job, path: str, sink: Sink) -> None:
        lane = self.lanes[path]
        job.path = path
        place = lane.join(job.id, front=job.replayed and path == "cpu")
        if place is not None:
            job.state = JobState.QUEUED
        self._refresh_degraded()
        acquire = asyncio.ensure_future(lane.wait(job.id, place) if place is not None else _no_wait())
        canceled = asyncio.ensure_future(job.canceled.wait())
        try:
            done, _ = await asyncio.wait({acquire, canceled}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            acquire.cancel()
            lane.leave(job.id)
            raise
        finally:
            canceled.cancel()
        if acquire not in done:
            acquire.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await acquire
            lane.leave(job.id)
            self._release_probe(job)
            raise _canceled(job, "while it waited in the " + path + " queue")
        job.queue_wait_s = acquire.result()
        try:
            if path == "gpu":
                why_not = self.gpu_out_reason()
                if why_not is not None:
                    raise Redirected(why_not)
            job.state = JobState.RUNNING
            self._refresh_degraded()
            await self._proxy(job, path, sink)
        finally:
            lane.release(job.id)

    async def _proxy(self, job: Job, path: str, sink: Sink) -> None:
        worker = self.cpu_worker if path == "cpu" else self.gpu_worker
        assert worker is not None
        if worker.state is not WorkerState.READY:
            if path == "gpu":
                raise Redirected(f"the GPU worker is {worker.state.value}")
            await self._wait_worker_ready(job, worker)
        attempt = Attempt(path, self._clock(), worker_exits=worker.exits)
        job.attempts.append(attempt)
        body = dict(job.body)
        body.pop("model", None)
        # Always an explicit limit, the one admission planned with: the
        # worker's own default may be none at all, and it does not know the
        # current API's name max_completion_tokens.
        body.pop("max_completion_tokens", None)
        body["max_tokens"] = job.max_tokens
        body["stream"] = True
        body.pop("stream_options", None)
        if path == "gpu":
            first_timeout, token_timeout = self._gpu_first_token_timeout_s(job), self.config.gpu.token_timeout_s
        else:
            first_timeout, token_timeout = CPU_FIRST_TOKEN_TIMEOUT_S, CPU_FIRST_TOKEN_TIMEOUT_S
        canceled = asyncio.ensure_future(job.canceled.wait())
        done_seen = False
        named_tool_calls: set[tuple[int, int]] = set()
        # Until the first token one deadline covers the wait for the headers
        # (llama-cpp-python sends them after prefill) and for the first event.
        first_deadline = time.monotonic() + first_timeout

        def wait_limit() -> float:
            if attempt.first_token_at is None:
                return max(0.0, first_deadline - time.monotonic())
            return token_timeout

        async def from_worker(awaitable):
            result = await _wait_on_worker(awaitable, canceled, wait_limit(), worker.liveness_problem)
            if result is _CANCELED:
                attempt.outcome = "canceled"
                raise _canceled(job, "while it ran")
            return result

        try:
            request = self._http.build_request("POST", f"{worker.base_url}{job.kind.upstream_path}", json=body,
                                               headers=worker.auth_headers)
            response = await from_worker(self._http.send(request, stream=True))
            try:
                attempt.reached_worker = True
                if response.status_code >= 400:
                    await self._upstream_error(response)
                lines = response.aiter_lines()
                while True:
                    line = await from_worker(lines.__anext__())
                    if line is None:
                        break
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done_seen = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        self._raise_upstream_failure(f"the worker reported an error: {event['error']}")
                    if _carries_token(event):
                        attempt.tokens += 1
                        if attempt.first_token_at is None:
                            attempt.first_token_at = self._clock()
                    event["id"] = _response_id(job)
                    event["model"] = worker.spec.model_name
                    event["system_fingerprint"] = self.fingerprints[path]
                    _drop_repeated_tool_names(event, named_tool_calls)
                    sink.emit(event)
            finally:
                await response.aclose()
        except WorkerFailure as failure:
            attempt.outcome = f"failed: {failure}"
            raise
        except asyncio.TimeoutError:
            attempt.outcome = "failed: hang"
            raise WorkerFailure(
                f"no output for {first_timeout if attempt.first_token_at is None else token_timeout:g} s"
            ) from None
        except (httpx.TransportError, httpx.StreamError) as exc:
            attempt.outcome = f"failed: {type(exc).__name__}"
            # Refused at connect: the request never reached the process, so
            # it can't be what killed it.
            attempt.reached_worker = not isinstance(exc, httpx.ConnectError)
            raise WorkerFailure(f"connection to the {path} worker broke: {type(exc).__name__}: {exc}",
                                process_may_have_died=True) from None
        finally:
            canceled.cancel()
            attempt.ended_at = self._clock()
        if not done_seen:
            attempt.outcome = "failed: truncated"
            # The connection closed cleanly: the server's generator raised for
            # this input. Only a dead process makes it a worker failure.
            # A process killed mid-answer can close the connection before it is
            # reaped, so give its exit a moment to show.
            exited = await worker.exit_after(attempt.worker_exits, STREAM_END_EXIT_WAIT_S)
            if exited is not None or worker.state is not WorkerState.READY:
                raise WorkerFailure("the worker's stream ended without [DONE] and the worker is gone",
                                    process_may_have_died=True)
            raise WorkerRequestError("the model server ended the answer early without saying why; "
                                     f"see {worker.log_path}")
        attempt.outcome = "completed"
        self._count_execution(job.id)
        first = attempt.first_token_at or attempt.ended_at
        self.speeds[path].observe(attempt.tokens, attempt.ended_at - first, job.prompt_tokens, first - attempt.started_at)
        self.metrics.ttft.labels(path).observe(first - attempt.started_at)
        if attempt.tokens > 1 and attempt.ended_at > first:
            self.metrics.tokens_per_second.labels(path).observe((attempt.tokens - 1) / (attempt.ended_at - first))
        if path == "gpu":
            self.breaker.record_success()
            job.half_open_probe = False

    def _gpu_first_token_timeout_s(self, job: Job) -> float:
        """How long the GPU may take to its first token before we call it hung:
        generous against the prefill time its measured speed predicts, and
        never more than the configured ceiling."""
        expected_s = job.prompt_tokens / max(1.0, self.speeds["gpu"].prompt_tokens_per_s)
        return min(self.config.gpu.first_token_timeout_s, FIRST_TOKEN_SLACK_S + FIRST_TOKEN_FACTOR * expected_s)

    def _count_execution(self, request_id: str) -> None:
        self.completed_total += 1
        count = self._executions.pop(request_id, 0) + 1
        self._executions[request_id] = count
        if count > 1:
            self.duplicate_executions += 1
            log.error("request %s completed %d executions", request_id, count)
        while len(self._executions) > EXECUTION_LEDGER_SIZE:
            self._executions.popitem(last=False)

    async def _upstream_error(self, response: httpx.Response) -> None:
        raw = await response.aread()
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = {}
        error = payload.get("error") if isinstance(payload, dict) else None
        message = (error or {}).get("message") if isinstance(error, dict) else None
        message = message or (payload.get("detail") if isinstance(payload, dict) else None) or raw.decode("utf-8", "replace")
        message = client_safe(str(message))
        if 400 <= response.status_code < 500:
            raise JobFailed(response.status_code, "invalid_request", f"the model server rejected the request: {message}",
                            err_type="invalid_request_error")
        self._raise_upstream_failure(f"the worker answered HTTP {response.status_code}: {message or 'no detail'}")

    @staticmethod
    def _raise_upstream_failure(message: str) -> None:
        if mentions_out_of_memory(message):
            raise WorkerFailure(message)
        if "validation error" in message:
            # llama-cpp-python answers 500 for a request it finds invalid.
            raise JobFailed(400, "invalid_request", f"the model server rejected the request: {message}",
                            err_type="invalid_request_error")
        raise WorkerRequestError(message)

    async def _wait_worker_ready(self, job: Job, worker: Worker) -> None:
        ready = asyncio.ensure_future(worker.ensure_ready(self.config.worker.ready_timeout_s))
        canceled = asyncio.ensure_future(job.canceled.wait())
        done, _ = await asyncio.wait({ready, canceled}, return_when=asyncio.FIRST_COMPLETED)
        canceled.cancel()
        if ready not in done:
            ready.cancel()
            raise _canceled(job, f"while the {worker.role} worker was starting")
        if not ready.result():
            raise JobFailed(503, "no_worker", f"the {worker.role} worker is not available: "
                            f"{worker.gave_up or worker.unhealthy_reason or 'it did not become ready'}",
                            retry_after_s=30.0)

    def _on_gpu_failure(self, job: Job, reason: str) -> None:
        job.first_failure = job.first_failure or reason
        self._release_probe(job, failed=reason)
        self._gpu_failed_at = self._clock()
        if self.gpu_worker is not None:
            self.gpu_worker.report_failure(reason)
        self.metrics.gpu_failures.labels("yes" if job.committed else "no").inc()
        moved = self.lanes["gpu"].redirect_waiting(f"the GPU worker failed: {reason}")
        self._note("gpu_failure", id=job.id, reason=reason, committed=job.committed, redirected=moved)

    def _release_probe(self, job: Job, failed: str | None = None) -> None:
        if failed is not None:
            self.breaker.record_failure(failed)
        elif job.half_open_probe:
            self.breaker.release_probe()
        job.half_open_probe = False

    # ----- degraded mode and status -------------------------------------------------

    def _refresh_degraded(self) -> None:
        reason = self._degraded_cause()
        if reason is None:
            if self._degraded_since is not None:
                self._note("degraded_end", lasted_s=round(time.time() - self._degraded_since, 3))
            self._degraded_since = None
            self._degraded_reason = None
            return
        if self._degraded_since is None:
            self._degraded_since = time.time()
            self._note("degraded_start", reason=reason)
        self._degraded_reason = reason

    def _degraded_cause(self) -> str | None:
        out = self.gpu_out_reason()
        if out is not None:
            return out
        free = self.latest_snapshot().gpu.free_mib
        if self.gpu_worker is not None and free is not None and free <= self.config.gpu.reserve_mib:
            # Every new request would go to the CPU: say so steadily, not only
            # while one happens to be in flight.
            return (f"not enough VRAM headroom: {free:.0f} MiB free, within the "
                    f"{self.config.gpu.reserve_mib} MiB reserve")
        for job in self.jobs.values():
            if job.path == "cpu" and job.state in (JobState.QUEUED, JobState.RUNNING) and job.reason in GPU_OUT_REASONS:
                return f"{job.reason.value}: {job.reason_detail}"
        return None

    def degraded(self) -> dict[str, Any]:
        self._refresh_degraded()
        # What a typical new request (64 prompt tokens, default max_tokens) would wait now.
        estimated = round(self._cpu_backlog_s() + self._service_time_s(64, TYPICAL_ANSWER_TOKENS, "cpu"), 2)
        return {
            "active": self._degraded_since is not None,
            "reason": self._degraded_reason,
            "since": self._degraded_since,
            "fallback_model": self.fallback_model_id,
            "fallback_equivalent": self.equivalence["equivalent"],
            "fallback_detail": self.equivalence["detail"],
            "estimated_latency_s": estimated,
            "cpu_context_cap": self.config.cpu.n_ctx,
            "cpu_queue_depth": len(self.lanes["cpu"].waiting_ids),
        }

    def health(self) -> tuple[bool, str]:
        if self.gpu_out_reason() is None:
            return True, "the GPU path can serve"
        if self.cpu_worker.state is WorkerState.READY:
            return True, "the CPU path can serve (degraded: " + (self.gpu_out_reason() or "") + ")"
        return False, f"no path can serve: GPU: {self.gpu_out_reason()}; CPU worker is {self.cpu_worker.state.value}" + (
            f" ({self.cpu_worker.gave_up or self.cpu_worker.unhealthy_reason})"
            if (self.cpu_worker.gave_up or self.cpu_worker.unhealthy_reason) else "")

    def status(self) -> dict[str, Any]:
        snapshot = self.latest_snapshot()
        workers = []
        for worker in (self.gpu_worker, self.cpu_worker):
            if worker is None:
                continue
            info = worker.snapshot()
            info["rss_mib"] = snapshot.host.rss_mib_by_pid.get(worker.pid) if worker.pid else None
            footprint = self.gpu_footprint if worker.role == "gpu" else self.cpu_footprint
            info["estimated_vram_mib"] = round(footprint.gpu.total / MIB, 1)
            info["estimated_ram_mib"] = round(footprint.host.total / MIB, 1)
            workers.append(info)
        gpu_status = snapshot.gpu.to_status()
        gpu_status["reserve_mib"] = self.config.gpu.reserve_mib
        gpu_status["path_out_reason"] = self.gpu_out_reason()
        gpu_status["offload_supported"] = self.offload_support.supported
        gpu_status["offload_message"] = self.offload_support.message
        if self.simulated is not None:
            gpu_status["pressure_mib"] = self.simulated.pressure_mib
        healthy, health_reason = self.health()
        return {
            "service": {"pid": os.getpid(), "started_at": self.started_at, "model": self.model_id, "healthy": healthy,
                        "health_reason": health_reason, "gpu_paused": self.gpu_paused},
            "workers": workers,
            "gpu": gpu_status,
            "ram": {**snapshot.host.to_status(), "floor_mib": self.config.cpu.ram_floor_mib},
            "breaker": self.breaker.snapshot(),
            "queues": {name: lane.snapshot() for name, lane in self.lanes.items()},
            "degraded": self.degraded(),
            # Jobs still being admitted hold their id but have no path or place yet.
            "requests": [self._request_status(job) for job in self.jobs.values()
                         if job.state is not JobState.ADMITTING],
            "recent_decisions": list(self.recent)[-20:],
            "speeds": {path: {"tokens_per_s": round(s.tokens_per_s, 2), "samples": s.samples}
                       for path, s in self.speeds.items()},
            "gpu_recovery_s": self.gpu_recovery_s,
            "accounting": {"completed_executions": self.completed_total,
                           "duplicate_executions": self.duplicate_executions},
            "events": list(self.events)[-20:],
        }

    def _request_status(self, job: Job) -> dict[str, Any]:
        summary = job.summary()
        summary["queue_position"] = self.lanes[job.path].position(job.id) if job.path else None
        return summary

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
        if worker.last_exit is not None:
            # NVML lags a process exit: let the old worker's memory come back
            # before the new one allocates, or it fails for no real reason.
            baseline = self._gpu_reader.read().free_mib
            if baseline is not None:
                await wait_for_vram_recovery(
                    lambda: self._gpu_reader.read().free_mib, baseline, self.gpu_footprint.gpu.total / MIB,
                )
        return LaunchExtras()

    def _on_worker_event(self, event: WorkerEvent) -> None:
        if event.role == "gpu":
            if event.state is not WorkerState.READY:
                self.lanes["gpu"].redirect_waiting(f"the GPU worker is {event.state.value}")
            if event.exit is not None and self.simulated is not None:
                self.simulated.set_footprint(GPU_FOOTPRINT_OWNER, 0)
            if event.exit is not None and event.exit.kind is ExitKind.OUT_OF_MEMORY:
                self.breaker.trip(f"GPU worker out of memory: {event.exit.evidence or event.exit.describe()}")
            if event.state is WorkerState.READY and self._gpu_failed_at is not None:
                self.gpu_recovery_s = round(self._clock() - self._gpu_failed_at, 3)
                self._gpu_failed_at = None
            if event.exit is not None and event.exit.kind is not ExitKind.CLEAN_STOP and self._gpu_failed_at is None:
                self._gpu_failed_at = self._clock()
        self._note("worker", role=event.role, state=event.state.value,
                   exit=event.exit.describe() if event.exit else None)
        self._refresh_degraded()


class _ServiceHooks(WorkerHooks):
    def __init__(self, service: Service) -> None:
        self._service = service

    async def before_spawn(self, worker: Worker) -> LaunchExtras:
        return await self._service._before_spawn(worker)

    def on_event(self, event: WorkerEvent) -> None:
        self._service._on_worker_event(event)


async def _no_wait() -> float:
    return 0.0


_CANCELED = object()


async def _wait_on_worker(awaitable, canceled: asyncio.Future, timeout: float,
                          liveness: Callable[[], str | None]):
    """The result of `awaitable` (the response, or the next SSE line: None at
    the end), or _CANCELED if the job was canceled meanwhile. Raises
    TimeoutError when the worker gives nothing for `timeout` seconds, and
    WorkerFailure as soon as `liveness` says the process can't progress."""
    pending = asyncio.ensure_future(awaitable)
    deadline = time.monotonic() + timeout
    problem = None
    while True:
        wait_s = min(LIVENESS_INTERVAL_S, max(0.0, deadline - time.monotonic()))
        done, _ = await asyncio.wait({pending, canceled}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        if done:
            break
        problem = liveness()
        if problem is not None or time.monotonic() >= deadline:
            break
    if pending in done:
        try:
            return pending.result()
        except StopAsyncIteration:
            return None
    pending.cancel()
    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, httpx.HTTPError):
        await pending
    if canceled in done:
        return _CANCELED
    if problem is not None:
        raise WorkerFailure(problem)
    raise asyncio.TimeoutError


def _drop_repeated_tool_names(event: dict[str, Any], named: set[tuple[int, int]]) -> None:
    """OpenAI streams a tool call's name once, in its first delta, and clients
    append the fragments; llama-cpp-python repeats the name in every delta,
    which would read as 'fnfnfn'. Keep only the first."""
    for choice in event.get("choices") or ():
        for call in (choice.get("delta") or {}).get("tool_calls") or ():
            function = call.get("function")
            if not isinstance(function, dict) or not function.get("name"):
                continue
            key = (choice.get("index", 0), call.get("index", 0))
            if key in named:
                function.pop("name")
                call.pop("id", None)
                call.pop("type", None)
            else:
                named.add(key)


def _carries_token(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or ():
        delta = choice.get("delta")
        if delta is not None and (delta.get("content") or delta.get("tool_calls") or delta.get("function_call")):
            return True
        if choice.get("text"):
            return True
    return False


_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.\-+@~]+){2,}")


def client_safe(message: str) -> str:
    """A worker's error message as a client may see it: one line, no
    traceback, no file system paths (they tell an attacker the install
    layout), and short."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    kept = [line for line in lines if not line.startswith(("Traceback", "File ", "^", "~"))]
    # A traceback's last line is the exception; otherwise the first few lines
    # (a validation error names the field on the next ones).
    text = kept[-1] if kept and lines[0].startswith("Traceback") else "; ".join(kept[:3])
    return _PATH.sub("<path>", text)[:300] or "no detail"


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


def _response_id(job: Job) -> str:
    prefix = "chatcmpl" if job.kind.value == "chat" else "cmpl"
    return f"{prefix}-{job.id}"


def _rejection(decision: Decision) -> JobFailed:
    err_type = "invalid_request_error" if decision.status < 500 else "server_error"
    return JobFailed(decision.status, decision.reason.value, decision.detail, err_type=err_type,
                     retry_after_s=decision.retry_after_s)


def _canceled(job: Job, where: str) -> JobFailed:
    return JobFailed(499, "request_canceled", f"request {job.id} was canceled {where}: {job.cancel_reason}",
                     err_type="canceled")
