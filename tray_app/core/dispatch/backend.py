"""One path a request can run on: its worker, its lane, its measured speed,
and how a request is streamed through it.

Everything that depends on talking to a llama.cpp server lives here: the
proxy, SSE parsing, liveness while waiting, upstream-error classification and
llama-cpp-python's quirks. The dispatcher decides *where* a request runs; a
backend only runs it and says how it ended, by returning or raising:

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
import json
import re
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, NoReturn, Protocol

import httpx

from ..engine.exits import ExitReport, is_input_crash, mentions_out_of_memory
from ..engine.handle import WorkerHandle
from ..engine.worker import WorkerState
from ..http_basics import SseLineTooLong, aiter_sse_lines
from .jobs import Attempt, Job, JobFailed, JobState, PathSpeed, WorkerFailure, WorkerRequestError
from .lanes import Lane, Redirected
from .latency import BusySpeeds, mean_busy

# How often a request that waits on a worker asks whether the process can
# still make progress at all (see Worker.liveness_problem).
LIVENESS_INTERVAL_S = 1.0
# After a connection breaks, how long to wait for the worker's exit status,
# which says whether the request crashed it (SIGSEGV) or something else did.
INPUT_CRASH_WAIT_S = 3.0
STREAM_END_EXIT_WAIT_S = 1.0
# The longest SSE line an upstream may send (an event with logprobs is a few KiB).
MAX_SSE_LINE_BYTES = 4 * 1024 * 1024


class Sink(Protocol):
    """Where a job's output goes. `emit` hands an event towards the client."""

    def emit(self, event: dict[str, Any]) -> None: ...

    def reset(self) -> None: ...


@dataclass(frozen=True)
class Deadlines:
    """How long a worker may stay silent before it counts as hung."""

    first_token_s: Callable[[Job], float]
    between_tokens_s: float
    ready_s: float  # how long a request waits for a starting worker


class Backend:
    def __init__(self, path: str, worker: WorkerHandle, lane: Lane, speed: PathSpeed, http: httpx.AsyncClient,
                 deadlines: Deadlines, *, fingerprint: str, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[], None] = lambda: None) -> None:
        self.path = path
        self.worker = worker
        self.lane = lane
        self.speed = speed
        # Decode speed by how many slots were busy: what the latency estimate uses.
        self.busy_speeds = BusySpeeds()
        self.fingerprint = fingerprint
        self._http = http
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
        job.path = self.path
        place = lane.join(job.id, front=job.replayed and self.path == "cpu")
        if place is not None:
            job.state = JobState.QUEUED
        self._on_change()
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
            raise canceled_error(job, f"while it waited in the {self.path} queue")
        job.queue_wait_s = acquire.result()
        try:
            why_not = still_open()
            if why_not is not None:
                raise Redirected(why_not)
            job.state = JobState.RUNNING
            self._on_change()
            return await self._stream(job, sink, still_open)
        except WorkerFailure:
            # Marked before the slot is freed: the next request in the lane
            # must not be sent to the process that just broke.
            self._failed_process = job.attempts[-1].worker_exits if job.attempts else self.worker.exits
            raise
        finally:
            lane.release(job.id)

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
        body = worker_body(job)
        first_timeout = self._deadlines.first_token_s(job)
        token_timeout = self._deadlines.between_tokens_s
        canceled = asyncio.ensure_future(job.canceled.wait())
        done_seen = False
        first_deadline = time.monotonic() + first_timeout

        async def from_worker(awaitable):
            result = await _wait_on_worker(awaitable, canceled, attempt.wait_limit_s(first_deadline, token_timeout),
                                           worker.liveness_problem)
            if result is _CANCELED:
                attempt.outcome = "canceled"
                raise canceled_error(job, "while it ran")
            return result

        def worker_error(message: str) -> NoReturn:
            _raise_upstream_failure(f"the worker {message}")
            raise AssertionError("unreachable")

        self._enter_process(job.id, attempt)
        try:
            request = self._http.build_request("POST", f"{worker.base_url}{job.kind.upstream_path}", json=body,
                                               headers=worker.auth_headers)
            response = await from_worker(self._http.send(request, stream=True))
            try:
                attempt.reached_worker = True
                if response.status_code >= 400:
                    await _upstream_error(response)
                done_seen = await relay_answer(response, job, attempt, sink, from_worker, fail=worker_error,
                                               model=worker.spec.model_name, fingerprint=self.fingerprint,
                                               clock=self._clock)
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
            raise WorkerFailure(f"connection to the {self.path} worker broke: {type(exc).__name__}: {exc}",
                                process_may_have_died=True) from None
        finally:
            canceled.cancel()
            attempt.ended_at = self._clock()
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
        self.speed.observe(attempt.tokens, attempt.ended_at - first, job.prompt_tokens, first - attempt.started_at)
        if attempt.tokens >= 4 and attempt.ended_at > first:
            busy = mean_busy(first, attempt.ended_at, ((n.started_at, n.ended_at) for n in attempt.neighbours))
            self.busy_speeds.observe(busy, (attempt.tokens - 1) / (attempt.ended_at - first))
        return attempt

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


# ----- the worker's wire format ------------------------------------------------------


async def sse_lines(response: Any) -> AsyncIterator[str]:
    """The lines of an upstream's SSE stream (see http_basics.SseLineSplitter),
    none longer than MAX_SSE_LINE_BYTES: an upstream (a peer, say) that never
    ends its line must not fill our memory."""
    try:
        async for line in aiter_sse_lines(response.aiter_bytes(), MAX_SSE_LINE_BYTES):
            yield line
    except SseLineTooLong as exc:
        raise httpx.RemoteProtocolError(str(exc)) from None


async def relay_answer(response: httpx.Response, job: Job, attempt: Attempt, sink: Sink,
                       wait: Callable[[Any], Awaitable[Any]], *, fail: Callable[[str], NoReturn], model: str,
                       fingerprint: str, clock: Callable[[], float]) -> bool:
    """Relay an upstream's streamed answer (a worker's or a peer's) to the
    sink, each event shaped as this server's, counting the tokens on the
    attempt. `wait` awaits each next line under the caller's deadlines and
    cancel; `fail(what)` raises the caller's failure for a bad or error
    event. Returns whether the stream ended with [DONE]."""
    named_tool_calls: set[tuple[int, int]] = set()
    lines = sse_lines(response)
    while True:
        line = await wait(lines.__anext__())
        if line is None:
            return False
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return True
        try:
            event = json.loads(data)
        except ValueError:
            fail("sent an event that is not JSON")
        if not isinstance(event, dict):
            fail("sent an event that is not a JSON object")
        if "error" in event:
            fail(f"reported an error: {event['error']}")
        choices = event.get("choices")
        if not choices:
            # llama-server's own usage chunk: the sink writes the usage of
            # the whole request (one execution) itself.
            continue
        if not isinstance(choices, list) or not all(
                isinstance(c, dict) and isinstance(c.get("delta", {}), dict) for c in choices):
            fail("sent an event whose choices are not OpenAI's shape")
        if shape_event(event, job, named_tool_calls, model=model, fingerprint=fingerprint):
            attempt.tokens += 1
            attempt.last_token_at = time.monotonic()
            if attempt.first_token_at is None:
                attempt.first_token_at = clock()
        sink.emit(event)


def shape_event(event: dict[str, Any], job: Job, named_tool_calls: set[tuple[int, int]], *, model: str,
                fingerprint: str) -> bool:
    """Make one streamed event of an upstream server (a worker, or a peer)
    what this server sends: its ids, its model name, OpenAI's shapes.
    Returns whether the event carries output (a token)."""
    # The upstream's per-request timings and usage are its business (the
    # sink writes the usage of the one execution), and the same answer
    # looks the same from any engine or server.
    event.pop("timings", None)
    event.pop("usage", None)
    _trim_logprobs(event, job.top_logprobs)
    _reasoning_as_reasoning_content(event)
    if job.forced_tool is not None:
        _as_forced_tool_call(event, job)
    carries = _carries_token(event)
    event["id"] = response_id(job)
    event["model"] = model
    event["system_fingerprint"] = fingerprint
    _drop_repeated_tool_names(event, named_tool_calls)
    return carries


def worker_body(job: Job) -> dict[str, Any]:
    body = dict(job.body)
    body.pop("model", None)
    # Always an explicit limit, the one admission planned with: the worker's
    # own default may be none at all, and it does not know the current API's
    # name max_completion_tokens.
    body.pop("max_completion_tokens", None)
    body["max_tokens"] = job.max_tokens
    # Always streamed from the worker: that gives cancellation, hang
    # detection, token metering and replay while nothing was sent.
    body["stream"] = True
    body.pop("stream_options", None)
    if job.top_logprobs is not None:
        # See _trim_logprobs: at least one, or llama-server sends none.
        key = "top_logprobs" if job.kind.value == "chat" else "logprobs"
        body[key] = max(1, job.top_logprobs)
    return body


async def upstream_error_message(response: httpx.Response) -> str:
    """An upstream's error answer as one client-safe line."""
    return upstream_error_text(await response.aread())


def upstream_error_text(raw: bytes) -> str:
    """An upstream's error body as one client-safe line."""
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = {}
    error = payload.get("error") if isinstance(payload, dict) else None
    message = (error or {}).get("message") if isinstance(error, dict) else None
    message = message or (payload.get("detail") if isinstance(payload, dict) else None) or raw.decode("utf-8", "replace")
    return client_safe(str(message))


async def _upstream_error(response: httpx.Response) -> None:
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


def _trim_logprobs(event: dict[str, Any], wanted: int | None) -> None:
    """Keep the alternatives the client asked for. llama-server returns 20
    when top_logprobs is absent and none at all for 0, so the worker is asked
    for at least one and the list is cut here (OpenAI's default is 0)."""
    if wanted is None:
        return
    for choice in event.get("choices") or ():
        logprobs = choice.get("logprobs")
        for token in (logprobs.get("content") or ()) if isinstance(logprobs, dict) else ():
            if isinstance(token, dict) and isinstance(token.get("top_logprobs"), list):
                del token["top_logprobs"][wanted:]


def _reasoning_as_reasoning_content(event: dict[str, Any]) -> None:
    """An upstream that streams the reasoning as `reasoning` (a peer with
    [server] reasoning_field = "reasoning", or vLLM) under llama-server's
    name, `reasoning_content`, which every sink reads."""
    for choice in event.get("choices") or ():
        delta = choice.get("delta")
        if isinstance(delta, dict) and isinstance(delta.get("reasoning"), str):
            text = delta.pop("reasoning")
            delta.setdefault("reasoning_content", text)


def _as_forced_tool_call(event: dict[str, Any], job: Job) -> None:
    """The constrained answer to a named tool_choice, as OpenAI streams a
    call: the arguments in fragments, the id and name in the first one only,
    and finish_reason "tool_calls". The id comes from the request id, so a
    replay names the call the same."""
    for choice in event.get("choices") or ():
        delta = choice.get("delta")
        if delta is None:
            continue
        text = delta.pop("content", None)
        if text:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if job.attempts and job.attempts[-1].tokens == 0:
                call.update(id=f"call_{job.id}", type="function")
                call["function"]["name"] = job.forced_tool
            delta["tool_calls"] = [call]
        if choice.get("finish_reason") == "stop":
            choice["finish_reason"] = "tool_calls"


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
        # A thinking model's reasoning is output too: without it, a model that
        # thinks for a while would look hung before its first answer token.
        if delta is not None and (delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
                                  or delta.get("function_call")):
            return True
        if choice.get("text"):
            return True
    return False


def response_id(job: Job) -> str:
    prefix = "chatcmpl" if job.kind.value == "chat" else "cmpl"
    return f"{prefix}-{job.id}"


def canceled_error(job: Job, where: str) -> JobFailed:
    return JobFailed(499, "request_canceled", f"request {job.id} was canceled {where}: {job.cancel_reason}")


# ----- waiting on a worker ---------------------------------------------------------------

_CANCELED = object()


async def _no_wait() -> float:
    return 0.0


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
