"""What a path's failure means for the job, the path and the rest.

Before any byte reached the client a failed path hands the job on: a GPU
failure replays it once on the CPU, a peer's failure runs it here (a re-run
only if it may have begun there). After a byte it is an explicit error that
says nothing was re-run. A request that crashed its worker is quarantined,
never replayed. Completions are counted in the ExecutionLedger.

The dispatcher decides where a job runs (`assign_route`) and calls these;
they reach it only through `Routing`.
"""

from __future__ import annotations

from typing import Callable, Protocol

from .admission import Decision, Reason
from .backend import Backend
from .breaker import CircuitBreaker
from .failover_time import fault_of
from .jobs import Attempt, Job, JobFailed, WorkerFailure
from .ledger import ExecutionLedger
from .peer import PeerFailure, Peers
from .ports import DispatchEvents, GpuResidency
from .quarantine import Quarantine
from .upstream import Sink

# Hangs of one request (by its fingerprint, within the quarantine's time) before it is kept out.
HANGS_BEFORE_QUARANTINE = 2


class Routing(Protocol):
    """What failover needs of the dispatcher."""

    gpu: Backend | None
    cpu: Backend
    breaker: CircuitBreaker
    peers: Peers | None
    model_names: tuple[str, ...]
    clock: Callable[[], float]
    residency: GpuResidency
    quarantine: Quarantine
    ledger: ExecutionLedger
    events: DispatchEvents

    def assign_route(self, job: Job) -> Decision: ...


async def replay_after_gpu_failure(routing: Routing, job: Job, sink: Sink, failure: WorkerFailure, *,
                                   no_fallback: bool) -> Decision:
    """The GPU failed the job: quarantine it if its input crashed the worker,
    count the failure, and hand back the decision for its one replay, or
    raise the client's error when it can't be replayed."""
    assert routing.gpu is not None
    await raise_if_crashed_by_input(routing, job, routing.gpu, failure)
    record_gpu_failure(routing, job, str(failure))
    why_not = continuation_refused(routing, job)
    if job.committed and why_not is not None:
        raise JobFailed(502, "gpu_worker_failed", f"the GPU worker failed after part of the answer was sent "
                        f"({failure}), and {why_not}; nothing was re-run. It is safe to retry this request.") from None
    if no_fallback:
        made = "after part of the answer was sent" if job.committed else "before any output"
        raise JobFailed(503, "gpu_worker_failed",
                        f"the GPU worker failed {made} ({failure}) and this request may not "
                        "run on the CPU (X-Fallback: never); nothing was re-run. It is safe to retry it.",
                        retry_after_s=30.0) from None
    if why_not is None:
        continuation = job.continue_after("gpu", routing.clock())
    else:
        continuation = None
        sink.reset()
        job.to_replay("gpu")
    failed = job.attempts[-1] if job.attempts else None
    if failed is not None and failed.path == "gpu" and failed.ended_at is not None:
        job.fault = fault_of(failed, gave_back=gpu_was_given_back(routing))
    decision = routing.assign_route(job)
    if not decision.accepted:
        if job.committed:
            raise JobFailed(502, "gpu_worker_failed", f"the GPU worker failed after part of the answer was sent "
                            f"({failure}), and the CPU can't continue it: {decision.detail}; nothing was re-run. "
                            "It is safe to retry this request.") from None
        raise rejection(decision) from None
    if continuation is None:
        routing.events.note("replay", id=job.id, reason=str(failure))
    else:
        routing.events.note("resume", id=job.id, reason=str(failure), cut_at_tokens=continuation.tokens,
                            streamed=continuation.streamed)
        sink.seam({"from": "gpu", "on": "cpu", "cut_at_tokens": continuation.tokens, "reason": str(failure)})
    return decision


def continuation_refused(routing: Routing, job: Job) -> str | None:
    """Why the answer the failed path began can't go on from its text on
    the CPU; None when it can. A job that made nothing starts over instead."""
    if not job.resume:
        return "resuming was turned off for it (X-Resume: never, or [routing] resume_answers = false)"
    if not job.continuable():
        if job.sent is None:
            return "this request's answer can't be continued (tools, a grammar or schema, logprobs or n > 1)"
        if job.sent.tool_call:
            return "a tool call had begun"
        return "no text of it was made"
    if job.attempts and job.attempts[-1].tokens_made() >= job.max_tokens:
        return "it had made all max_tokens tokens"
    runtime = getattr(routing.cpu.worker, "runtime", None)
    if not getattr(runtime, "continues_prefill", False):
        return f"the CPU's engine ({getattr(runtime, 'name', 'unknown')}) can't continue an answer"
    if job.continuation is not None:
        return "it was already continued once"
    return None


async def run_on_cpu(routing: Routing, job: Job, sink: Sink) -> None:
    """Run the job on the CPU, the last path: its failure is the client's error."""
    try:
        record_completion(routing, job, await routing.cpu.run(job, sink))
    except WorkerFailure as failure:
        await raise_if_crashed_by_input(routing, job, routing.cpu, failure)
        job.note_failure(str(failure))
        routing.cpu.report_failure(str(failure))
        routing.events.note("cpu_failure", id=job.id, reason=str(failure))
        raise JobFailed(502, "cpu_worker_failed", f"the CPU worker failed while serving this request ({failure}); "
                        "nothing was re-run. It is safe to retry this request.") from None


async def run_on_peer(routing: Routing, job: Job, sink: Sink) -> Decision | None:
    """Run the job on the peer admission chose. None when it answered;
    the decision for the one run here when it failed before any output
    reached the client."""
    assert routing.peers is not None
    peer = routing.peers.get(job.peer)
    assert peer is not None
    job.running_on("peer")
    routing.events.changed()
    succeeded = False
    try:
        # The answer names the model as this server does; its fingerprint
        # says another server made it.
        attempt = await peer.run(job, sink, routing.model_names, routing.model_names[0], f"fp_peer_{peer.name}")
        succeeded = True
    except PeerFailure as failure:
        peer.record_failure(failure)
        job.note_failure(f"peer {peer.name}: {failure}")
        job.peer_failed = True
        routing.events.note("peer_failure", id=job.id, peer=peer.name, reason=str(failure), committed=job.committed,
                            ran=failure.ran)
        why_not = continuation_refused(routing, job)
        if job.committed and why_not is not None:
            raise JobFailed(502, "peer_failed", f"peer {peer.name} failed after part of the answer was sent "
                            f"({failure}), and {why_not}; nothing was re-run. It is safe to retry this "
                            "request.") from None
        job.back_to_admission()
        continuation = job.continue_after("peer", routing.clock()) if why_not is None else None
        if continuation is None:
            sink.reset()
            if failure.ran:
                # It may have begun there: this is the one re-run, on the CPU.
                job.to_replay("peer")
        decision = routing.assign_route(job)
        if not decision.accepted:
            made = "after part of the answer was sent " if job.committed else ""
            raise JobFailed(decision.status if not job.committed else 502,
                            decision.reason.value if not job.committed else "peer_failed",
                            f"peer {peer.name} failed {made}({failure}), and {decision.detail}",
                            retry_after_s=decision.retry_after_s) from None
        if continuation is not None:
            routing.events.note("resume", id=job.id, reason=f"peer {peer.name}: {failure}",
                                cut_at_tokens=continuation.tokens, streamed=continuation.streamed)
            sink.seam({"from": "peer", "on": "cpu", "cut_at_tokens": continuation.tokens,
                       "reason": f"peer {peer.name}: {failure}"})
        elif failure.ran:
            routing.events.note("replay", id=job.id, reason=f"peer {peer.name}: {failure}")
        return decision
    finally:
        if job.peer_probe:
            job.peer_probe = False
            peer.settle_probe(succeeded)
    routing.ledger.count(job.id)
    routing.events.completed(job, attempt)
    return None


async def raise_if_crashed_by_input(routing: Routing, job: Job, backend: Backend, failure: WorkerFailure) -> None:
    """A request that crashed its worker is not replayed: a request that
    segfaults a healthy worker would segfault the other one too. It is
    quarantined, so a retry gets the same answer without reaching a worker."""
    if failure.hung:
        _quarantine_if_hung_twice(routing, job, backend)
    report = await backend.crash_cause(job, failure)
    if report is None:
        return
    detail = f"it crashed the {backend.path} model server ({report.signal_name})"
    job.note_failure(detail)
    routing.quarantine.add(job.fingerprint, detail)
    routing.events.note("request_crashed_worker", id=job.id, path=backend.path, signal=report.signal_name,
                        committed=job.committed)
    refusal = routing.quarantine.refusal(job.fingerprint, job.id)
    assert refusal is not None
    raise refusal from None


def _quarantine_if_hung_twice(routing: Routing, job: Job, backend: Backend) -> None:
    """A request that hangs a worker is replayed once, like any failure; the
    same request hanging one again (a client's retry loop, an agent resending
    its long first prompt) is quarantined as a crash is, so it can't kill
    and restart the GPU worker over and over. Only one that was alone in the
    process counts: with others in the batch, the hang is no one's."""
    if not job.attempts or job.attempts[-1].shared_at_crash():
        return
    if routing.quarantine.note_hang(job.fingerprint) < HANGS_BEFORE_QUARANTINE:
        return
    detail = f"it left the {backend.path} model server silent past its deadline {HANGS_BEFORE_QUARANTINE} times"
    job.note_failure(detail)
    backend.report_failure(detail)  # the silent process is replaced all the same
    routing.quarantine.add(job.fingerprint, detail)
    routing.events.note("request_hung_worker", id=job.id, path=backend.path, committed=job.committed)
    refusal = routing.quarantine.refusal(job.fingerprint, job.id)
    assert refusal is not None
    raise refusal from None


def record_gpu_failure(routing: Routing, job: Job, reason: str) -> None:
    """Count a GPU failure: its breaker, its worker's owner, the requests
    waiting for it, the events. Not one we caused by unloading the GPU."""
    assert routing.gpu is not None
    if gpu_was_given_back(routing):
        resident = routing.residency.gpu_out()
        assert resident is not None
        # We unloaded the worker under this request (it outran the drain
        # time of a give-back): not a GPU failure, for the breaker or anyone.
        reason = f"{reason}; the GPU model was unloaded under it ({resident.detail})"
        job.note_failure(reason)
        settle_gpu_probe(routing.breaker, job)
        routing.events.note("gpu_unloaded_under_request", id=job.id, committed=job.committed)
        return
    job.note_failure(reason)
    settle_gpu_probe(routing.breaker, job, failed=reason)
    routing.gpu.report_failure(reason)
    moved = routing.gpu.lane.redirect_waiting(f"the GPU worker failed: {reason}")
    routing.events.gpu_failed(job, reason)
    routing.events.note("gpu_failure", id=job.id, reason=reason, committed=job.committed, redirected=moved)


def gpu_was_given_back(routing: Routing) -> bool:
    """The GPU model is unloaded because the user gave the GPU back."""
    resident = routing.residency.gpu_out()
    return resident is not None and resident.reason is Reason.GPU_YIELDED


def record_completion(routing: Routing, job: Job, attempt: Attempt) -> None:
    routing.ledger.count(job.id)
    if attempt.path == "gpu":
        routing.breaker.record_success()
        job.half_open_probe = False
    routing.events.completed(job, attempt)


def settle_gpu_probe(breaker: CircuitBreaker, job: Job, failed: str | None = None) -> None:
    """The GPU breaker's half-open probe this job holds, if any, is over: a
    failure opens the breaker again; otherwise the probe goes back."""
    if failed is not None:
        breaker.record_failure(failed)
    elif job.half_open_probe:
        breaker.release_probe()
    job.half_open_probe = False


def rejection(decision: Decision) -> JobFailed:
    return JobFailed(decision.status, decision.reason.value, decision.detail, retry_after_s=decision.retry_after_s)
