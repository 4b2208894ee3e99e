"""Where each request runs, and what happens when that path fails.

The dispatcher gathers admission's inputs (what the backends, the breaker
and the latest memory reading say), calls the pure `admission.decide`, and
carries the decision out through the backends: run, redirect when the GPU
closes while a request waits, and on a failure what `failover` says (replay
once on the CPU when the GPU fails before any byte was sent, quarantine a
request that crashed its worker). It acts on the rest of the service only
through `ports.DispatchEvents`, so its tests drive it in-process with fake
backends.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..memory.telemetry import MemorySnapshot
from .admission import (
    GPU_OUT_REASONS, CpuView, Decision, GpuOut, GpuView, PeerView, Reason, RequestShape, Route, decide, offer_to_peer,
    token_limit,
)
from .backend import Backend
from .backlog import EXPECTED_ANSWER_TOKENS, backlog_s, path_load, remaining_work
from .breaker import BreakerState, CircuitBreaker
from .failover import (
    record_completion, rejection, replay_after_gpu_failure, run_on_cpu, run_on_peer, settle_gpu_probe,
)
from .gpu_gate import gpu_out
from .jobs import Job, JobFailed, JobState, WorkerFailure, WorkerRequestError
from .lanes import Redirected
from .latency import Work, estimate
from .ledger import ExecutionLedger
from .peer import Peers, job_may_use_peers
from .ports import AlwaysResident, DispatchEvents, GpuResidency
from .quarantine import Quarantine
from .upstream import Sink

RECENT_DECISIONS = 50


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
    # Running on the CPU slows the GPU worker down by more than it adds
    # (launch_env.workers_oversubscribe): overflow waits for a GPU slot.
    cpu_slows_gpu: bool = False


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
        self.events = events
        self._clock = clock
        self.clock = clock  # failover's, for when a continued answer was cut
        self.gpu_missing_reason = gpu_missing_reason
        self.gpu_paused = False
        # [routing] fallback = "never": requests may not run on the CPU unless they ask.
        self.no_fallback = no_fallback
        # The CPU worker has the model's projector: it may take requests with images.
        self.cpu_reads_images = cpu_reads_images
        self.residency: GpuResidency = AlwaysResident()
        # Other servers on the LAN ([[peers]]), and the names this model goes
        # by (the first is what answers say; a peer may know it by any).
        self.peers = peers
        self.model_names = model_names
        self.jobs: dict[str, Job] = {}
        self.quarantine = Quarantine(clock)
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_DECISIONS)
        self.ledger = ExecutionLedger()

    # ----- entry points --------------------------------------------------------------

    def register(self, job: Job) -> bool:
        """Take the job's id for as long as it lives; False if the id is in use.
        Call before the first await of a request, so twins can't both run."""
        if job.id in self.jobs:
            return False
        self.jobs[job.id] = job
        job.registered_at = self._clock()
        return True

    def unregister(self, job: Job) -> None:
        if self.jobs.get(job.id) is job:
            del self.jobs[job.id]

    def quarantined(self, job: Job) -> JobFailed | None:
        """The refusal for a request that recently crashed a worker, or None."""
        return self.quarantine.refusal(job.fingerprint, job.id)

    def _context_caps(self) -> list[int]:
        return [self.limits.cpu_n_ctx] + ([self.limits.gpu_n_ctx] if self.gpu is not None else [])

    def token_limit(self, prompt_tokens: int, requested: int | None, chat: bool) -> int:
        return token_limit(prompt_tokens, requested, self._context_caps(), chat=chat)

    def largest_context(self) -> int:
        """The most tokens one request may hold on any of this model's paths."""
        return max(self._context_caps())

    async def run(self, job: Job, sink: Sink) -> None:
        """Admit a registered job and run it to the end. Raises JobFailed for
        every answer that is not the model's: a refusal, a failure, a cancel."""
        try:
            refusal = self.quarantined(job)
            if refusal is not None:
                raise refusal
            decision = self.assign_route(job)
            if not decision.accepted:
                raise rejection(decision)
            await self._execute(job, sink, decision)
        finally:
            # Every way out passes here, so a probe the job still holds (a
            # cancel, a client error, an unexpected exception) is given back;
            # success and GPU failure have already settled theirs.
            self._release_probe(job)
            job.finished()
            self.unregister(job)
            self.events.changed()

    def cancel(self, request_id: str, why: str) -> dict[str, Any] | None:
        job = self.jobs.get(request_id)
        if job is None or job.state is JobState.DONE:
            return None
        state_was = job.state.value
        job.cancel(why)
        self.events.note("canceled", id=request_id, state=state_was)
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

    @property
    def completed_total(self) -> int:
        return self.ledger.completed_total

    @property
    def duplicate_executions(self) -> int:
        return self.ledger.duplicate_executions

    def gpu_out(self) -> GpuOut | None:
        """Why the GPU path can't take work right now, or None if it can."""
        return gpu_out(self.gpu, self.gpu_missing_reason, self.gpu_paused, self.residency, self.breaker, self._memory)

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
            if (self.gpu is not None and job.path == "cpu" and job.state in (JobState.QUEUED, JobState.RUNNING)
                    and job.reason in GPU_OUT_REASONS):
                return f"{job.reason.value}: {job.reason_detail}"
        for job in self.jobs.values():
            if job.path == "peer" and job.state is JobState.RUNNING:
                return f"{Reason.PEER.value}: {job.reason_detail}"
        return None

    def cpu_wait_s(self, prompt_tokens: int, max_tokens: int) -> float:
        """What a new CPU request of this size would wait for its answer now."""
        load = path_load(self.cpu, self.jobs, self._cpu_load_eta_s())
        return estimate(load, Work(prompt_tokens, max_tokens)).latency_s

    def refresh_estimate(self, job: Job) -> None:
        """Re-estimate a running job from where it stands: the time it has
        taken so far and what the rest will take among the requests beside
        and behind it now. Done at each answer's first event: by then the
        requests that arrived after admission are known, and those were
        what the admission estimate couldn't see (its worst decile, issue
        32). A streamed answer's headers (X-Estimated-Latency) and its
        degraded note go out then; a whole answer's header carries it at
        the end, and the banner's time left uses it while it runs."""
        backend = self._backend(job.path)
        if backend is None or job.state is not JobState.RUNNING or job.choices != 1:
            return
        others = {job_id: other for job_id, other in self.jobs.items() if job_id != job.id}
        # The prompt is read by the first event; what is left is the answer.
        rest = Work(0, remaining_work(job)[0].answer_tokens)
        job.estimated_latency_s = round(job.age_s() + estimate(path_load(backend, others), rest,
                                                                holds_slot=True).latency_s, 2)

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
                             is_continuation=job.continuation is not None,
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
        job.decided(decision)
        self.recent.append({
            "t": round(time.time(), 3), "id": job.id, "route": decision.route.value,
            "reason": decision.reason.value, "detail": decision.detail, "client": job.client,
            "estimated_latency_s": decision.estimated_latency_s,
        })
        self.events.decided(job, decision)

    def _gpu_view(self, job: Job) -> GpuView | None:
        if self.gpu is None:
            return None
        return GpuView(
            lane=self.gpu.lane.state(self.limits.gpu_n_ctx, job.choices),
            out=self.gpu_out(),
            free_vram_mib=self._memory().gpu.free_mib,
            reserve_mib=self.limits.reserve_mib,
            # Each choice is its own slot with its own KV cache (--no-kv-unified).
            request_vram_mib=self._costs.gpu_mib(job.choices * (job.prompt_tokens + job.max_tokens)),
            backlog_s=backlog_s(self.gpu, self.jobs),
            load=path_load(self.gpu, self.jobs),
        )

    def _cpu_view(self, job: Job) -> CpuView:
        worker = self.cpu.worker
        return CpuView(
            lane=self.cpu.lane.state(self.limits.cpu_n_ctx, job.choices),
            can_serve=self.cpu.can_queue(),
            out_reason=worker.gave_up or worker.unhealthy_reason,
            host_available_mib=self._memory().host.available_mib,
            ram_floor_mib=self.limits.ram_floor_mib,
            request_ram_mib=self._costs.cpu_mib(job.choices * (job.prompt_tokens + job.max_tokens))
            + job.image_decode_mib,
            tokens_per_s=self.cpu.speed.tokens_per_s,
            prompt_tokens_per_s=self.cpu.speed.prompt_tokens_per_s,
            # A CPU worker that loads on demand, or is restarting, answers after its load.
            backlog_s=backlog_s(self.cpu, self.jobs) + self._cpu_load_eta_s(),
            load_ram_mib=self._costs.cpu_load_mib(),
            evictable_ram_mib=self._costs.cpu_evictable_mib(),
            load=path_load(self.cpu, self.jobs, self._cpu_load_eta_s()),
            slows_gpu=self.limits.cpu_slows_gpu,
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

    def _cpu_load_eta_s(self) -> float:
        return self.cpu.worker.load_eta_s(self.limits.cpu_load_prior_s)

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
                    next_decision = await run_on_peer(self, job, sink)
                else:
                    next_decision = await self._run_on_gpu(job, sink)
                if next_decision is None:
                    return
                decision = next_decision
            await run_on_cpu(self, job, sink)
        except WorkerRequestError as error:
            raise JobFailed(502, "worker_error", f"the model server failed on this request: {error}") from None

    async def _run_on_gpu(self, job: Job, sink: Sink) -> Decision | None:
        """Run the job on the GPU. None when it answered; the next decision
        when the GPU closed while it waited, or failed before any output."""
        assert self.gpu is not None
        try:
            record_completion(self, job, await self.gpu.run(job, sink, lambda: self._gpu_closed_for(job)))
            return None
        except Redirected as redirected:
            # Nothing ran yet; decide again with what we know now.
            decision = self.assign_route(job)
            if decision.reason is Reason.ADMITTED:
                # The GPU said no once for this job: it goes to the CPU, and
                # a probe the fresh decision took goes back at once.
                self._release_probe(job)
                if self._cpu_refusal(job):
                    decision = Decision(Route.REJECT, Reason.CPU_CANNOT_READ_IMAGES,
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
                raise rejection(decision) from None
            return decision
        except WorkerFailure as failure:
            return await replay_after_gpu_failure(self, job, sink, failure, no_fallback=self._no_fallback(job))

    def _release_probe(self, job: Job) -> None:
        settle_gpu_probe(self.breaker, job)

    def _backend(self, path: str | None) -> Backend | None:
        return self.gpu if path == "gpu" else self.cpu if path == "cpu" else None

