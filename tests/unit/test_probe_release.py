"""The breaker's half-open probe goes back on every way a request can end.

The service is built in-process on the simulated GPU; no worker starts. The
one effect replaced is the proxy to a worker (`_proxy`), which is where each
exit path begins: it raises what a real worker exchange would raise.
"""

from __future__ import annotations

import asyncio

import pytest

from tray_app.core.dispatch.admission import Route
from tray_app.core.dispatch.breaker import BreakerState
from tray_app.core.config import parse_config_text
from tray_app.core.dispatch.jobs import Job, JobFailed, JobKind, WorkerFailure, WorkerRequestError
from tray_app.core.dispatch.lanes import Redirected
from tray_app.core.service import Service, _canceled

CONFIG = """
[gpu]
simulate_mib = 4096
reserve_mib = 256
queue_limit = 2
[breaker]
failure_threshold = 1
cooldown_s = 5
"""


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    def emit(self, event) -> None:
        pass

    def reset(self) -> None:
        pass


@pytest.fixture
async def service(tmp_path):
    clock = FakeClock()
    svc = Service(parse_config_text(CONFIG), log_dir=tmp_path, clock=clock)
    # No worker process runs in these tests: the GPU path counts as able to serve.
    svc.gpu_out_reason = lambda: None
    svc.breaker.trip("a GPU failure before this test")
    clock.now += 6  # past the cooldown: half-open, one probe allowed
    assert svc.breaker.state is BreakerState.HALF_OPEN
    try:
        yield svc
    finally:
        await svc.stop()


def new_job(request_id: str = "probe-1") -> Job:
    job = Job(id=request_id, kind=JobKind.CHAT, body={"messages": [{"role": "user", "content": "hi"}]}, stream=False)
    job.prompt_tokens, job.max_tokens = 8, 8
    return job


def probe_is_free(svc: Service) -> bool:
    """True if a new request could become the probe, i.e. none is held."""
    taken = svc.breaker.try_acquire()
    if taken:
        svc.breaker.release_probe()
    return taken


async def run_with_gpu_proxy(svc: Service, job: Job, gpu_effect) -> None:
    async def proxy(job_, path, sink):
        if path == "gpu":
            await gpu_effect(job_)
        # The CPU path (after a redirect or replay) just succeeds.

    svc._proxy = proxy
    decision = svc.decide(job)
    assert decision.route is Route.GPU and job.half_open_probe
    assert not probe_is_free(svc)
    svc.register(job)
    await svc.execute(job, Recorder(), decision)


async def test_probe_is_released_when_canceled_while_running(service):
    async def canceled(job):
        job.cancel("the client disconnected")
        raise _canceled(job, "while it ran")

    with pytest.raises(JobFailed) as failed:
        await run_with_gpu_proxy(service, new_job(), canceled)
    assert failed.value.code == "request_canceled"
    assert probe_is_free(service)


async def test_probe_is_released_on_a_client_error_from_the_worker(service):
    async def rejected(job):
        raise JobFailed(400, "invalid_request", "the model server rejected the request")

    with pytest.raises(JobFailed):
        await run_with_gpu_proxy(service, new_job(), rejected)
    assert probe_is_free(service)


async def test_probe_is_released_when_redirected_after_it_was_taken(service):
    async def redirected(job):
        raise Redirected("the GPU worker is restarting")

    job = new_job()
    await run_with_gpu_proxy(service, job, redirected)
    assert job.path == "cpu"
    assert probe_is_free(service)


async def test_probe_is_released_on_an_unexpected_exception(service):
    async def broken(job):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError):
        await run_with_gpu_proxy(service, new_job(), broken)
    assert probe_is_free(service)


async def test_probe_is_released_on_a_worker_request_error(service):
    async def request_error(job):
        raise WorkerRequestError("the server raised for this input")

    with pytest.raises(JobFailed):
        await run_with_gpu_proxy(service, new_job(), request_error)
    assert probe_is_free(service)


async def test_a_failed_probe_reopens_the_breaker(service):
    async def failure(job):
        raise WorkerFailure("CUDA out of memory")

    job = new_job()
    # No CPU worker runs here, so the replay is refused; the breaker is the point.
    with pytest.raises(JobFailed):
        await run_with_gpu_proxy(service, job, failure)
    assert job.replayed
    assert service.breaker.state is BreakerState.OPEN


async def test_probe_is_released_when_canceled_while_queued(service):
    started, release = asyncio.Event(), asyncio.Event()

    async def proxy(job, path, sink):
        started.set()
        await release.wait()

    service._proxy = proxy
    # An ordinary request holds the only GPU slot (the breaker is closed for it).
    service.breaker.record_success()
    holder = new_job("holder")
    holder_decision = service.decide(holder)
    service.register(holder)
    holder_task = asyncio.create_task(service.execute(holder, Recorder(), holder_decision))
    await started.wait()
    service.breaker.trip("again")
    service._clock.now += 6
    probe = new_job("queued-probe")
    decision = service.decide(probe)
    assert decision.route is Route.GPU_QUEUE and probe.half_open_probe
    service.register(probe)
    queued = asyncio.create_task(service.execute(probe, Recorder(), decision))
    await asyncio.sleep(0)
    probe.cancel("canceled by the test")
    with pytest.raises(JobFailed):
        await queued
    assert probe_is_free(service)
    release.set()
    await holder_task
