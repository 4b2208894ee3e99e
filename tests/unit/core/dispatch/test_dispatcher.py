"""The request path in-process: Dispatcher + Backend with fakes.

No model, no process, no network. Each backend keeps the real lane logic of
`Backend.run` (queue, cancel, redirect, still_open) and replaces only
`_stream`, the one place that talks to a worker, with a scripted coroutine.
Memory readings, the breaker's clock and the worker are fakes whose numbers
each test chooses.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import pytest

from tests.fakes.clock import FakeClock
from tests.fakes.worker import FakeWorker
from tray_app.core.api.idempotency import MAX_KEY_LENGTH, IdempotencyStore
from tray_app.core.dispatch.admission import Reason, Route
from tray_app.core.dispatch.backend import INPUT_CRASH_WAIT_S, Backend, Deadlines, canceled_error
from tray_app.core.dispatch.breaker import BreakerPolicy, BreakerState, CircuitBreaker
from tray_app.core.dispatch.dispatcher import Costs, Dispatcher, Limits
from tray_app.core.dispatch.jobs import (
    Attempt, Job, JobFailed, JobKind, JobRequest, JobState, PathSpeed, WorkerFailure, WorkerRequestError,
)
from tray_app.core.dispatch.lanes import Lane, Redirected
from tray_app.core.dispatch.quarantine import QUARANTINE_S
from tray_app.core.engine.exits import ExitKind, ExitReport
from tray_app.core.engine.worker import WorkerState
from tray_app.core.memory.telemetry import GpuDevice, GpuReading, HostReading, MemorySnapshot, UNKNOWN_GPU

GPU_N_CTX = 4096
CPU_N_CTX = 8192
RESERVE_MIB = 500.0
RAM_FLOOR_MIB = 1000.0
CPU_TOKENS_PER_S = 10.0
CPU_PROMPT_TOKENS_PER_S = 100.0
SIGSEGV = ExitReport(ExitKind.CRASH, -11, "SIGSEGV", None)
SIGKILL = ExitReport(ExitKind.CRASH, -9, "SIGKILL", None)
CHUNK = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}


# ----- fakes ---------------------------------------------------------------------------


Script = Callable[[Job, Any, Attempt], Awaitable[None]]


async def complete(job: Job, sink, attempt: Attempt) -> None:
    attempt.reached_worker = True
    sink.emit(dict(CHUNK))
    attempt.tokens += 1


class FakeBackend(Backend):
    """The real Backend, except the exchange with the worker is a script.
    `scripts[job.id]` wins over `script`, so tests can script each request."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.script: Script = complete
        self.scripts: dict[str, Script] = {}
        self.calls: list[str] = []

    async def _stream(self, job: Job, sink, still_open=lambda: None) -> Attempt:
        self.calls.append(job.id)
        attempt = Attempt(self.path, self._clock(), worker_exits=self.worker.exits)
        job.attempts.append(attempt)
        self._enter_process(job.id, attempt)
        try:
            await self.scripts.get(job.id, self.script)(job, sink, attempt)
        finally:
            self._in_process.pop(job.id, None)
        attempt.outcome = "completed"
        attempt.ended_at = self._clock()
        return attempt


class Events:
    def __init__(self) -> None:
        self.notes: list[tuple[str, dict]] = []
        self.changes = 0
        self.decisions: list[tuple[str, Route, Reason]] = []
        self.completions: list[tuple[str, str]] = []
        self.gpu_failures: list[tuple[str, str]] = []

    def note(self, kind: str, **data: Any) -> None:
        self.notes.append((kind, data))

    def changed(self) -> None:
        self.changes += 1

    def decided(self, job: Job, decision) -> None:
        self.decisions.append((job.id, decision.route, decision.reason))

    def completed(self, job: Job, attempt: Attempt) -> None:
        self.completions.append((job.id, attempt.path))

    def gpu_failed(self, job: Job, reason: str) -> None:
        self.gpu_failures.append((job.id, reason))

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.notes]


class FakeMemory:
    """Returns a MemorySnapshot with the numbers the test set."""

    def __init__(self, free_mib: float = 8000.0, host_mib: float = 16000.0) -> None:
        self.free_mib = free_mib
        self.host_mib = host_mib
        self.gpu_readable = True

    def __call__(self) -> MemorySnapshot:
        if self.gpu_readable:
            device = GpuDevice(index=0, name="fake", total_mib=10000.0, used_mib=10000.0 - self.free_mib,
                               free_mib=self.free_mib)
            gpu = GpuReading(available=True, simulated=False, devices=(device,))
        else:
            gpu = UNKNOWN_GPU("NVML stopped answering")
        host = HostReading(total_mib=32000.0, available_mib=self.host_mib, swap_total_mib=0.0, swap_used_mib=0.0)
        return MemorySnapshot(taken_at=0.0, gpu=gpu, host=host)


class Sink:
    """Records what reaches the client. `streaming` models a streaming client:
    the first emit commits the job, as the HTTP layer does."""

    def __init__(self, job: Job | None = None, streaming: bool = False) -> None:
        self.job = job
        self.streaming = streaming
        self.events: list[dict] = []
        self.resets = 0

    def emit(self, event: dict) -> None:
        self.events.append(event)
        if self.streaming and self.job is not None:
            self.job.committed = True

    def reset(self) -> None:
        self.resets += 1
        self.events.clear()

    def seam(self, note: dict) -> None:
        self.events.append({"seam": note})


@dataclass
class Rig:
    dispatcher: Dispatcher
    gpu: FakeBackend
    cpu: FakeBackend
    events: Events
    memory: FakeMemory
    clock: FakeClock
    breaker: CircuitBreaker


def make_backend(path: str, slots: int, queue: int, speed: PathSpeed, clock: FakeClock) -> FakeBackend:
    deadlines = Deadlines(first_token_s=lambda job: 30.0, between_tokens_s=10.0, ready_s=5.0)
    worker = FakeWorker(path, reject_stale_reports=True)
    return FakeBackend(path, worker, Lane(path, slots, queue, clock), speed, None, deadlines,
                       fingerprint="fp_test", clock=clock)


def make_rig(*, with_gpu: bool = True, gpu_slots: int = 1, gpu_queue: int = 2, cpu_slots: int = 1,
             cpu_queue: int = 2, threshold: int = 3, cooldown_s: float = 5.0) -> Rig:
    clock = FakeClock()
    events = Events()
    memory = FakeMemory()
    breaker = CircuitBreaker(BreakerPolicy(failure_threshold=threshold, window_s=60.0, cooldown_s=cooldown_s), clock)
    gpu = make_backend("gpu", gpu_slots, gpu_queue, PathSpeed(100.0, 1000.0), clock)
    cpu = make_backend("cpu", cpu_slots, cpu_queue, PathSpeed(CPU_TOKENS_PER_S, CPU_PROMPT_TOKENS_PER_S), clock)
    backends = {"gpu": gpu, "cpu": cpu} if with_gpu else {"cpu": cpu}
    dispatcher = Dispatcher(
        Limits(gpu_n_ctx=GPU_N_CTX, cpu_n_ctx=CPU_N_CTX, reserve_mib=RESERVE_MIB, ram_floor_mib=RAM_FLOOR_MIB),
        backends, breaker, memory,
        Costs(gpu_mib=lambda tokens: tokens * 1.0, cpu_mib=lambda tokens: tokens * 0.5),
        events, gpu_missing_reason=None if with_gpu else "no GPU in this machine", clock=clock,
    )
    return Rig(dispatcher, gpu, cpu, events, memory, clock, breaker)


@pytest.fixture
def rig() -> Rig:
    return make_rig()


def make_job(request_id: str = "req-1", *, prompt: int = 10, max_tokens: int = 10,
             kind: JobKind = JobKind.CHAT, fingerprint: str | None = None, **request: Any) -> Job:
    """A job whose request is this one; `request` sets its other fields (force_cpu=True, ...)."""
    return Job(JobRequest(id=request_id, kind=kind, body={"messages": [{"role": "user", "content": request_id}]},
                          stream=False, prompt_tokens=prompt, max_tokens=max_tokens,
                          fingerprint=fingerprint if fingerprint is not None else f"fp-{request_id}", **request))


async def run_job(rig: Rig, job: Job, sink: Sink | None = None) -> Sink:
    sink = sink or Sink(job)
    assert rig.dispatcher.register(job)
    await rig.dispatcher.run(job, sink)
    return sink


async def failed(rig: Rig, job: Job, sink: Sink | None = None) -> JobFailed:
    with pytest.raises(JobFailed) as caught:
        await run_job(rig, job, sink)
    return caught.value


def start(rig: Rig, job: Job, sink: Sink | None = None) -> asyncio.Task:
    assert rig.dispatcher.register(job)
    return asyncio.create_task(rig.dispatcher.run(job, sink or Sink(job)))


async def until(condition: Callable[[], bool], spins: int = 200) -> None:
    """Let the loop run until condition holds (bounded, no wall-clock waits)."""
    for _ in range(spins):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


class Gate:
    """A script that holds its slot until released, honouring a cancel the
    way the real stream does."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, job: Job, sink, attempt: Attempt) -> None:
        attempt.reached_worker = True
        self.started.set()
        released = asyncio.ensure_future(self.release.wait())
        canceled = asyncio.ensure_future(job.canceled.wait())
        await asyncio.wait({released, canceled}, return_when=asyncio.FIRST_COMPLETED)
        released.cancel()
        canceled.cancel()
        if job.canceled.is_set():
            raise canceled_error(job, "while it ran")
        sink.emit(dict(CHUNK))


def raising(exc: BaseException, *, emit_first: bool = False, reached: bool = True) -> Script:
    async def script(job: Job, sink, attempt: Attempt) -> None:
        attempt.reached_worker = reached
        if emit_first:
            sink.emit(dict(CHUNK))
        raise exc

    return script


def half_open(rig: Rig) -> None:
    rig.breaker.trip("a GPU failure before this test")
    rig.clock.now += 6  # past the 5 s cooldown: one probe allowed
    assert rig.breaker.state is BreakerState.HALF_OPEN


def probe_is_free(breaker: CircuitBreaker) -> bool:
    """True if a new request could become the probe, i.e. none is held."""
    taken = breaker.try_acquire()
    if taken:
        breaker.release_probe()
    return taken


def lanes_empty(rig: Rig) -> bool:
    return not (rig.gpu.lane.running_ids or rig.gpu.lane.waiting_ids
                or rig.cpu.lane.running_ids or rig.cpu.lane.waiting_ids)


async def hold_the_gpu_and_queue_one(rig):
    """A request holds the only GPU slot (until gate.release) and a second waits in the GPU queue."""
    gate = Gate()
    rig.gpu.scripts["holder"] = gate
    holder = start(rig, make_job("holder"))
    await gate.started.wait()
    waiter = make_job("waiter")
    task = start(rig, waiter)
    await until(lambda: rig.gpu.lane.waiting_ids == ["waiter"])
    return gate, holder, waiter, task


# ----- the happy path and the execution ledger ------------------------------------------------


async def test_admitted_to_gpu_completes_once_and_unregisters(rig):
    job = make_job()
    sink = await run_job(rig, job)
    assert rig.events.decisions == [("req-1", Route.GPU, Reason.ADMITTED)]
    assert rig.events.completions == [("req-1", "gpu")]
    assert rig.gpu.calls == ["req-1"] and rig.cpu.calls == []
    assert rig.dispatcher.completed_total == 1 and rig.dispatcher.duplicate_executions == 0
    assert rig.dispatcher.ledger.counts == {"req-1": 1}
    assert "req-1" not in rig.dispatcher.jobs and job.state is JobState.DONE
    assert sink.events == [CHUNK] and sink.resets == 0
    assert lanes_empty(rig) and rig.events.changes >= 1
    assert rig.dispatcher.recent[-1]["route"] == "gpu"


async def test_duplicate_id_is_refused_while_the_first_lives(rig):
    first, twin = make_job("same"), make_job("same")
    assert rig.dispatcher.register(first)
    assert rig.dispatcher.register(twin) is False
    assert rig.dispatcher.jobs["same"] is first
    rig.dispatcher.unregister(twin)  # a twin's unregister must not free the first's id
    assert rig.dispatcher.jobs["same"] is first
    await rig.dispatcher.run(first, Sink(first))
    assert rig.dispatcher.register(make_job("same"))  # free again once the first ended


async def test_ledger_counts_a_second_execution_of_one_id_as_a_duplicate(rig):
    await run_job(rig, make_job("again"))
    await run_job(rig, make_job("again"))
    assert rig.dispatcher.completed_total == 2
    assert rig.dispatcher.duplicate_executions == 1
    assert rig.dispatcher.ledger.counts["again"] == 2


# ----- GPU failure: replay, commit, CPU failure, request errors -------------------------------


async def test_gpu_failure_before_the_first_byte_is_replayed_once_on_cpu(rig):
    rig.gpu.script = raising(WorkerFailure("CUDA error: out of memory"))
    job = make_job()
    sink = await run_job(rig, job)
    assert rig.gpu.calls == ["req-1"] and rig.cpu.calls == ["req-1"]
    assert job.replayed and job.reason is Reason.GPU_FAILED_REPLAYED and job.path == "cpu"
    assert sink.resets == 1 and sink.events == [CHUNK]
    assert "replay" in rig.events.kinds() and "gpu_failure" in rig.events.kinds()
    assert rig.gpu.worker.failures == ["CUDA error: out of memory"]
    assert rig.events.gpu_failures == [("req-1", "CUDA error: out of memory")]
    assert rig.events.completions == [("req-1", "cpu")]
    assert rig.dispatcher.completed_total == 1 and rig.dispatcher.duplicate_executions == 0
    assert job.first_failure == "CUDA error: out of memory"
    assert rig.breaker.snapshot()["recent_failures"] == 1
    # The failed process gets no more work until it is replaced.
    assert "being replaced" in rig.dispatcher.gpu_out_reason()


async def test_partial_output_to_a_buffering_client_is_discarded_and_replayed(rig):
    rig.gpu.script = raising(WorkerFailure("connection reset"), emit_first=True)
    rig.cpu.script = complete
    job = make_job()
    sink = await run_job(rig, job, Sink(job, streaming=False))
    assert sink.resets == 1 and sink.events == [CHUNK]  # only the CPU's answer is left
    assert rig.cpu.calls == ["req-1"]


async def test_mid_stream_gpu_failure_after_bytes_were_sent_is_not_replayed(rig):
    rig.gpu.script = raising(WorkerFailure("connection reset"), emit_first=True)
    job = make_job()
    error = await failed(rig, job, Sink(job, streaming=True))
    assert (error.status, error.code) == (502, "gpu_worker_failed")
    assert rig.cpu.calls == [] and not job.replayed
    assert rig.gpu.worker.failures == ["connection reset"]
    assert rig.events.gpu_failures == [("req-1", "connection reset")]
    assert rig.dispatcher.completed_total == 0 and "req-1" not in rig.dispatcher.jobs


async def test_cpu_failure_is_a_502_and_does_not_touch_the_breaker(rig):
    rig.cpu.script = raising(WorkerFailure("connection reset"))
    job = make_job(force_cpu=True)
    error = await failed(rig, job)
    assert (error.status, error.code) == (502, "cpu_worker_failed")
    assert rig.cpu.worker.failures == ["connection reset"] and rig.gpu.calls == []
    assert "cpu_failure" in rig.events.kinds()
    assert rig.breaker.snapshot()["recent_failures"] == 0
    assert job.first_failure == "connection reset"


async def test_a_replay_that_fails_on_cpu_too_is_not_run_a_third_time(rig):
    rig.gpu.script = raising(WorkerFailure("gpu broke"))
    rig.cpu.script = raising(WorkerFailure("cpu broke"))
    job = make_job()
    error = await failed(rig, job)
    assert (error.status, error.code) == (502, "cpu_worker_failed")
    assert rig.gpu.calls == ["req-1"] and rig.cpu.calls == ["req-1"]
    assert job.first_failure == "gpu broke"  # the first cause is the one kept


async def test_replay_refused_when_the_cpu_worker_is_down(rig):
    rig.gpu.script = raising(WorkerFailure("gpu broke"))
    rig.cpu.worker.gave_up = "the CPU worker crashed 5 times"
    job = make_job()
    error = await failed(rig, job)
    assert (error.status, error.code) == (503, "no_worker")
    assert rig.cpu.calls == [] and job.replayed


async def test_worker_request_error_is_a_502_without_replay(rig):
    rig.gpu.script = raising(WorkerRequestError("the server raised for this input"))
    error = await failed(rig, make_job())
    assert (error.status, error.code) == (502, "worker_error")
    assert rig.cpu.calls == [] and rig.gpu.worker.failures == []
    assert rig.breaker.snapshot()["recent_failures"] == 0
    assert rig.dispatcher.gpu_out_reason() is None  # the worker stays in service


async def test_client_error_from_the_worker_reaches_the_client_as_is(rig):
    rig.gpu.script = raising(JobFailed(400, "invalid_request", "the model server rejected the request"))
    error = await failed(rig, make_job())
    assert (error.status, error.code) == (400, "invalid_request")
    assert rig.cpu.calls == [] and rig.gpu.worker.failures == []


# ----- the half-open probe ----------------------------------------------------------------------


async def test_probe_released_when_canceled_while_running(rig):
    half_open(rig)
    gate = Gate()
    rig.gpu.script = gate
    job = make_job()
    task = start(rig, job)
    await gate.started.wait()
    assert job.half_open_probe and not probe_is_free(rig.breaker)
    assert rig.dispatcher.cancel("req-1", "the client disconnected")["state_was"] == "running"
    with pytest.raises(JobFailed) as caught:
        await task
    assert caught.value.code == "request_canceled"
    assert probe_is_free(rig.breaker) and rig.breaker.state is BreakerState.HALF_OPEN
    assert lanes_empty(rig)


async def test_probe_released_when_canceled_while_queued(rig):
    gate = Gate()
    rig.gpu.scripts["holder"] = gate
    holder = start(rig, make_job("holder"))  # breaker closed: an ordinary request
    await gate.started.wait()
    half_open(rig)
    probe = make_job("probe")
    task = start(rig, probe)
    await until(lambda: rig.gpu.lane.waiting_ids == ["probe"])
    assert probe.half_open_probe and probe.decision.route is Route.GPU_QUEUE
    assert not probe_is_free(rig.breaker)
    assert rig.dispatcher.cancel("probe", "canceled by the test")["state_was"] == "queued"
    with pytest.raises(JobFailed) as caught:
        await task
    assert caught.value.code == "request_canceled"
    assert probe_is_free(rig.breaker)
    assert rig.gpu.lane.waiting_ids == [] and rig.gpu.calls == ["holder"]
    gate.release.set()
    await holder


async def test_probe_released_on_a_client_error_from_the_worker(rig):
    half_open(rig)
    rig.gpu.script = raising(JobFailed(400, "invalid_request", "rejected"))
    await failed(rig, make_job())
    assert probe_is_free(rig.breaker) and rig.breaker.state is BreakerState.HALF_OPEN


async def test_probe_released_when_redirected_after_it_was_taken(rig):
    half_open(rig)
    rig.gpu.script = raising(Redirected("the GPU worker is restarting"))
    job = make_job()
    await run_job(rig, job)
    assert job.path == "cpu" and job.reason is Reason.GPU_UNAVAILABLE
    assert job.reason_detail == "the GPU worker is restarting"
    assert rig.cpu.calls == ["req-1"]
    assert probe_is_free(rig.breaker) and rig.breaker.state is BreakerState.HALF_OPEN


async def test_a_redirected_job_running_on_cpu_does_not_hold_the_probe(rig):
    half_open(rig)
    rig.gpu.script = raising(Redirected("the GPU worker is restarting"))
    gate = Gate()
    rig.cpu.script = gate
    task = start(rig, make_job())
    await gate.started.wait()
    try:
        assert probe_is_free(rig.breaker)
    finally:
        gate.release.set()
        await task


async def test_probe_released_on_an_unexpected_exception(rig):
    half_open(rig)
    rig.gpu.script = raising(RuntimeError("a bug"))
    job = make_job()
    with pytest.raises(RuntimeError, match="a bug"):
        await run_job(rig, job)
    assert probe_is_free(rig.breaker)
    assert lanes_empty(rig) and "req-1" not in rig.dispatcher.jobs


async def test_probe_released_on_a_worker_request_error(rig):
    half_open(rig)
    rig.gpu.script = raising(WorkerRequestError("the server raised for this input"))
    error = await failed(rig, make_job())
    assert error.code == "worker_error"
    assert probe_is_free(rig.breaker) and rig.breaker.state is BreakerState.HALF_OPEN


async def test_probe_released_when_the_task_itself_is_cancelled(rig):
    half_open(rig)
    gate = Gate()
    rig.gpu.script = gate
    task = start(rig, make_job())
    await gate.started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert probe_is_free(rig.breaker) and lanes_empty(rig) and rig.dispatcher.jobs == {}


async def test_a_failed_probe_reopens_the_breaker_and_replays_on_cpu(rig):
    half_open(rig)
    rig.gpu.script = raising(WorkerFailure("CUDA error: out of memory"))
    job = make_job()
    await run_job(rig, job)
    assert rig.breaker.state is BreakerState.OPEN
    assert job.reason is Reason.GPU_FAILED_REPLAYED and rig.cpu.calls == ["req-1"]
    assert not job.half_open_probe


async def test_a_successful_probe_closes_the_breaker(rig):
    half_open(rig)
    job = make_job()
    await run_job(rig, job)
    assert rig.gpu.calls == ["req-1"]
    assert rig.breaker.state is BreakerState.CLOSED and not job.half_open_probe


async def test_while_the_probe_runs_other_requests_go_to_cpu(rig):
    half_open(rig)
    gate = Gate()
    rig.gpu.scripts["probe"] = gate
    probe = start(rig, make_job("probe"))
    await gate.started.wait()
    other = make_job("other")
    await run_job(rig, other)
    assert other.path == "cpu" and other.reason is Reason.GPU_UNAVAILABLE
    assert "probe" in other.reason_detail
    gate.release.set()
    await probe
    assert rig.breaker.state is BreakerState.CLOSED


async def test_open_breaker_sends_requests_to_cpu_with_its_reason(rig):
    rig.breaker.trip("three GPU failures")
    job = make_job()
    await run_job(rig, job)
    assert job.reason is Reason.GPU_UNAVAILABLE and "circuit breaker is open" in job.reason_detail
    assert rig.gpu.calls == []


# ----- cancel ------------------------------------------------------------------------------------


async def test_cancel_while_queued_leaves_an_empty_queue(rig):
    gate, holder, waiter, task = await hold_the_gpu_and_queue_one(rig)
    row = {r["id"]: r for r in rig.dispatcher.request_status()}["waiter"]
    assert row["state"] == "queued" and row["queue_position"] == 1
    assert rig.dispatcher.cancel("waiter", "the client went away") == {
        "id": "waiter", "object": "request.cancel", "canceled": True, "state_was": "queued"}
    with pytest.raises(JobFailed) as caught:
        await task
    assert (caught.value.status, caught.value.code) == (499, "request_canceled")
    assert "queue" in caught.value.message
    assert rig.gpu.lane.waiting_ids == [] and rig.gpu.lane.running_ids == ["holder"]
    assert rig.gpu.calls == ["holder"] and rig.cpu.calls == []
    gate.release.set()
    await holder
    assert lanes_empty(rig)


async def test_cancel_while_running_frees_the_slot(rig):
    gate = Gate()
    rig.gpu.script = gate
    job = make_job()
    task = start(rig, job)
    await gate.started.wait()
    assert rig.dispatcher.cancel("req-1", "stop")["state_was"] == "running"
    with pytest.raises(JobFailed) as caught:
        await task
    assert (caught.value.status, caught.value.code) == (499, "request_canceled")
    assert lanes_empty(rig) and rig.dispatcher.completed_total == 0
    assert rig.dispatcher.cancel("req-1", "again") is None  # gone once done
    assert rig.dispatcher.cancel("no-such-id", "stop") is None


async def test_cancel_all_cancels_every_live_request(rig):
    gate = Gate()
    rig.gpu.script = gate
    tasks = [start(rig, make_job("a")), start(rig, make_job("b"))]
    await until(lambda: rig.gpu.lane.waiting_ids == ["b"])
    rig.dispatcher.cancel_all("shutting down")
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert [getattr(r, "code", r) for r in results] == ["request_canceled"] * 2
    assert lanes_empty(rig)


# ----- admission: refusals and the CPU path -----------------------------------------------------


async def test_deadline_too_short_for_the_cpu_is_refused_when_the_gpu_is_out(rig):
    rig.gpu.worker.state = WorkerState.UNHEALTHY
    job = make_job(prompt=100, max_tokens=100, deadline_s=5.0)  # CPU: 100/10 + 100/100 = 11 s
    error = await failed(rig, job)
    assert (error.status, error.code) == (503, "deadline_too_short")
    assert error.retry_after_s == 1.0  # nothing ahead in the CPU lane
    assert job.estimated_latency_s == 11.0
    assert rig.gpu.calls == [] and rig.cpu.calls == []


async def test_a_long_enough_deadline_runs_on_cpu(rig):
    rig.gpu.worker.state = WorkerState.UNHEALTHY
    job = make_job(prompt=100, max_tokens=100, deadline_s=11.0)
    await run_job(rig, job)
    assert rig.cpu.calls == ["req-1"] and job.reason is Reason.GPU_UNAVAILABLE


async def test_deadline_does_not_apply_to_the_gpu_path(rig):
    job = make_job(prompt=100, max_tokens=100, deadline_s=0.5)
    await run_job(rig, job)
    assert rig.gpu.calls == ["req-1"] and job.reason is Reason.ADMITTED


async def test_cpu_queue_full_is_a_503_with_retry_after_from_the_backlog():
    rig = make_rig(cpu_slots=1, cpu_queue=1)
    rig.dispatcher.set_gpu_paused(True)
    gate = Gate()
    rig.cpu.script = gate
    running, queued = start(rig, make_job("running")), start(rig, make_job("queued"))
    await gate.started.wait()
    assert rig.cpu.lane.waiting_ids == ["queued"]
    # Each takes 10/10 + 10/100 = 1.1 s; the clock stands still, so 2.2 s of backlog.
    assert rig.dispatcher.cpu_wait_s(10, 10) == pytest.approx(3.3)
    refused = make_job("refused")
    error = await failed(rig, refused)
    assert (error.status, error.code) == (503, "cpu_queue_full")
    assert error.retry_after_s == 3.0
    assert rig.cpu.calls == ["running"]
    gate.release.set()
    await asyncio.gather(running, queued)
    assert rig.cpu.calls == ["running", "queued"]


async def test_prompt_over_every_context_is_a_400(rig):
    job = make_job(prompt=CPU_N_CTX, max_tokens=1)
    error = await failed(rig, job)
    assert (error.status, error.code) == (400, "context_length_exceeded")
    assert rig.events.decisions == [("req-1", Route.REJECT, Reason.CONTEXT_LENGTH_EXCEEDED)]
    assert rig.gpu.calls == [] and rig.cpu.calls == [] and rig.dispatcher.jobs == {}


async def test_over_the_gpu_context_runs_on_cpu(rig):
    job = make_job(prompt=GPU_N_CTX, max_tokens=100)
    await run_job(rig, job)
    assert job.reason is Reason.GPU_CONTEXT_CAP and rig.cpu.calls == ["req-1"]


async def test_vram_headroom_short_runs_on_cpu(rig):
    rig.memory.free_mib = RESERVE_MIB + 19  # the request needs 20 MiB above the reserve
    job = make_job()
    await run_job(rig, job)
    assert job.reason is Reason.GPU_VRAM_HEADROOM and rig.cpu.calls == ["req-1"]
    assert rig.gpu.calls == []


async def test_vram_headroom_just_enough_runs_on_gpu(rig):
    rig.memory.free_mib = RESERVE_MIB + 20
    job = make_job()
    await run_job(rig, job)
    assert job.reason is Reason.ADMITTED and rig.gpu.calls == ["req-1"]


async def test_unknown_vram_is_gpu_unavailable(rig):
    rig.memory.gpu_readable = False
    job = make_job()
    await run_job(rig, job)
    assert job.reason is Reason.GPU_UNAVAILABLE and "can't be read" in job.reason_detail
    assert "NVML stopped answering" in job.reason_detail
    assert rig.cpu.calls == ["req-1"] and rig.gpu.calls == []


async def test_ram_floor_refuses_the_cpu_path(rig):
    rig.gpu.worker.state = WorkerState.STARTING
    rig.memory.host_mib = RAM_FLOOR_MIB + 9  # the request needs 10 MiB of RAM
    error = await failed(rig, make_job())
    assert (error.status, error.code) == (503, "ram_floor")
    assert rig.cpu.calls == []


async def test_gpu_busy_with_a_full_queue_spills_to_cpu():
    rig = make_rig(gpu_slots=1, gpu_queue=1, cpu_slots=2)
    gate = Gate()
    rig.gpu.script = gate
    tasks = [start(rig, make_job("running")), start(rig, make_job("queued"))]
    await until(lambda: rig.gpu.lane.waiting_ids == ["queued"])
    spilled = make_job("spilled")
    await run_job(rig, spilled)
    assert spilled.reason is Reason.GPU_BUSY and rig.cpu.calls == ["spilled"]
    gate.release.set()
    await asyncio.gather(*tasks)
    assert rig.gpu.calls == ["running", "queued"]


async def test_no_gpu_configured_runs_on_cpu_with_the_reason():
    rig = make_rig(with_gpu=False)
    job = make_job()
    await run_job(rig, job)
    assert job.reason is Reason.CPU_ONLY and rig.cpu.calls == ["req-1"]
    assert rig.dispatcher.gpu_out_reason() == "no GPU in this machine"
    assert rig.dispatcher.redirect_gpu_waiting("anything") == 0


async def test_forced_cpu_by_the_client(rig):
    job = make_job(force_cpu=True)
    await run_job(rig, job)
    assert job.reason is Reason.FORCED_CPU and rig.cpu.calls == ["req-1"] and rig.gpu.calls == []


async def test_paused_gpu_forces_cpu_and_redirects_gpu_waiters(rig):
    gate, holder, waiter, task = await hold_the_gpu_and_queue_one(rig)
    rig.dispatcher.set_gpu_paused(True)
    await task
    assert waiter.reason is Reason.FORCED_CPU and rig.cpu.calls == ["waiter"]
    assert "paused" in rig.dispatcher.gpu_out_reason()
    later = make_job("later")
    await run_job(rig, later)
    assert later.reason is Reason.FORCED_CPU
    rig.dispatcher.set_gpu_paused(False)
    assert rig.dispatcher.gpu_out_reason() is None
    gate.release.set()
    await holder


# ----- redirects ----------------------------------------------------------------------------------


async def test_worker_dying_while_a_job_waits_redirects_it_before_it_runs(rig):
    gate, holder, waiter, task = await hold_the_gpu_and_queue_one(rig)
    assert waiter.decision.route is Route.GPU_QUEUE
    rig.gpu.worker.state = WorkerState.UNHEALTHY
    rig.gpu.worker.unhealthy_reason = "lost the device"
    gate.release.set()  # the holder ends and hands its slot to the waiter
    await asyncio.gather(holder, task)
    assert rig.gpu.calls == ["holder"] and rig.cpu.calls == ["waiter"]
    assert waiter.reason is Reason.GPU_UNAVAILABLE
    assert waiter.reason_detail == "the GPU worker is unhealthy: lost the device"
    assert lanes_empty(rig)


async def test_redirect_gpu_waiting_sends_the_waiter_to_cpu(rig):
    gate, holder, waiter, task = await hold_the_gpu_and_queue_one(rig)
    assert rig.dispatcher.redirect_gpu_waiting("the GPU worker failed") == 1
    await task
    assert rig.cpu.calls == ["waiter"] and waiter.path == "cpu"
    assert (waiter.reason, waiter.reason_detail) == (Reason.GPU_UNAVAILABLE, "the GPU worker failed")
    gate.release.set()
    await holder
    assert rig.gpu.calls == ["holder"]


async def test_a_gpu_failure_sends_every_waiter_to_cpu_and_replays_the_failed_job():
    rig = make_rig(gpu_queue=2, cpu_slots=3)
    failing = asyncio.Event()

    async def fail_when_told(job, sink, attempt):
        await failing.wait()
        raise WorkerFailure("CUDA error: device lost")

    rig.gpu.scripts["holder"] = fail_when_told
    jobs = [make_job("holder"), make_job("w1"), make_job("w2")]
    tasks = [start(rig, job) for job in jobs]
    await until(lambda: rig.gpu.lane.waiting_ids == ["w1", "w2"] and rig.gpu.calls == ["holder"])
    failing.set()
    await asyncio.gather(*tasks)
    assert rig.gpu.calls == ["holder"] and sorted(rig.cpu.calls) == ["holder", "w1", "w2"]
    assert [job.reason for job in jobs] == [Reason.GPU_FAILED_REPLAYED, Reason.GPU_UNAVAILABLE,
                                            Reason.GPU_UNAVAILABLE]
    # w1 was handed the failed holder's slot and turned away by still_open; w2 by the redirect.
    assert [data["redirected"] for kind, data in rig.events.notes if kind == "gpu_failure"] == [1]
    assert rig.dispatcher.completed_total == 3 and rig.dispatcher.duplicate_executions == 0
    assert lanes_empty(rig)


async def test_a_waiter_is_not_sent_to_a_gpu_worker_whose_connection_just_broke(rig):
    failing = asyncio.Event()

    async def fail_when_told(job, sink, attempt):
        attempt.reached_worker = True
        await failing.wait()
        raise WorkerFailure("connection broke", process_may_have_died=True)

    rig.gpu.scripts["holder"] = fail_when_told
    rig.gpu.worker.exit_gate = asyncio.Event()  # the exit status takes a moment to show
    tasks = [start(rig, make_job("holder")), start(rig, make_job("waiter"))]
    await until(lambda: rig.gpu.lane.waiting_ids == ["waiter"] and rig.gpu.calls == ["holder"])
    failing.set()
    await until(lambda: rig.gpu.worker.exit_after_calls != [])
    for _ in range(20):
        await asyncio.sleep(0)
    try:
        assert rig.gpu.calls == ["holder"]
    finally:
        rig.gpu.worker.exit_gate.set()
        await asyncio.gather(*tasks)


# ----- a request that crashes its worker --------------------------------------------------------


async def test_input_crash_is_quarantined_not_replayed(rig):
    rig.gpu.script = raising(WorkerFailure("connection broke", process_may_have_died=True), reached=True)
    rig.gpu.worker.exit_report = SIGSEGV
    job = make_job(fingerprint="fp-crasher")
    error = await failed(rig, job)
    assert (error.status, error.code) == (400, "request_crashed_worker")
    assert rig.cpu.calls == [] and not job.replayed
    assert rig.gpu.worker.exit_after_calls == [(0, INPUT_CRASH_WAIT_S)]
    assert rig.breaker.snapshot()["recent_failures"] == 0 and rig.events.gpu_failures == []
    assert "request_crashed_worker" in rig.events.kinds()
    twin = rig.dispatcher.quarantined(make_job("twin", fingerprint="fp-crasher"))
    assert twin is not None and (twin.status, twin.code) == (400, "request_crashed_worker")
    assert "twin" in twin.message and "SIGSEGV" in twin.message
    assert rig.dispatcher.quarantined(make_job("other", fingerprint="fp-other")) is None
    rig.clock.now += QUARANTINE_S
    assert rig.dispatcher.quarantined(make_job("later", fingerprint="fp-crasher")) is None


ASSERT_ABORT = ExitReport(ExitKind.CRASH, -6, "SIGABRT",
                          'sampling.cpp:254: GGML_ASSERT(false && "unknown trigger type") failed')
PLAIN_ABORT = ExitReport(ExitKind.CRASH, -6, "SIGABRT", None)


async def test_an_abort_on_a_failed_assert_is_quarantined_not_replayed(rig):
    """The GGML_ASSERT a request field reached kills the CPU worker the same
    way: no replay."""
    rig.gpu.script = raising(WorkerFailure("connection broke", process_may_have_died=True), reached=True)
    rig.gpu.worker.exit_report = ASSERT_ABORT
    error = await failed(rig, make_job(fingerprint="fp-assert"))
    assert error.code == "request_crashed_worker" and "SIGABRT" in error.message
    assert rig.cpu.calls == []


async def test_an_abort_without_a_failed_check_is_the_gpus_and_replayed(rig):
    """A SIGABRT from outside (the drill, a lost device) is not the request's."""
    rig.gpu.script = raising(WorkerFailure("connection broke", process_may_have_died=True), reached=True)
    rig.gpu.worker.exit_report = PLAIN_ABORT
    job = make_job(fingerprint="fp-abort")
    await run_job(rig, job)
    assert job.replayed and rig.cpu.calls == [job.id]


async def test_a_request_that_hangs_the_gpu_twice_is_quarantined(rig):
    """An agent's long first prompt, taken for a hang, killed the GPU worker
    once per client retry, nine times. The first hang is replayed; the same
    request hanging it again is kept out, as a crash is."""
    # A worker whose owner replaces it after a failure, as a real one's does.
    rig.gpu.worker = FakeWorker("gpu", live=True)
    rig.gpu.script = raising(WorkerFailure("no output for 17 s", hung=True), reached=True)
    first = make_job("hang-1", fingerprint="fp-long-prompt")
    await run_job(rig, first)
    assert first.replayed and rig.cpu.calls == ["hang-1"]
    await rig.gpu.worker.wait_for_state(WorkerState.READY, timeout=5)
    error = await failed(rig, make_job("hang-2", fingerprint="fp-long-prompt"))
    assert (error.status, error.code) == (400, "request_crashed_worker") and "silent" in error.message
    assert rig.cpu.calls == ["hang-1"]
    assert rig.dispatcher.quarantined(make_job("hang-3", fingerprint="fp-long-prompt")) is not None
    # Another request's single hang is only replayed.
    await rig.gpu.worker.wait_for_state(WorkerState.READY, timeout=5)
    other = make_job("other", fingerprint="fp-other")
    await run_job(rig, other)
    assert other.replayed


async def test_input_crash_on_cpu_is_quarantined_too(rig):
    rig.cpu.script = raising(WorkerFailure("connection broke", process_may_have_died=True))
    rig.cpu.worker.exit_report = SIGSEGV
    job = make_job(fingerprint="fp-crasher", force_cpu=True)
    error = await failed(rig, job)
    assert error.code == "request_crashed_worker"
    assert "cpu" in error.message and rig.cpu.worker.failures == []


async def test_refused_at_connect_is_replayed_without_asking_how_the_worker_died(rig):
    rig.gpu.script = raising(WorkerFailure("connect refused", process_may_have_died=True), reached=False)
    rig.gpu.worker.exit_report = SIGSEGV
    job = make_job(fingerprint="fp-innocent")
    await run_job(rig, job)
    assert rig.cpu.calls == ["req-1"] and job.reason is Reason.GPU_FAILED_REPLAYED
    assert rig.gpu.worker.exit_after_calls == []
    assert rig.dispatcher.quarantined(job) is None


async def test_a_crash_with_other_requests_in_the_batch_is_pinned_on_none_of_them():
    # llama-server decodes its slots together: when it segfaults, any of the
    # requests inside may be the cause, so each is replayed like any other
    # GPU failure, and none is quarantined.
    rig = make_rig(gpu_slots=2)
    rig.gpu.worker.exit_report = SIGSEGV
    crash = asyncio.Event()

    async def batched_then_crash(job: Job, sink, attempt: Attempt) -> None:
        attempt.reached_worker = True
        await crash.wait()
        raise WorkerFailure("connection broke", process_may_have_died=True)

    rig.gpu.script = batched_then_crash
    first, second = make_job("a", fingerprint="fp-a"), make_job("b", fingerprint="fp-b")
    tasks = [start(rig, first), start(rig, second)]
    await until(lambda: len(rig.gpu._in_process) == 2)
    crash.set()
    await asyncio.gather(*tasks)
    assert sorted(rig.cpu.calls) == ["a", "b"] and first.replayed and second.replayed
    assert rig.dispatcher.quarantined(first) is None and rig.dispatcher.quarantined(second) is None
    assert "request_crashed_worker" not in rig.events.kinds()


async def test_a_neighbour_that_finished_before_the_crash_does_not_shield_the_request():
    rig = make_rig(gpu_slots=2)
    rig.gpu.worker.exit_report = SIGSEGV
    crash = asyncio.Event()

    async def short(job: Job, sink, attempt: Attempt) -> None:
        attempt.reached_worker = True
        await complete(job, sink, attempt)

    async def crashes_later(job: Job, sink, attempt: Attempt) -> None:
        attempt.reached_worker = True
        await crash.wait()
        raise WorkerFailure("connection broke", process_may_have_died=True)

    rig.gpu.scripts = {"neighbour": short, "poison": crashes_later}
    poison = start(rig, make_job("poison", fingerprint="fp-poison"))
    await until(lambda: "poison" in rig.gpu._in_process)
    neighbour = make_job("neighbour")
    await run_job(rig, neighbour)
    # They overlapped in the process, but the neighbour was done before the crash.
    assert neighbour.attempts[-1] in rig.gpu._in_process["poison"].neighbours
    crash.set()
    with pytest.raises(JobFailed) as caught:
        await poison
    assert caught.value.code == "request_crashed_worker"


async def test_a_crash_alone_in_the_process_is_still_pinned_on_its_request():
    rig = make_rig(gpu_slots=2)
    rig.gpu.script = raising(WorkerFailure("connection broke", process_may_have_died=True))
    rig.gpu.worker.exit_report = SIGSEGV
    error = await failed(rig, make_job("alone", fingerprint="fp-alone"))
    assert error.code == "request_crashed_worker"


async def test_a_worker_killed_by_the_oom_killer_is_not_an_input_crash(rig):
    rig.gpu.script = raising(WorkerFailure("connection broke", process_may_have_died=True))
    rig.gpu.worker.exit_report = SIGKILL
    job = make_job()
    await run_job(rig, job)
    assert rig.gpu.worker.exit_after_calls == [(0, INPUT_CRASH_WAIT_S)]
    assert rig.cpu.calls == ["req-1"] and rig.dispatcher.quarantined(job) is None
    assert rig.breaker.snapshot()["recent_failures"] == 1


# ----- degraded mode, token limits ------------------------------------------------------------


async def test_degraded_cause_is_none_when_healthy(rig):
    assert rig.dispatcher.degraded_cause() is None
    assert rig.dispatcher.gpu_out_reason() is None


async def test_degraded_cause_says_why_the_gpu_is_out(rig):
    rig.gpu.worker.state = WorkerState.UNHEALTHY
    rig.gpu.worker.unhealthy_reason = "lost the device"
    assert rig.dispatcher.degraded_cause() == "the GPU worker is unhealthy: lost the device"


async def test_degraded_cause_mentions_headroom_within_the_reserve(rig):
    rig.memory.free_mib = RESERVE_MIB
    cause = rig.dispatcher.degraded_cause()
    assert cause is not None and "headroom" in cause and "500 MiB free" in cause
    rig.memory.free_mib = RESERVE_MIB + 1
    assert rig.dispatcher.degraded_cause() is None


async def test_degraded_cause_names_a_cpu_job_running_for_a_gpu_reason(rig):
    gate = Gate()
    rig.cpu.script = gate
    task = start(rig, make_job(prompt=GPU_N_CTX, max_tokens=100))
    await gate.started.wait()
    assert rig.dispatcher.degraded_cause().startswith("gpu_context_cap: ")
    gate.release.set()
    await task
    assert rig.dispatcher.degraded_cause() is None


async def test_token_limit_chat_without_a_limit_fills_the_smallest_context_that_fits(rig):
    assert rig.dispatcher.token_limit(100, None, chat=True) == GPU_N_CTX - 8 - 100
    # Too long for the GPU's context: the CPU's room.
    assert rig.dispatcher.token_limit(GPU_N_CTX, None, chat=True) == CPU_N_CTX - 8 - GPU_N_CTX


async def test_token_limit_completion_defaults_to_16(rig):
    assert rig.dispatcher.token_limit(100, None, chat=False) == 16


async def test_token_limit_bounds_a_requested_limit_by_the_room_left(rig):
    assert rig.dispatcher.token_limit(100, 50, chat=True) == 50
    assert rig.dispatcher.token_limit(100, 100_000, chat=True) == CPU_N_CTX - 8 - 100
    assert rig.dispatcher.token_limit(CPU_N_CTX, 10, chat=True) == 1  # fits nowhere: admission refuses it


async def test_token_limit_without_a_gpu_uses_only_the_cpu_context():
    rig = make_rig(with_gpu=False)
    assert rig.dispatcher.token_limit(100, None, chat=True) == CPU_N_CTX - 8 - 100


# ----- Idempotency-Key twins ------------------------------------------------------------------


async def test_idempotent_twin_gets_the_first_result():
    store = IdempotencyStore(FakeClock())
    assert store.lookup("key-1", "fp") is None
    done = store.claim("key-1", "fp", "req-first")
    entry = store.lookup("key-1", "fp")
    assert entry is not None and entry.job_id == "req-first"
    twin = asyncio.create_task(store.wait(entry))
    await asyncio.sleep(0)
    assert not twin.done()
    done.set_result({"answer": 42})
    assert await twin == {"answer": 42}


async def test_idempotency_key_reused_with_another_body_is_a_422():
    store = IdempotencyStore(FakeClock())
    store.claim("key-1", "fp-a", "req-first")
    with pytest.raises(JobFailed) as caught:
        store.lookup("key-1", "fp-b")
    assert (caught.value.status, caught.value.code) == (422, "idempotency_key_reused")


async def test_idempotency_key_over_255_chars_is_a_400():
    store = IdempotencyStore(FakeClock())
    assert store.lookup("k" * MAX_KEY_LENGTH, "fp") is None
    with pytest.raises(JobFailed) as caught:
        store.lookup("k" * (MAX_KEY_LENGTH + 1), "fp")
    assert (caught.value.status, caught.value.code) == (400, "invalid_idempotency_key")


async def test_idempotency_entries_expire_in_time_order():
    clock = FakeClock()
    store = IdempotencyStore(clock, ttl_s=600.0)
    store.claim("old", "fp", "req-old")
    clock.now += 100
    store.claim("new", "fp", "req-new")
    clock.now += 550  # old is 650 s old, new 550 s
    assert store.lookup("old", "fp") is None
    assert store.lookup("new", "fp").job_id == "req-new"
    assert len(store) == 1
    clock.now += 50
    assert store.lookup("new", "fp") is None and len(store) == 0


async def test_idempotency_wait_deadline_is_a_409_and_keeps_the_first_running():
    store = IdempotencyStore(FakeClock(), wait_timeout_s=0.01)
    done = store.claim("key-1", "fp", "req-first")
    entry = store.lookup("key-1", "fp")
    with pytest.raises(JobFailed) as caught:
        await store.wait(entry)
    assert (caught.value.status, caught.value.code) == (409, "idempotency_key_in_progress")
    assert caught.value.retry_after_s == 30.0
    assert not done.cancelled()  # the first request's result can still be recorded
    done.set_result("late")
    assert await store.wait(store.lookup("key-1", "fp")) == "late"


# ----- sharing the GPU: residency, X-Prefer-Path, never falling back ------------------------


class FakeResidency:
    """What GpuSharing tells the dispatcher, as values the test sets."""

    def __init__(self, out=None) -> None:
        self.out = out
        self.arrivals = 0

    def gpu_out(self):
        return self.out

    def request_arrived(self) -> None:
        self.arrivals += 1


def with_residency(rig: Rig, reason: Reason, detail: str, back_in_s: float | None = None) -> FakeResidency:
    from tray_app.core.dispatch.admission import GpuOut
    residency = FakeResidency(GpuOut(reason, detail, back_in_s=back_in_s))
    rig.dispatcher.residency = residency
    return residency


async def test_a_given_away_gpu_sends_requests_to_the_cpu_as_gpu_yielded(rig):
    residency = with_residency(rig, Reason.GPU_YIELDED, "GPU given to steam (9.1 GiB)")
    await run_job(rig, make_job())
    assert rig.events.decisions == [("req-1", Route.CPU, Reason.GPU_YIELDED)]
    assert rig.gpu.calls == [] and rig.cpu.calls == ["req-1"]
    assert residency.arrivals == 1
    assert rig.dispatcher.degraded_cause() == "GPU given to steam (9.1 GiB)"


async def test_an_idle_unloaded_gpu_is_not_degraded_until_a_request_runs_elsewhere(rig):
    from tray_app.core.dispatch.admission import GpuOut
    rig.dispatcher.residency = FakeResidency(GpuOut(Reason.GPU_LOADING, "unloaded (idle)", quiet=True))
    assert rig.dispatcher.degraded_cause() is None


async def test_a_loading_gpu_sends_requests_to_the_cpu_unless_they_prefer_to_wait(rig):
    with_residency(rig, Reason.GPU_LOADING, "the GPU worker is loading", back_in_s=4.0)
    await run_job(rig, make_job("impatient"))
    waiting = make_job("patient", prefer_gpu=True)
    await run_job(rig, waiting)
    assert rig.events.decisions == [("impatient", Route.CPU, Reason.GPU_LOADING),
                                    ("patient", Route.GPU_QUEUE, Reason.ADMITTED)]
    assert rig.gpu.calls == ["patient"] and rig.cpu.calls == ["impatient"]
    # Its estimate includes the load.
    assert waiting.estimated_latency_s == pytest.approx(4.0)


async def test_preferring_the_gpu_does_not_wait_past_the_clients_deadline(rig):
    with_residency(rig, Reason.GPU_LOADING, "the GPU worker is loading", back_in_s=40.0)
    job = make_job(prefer_gpu=True, deadline_s=20.0)
    await run_job(rig, job)
    assert rig.events.decisions == [("req-1", Route.CPU, Reason.GPU_LOADING)]


async def test_never_fall_back_is_a_503_with_when_the_gpu_is_back(rig):
    with_residency(rig, Reason.GPU_YIELDED, "GPU given to steam; the memory is free again", back_in_s=12.2)
    job = make_job(no_fallback=True)
    failure = await failed(rig, job)
    assert (failure.status, failure.code, failure.retry_after_s) == (503, "gpu_yielded", 13.0)
    assert "expected back in about 12 s" in failure.message
    assert rig.cpu.calls == [] and rig.gpu.calls == []


async def test_a_request_that_may_not_fall_back_waits_for_a_loading_gpu_instead_of_a_503(rig):
    with_residency(rig, Reason.GPU_LOADING, "the GPU worker is loading", back_in_s=3.0)
    job = make_job(no_fallback=True)
    await run_job(rig, job)
    assert rig.events.decisions == [("req-1", Route.GPU_QUEUE, Reason.ADMITTED)]
    assert rig.gpu.calls == ["req-1"] and rig.cpu.calls == []


async def test_the_configured_policy_applies_unless_the_request_says_otherwise(rig):
    with_residency(rig, Reason.GPU_YIELDED, "GPU given to steam")
    rig.dispatcher.no_fallback = True
    refused = await failed(rig, make_job("by-policy"))
    assert (refused.status, refused.code) == (503, "gpu_yielded")
    assert "nobody can say when" in refused.message
    allowed = make_job("x-fallback-cpu", no_fallback=False)
    await run_job(rig, allowed)
    asked = make_job("x-force-path-cpu", force_cpu=True)
    await run_job(rig, asked)
    assert rig.cpu.calls == ["x-fallback-cpu", "x-force-path-cpu"]


async def test_a_gpu_failure_is_not_replayed_on_the_cpu_when_fallback_is_never(rig):
    rig.gpu.script = raising(WorkerFailure("connection reset"))
    job = make_job(no_fallback=True)
    failure = await failed(rig, job)
    assert (failure.status, failure.code) == (503, "gpu_worker_failed")
    assert "nothing was re-run" in failure.message
    assert rig.cpu.calls == [] and not job.replayed


async def test_a_client_forcing_the_cpu_does_not_wake_an_unloaded_gpu(rig):
    residency = with_residency(rig, Reason.GPU_LOADING, "unloaded (idle)")
    job = make_job(force_cpu=True)
    await run_job(rig, job)
    assert residency.arrivals == 0


async def test_an_on_demand_cpu_worker_counts_its_load_in_the_estimate(rig):
    rig.dispatcher.set_gpu_paused(True)
    warm = make_job("warm")
    await run_job(rig, warm)
    rig.cpu.worker.state = WorkerState.STOPPED
    assert not rig.cpu.can_queue()  # stopped, and not loading on demand: out of service
    rig.cpu.loads_on_demand = True
    assert rig.cpu.can_queue()
    cold = make_job("cold")
    await run_job(rig, cold)
    assert rig.events.decisions[-1] == ("cold", Route.CPU, Reason.FORCED_CPU)
    # The prior load time (5 s until a load is measured) comes on top.
    assert cold.estimated_latency_s == pytest.approx(warm.estimated_latency_s + 5.0, abs=0.01)


async def test_a_request_cut_short_by_a_give_back_is_replayed_without_counting_as_a_gpu_failure(rig):
    with_residency(rig, Reason.GPU_YIELDED, "GPU given to steam")
    rig.dispatcher.residency.out = None  # admitted while the GPU was still ours
    job = make_job()

    async def unloaded_under_it(job, sink, attempt):
        attempt.reached_worker = True
        from tray_app.core.dispatch.admission import GpuOut
        rig.dispatcher.residency.out = GpuOut(Reason.GPU_YIELDED, "GPU given to steam")
        raise WorkerFailure("connection closed", process_may_have_died=True)

    rig.gpu.script = unloaded_under_it
    await run_job(rig, job)
    assert rig.cpu.calls == ["req-1"] and job.replayed
    assert rig.breaker.snapshot()["recent_failures"] == 0
    assert rig.gpu.worker.failures == [] and rig.events.gpu_failures == []
    assert "unloaded under it" in job.first_failure
    assert "gpu_unloaded_under_request" in rig.events.kinds()


async def test_waiters_that_prefer_the_gpu_keep_their_places_while_it_loads():
    rig = make_rig(gpu_slots=1, gpu_queue=3)
    gate = Gate()
    rig.gpu.script = gate
    first = start(rig, make_job("running"))
    await gate.started.wait()
    residency = with_residency(rig, Reason.GPU_LOADING, "the GPU worker is loading", back_in_s=2.0)
    patient = make_job("patient", prefer_gpu=True)
    waiting = start(rig, patient)
    await until(lambda: rig.gpu.lane.position("patient") is not None)
    assert rig.dispatcher.redirect_gpu_waiting("the GPU worker is starting") == 0
    assert rig.gpu.lane.position("patient") is not None
    # Once the GPU is given away instead, nobody waits for it.
    from tray_app.core.dispatch.admission import GpuOut
    residency.out = GpuOut(Reason.GPU_YIELDED, "GPU given to steam")
    assert rig.dispatcher.redirect_gpu_waiting("given away") == 1
    gate.release.set()
    await asyncio.gather(first, waiting)
    assert rig.cpu.calls == ["patient"]


async def test_a_running_answers_estimate_is_refreshed_with_the_requests_that_came_after_it():
    # What a streamed answer's X-Estimated-Latency carries, sent with its first event.
    rig = make_rig(cpu_slots=2)
    release = asyncio.Event()

    async def held(job: Job, sink, attempt: Attempt) -> None:
        await release.wait()

    rig.cpu.script = held
    first = make_job("first", force_cpu=True, prompt=10, max_tokens=100)
    first_task = start(rig, first)
    await until(lambda: first.state is JobState.RUNNING)
    # Admitted alone: its prompt, then 100 tokens at the CPU's single-stream speed.
    assert first.estimated_latency_s == pytest.approx(10 / CPU_PROMPT_TOKENS_PER_S + 100 / CPU_TOKENS_PER_S, abs=0.02)
    second = make_job("second", force_cpu=True, prompt=10, max_tokens=100)
    second_task = start(rig, second)
    await until(lambda: second.state is JobState.RUNNING)
    queued = make_job("queued", force_cpu=True, prompt=10, max_tokens=100)
    queued_task = start(rig, queued)
    await until(lambda: queued.state is JobState.QUEUED)
    rig.dispatcher.refresh_estimate(first)
    # Two answers share the CPU now: its 100 tokens at half the speed (the prompt is read).
    assert first.estimated_latency_s == pytest.approx(100 / (CPU_TOKENS_PER_S / 2), abs=0.05)
    # A job not running keeps admission's estimate.
    before = queued.estimated_latency_s
    rig.dispatcher.refresh_estimate(queued)
    assert queued.estimated_latency_s == before
    release.set()
    await asyncio.gather(first_task, second_task, queued_task)
