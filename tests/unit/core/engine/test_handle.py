"""The seam above the engine: the real Worker and the shared fake both are a
WorkerHandle, and the fake keeps the parts of Worker's contract the service
leans on (hooks see each change, ensure_ready waits out a stop)."""

from __future__ import annotations

import asyncio

from tests.fakes.worker import FakeRuntime, FakeWorker, spec_for
from tray_app.core.engine.handle import WorkerHandle
from tray_app.core.engine.worker import Worker, WorkerEvent, WorkerHooks, WorkerState


async def test_the_real_worker_and_the_fake_are_both_worker_handles(tmp_path):
    worker = Worker(spec_for("cpu"), FakeRuntime(), tmp_path)
    try:
        assert isinstance(worker, WorkerHandle)
    finally:
        await worker.close()
    assert isinstance(FakeWorker("cpu"), WorkerHandle)


class Recorded(WorkerHooks):
    def __init__(self) -> None:
        self.events: list[WorkerEvent] = []
        self.spawns = 0

    async def before_spawn(self, worker):
        self.spawns += 1
        return await super().before_spawn(worker)

    def on_event(self, event: WorkerEvent) -> None:
        self.events.append(event)


async def test_a_live_fake_loads_through_its_hooks_and_is_replaced_after_a_failure():
    hooks = Recorded()
    worker = FakeWorker("gpu", hooks=hooks, state=WorkerState.STOPPED, live=True)
    assert await worker.ensure_ready(5)
    worker.report_failure("CUDA error", process=worker.exits)
    assert worker.state is WorkerState.UNHEALTHY and worker.last_exit.evidence == "CUDA error"
    assert await worker.exit_after(0, 5) is worker.last_exit
    await worker.wait_for_state(WorkerState.READY, timeout=5)
    assert hooks.spawns == 2 and worker.exits == 1 and worker.restarts == 1
    assert [e.state for e in hooks.events] == [WorkerState.STARTING, WorkerState.READY, WorkerState.UNHEALTHY,
                                               WorkerState.UNHEALTHY, WorkerState.STARTING, WorkerState.READY]


async def test_ensure_ready_on_a_stopping_fake_waits_out_the_stop_and_loads_again():
    worker = FakeWorker("cpu", live=True)
    gate = worker.load_gate = asyncio.Event()
    worker.request_stop()
    ready = asyncio.ensure_future(worker.ensure_ready(5))
    await worker.wait_for_state(WorkerState.STARTING, timeout=5)
    assert worker.exits == 1 and not ready.done()
    gate.set()
    assert await ready and worker.state is WorkerState.READY
