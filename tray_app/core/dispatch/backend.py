"""One path a request can run on: its worker, its lane, its measured speed,
and how a request is streamed through it.

What is particular to a local llama.cpp server lives here: waiting for a
starting worker, liveness while waiting, its error answers, a stream that
ends without [DONE], llama-cpp-python's quirks. The stream itself (SSE, the
deadlines, each event's shape) is upstream.py's, shared with the peers. The
dispatcher decides *where* a request runs; a backend only runs it and says
how it ended, by returning or raising:

- Redirected: nothing ran, decide again (the GPU is no longer usable);
- WorkerFailure: the worker broke (replace it; maybe replay elsewhere);
- WorkerRequestError: the worker is fine but failed this request;
- JobFailed: an answer for the client (a 4xx from the worker, a cancel).

The backend never writes its worker's state: it tells the worker's owner
task (`report_failure`) and, until a new process is up, remembers itself
that the old one failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

import httpx

from ..engine.exits import ExitReport, is_input_crash, mentions_out_of_memory
from ..engine.handle import WorkerHandle
from ..engine.worker import WorkerState
from .jobs import Attempt, DraftTally, Job, JobFailed, PathSpeed, WorkerFailure, WorkerRequestError
from .lanes import Lane, Redirected
from .latency import BusySpeeds, mean_busy
from .upstream import (Hop, Sink, UpstreamResponse, UpstreamRules, Waiter, canceled_error, response_id,
                       stream_attempt, upstream_error_message, worker_body)

# After a connection breaks, how long to wait for the worker's exit status,
# which says whether the request crashed it (SIGSEGV) or something else did.
INPUT_CRASH_WAIT_S = 3.0
STREAM_END_EXIT_WAIT_S = 1.0


@dataclass(frozen=True)
class Deadlines:
    """How long a worker may stay silent before it counts as hung."""

    first_token_s: Callable[[Job], float]
    between_tokens_s: float
    ready_s: float  # how long a request waits for a starting worker


class Backend:
    def __init__(self, path: str, worker: WorkerHandle, lane: Lane, speed: PathSpeed, hop: Hop,
                 deadlines: Deadlines, *, fingerprint: str, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[], None] = lambda: None) -> None:
        self.path = path
        self.worker = worker
        self.lane = lane
        self.speed = speed
        # Decode speed by how many slots were busy: what the latency estimate uses.
        self.busy_speeds = BusySpeeds()
        # How well speculative decoding's drafts are accepted, when the worker drafts.
        self.drafts = DraftTally()
        self.fingerprint = fingerprint
        self._hop = hop
        self._deadlines = deadlines
        self._clock = clock
        self._on_change = on_change
        # The process (by Worker.exits when it started) that failed a request:
        # it gets no more work, even while its owner has not replaced it yet.
        self._failed_process: int | None = None
        # Attempts inside a worker process now, by job id.
        self._in_process: dict[str, Attempt] = {}
        # A stopped worker is loaded by the first request that needs it
        # ([cpu] keep = "on_demand"), rather than being out of service.
        self.loads_on_demand = False

    # ----- read side -----------------------------------------------------------

    def out_reason(self) -> str | None:
        """Why this worker can't take a request right now, or None."""
        worker = self.worker
        if worker.state is not WorkerState.READY:
            detail = worker.unhealthy_reason or (worker.last_exit.describe() if worker.last_exit else None)
            return f"the {self.path.upper()} worker is {worker.state.value}" + (f": {detail}" if detail else "")
        if self._failed_process == worker.exits:
            return f"the {self.path.upper()} worker failed a request and is being replaced"
        return None

    def can_queue(self) -> bool:
        """A starting or restarting worker can take requests: they wait in its
        queue; so can a stopped one that loads on demand."""
        if self.worker.gave_up is not None:
            return False
        return self.loads_on_demand or self.worker.state is not WorkerState.STOPPED

    # ----- effects -------------------------------------------------------------

    def report_failure(self, reason: str) -> None:
        """The worker failed a request: keep work away from this process and
        ask its owner to replace it."""
        if self._failed_process is None:
            self._failed_process = self.worker.exits
        self.worker.report_failure(reason, process=self._failed_process)

    async def crash_cause(self, job: Job, failure: WorkerFailure) -> ExitReport | None:
        """How the process ended if this job's input is what crashed it, else None.
        Only a request that got into the process can be the cause, and only
        if it was alone there: with several in one batch, any of them may be."""
        if not failure.process_may_have_died or not job.attempts or not job.attempts[-1].reached_worker:
            return None
        if job.attempts[-1].shared_at_crash():
            return None
        report = await self.worker.exit_after(job.attempts[-1].worker_exits, INPUT_CRASH_WAIT_S)
        return report if report is not None and is_input_crash(report) else None

    async def run(self, job: Job, sink: Sink, still_open: Callable[[], str | None] = lambda: None) -> Attempt:
        """Wait for a slot in the lane, then stream the job through the worker.
        `still_open` is asked once the slot is ours: a reason means redirect."""
        lane = self.lane
        if job.choices > lane.concurrency:
            # llama-server refuses n above its slot count, and the choices run
            # at once or not at all: a path with fewer slots (the CPU, after
            # the GPU failed) can't serve this request. Nothing ran yet.
            job.refused_by(self.path)
            raise JobFailed(503, "too_many_choices",
                            f"n={job.choices} needs {job.choices} parallel slots and the {self.path.upper()} path "
                            f"has {lane.concurrency}; retry later or ask for n <= {lane.concurrency}",
                            retry_after_s=30.0, param="n")
        place = lane.join(job.id, front=job.replayed and self.path == "cpu", slots=job.choices)
        job.joined_lane(self.path, queued=place is not None)
        self._on_change()
        if place is None:
            # A free slot: nothing to wait for, so no tasks and no asyncio.wait
            # (they cost a few loop turns of CPU on every request).
            job.got_slot(0.0)
        else:
            await self._wait_in_queue(job, lane, place)
        try:
            why_not = still_open()
            if why_not is not None:
                raise Redirected(why_not)
            job.running_on(self.path)
            self._on_change()
            return await self._stream(job, sink, still_open)
        except WorkerFailure:
            # Marked before the slot is freed: the next request in the lane
            # must not be sent to the process that just broke.
            self._failed_process = job.attempts[-1].worker_exits if job.attempts else self.worker.exits
            raise
        finally:
            lane.release(job.id)

    async def _wait_in_queue(self, job: Job, lane: Lane, place: asyncio.Future) -> None:
        """Wait for the lane's slot, or leave the queue when the job is canceled."""
        acquire = asyncio.ensure_future(lane.wait(job.id, place))
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
            raise canceled_error(job, f"while it waited in the {self.path} queue")
        job.got_slot(acquire.result())

    async def _stream(self, job: Job, sink: Sink, still_open: Callable[[], str | None]) -> Attempt:
        worker = self.worker
        out = self.out_reason()
        if out is not None:
            if self.path != "gpu":
                await self._wait_ready(job)
            elif still_open() is None:
                # The job chose to wait for a loading GPU (X-Prefer-Path: gpu).
                await self._wait_loaded(job, still_open)
            else:
                raise Redirected(out)
        attempt = Attempt(self.path, self._clock(), worker_exits=worker.exits)
        job.attempts.append(attempt)
        log_mark = worker.log_lines
        self._enter_process(job.id, attempt)
        try:
            done_seen = await stream_attempt(
                self._hop, f"{worker.base_url}{job.kind.upstream_path}", worker_body(job), worker.auth_headers,
                job, attempt, sink, _WorkerRules(self), clock=self._clock,
                first_token_s=self._deadlines.first_token_s(job), between_tokens_s=self._deadlines.between_tokens_s,
                model=worker.spec.model_name, fingerprint=self.fingerprint)
        finally:
            self._in_process.pop(job.id, None)
        if not done_seen:
            attempt.outcome = "failed: truncated"
            # The connection closed cleanly: the server's generator raised for
            # this input. Only a dead process makes it a worker failure; one
            # killed mid-answer can close the connection before it is reaped,
            # so give its exit a moment to show.
            exited = await worker.exit_after(attempt.worker_exits, STREAM_END_EXIT_WAIT_S)
            if exited is not None or worker.state is not WorkerState.READY:
                raise WorkerFailure("the worker's stream ended without [DONE] and the worker is gone",
                                    process_may_have_died=True)
            if not _context_was_full(worker.log_since(log_mark)):
                raise WorkerRequestError("the model server ended the answer early without saying why; "
                                         f"see {worker.log_path}")
            # llama-cpp-python's server ran off the end of its KV cache: it
            # skips its own length check while the output is an incomplete
            # UTF-8 sequence, which random bytes can keep up to the last cell.
            # The answer reached the end of the context: it ends the way
            # OpenAI ends such an answer, with finish_reason "length".
            sink.emit(_length_event(job, self.fingerprint, worker.spec.model_name))
        attempt.outcome = "completed"
        first = attempt.first_token_at or attempt.ended_at
        # The prompt's speed from what the worker really read, when it says:
        # a cache hit read in milliseconds would otherwise look like thousands
        # of tokens a second, and the next long prompt's deadline would follow.
        read, read_s = ((attempt.prompt_read, attempt.prompt_read_s) if attempt.prompt_read_s
                        else (job.prompt_tokens, first - attempt.started_at))
        self.speed.observe(attempt.tokens, attempt.ended_at - first, read, read_s)
        if attempt.drafted:
            self.drafts.observe(attempt.ended_at, attempt.drafted, attempt.draft_accepted or 0)
        if attempt.first_token_at is not None:
            self.busy_speeds.first_token.observe(job.prompt_tokens, attempt.first_token_at - attempt.started_at)
        if attempt.tokens >= 4 and attempt.ended_at > first:
            busy = mean_busy(first, attempt.ended_at, ((n.started_at, n.ended_at) for n in attempt.neighbours))
            self.busy_speeds.observe(busy, (attempt.tokens - 1) / (attempt.ended_at - first))
        return attempt

    def draft_acceptance(self) -> dict[str, Any]:
        """Speculative decoding's drafts on this path over the last minutes."""
        return self.drafts.summary(self._clock())

    def _enter_process(self, job_id: str, attempt: Attempt) -> None:
        """Count the attempt as inside its process, and introduce it to the
        attempts already there (see Attempt.shared_at_crash)."""
        for other in self._in_process.values():
            if other.worker_exits == attempt.worker_exits:
                other.neighbours.append(attempt)
                attempt.neighbours.append(other)
        self._in_process[job_id] = attempt

    async def _wait_loaded(self, job: Job, still_open: Callable[[], str | None]) -> None:
        """Wait for a loading GPU worker without starting it ourselves (a
        worker that was given away must stay unloaded): redirect if the
        path closes meanwhile, fail if it takes longer than a load may."""
        worker = self.worker
        # No longer than a load may take, nor than the client gave (X-Request-Timeout).
        limit_s = min(self._deadlines.ready_s, job.deadline_s or self._deadlines.ready_s)
        deadline = self._clock() + limit_s
        while self.out_reason() is not None:
            why_not = still_open()
            if why_not is not None:
                raise Redirected(why_not)
            if job.canceled.is_set():
                raise canceled_error(job, f"while the {self.path} worker was loading")
            if self._clock() >= deadline:
                raise JobFailed(503, "no_worker", f"the {self.path} worker did not finish loading in "
                                f"{limit_s:g} s", retry_after_s=30.0)
            with contextlib.suppress(asyncio.TimeoutError):
                await worker.wait_for_state(WorkerState.READY, timeout=0.25)

    async def _wait_ready(self, job: Job) -> None:
        worker = self.worker
        if self._failed_process is not None and self._failed_process == worker.exits:
            # The failed process is still on its way out: its replacement is the one to wait for.
            await worker.exit_after(self._failed_process, self._deadlines.ready_s)
        ready = asyncio.ensure_future(worker.ensure_ready(self._deadlines.ready_s))
        canceled = asyncio.ensure_future(job.canceled.wait())
        done, _ = await asyncio.wait({ready, canceled}, return_when=asyncio.FIRST_COMPLETED)
        canceled.cancel()
        if ready not in done:
            ready.cancel()
            raise canceled_error(job, f"while the {self.path} worker was starting")
        if not ready.result():
            raise JobFailed(503, "no_worker", f"the {self.path} worker is not available: "
                            f"{worker.gave_up or worker.unhealthy_reason or 'it did not become ready'}",
                            retry_after_s=30.0)


# ----- llama.cpp's answers -------------------------------------------------------------


class _WorkerRules(UpstreamRules):
    """How an attempt at a local worker ends without an answer: a broken or
    hung process is a WorkerFailure (replace it, maybe replay); an error for
    this input a WorkerRequestError or the client's JobFailed."""

    failure = WorkerFailure

    def __init__(self, backend: Backend) -> None:
        self._path = backend.path
        self.liveness = backend.worker.liveness_problem

    async def refused(self, response: UpstreamResponse, wait: Waiter, silent_s: Callable[[], float]) -> NoReturn:
        await _upstream_error(response)
        raise AssertionError("unreachable")

    def bad_event(self, message: str) -> NoReturn:
        _raise_upstream_failure(f"the worker {message}")
        raise AssertionError("unreachable")

    def hung(self, silent_s: float) -> Exception:
        return WorkerFailure(f"no output for {silent_s:g} s", hung=True)

    def broke(self, exc: Exception, attempt: Attempt) -> Exception | None:
        if not isinstance(exc, (httpx.TransportError, httpx.StreamError)):
            return None
        # Refused at connect: the request never reached the process, so it
        # can't be what killed it.
        attempt.reached_worker = not isinstance(exc, httpx.ConnectError)
        return WorkerFailure(f"connection to the {self._path} worker broke: {type(exc).__name__}: {exc}",
                             process_may_have_died=True)


async def _upstream_error(response: UpstreamResponse) -> None:
    message = await upstream_error_message(response)
    if 400 <= response.status_code < 500:
        raise JobFailed(response.status_code, "invalid_request", f"the model server rejected the request: {message}")
    _raise_upstream_failure(f"the worker answered HTTP {response.status_code}: {message or 'no detail'}")



# What llama.cpp logs when a decode finds no free KV cell: the context is full.
_CONTEXT_FULL_MARKS = ("llama_decode returned 1", "failed to find a memory slot", "failed to find free space in the KV")


def _context_was_full(log_lines: list[str]) -> bool:
    return any(mark in line for line in log_lines for mark in _CONTEXT_FULL_MARKS)



def _length_event(job: Job, fingerprint: str, model: str) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    if job.kind.value == "chat":
        choice["delta"] = {}
    else:
        choice["text"] = ""
    return {"id": response_id(job), "object": "chat.completion.chunk" if job.kind.value == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "system_fingerprint": fingerprint, "choices": [choice]}



def _raise_upstream_failure(message: str) -> None:
    if mentions_out_of_memory(message):
        raise WorkerFailure(message)
    if "validation error" in message:
        # llama-cpp-python answers 500 for a request it finds invalid.
        raise JobFailed(400, "invalid_request", f"the model server rejected the request: {message}")
    raise WorkerRequestError(message)

