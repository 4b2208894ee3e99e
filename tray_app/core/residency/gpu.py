"""The GPU worker gives its VRAM back and takes it again: residency's effects.

`policy.Residency` decides; `GpuSharing` is the one writer of it. It feeds
it each memory reading and every command (the user's, an eviction, a
refused load), and carries its decisions out on the one worker it owns the
residency of: drain, unload, wait for the memory to really come back,
reload. It tells the dispatcher why the GPU can't serve (`gpu_out`) and
hears from it when a request arrives (`request_arrived`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from ..dispatch.admission import GpuOut, Reason
from ..dispatch.backend import Backend
from ..engine.worker import WorkerState
from ..memory.telemetry import GpuReading, MemorySnapshot
from ..status_contract import ResidencyStatus
from .policy import Action, DeviceView, Hold, HoldKind, Residency

log = logging.getLogger(__name__)

# Until a load has been measured: a model's load time, guessed from its size
# (disk read plus upload) plus the server's own start.
PRIOR_LOAD_BASE_S = 3.0
PRIOR_LOAD_MIB_PER_S = 1000.0
DRAIN_POLL_S = 0.1
RELEASE_POLL_S = 0.1
# NVML lags a process exit: how long to wait for the unloaded worker's
# memory to show up as free before calling the release done anyway.
RELEASE_WAIT_S = 10.0


class GpuSharing:
    def __init__(self, residency: Residency, backend: Backend, *, need_mib: Callable[[], float], reserve_mib: float,
                 model_mib: float, drain_s: float, ours_mib: Callable[[GpuReading], float],
                 our_pids: Callable[[], set[int]], note: Callable[..., None], changed: Callable[[], None],
                 read_gpu: Callable[[], GpuReading], clock: Callable[[], float] = time.monotonic,
                 make_room: Callable[[], Awaitable[str | None]] | None = None,
                 ours_elsewhere_mib: Callable[[GpuReading], float] | None = None) -> None:
        self.residency = residency
        # What our other models' GPU workers hold: another app's only while
        # this worker is loaded too (then all of it is in the way); an
        # unloaded model makes room by eviction, not by waiting for them.
        self._ours_elsewhere_mib = ours_elsewhere_mib
        # Asked before each load: frees VRAM by unloading other models
        # (coordinator.make_vram_room); a reason when no unloading can make room.
        self._make_room = make_room
        # Why the last load could not start; cleared by the next attempt.
        self.no_room: str | None = None
        self._backend = backend
        self._need_mib = need_mib
        self._reserve_mib = reserve_mib
        self._model_mib = model_mib
        self._drain_s = drain_s
        self._ours_mib = ours_mib
        self._our_pids = our_pids
        self._note = note
        self._changed = changed
        self._read_gpu = read_gpu
        self._clock = clock
        self._last_activity = clock()
        self._task: asyncio.Task | None = None
        self._task_is_load = False
        # Wall-clock time of the last change, for "unloaded at 14:02".
        self.changed_at: float | None = None
        self.last_release_s: float | None = None
        self.last_load_s: float | None = None
        self.yields = 0
        self.loads = 0
        # Unloads for another model's load.
        self.evictions = 0

    @property
    def _worker(self):
        return self._backend.worker

    # ----- what the dispatcher asks --------------------------------------------------

    def gpu_out(self) -> GpuOut | None:
        hold = self.residency.hold
        if hold is not None and hold.kind is HoldKind.USER:
            return GpuOut(Reason.GPU_YIELDED, hold.describe() + '; it comes back with "Use the GPU again"')
        if hold is not None and hold.kind is HoldKind.YIELDED:
            reload_in = self.residency.reload_in_s()
            back = None if reload_in is None else reload_in + self.load_eta_s()
            when = (f"; it comes back once the memory has stayed free for {self.residency.settle_s():g} s"
                    if reload_in is None else f"; the memory is free again, reloading in {reload_in:.0f} s")
            return GpuOut(Reason.GPU_YIELDED, hold.describe() + when, back_in_s=back)
        if hold is not None and self.no_room is not None:
            return GpuOut(Reason.GPU_VRAM_HEADROOM, self.no_room)
        if hold is not None:
            return GpuOut(Reason.GPU_LOADING, "the GPU worker is unloaded (idle) and loads on the next request",
                          back_in_s=self.load_eta_s(), quiet=True)
        if self._worker.state is WorkerState.STARTING or self._loading():
            eta = self.load_eta_s()
            return GpuOut(Reason.GPU_LOADING, f"the GPU worker is loading the model (about {eta:.0f} s left)",
                          back_in_s=eta)
        return None

    @property
    def last_activity(self) -> float:
        """When the GPU path last had a request (the clock's time): what
        least-recently-used eviction sorts by."""
        return self._last_activity

    def request_arrived(self) -> None:
        self._last_activity = self._clock()
        if self.residency.request_arrived() is Action.LOAD:
            self._load("a request arrived")

    def load_eta_s(self) -> float:
        """Seconds until a load now under way (or one starting now) is done."""
        return self._worker.load_eta_s(prior_load_s(self._model_mib))

    def _loading(self) -> bool:
        """A load we asked for is under way (or waits for an unload to end
        first). A worker backing off after a failed start is not loading:
        it is unhealthy, and says why."""
        return self._load_task_running() and self._worker.state in (WorkerState.STOPPED, WorkerState.STOPPING,
                                                                    WorkerState.STARTING)

    def _load_task_running(self) -> bool:
        return self._task is not None and not self._task.done() and self._task_is_load

    @property
    def releasing(self) -> bool:
        """An unload is under way (a give-back, an idle unload, an eviction):
        its memory is on its way back to the device."""
        return self._task is not None and not self._task.done() and not self._task_is_load

    # ----- inputs ----------------------------------------------------------------------------

    def on_sample(self, snapshot: MemorySnapshot) -> None:
        lane = self._backend.lane
        now = self._clock()
        if lane.running_ids or lane.waiting_ids or self._worker.state is not WorkerState.READY:
            self._last_activity = now
        elif lane.last_released_at is not None:
            # A request that came and went between two samples: idle since it left.
            self._last_activity = max(self._last_activity, lane.last_released_at)
        view = self._device_view(snapshot.gpu)
        before = self.residency.hold
        action = self.residency.observe(view, loaded=self._holds_memory(),
                                        idle_for_s=None if lane.running_ids or lane.waiting_ids
                                        else now - self._last_activity)
        if action is Action.YIELD:
            # The release time runs from the first reading that saw the other app's allocation.
            self._give_back_now(self.residency.crowded_since or now)
        elif action is Action.UNLOAD:
            # Stopping at once, so a request arriving now is not admitted to it.
            self._worker.request_stop()
            self._start(self._unload_idle, is_load=False)
        elif action is Action.LOAD:
            self._load("the memory has stayed free")
        elif self.residency.hold != before:
            self._changed_now()

    def give_back(self) -> None:
        """The user's "Give the GPU back now"."""
        if self.residency.give_back() is Action.YIELD:
            self._give_back_now(self._clock())
        self._changed_now()

    def take_again(self) -> None:
        """The user's "Use the GPU again"."""
        if self.residency.take_again() is Action.LOAD:
            self._load("the user asked for the GPU again")

    def keep_alive(self, seconds: float | None) -> None:
        """A request's keep_alive (see Residency.set_keep_alive)."""
        self.residency.set_keep_alive(seconds)

    def set_yield_to_other_apps(self, enabled: bool) -> None:
        if self.residency.set_yield_to_other_apps(enabled) is Action.LOAD:
            self._load("the user asked for the GPU again")

    def given_back_by_user(self) -> bool:
        hold = self.residency.hold
        return hold is not None and hold.kind is HoldKind.USER

    # ----- effects -------------------------------------------------------------------------

    def _start(self, change: Callable[[], Awaitable[None]], *, is_load: bool) -> None:
        """Run one residency change after the one before it. A load under
        way is cancelled (stopping a loading worker is fine); an unload is
        never: its stop is already on its way, and a load must come after it."""
        previous, previous_is_load = self._task, self._task_is_load

        async def run() -> None:
            if previous is not None and not previous.done():
                if previous_is_load:
                    previous.cancel()
                await asyncio.wait({previous})  # its outcome is its own; our cancel still reaches us
            await change()

        self._task = asyncio.create_task(run(), name="gpu-residency")
        self._task_is_load = is_load
        self._changed_now()

    def _load(self, why: str) -> None:
        self._start(lambda: self._take_again(why), is_load=True)

    def _give_back_now(self, seen_at: float) -> None:
        hold = self.residency.hold
        assert hold is not None
        self._start(lambda: self._give_back(hold, seen_at), is_load=False)

    async def close(self) -> None:
        """Stop what is under way (the service is shutting down)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task})

    async def _give_back(self, hold: Hold, seen_at: float) -> None:
        self.yields += 1
        moved = self._backend.lane.redirect_waiting(hold.describe())
        self._note("gpu_yield_start", text=hold.describe(), app=hold.app, app_mib=hold.app_mib, redirected=moved)
        self._changed()
        drained = await self._drain()
        free_before = await asyncio.to_thread(self._read_free_mib)
        pid = self._worker.pid
        await self._worker.stop()
        await self._wait_released(free_before, pid)
        self.last_release_s = round(self._clock() - seen_at, 3)
        self._note("gpu_given_back", text=hold.describe(), app=hold.app, app_mib=hold.app_mib,
                   release_s=self.last_release_s, drained=drained, by_user=hold.kind is HoldKind.USER)
        self._changed_now()

    async def evict(self, why: str, for_model: str | None = None) -> None:
        """Unload now for another model's load (or the user's Unload), and
        wait until the device shows the memory free. It loads again on its
        next request."""
        self.residency.evicted(for_model)
        if for_model is not None:
            self.evictions += 1
        # The pid before the stop: a worker that exits at once has none
        # afterwards, and _wait_released needs it to see the process gone.
        pid = self._worker.pid
        self._worker.request_stop()
        self._start(lambda: self._evicted(why, pid), is_load=False)
        task = self._task
        assert task is not None
        await asyncio.shield(task)

    async def _evicted(self, why: str, pid: int | None) -> None:
        # Read after the stop was asked for: if the worker is already gone this
        # counts its memory as free before, and only the pid check ends the
        # wait early (left alone: the stop can't wait for a blocking read).
        free_before = await asyncio.to_thread(self._read_free_mib)
        await self._worker.stop()
        await self._wait_released(free_before, pid)
        self._note("gpu_evicted", why=why)
        self._changed_now()

    async def _unload_idle(self) -> None:
        await self._worker.stop()
        self._note("gpu_unloaded_idle", idle_unload_s=self.residency.policy.idle_unload_s)
        self._changed_now()

    async def _take_again(self, why: str) -> None:
        started = self._clock()
        self._changed()
        if self._make_room is not None:
            self.no_room = await self._make_room()
            if self.no_room is not None:
                self.residency.load_refused()
                self._backend.lane.redirect_waiting(self.no_room)
                self._note("gpu_load_refused", why=why, reason=self.no_room)
                self._changed_now()
                return
        if not await self._worker.ensure_ready():
            self._note("gpu_load_failed", why=why, reason=self._worker.gave_up or self._worker.unhealthy_reason)
            return
        self.last_load_s = round(self._clock() - started, 3)
        self.loads += 1
        self._last_activity = self._clock()
        self._note("gpu_taken_again", why=why, load_s=self.last_load_s)
        self._changed_now()

    async def _drain(self) -> bool:
        """Let running GPU requests finish, up to the drain time. True if they all did."""
        deadline = self._clock() + self._drain_s
        while self._backend.lane.running_ids:
            if self._clock() >= deadline:
                log.warning("GPU requests still running after %.0f s; unloading anyway", self._drain_s)
                return False
            await asyncio.sleep(DRAIN_POLL_S)
        return True

    async def _wait_released(self, free_before: float | None, pid: int | None) -> None:
        """Wait until the device shows the worker's memory as given up: free
        again, or (while a game takes it as fast as it comes) the process
        gone from the device's list. Only then has the other app got it.
        Reads run off the loop: NVML calls block."""
        if free_before is None:
            return
        deadline = self._clock() + RELEASE_WAIT_S
        while self._clock() < deadline:
            reading = await asyncio.to_thread(self._read_gpu)
            free = reading.free_mib
            if free is not None and free - free_before >= 0.75 * self._need_mib():
                return
            device = reading.devices[0] if reading.available and reading.devices else None
            if (pid is not None and device is not None and device.processes_reported and device.processes
                    and all(p.pid != pid for p in device.processes)):
                return
            await asyncio.sleep(RELEASE_POLL_S)

    def _read_free_mib(self) -> float | None:
        return self._read_gpu().free_mib

    def _changed_now(self) -> None:
        self.changed_at = time.time()
        self._changed()

    # ----- reads -------------------------------------------------------------------------------

    def _holds_memory(self) -> bool:
        return self._worker.state is not WorkerState.STOPPED

    def _device_view(self, reading: GpuReading) -> DeviceView:
        if reading.used_mib is None:
            return DeviceView(None, None, self._need_mib(), self._reserve_mib)
        others = reading.used_mib - self._ours_mib(reading)
        if self._ours_elsewhere_mib is not None and not self._holds_memory():
            others -= self._ours_elsewhere_mib(reading)
        others = max(0.0, others)
        ours = self._our_pids()
        strangers = [p for p in reading.devices[0].processes if p.pid not in ours and p.used_mib]
        top = max(strangers, key=lambda p: p.used_mib or 0.0, default=None)
        return DeviceView(reading.total_mib, others, self._need_mib(), self._reserve_mib,
                          top_app=top.name if top is not None else None,
                          top_app_mib=top.used_mib if top is not None else None)

    def state(self) -> str:
        hold = self.residency.hold
        if hold is not None:
            return {HoldKind.YIELDED: "given_away", HoldKind.IDLE: "unloaded_idle",
                    HoldKind.USER: "given_back_by_user"}[hold.kind]
        ready = self._worker.state is WorkerState.READY
        if ready and not self._load_task_running():
            return "loaded"
        # Ready, its load's task not yet resumed: "loaded" comes with that load's numbers
        # (last_load_s), never before them.
        if ready or self._worker.state is WorkerState.STARTING or self._loading():
            return "loading"
        return self._worker.state.value

    def status(self) -> ResidencyStatus:
        hold = self.residency.hold
        policy = self.residency.policy
        out = self.gpu_out()
        return {
            "state": self.state(),
            "text": hold.describe() if hold is not None else ("GPU loading" if self.state() == "loading" else None),
            "detail": out.detail if out is not None else None,
            "since": self.changed_at,
            "app": hold.app if hold is not None else None,
            "app_mib": round(hold.app_mib, 1) if hold is not None and hold.app_mib is not None else None,
            "reload_in_s": _round(self.residency.reload_in_s()),
            "settle_s": self.residency.settle_s(),
            "load_eta_s": _round(self.load_eta_s()),
            "last_release_s": self.last_release_s,
            "last_load_s": self.last_load_s,
            "yields": self.yields,
            "reloads": self.loads,
            "yield_to_other_apps": policy.yield_to_other_apps,
            "idle_unload_s": policy.idle_unload_s,
            # What the last request's keep_alive made of it; None = never.
            "idle_limit_s": self.residency.idle_limit_s(),
            "no_room": self.no_room,
            "unload_in_s": _round(self.unload_in_s()),
        }

    def unload_in_s(self) -> float | None:
        """Seconds until a loaded, idle GPU worker unloads for idleness;
        None when it won't (busy, not loaded, or kept forever)."""
        limit = self.residency.idle_limit_s()
        lane = self._backend.lane
        if (limit is None or self.residency.hold is not None or self._worker.state is not WorkerState.READY
                or lane.running_ids or lane.waiting_ids):
            return None
        return max(0.0, limit - (self._clock() - self._last_activity))


def prior_load_s(model_mib: float) -> float:
    """A model's load time before one has been measured."""
    return PRIOR_LOAD_BASE_S + model_mib / PRIOR_LOAD_MIB_PER_S


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
