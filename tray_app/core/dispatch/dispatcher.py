"""Where each request runs, and what happens when that path fails.

The dispatcher gathers admission's inputs (what the backends, the breaker
and the latest memory reading say), calls the pure `admission.decide`, and
carries the decision out through the backends: run, replay once on the CPU
when the GPU fails before any byte was sent, redirect when the GPU closes
while a request waits, quarantine a request that crashed its worker. It
acts on the rest of the service only through `DispatchEvents`, so its tests
drive it in-process with fake backends.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from ..memory.telemetry import MemorySnapshot
from .admission import (
    GPU_OUT_REASONS, CpuView, Decision, GpuOut, GpuView, PeerView, Reason, RequestShape, Route, decide, offer_to_peer,
    token_limit,
)
from .backend import Backend, Sink
from .breaker import BreakerState, CircuitBreaker
from .jobs import Attempt, Job, JobFailed, JobState, WorkerFailure, WorkerRequestError
from .lanes import Redirected
from .latency import PathLoad, Work, estimate
from .peer import PeerFailure, Peers, job_may_use_peers
from .quarantine import Quarantine

log = logging.getLogger(__name__)

EXECUTION_LEDGER_SIZE = 10_000
RECENT_DECISIONS = 50
# The answer length a queued request is expected to run to, when its limit is
# larger: the wait estimate for those behind it (see Dispatcher._backlog_s).
EXPECTED_ANSWER_TOKENS = 256


class DispatchEvents(Protocol):
    """What the dispatcher tells the rest of the service. Never asks anything."""

    def note(self, kind: str, **data: Any) -> None:
        """Something worth the event log (/status events, the tray's notifications)."""

    def changed(self) -> None:
        """Requests moved between states: degraded mode may have begun or ended."""

    def decided(self, job: Job, decision: Decision) -> None: ...

    def completed(self, job: Job, attempt: Attempt) -> None: ...

    def gpu_failed(self, job: Job, reason: str) -> None: ...


class GpuResidency(Protocol):
    """Whether the GPU worker holds its memory (see residency.gpu.GpuSharing)."""

    def gpu_out(self) -> GpuOut | None:
        """Given away, unloaded or loading: why the GPU can't serve now, or None."""

    def request_arrived(self) -> None:
        """A request is being admitted: an unloaded GPU starts loading."""


class _AlwaysResident:
    def gpu_out(self) -> GpuOut | None:
        return None

    def request_arrived(self) -> None:
        pass


@dataclass(frozen=True)
class Limits:
    """The configuration the dispatcher decides with."""

    gpu_n_ctx: int
    cpu_n_ctx: int
    reserve_mib: float
    ram_floor_mib: float
    # How long a request may wait for a slot without an X-Request-Timeout.
    queue_budget_s: float | None = None
    # The CPU worker's load time until one has been measured.
    cpu_load_prior_s: float = 5.0


@dataclass(frozen=True)
class Costs:
    """What one request of n tokens adds, in MiB, on each path (from the estimator)."""

    gpu_mib: Callable[[int], float]
    cpu_mib: Callable[[int], float]
    # The RAM a CPU worker's load takes (0 once loaded), and what unloading
    # other models' idle CPU workers would free (see CpuView).
    cpu_load_mib: Callable[[], float] = lambda: 0.0
    cpu_evictable_mib: Callable[[], float] = lambda: 0.0


class Dispatcher:
    def __init__(self, limits: Limits, backends: dict[str, Backend], breaker: CircuitBreaker,
                 memory: Callable[[], MemorySnapshot], costs: Costs, events: DispatchEvents, *,
                 gpu_missing_reason: str | None = None, clock: Callable[[], float] = time.monotonic,
                 no_fallback: bool = False, peers: Peers | None = None,
                 model_names: tuple[str, ...] = ("",), cpu_reads_images: bool = False) -> None:
        self.limits = limits
        self.gpu = backends.get("gpu")
        self.cpu = backends["cpu"]
        self.breaker = breaker
        self._memory = memory
        self._costs = costs
        self._events = events
        self._clock = clock
        self.gpu_missing_reason = gpu_missing_reason
        self.gpu_paused = False
        # [routing] fallback = "never": requests may not run on the CPU unless they ask.
        self.no_fallback = no_fallback
        # The CPU worker has the model's projector: it may take requests with images.
        self.cpu_reads_images = cpu_reads_images
        self.residency: GpuResidency = _AlwaysResident()
        # Other servers on the LAN ([[peers]]), and the names this model goes
        # by (the first is what answers say; a peer may know it by any).
        self.peers = peers
        self.model_names = model_names
        self.jobs: dict[str, Job] = {}
        self.quarantine = Quarantine(clock)
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_DECISIONS)
        # Completed executions per request id (bounded): the evidence that no
        # request ran twice, for /status, the drill and the soak.
        self._executions: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.completed_total = 0
        self.duplicate_executions = 0

    # ----- entry points --------------------------------------------------------------

    def register(self, job: Job) -> bool:
        """Take the job's id for as long as it lives; False if the id is in use.
        Call before the first await of a request, so twins can't both run."""
        if job.id in self.jobs:
            return False
        self.jobs[job.id] = job
        return True

    def unregister(self, job: Job) -> None:
        if self.jobs.get(job.id) is job:
            del self.jobs[job.id]

    def quarantined(self, job: Job) -> JobFailed | None:
        """The refusal for a request that recently crashed a worker, or None."""
        return self.quarantine.refusal(job.fingerprint, job.id)

    def token_limit(self, prompt_tokens: int, requested: int | None, chat: bool) -> int:
        caps = [self.limits.cpu_n_ctx] + ([self.limits.gpu_n_ctx] if self.gpu is not None else [])
        return token_limit(prompt_tokens, requested, caps, chat=chat)

    async def run(self, job: Job, sink: Sink) -> None:
        """Admit a registered job and run it to the end. Raises JobFailed for
        every answer that is not the model's: a refusal, a failure, a cancel."""
        try:
            refusal = self.quarantined(job)
            if refusal is not None:
                raise refusal
            decision = self.assign_route(job)
            if not decision.accepted:
                raise _rejection(decision)
            await self._execute(job, sink, decision)
        finally:
            # Every way out passes here, so a probe the job still holds (a
            # cancel, a client error, an unexpected exception) is given back;
            # success and GPU failure have already settled theirs.
            self._release_probe(job)
            job.state = JobState.DONE
            self.unregister(job)
            self._events.changed()

    def cancel(self, request_id: str, why: str) -> dict[str, Any] | None:
        job = self.jobs.get(request_id)
        if job is None or job.state is JobState.DONE:
            return None
        state_was = job.state.value
        job.cancel(why)
        self._events.note("canceled", id=request_id, state=state_was)
        return {"id": request_id, "object": "request.cancel", "canceled": True, "state_was": state_was}

    def cancel_all(self, why: str) -> None:
        for job in list(self.jobs.values()):
            job.cancel(why)

    def set_gpu_paused(self, paused: bool) -> None:
        self.gpu_paused = paused
        if paused and self.gpu is not None:
            self.gpu.lane.redirect_waiting("the GPU path was paused")

    def redirect_gpu_waiting(self, reason: str) -> int:
        """Send the GPU lane's waiters elsewhere: the GPU can't take them.
        Those that chose to wait for a loading GPU (X-Prefer-Path: gpu) stay
        while it loads."""
        if self.gpu is None:
            return 0
        out = self.gpu_out()
        loading = out is not None and out.reason is Reason.GPU_LOADING

        def waits_for_the_load(request_id: str) -> bool:
            job = self.jobs.get(request_id)
            return loading and job is not None and self._gpu_closed_for(job) is None

        return self.gpu.lane.redirect_waiting(reason, keep=waits_for_the_load)

    # ----- reads ------------------------------------------------------------------------

    def gpu_out(self) -> GpuOut | None:
        """Why the GPU path can't take work right now, or None if it can."""
        if self.gpu is None:
            return GpuOut(Reason.GPU_UNAVAILABLE, self.gpu_missing_reason or "no GPU path")
        if self.gpu_paused:
            return GpuOut(Reason.FORCED_CPU, "the GPU path is paused (force CPU)")
        resident = self.residency.gpu_out()
        breaker_open = self._breaker_open()
        if resident is not None and not (resident.reason is Reason.GPU_LOADING and breaker_open):
            # (A worker restarting after failures may be loading, but the GPU
            # takes no work until the breaker's cooldown is over: that comes first.)
            return resident
        out = self.gpu.out_reason()
        if out is not None and resident is None:
            return GpuOut(Reason.GPU_UNAVAILABLE, out)
        if breaker_open is not None:
            return breaker_open
        reading = self._memory().gpu
        if not reading.available:
            return GpuOut(Reason.GPU_UNAVAILABLE, f"GPU memory can't be read: {reading.reason}")
        return None

    def _breaker_open(self) -> GpuOut | None:
        if self.breaker.state is not BreakerState.OPEN:
            return None
        snap = self.breaker.snapshot()
        return GpuOut(Reason.GPU_UNAVAILABLE,
                      f"the circuit breaker is open after repeated GPU failures "
                      f"({snap.get('last_failure_reason')}); retrying in {snap.get('retry_in_s')} s",
                      back_in_s=snap.get("retry_in_s"))

    def gpu_out_reason(self) -> str | None:
        out = self.gpu_out()
        return None if out is None else out.detail

    def degraded_cause(self) -> str | None:
        """Why the CPU path serves instead of the GPU now, or None."""
        out = self.gpu_out()
        if out is not None and not out.quiet:
            return out.detail
        free = self._memory().gpu.free_mib
        if out is None and self.gpu is not None and free is not None and free <= self.limits.reserve_mib:
            # Every new request would go to the CPU: say so steadily, not only
            # while one happens to be in flight.
            return (f"not enough VRAM headroom: {free:.0f} MiB free, within the "
                    f"{self.limits.reserve_mib:g} MiB reserve")
        for job in self.jobs.values():
            if job.path == "cpu" and job.state in (JobState.QUEUED, JobState.RUNNING) and job.reason in GPU_OUT_REASONS:
                return f"{job.reason.value}: {job.reason_detail}"
        for job in self.jobs.values():
            if job.path == "peer" and job.state is JobState.RUNNING:
                return f"{Reason.PEER.value}: {job.reason_detail}"
        return None

    def cpu_wait_s(self, prompt_tokens: int, max_tokens: int) -> float:
        """What a new CPU request of this size would wait for its answer now."""
        return estimate(self._load(self.cpu, self._cpu_load_eta_s()), Work(prompt_tokens, max_tokens)).latency_s

    def request_status(self) -> list[dict[str, Any]]:
        # Jobs still being admitted hold their id but have no path or place yet.
        rows = []
        for job in self.jobs.values():
            if job.state is JobState.ADMITTING:
                continue
            row = job.summary()
            backend = self._backend(job.path)
            row["queue_position"] = backend.lane.position(job.id) if backend is not None else None
            rows.append(row)
        return rows

    # ----- admission ----------------------------------------------------------------------

    def assign_route(self, job: Job) -> Decision:
        """Decide where the job runs and commit it there: gather the inputs,
        ask the pure admission function, take (or give back) the GPU's and a
        peer's half-open probe, write the decision on the job, record it and
        tell the events. No await in here, so nothing can change between what
        we read and what we decide."""
        # A fresh decision starts without a probe: one this job took earlier
        # (before a redirect) goes back, or the breaker would wait for it forever.
        self._release_probe(job)
        if not job.force_cpu and not job.replayed:
            self.residency.request_arrived()
        gpu = self._gpu_view(job)
        half_open_probe = False
        if gpu is not None and gpu.out is None and self.breaker.state is BreakerState.HALF_OPEN:
            if self.breaker.try_acquire():
                half_open_probe = True
            else:
                gpu = dataclasses.replace(gpu, out=GpuOut(
                    Reason.GPU_UNAVAILABLE, "the circuit breaker is half-open and a probe request is testing the GPU"))
        shape = RequestShape(prompt_tokens=job.prompt_tokens, max_tokens=job.max_tokens,
                             force_cpu=job.force_cpu or self.gpu_paused, deadline_s=job.deadline_s,
                             is_replay=job.replayed, replayed_from=job.replayed_from,
                             queue_budget_s=job.deadline_s if job.deadline_s is not None else self.limits.queue_budget_s,
                             prefer_gpu=job.prefer_gpu, no_fallback=self._no_fallback(job),
                             cpu_refusal=self._cpu_refusal(job))
        decision = decide(shape, gpu, self._cpu_view(job))
        decision, job.peer = offer_to_peer(decision, shape, self._peer_views(job))
        peer = self.peers.get(job.peer) if self.peers is not None else None
        if peer is not None and peer.breaker.state is BreakerState.HALF_OPEN:
            # Its cooldown is over: this request is the one probe that tests it
            # (offered only while no other probe is out; no await since).
            job.peer_probe = peer.breaker.try_acquire()
        on_gpu = decision.route in (Route.GPU, Route.GPU_QUEUE)
        if half_open_probe and not on_gpu:
            self.breaker.release_probe()
        job.half_open_probe = half_open_probe and on_gpu
        self._apply(job, decision)
        return decision

    def _apply(self, job: Job, decision: Decision) -> None:
        job.reason = decision.reason
        job.reason_detail = decision.detail
        job.decision = decision
        if decision.estimated_latency_s is not None:
            job.estimated_latency_s = decision.estimated_latency_s
        self.recent.append({
            "t": round(time.time(), 3), "id": job.id, "route": decision.route.value,
            "reason": decision.reason.value, "detail": decision.detail,
        })
        self._events.decided(job, decision)

    def _gpu_view(self, job: Job) -> GpuView | None:
        if self.gpu is None:
            return None
        return GpuView(
            lane=self.gpu.lane.state(self.limits.gpu_n_ctx),
            out=self.gpu_out(),
            free_vram_mib=self._memory().gpu.free_mib,
            reserve_mib=self.limits.reserve_mib,
            request_vram_mib=self._costs.gpu_mib(job.prompt_tokens + job.max_tokens),
            backlog_s=self._backlog_s(self.gpu),
            load=self._load(self.gpu),
        )

    def _cpu_view(self, job: Job) -> CpuView:
        worker = self.cpu.worker
        return CpuView(
            lane=self.cpu.lane.state(self.limits.cpu_n_ctx),
            can_serve=self.cpu.can_queue(),
            out_reason=worker.gave_up or worker.unhealthy_reason,
            host_available_mib=self._memory().host.available_mib,
            ram_floor_mib=self.limits.ram_floor_mib,
            request_ram_mib=self._costs.cpu_mib(job.prompt_tokens + job.max_tokens),
            tokens_per_s=self.cpu.speed.tokens_per_s,
            prompt_tokens_per_s=self.cpu.speed.prompt_tokens_per_s,
            # A CPU worker that loads on demand, or is restarting, answers after its load.
            backlog_s=self._backlog_s(self.cpu) + self._cpu_load_eta_s(),
            load_ram_mib=self._costs.cpu_load_mib(),
            evictable_ram_mib=self._costs.cpu_evictable_mib(),
            load=self._load(self.cpu, self._cpu_load_eta_s()),
        )

    def _peer_views(self, job: Job) -> list[PeerView]:
        # A peer may not see: a request with images stays here.
        if self.peers is None or not job_may_use_peers(job) or self._no_fallback(job) or job.images:
            return []
        expected = EXPECTED_ANSWER_TOKENS
        return [peer.view(job.prompt_tokens, job.max_tokens, expected) for peer in self.peers.offering(self.model_names)]

    def _cpu_refusal(self, job: Job) -> str | None:
        """Why the CPU path can't run this job at all, or None."""
        if job.images and not self.cpu_reads_images:
            return "the request carries images, which the CPU worker can't read (it has no projector)"
        return None

    def _no_fallback(self, job: Job) -> bool:
        """May this job not run on the CPU? A client that asked for the CPU
        (X-Force-Path: cpu) gets it whatever the policy."""
        if job.force_cpu:
            return False
        return job.no_fallback if job.no_fallback is not None else self.no_fallback

    def _gpu_closed_for(self, job: Job) -> str | None:
        """Asked once a GPU slot is the job's: why it must go elsewhere, or
        None. A job that prefers the GPU waits through its load."""
        out = self.gpu_out()
        if out is None or (out.reason is Reason.GPU_LOADING and job.decision is not None
                           and job.decision.waits_for_load):
            return None
        return out.detail

    def _cpu_backlog_s(self) -> float:
        return self._backlog_s(self.cpu) + self._cpu_load_eta_s()

    def _cpu_load_eta_s(self) -> float:
        return self.cpu.worker.load_eta_s(self.limits.cpu_load_prior_s)

    def _backlog_s(self, backend: Backend) -> float:
        """Seconds until a slot of this path frees up for a new arrival: the
        work ahead (running and queued) played forward on its slots at the
        speed each number of busy slots gets. 0 while a slot is free."""
        lane = backend.lane
        if len(lane.running_ids) < lane.concurrency and not lane.waiting_ids:
            return 0.0
        return estimate(self._load(backend), Work(0, 0)).wait_s

    def _load(self, backend: Backend, not_before_s: float = 0.0) -> PathLoad:
        """A path's slots and the work on them and in its queue, for the
        latency estimate. A request's work is counted at its expected length,
        not its limit: a chat without max_tokens may fill its context, but few
        do. One that has already run long is expected to run as long again."""
        def remaining(job_id: str) -> Work | None:
            job = self.jobs.get(job_id)
            if job is None:
                return None
            done = job.attempts[-1].tokens if job.state is JobState.RUNNING and job.attempts else 0
            expected = min(job.max_tokens, max(EXPECTED_ANSWER_TOKENS, 2 * done))
            return Work(job.prompt_tokens if done == 0 else 0, max(0, expected - done))

        lane = backend.lane
        running = tuple(work for work in map(remaining, lane.running_ids) if work is not None)
        queued = tuple(work for work in map(remaining, lane.waiting_ids) if work is not None)
        speeds = backend.busy_speeds.curve(backend.speed.tokens_per_s, backend.speed.prompt_tokens_per_s)
        return PathLoad(lane.concurrency, running, queued, speeds, not_before_s)

    # ----- execution ------------------------------------------------------------------------

    async def _execute(self, job: Job, sink: Sink, decision: Decision) -> None:
        """Run an admitted job, replaying once on the CPU if the GPU (or a
        peer) fails before anything reached the client."""
        try:
            # Each path either answers (None) or hands over the next decision.
            # It ends: a peer is tried once (job.no_peer after), a redirected
            # GPU job goes to the CPU or a peer, a failed one replays on the CPU.
            while decision.route is not Route.CPU:
                if decision.route is Route.PEER:
                    next_decision = await self._run_on_peer(job, sink)
                else:
                    next_decision = await self._run_on_gpu(job, sink)
                if next_decision is None:
                    return
                decision = next_decision
            try:
                self._completed(job, await self.cpu.run(job, sink))
            except WorkerFailure as failure:
                await self._raise_if_crashed_by_input(job, self.cpu, failure)
                job.first_failure = job.first_failure or str(failure)
                self.cpu.report_failure(str(failure))
                self._events.note("cpu_failure", id=job.id, reason=str(failure))
                raise JobFailed(502, "cpu_worker_failed",
                                f"the CPU worker failed while serving this request ({failure}); "
                                "nothing was re-run. It is safe to retry this request.") from None
        except WorkerRequestError as error:
            raise JobFailed(502, "worker_error", f"the model server failed on this request: {error}") from None

    async def _run_on_gpu(self, job: Job, sink: Sink) -> Decision | None:
        """Run the job on the GPU. None when it answered; the next decision
        when the GPU closed while it waited, or failed before any output."""
        assert self.gpu is not None
        try:
            self._completed(job, await self.gpu.run(job, sink, lambda: self._gpu_closed_for(job)))
            return None
        except Redirected as redirected:
            # Nothing ran yet; decide again with what we know now.
            decision = self.assign_route(job)
            if decision.reason is Reason.ADMITTED:
                # The GPU said no once for this job: it goes to the CPU, and
                # a probe the fresh decision took goes back at once.
                self._release_probe(job)
                if self._cpu_refusal(job):
                    decision = Decision(Route.REJECT, Reason.GPU_UNAVAILABLE,
                                        f"the GPU path closed while this request waited ({redirected.reason}) "
                                        f"and {self._cpu_refusal(job)}", status=503, retry_after_s=30.0)
                elif self._no_fallback(job):
                    decision = Decision(Route.REJECT, Reason.GPU_UNAVAILABLE,
                                        f"the GPU path closed while this request waited ({redirected.reason}) "
                                        "and it may not run on the CPU (X-Fallback: never)",
                                        status=503, retry_after_s=30.0)
                else:
                    decision = Decision(Route.CPU, Reason.GPU_UNAVAILABLE, redirected.reason)
                self._apply(job, decision)
            if not decision.accepted:
                raise _rejection(decision) from None
            return decision
        except WorkerFailure as failure:
            await self._raise_if_crashed_by_input(job, self.gpu, failure)
            self._on_gpu_failure(job, str(failure))
            if job.committed:
                raise JobFailed(
                    502, "gpu_worker_failed",
                    f"the GPU worker failed after part of the answer was sent ({failure}); "
                    "nothing was re-run. It is safe to retry this request.",
                ) from None
            if self._no_fallback(job):
                raise JobFailed(
                    503, "gpu_worker_failed",
                    f"the GPU worker failed before any output ({failure}) and this request may not "
                    "run on the CPU (X-Fallback: never); nothing was re-run. It is safe to retry it.",
                    retry_after_s=30.0,
                ) from None
            sink.reset()
            job.replayed = True
            decision = self.assign_route(job)
            if not decision.accepted:
                raise _rejection(decision) from None
            self._events.note("replay", id=job.id, reason=str(failure))
            return decision

    async def _run_on_peer(self, job: Job, sink: Sink) -> Decision | None:
        """Run the job on the peer admission chose. None when it answered;
        the decision for the one re-run here when it failed before any
        output reached the client."""
        assert self.peers is not None
        peer = self.peers.get(job.peer)
        assert peer is not None
        job.path, job.state = "peer", JobState.RUNNING
        self._events.changed()
        succeeded = False
        try:
            # The answer names the model as this server does; its fingerprint
            # says another server made it.
            attempt = await peer.run(job, sink, self.model_names, self.model_names[0], f"fp_peer_{peer.name}")
            succeeded = True
        except PeerFailure as failure:
            peer.record_failure(failure)
            job.first_failure = job.first_failure or f"peer {peer.name}: {failure}"
            job.no_peer = True
            self._events.note("peer_failure", id=job.id, peer=peer.name, reason=str(failure), committed=job.committed,
                              ran=failure.ran)
            if job.committed:
                raise JobFailed(502, "peer_failed",
                                f"peer {peer.name} failed after part of the answer was sent ({failure}); "
                                "nothing was re-run. It is safe to retry this request.") from None
            sink.reset()
            job.path, job.state = None, JobState.ADMITTING
            if failure.ran:
                # It may have begun there: this is the one re-run, on the CPU.
                job.replayed, job.replayed_from = True, "peer"
            decision = self.assign_route(job)
            if not decision.accepted:
                raise JobFailed(decision.status, decision.reason.value,
                                f"peer {peer.name} failed ({failure}), and {decision.detail}",
                                retry_after_s=decision.retry_after_s) from None
            if failure.ran:
                self._events.note("replay", id=job.id, reason=f"peer {peer.name}: {failure}")
            return decision
        finally:
            if job.peer_probe:
                job.peer_probe = False
                peer.settle_probe(succeeded)
        self._count_execution(job.id)
        self._events.completed(job, attempt)
        return None

    async def _raise_if_crashed_by_input(self, job: Job, backend: Backend, failure: WorkerFailure) -> None:
        """A request that crashed its worker is not replayed: a request that
        segfaults a healthy worker would segfault the other one too. It is
        quarantined, so a retry gets the same answer without reaching a worker."""
        report = await backend.crash_cause(job, failure)
        if report is None:
            return
        detail = f"it crashed the {backend.path} model server ({report.signal_name})"
        job.first_failure = job.first_failure or detail
        self.quarantine.add(job.fingerprint, detail)
        self._events.note("request_crashed_worker", id=job.id, path=backend.path, signal=report.signal_name,
                          committed=job.committed)
        refusal = self.quarantine.refusal(job.fingerprint, job.id)
        assert refusal is not None
        raise refusal from None

    def _completed(self, job: Job, attempt: Attempt) -> None:
        self._count_execution(job.id)
        if attempt.path == "gpu":
            self.breaker.record_success()
            job.half_open_probe = False
        self._events.completed(job, attempt)

    def _count_execution(self, request_id: str) -> None:
        self.completed_total += 1
        count = self._executions.pop(request_id, 0) + 1
        self._executions[request_id] = count
        if count > 1:
            self.duplicate_executions += 1
            log.error("request %s completed %d executions", request_id, count)
        while len(self._executions) > EXECUTION_LEDGER_SIZE:
            self._executions.popitem(last=False)

    def _on_gpu_failure(self, job: Job, reason: str) -> None:
        assert self.gpu is not None
        resident = self.residency.gpu_out()
        if resident is not None and resident.reason is Reason.GPU_YIELDED:
            # We unloaded the worker under this request (it outran the drain
            # time of a give-back): not a GPU failure, for the breaker or anyone.
            reason = f"{reason}; the GPU model was unloaded under it ({resident.detail})"
            job.first_failure = job.first_failure or reason
            self._release_probe(job)
            self._events.note("gpu_unloaded_under_request", id=job.id, committed=job.committed)
            return
        job.first_failure = job.first_failure or reason
        self._release_probe(job, failed=reason)
        self.gpu.report_failure(reason)
        moved = self.gpu.lane.redirect_waiting(f"the GPU worker failed: {reason}")
        self._events.gpu_failed(job, reason)
        self._events.note("gpu_failure", id=job.id, reason=reason, committed=job.committed, redirected=moved)

    def _release_probe(self, job: Job, failed: str | None = None) -> None:
        if failed is not None:
            self.breaker.record_failure(failed)
        elif job.half_open_probe:
            self.breaker.release_probe()
        job.half_open_probe = False

    def _backend(self, path: str | None) -> Backend | None:
        return self.gpu if path == "gpu" else self.cpu if path == "cpu" else None


def _rejection(decision: Decision) -> JobFailed:
    return JobFailed(decision.status, decision.reason.value, decision.detail, retry_after_s=decision.retry_after_s)
