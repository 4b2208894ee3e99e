"""Circuit breaker that stops the dispatcher from hammering a worker that keeps failing.

Not thread-safe by design: it lives on the service's asyncio loop, where calls
never interleave, so a lock would only hide a misuse.  Time comes from an
injected monotonic clock so tests can drive every transition without sleeping.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from enum import Enum
from typing import Any

# BreakerPolicy is the config's [breaker] section too: it lives below both.
from ..base.policies import BreakerPolicy


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, policy: BreakerPolicy = BreakerPolicy(), clock: Callable[[], float] = time.monotonic) -> None:
        self._policy = policy
        self._clock = clock
        self._failure_times: deque[float] = deque()
        self._last_failure_reason: str | None = None
        self._opened_at: float | None = None  # set while OPEN or HALF_OPEN
        self._probe_in_flight = False

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        # OPEN turns into HALF_OPEN by the passage of time alone, so it is
        # derived on read rather than stored: no timer task is needed.
        if self._clock() - self._opened_at >= self._policy.cooldown_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def try_acquire(self) -> bool:
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.OPEN or self._probe_in_flight:
            return False
        # One probe at a time: if the worker is still broken, a single request
        # finds out, not a burst of them.
        self._probe_in_flight = True
        return True

    def record_success(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self._close()
        # In CLOSED, old failures age out of the window on their own; a success
        # does not wipe them, or alternating success/failure would never trip.

    def record_failure(self, reason: str) -> None:
        now = self._clock()
        self._last_failure_reason = reason
        state = self.state
        if state is BreakerState.HALF_OPEN:
            self._open(now)  # the probe failed: start a fresh cooldown
            return
        if state is BreakerState.OPEN:
            return  # stragglers admitted before the trip add nothing
        self._failure_times.append(now)
        self._forget_failures_before(now - self._policy.window_s)
        if len(self._failure_times) >= self._policy.failure_threshold:
            self._open(now)

    def trip(self, reason: str) -> None:
        self._last_failure_reason = reason
        self._open(self._clock())

    def release_probe(self) -> None:
        self._probe_in_flight = False

    @property
    def probe_in_flight(self) -> bool:
        return self._probe_in_flight

    def snapshot(self) -> dict[str, Any]:
        now = self._clock()
        state = self.state
        if state is BreakerState.CLOSED:
            self._forget_failures_before(now - self._policy.window_s)
        opened_for_s = None if self._opened_at is None else now - self._opened_at
        retry_in_s = None
        if state is BreakerState.OPEN and opened_for_s is not None:
            retry_in_s = self._policy.cooldown_s - opened_for_s
        return {
            "state": state.value,
            "recent_failures": len(self._failure_times),
            "last_failure_reason": self._last_failure_reason,
            "opened_for_s": opened_for_s,
            "retry_in_s": retry_in_s,
        }

    def _open(self, now: float) -> None:
        self._opened_at = now
        self._probe_in_flight = False

    def _close(self) -> None:
        self._opened_at = None
        self._probe_in_flight = False
        self._failure_times.clear()

    def _forget_failures_before(self, cutoff: float) -> None:
        while self._failure_times and self._failure_times[0] <= cutoff:
            self._failure_times.popleft()
