"""What the service is doing, for everyone who looks: memory readings, the
event log and degraded mode.

The observer is advanced by the sampler's tick and by events (a request
changed state, a worker changed state); reading it (`/status`, `/metrics`,
the tray) changes nothing, except that the /status route notes someone
looking (`looked_at`), which makes the sampler tick faster (see
sample_interval_s). That is why degraded mode starts and ends
here, on an advance, and not inside a query.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any, Callable

from .dispatch.failover_time import FailoverTimes
from .memory.telemetry import GpuReader, MemorySnapshot, TelemetryHistory, read_host

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 1.0
# While nothing is in flight, no GPU worker holds VRAM another app may want
# back, and nobody reads /status at the panel's rate, memory is read this
# seldom: an idle service (and the tray around it) should cost next to
# nothing. A request or a reader brings 1 s back within a second.
IDLE_SAMPLE_INTERVAL_S = 5.0
# A /status read this recent means someone is looking (the panel and the web
# page read every second; the tray alone, with its panel closed, every 5 s).
LOOKED_AT_WITHIN_S = 2.5


def sample_interval_s(*, needs_full_rate: bool, last_look_age_s: float | None) -> float:
    """How often memory is read now: every second while the service needs it
    (a request in flight, VRAM held that another app may need) or someone looks
    at the numbers, else every IDLE_SAMPLE_INTERVAL_S."""
    if needs_full_rate or (last_look_age_s is not None and last_look_age_s <= LOOKED_AT_WITHIN_S):
        return SAMPLE_INTERVAL_S
    return IDLE_SAMPLE_INTERVAL_S
EVENT_LOG_SIZE = 100


class Observer:
    def __init__(self, gpu_reader: GpuReader, worker_pids: Callable[[], list[int]],
                 degraded_cause: Callable[[], str | None],
                 on_sample: Callable[[MemorySnapshot], None] = lambda snapshot: None,
                 needs_full_rate: Callable[[], bool] = lambda: True) -> None:
        self._gpu_reader = gpu_reader
        self._on_sample = on_sample
        self._worker_pids = worker_pids
        self._needs_full_rate = needs_full_rate
        # When /status was last served (time.monotonic): someone looking.
        self._looked_at: float | None = None
        self._degraded_cause = degraded_cause
        self.history = TelemetryHistory()
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=EVENT_LOG_SIZE)
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self.degraded_since: float | None = None
        self.degraded_reason: str | None = None
        self._sampler: asyncio.Task | None = None
        # Fault to first token of each replay, for /status and the panel.
        self.failovers = FailoverTimes()

    # ----- advancing -------------------------------------------------------------

    def sample(self) -> MemorySnapshot:
        """Read GPU and host memory now; blocking (NVML), so the loop runs it in a thread."""
        snapshot = MemorySnapshot(time.time(), self._gpu_reader.read(), read_host(self._worker_pids()))
        self.history.append(snapshot)
        return snapshot

    def advance(self) -> None:
        """Re-evaluate degraded mode, noting when it starts and ends."""
        reason = self._degraded_cause()
        if reason is None:
            if self.degraded_since is not None:
                self.note("degraded_end", lasted_s=round(time.time() - self.degraded_since, 3))
            self.degraded_since = None
            self.degraded_reason = None
            return
        if self.degraded_since is None:
            self.degraded_since = time.time()
            self.note("degraded_start", reason=reason)
        self.degraded_reason = reason

    def note(self, kind: str, **data: Any) -> None:
        event = {"t": round(time.time(), 3), "kind": kind, **data}
        self.events.append(event)
        for listener in self._listeners:
            listener(event)

    def failed_over(self, fault: str, seconds: float, *, resumed: bool = False, **data: Any) -> None:
        """A replay's first token came `seconds` after the GPU's fault (for a
        continued answer: its first new token, the seam)."""
        self.failovers.record(fault, seconds, resumed=resumed)
        self.note("failover", fault=fault, seconds=round(seconds, 3), resumed=resumed, **data)

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        self._listeners.append(listener)

    def start(self) -> None:
        self._sampler = asyncio.create_task(self._sample_forever(), name="telemetry")

    def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()

    def looked_at(self) -> None:
        """Someone read /status: keep the numbers fresh for them. The route
        says so, not the status builder: /metrics and the service's own
        reads build a status too, and nobody is looking at those."""
        self._looked_at = time.monotonic()

    @property
    def last_looked_at(self) -> float | None:
        """When someone last read /status (time.monotonic), or None: never."""
        return self._looked_at

    async def _sample_forever(self) -> None:
        last = time.monotonic()
        while True:
            # Wakes every second (cheap) but reads memory only when due, so
            # a request or a reader gets 1 s samples back within a second.
            await asyncio.sleep(SAMPLE_INTERVAL_S)
            now = time.monotonic()
            look_age = None if self._looked_at is None else now - self._looked_at
            if now - last < sample_interval_s(needs_full_rate=self._needs_full_rate(), last_look_age_s=look_age) - 0.05:
                continue
            last = now
            try:
                snapshot = await asyncio.to_thread(self.sample)
                # Who holds the GPU's memory may have changed (a game started).
                self._on_sample(snapshot)
                self.advance()
            except Exception:  # a sampler that dies would freeze every gauge
                log.exception("telemetry sample failed")

    # ----- reading ---------------------------------------------------------------

    def latest(self) -> MemorySnapshot:
        latest = self.history.latest()
        assert latest is not None, "sample() runs once when the service is built"
        return latest
