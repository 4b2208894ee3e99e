"""A worker that loads when a request needs it and unloads when idle:
residency's effect for the workers that are not resident (an on-demand CPU
worker, the embedding worker). Its decision (idle for idle_unload_s with an
empty lane) is one comparison, so it sits with its effect."""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Protocol

from ..dispatch.lanes import Lane
from ..engine.handle import WorkerHandle
from ..engine.worker import WorkerState


class Kept(Protocol):
    """What OnDemandWorker keeps: a worker and the lane in front of it (a
    dispatch Backend, or the embedding path)."""

    worker: WorkerHandle
    lane: Lane
    loads_on_demand: bool


class OnDemandWorker:
    """A worker loaded by the first request that needs it and unloaded after
    idle_unload_s without one: the CPU worker under [cpu] keep = "on_demand"
    (Backend.loads_on_demand), and the embedding worker always. Saves its
    RAM; the first request after an unload waits for a load. Idle means an
    empty lane: a request takes its place in the lane before it loads the
    worker, so nothing is unloaded under a request on its way in."""

    def __init__(self, kept: Kept, idle_unload_s: float, note: Callable[..., None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._kept = kept
        self._idle_unload_s = idle_unload_s
        self._note = note
        self._clock = clock
        self._last_activity = clock()
        self._task: asyncio.Task | None = None
        kept.loads_on_demand = True

    def on_sample(self) -> None:
        lane = self._kept.lane
        worker = self._kept.worker
        now = self._clock()
        if lane.running_ids or lane.waiting_ids or worker.state not in (WorkerState.READY, WorkerState.STOPPED):
            self._last_activity = now
            return
        busy = self._task is not None and not self._task.done()
        # A request that came and went between two samples counts too: the
        # idle spell starts when the last one left, not at the last busy sample.
        if lane.last_released_at is not None:
            self._last_activity = max(self._last_activity, lane.last_released_at)
        if (worker.state is WorkerState.READY and not busy and self._idle_unload_s > 0
                and now - self._last_activity >= self._idle_unload_s):
            # Stopping at once: a request arriving now waits for a fresh load
            # (it waits out the STOPPING state) instead of reaching a process on its way out.
            worker.request_stop()
            self._task = asyncio.create_task(self._unload(), name=f"{worker.role}-unload")

    async def _unload(self) -> None:
        worker = self._kept.worker
        await worker.stop()
        # "cpu_unloaded_idle", "embed_unloaded_idle": the event log's names.
        self._note(f"{worker.role}_unloaded_idle", idle_unload_s=self._idle_unload_s)

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task})
