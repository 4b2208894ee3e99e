"""A lane: the slots and the bounded FIFO queue in front of one worker.

A request holds one slot per answer it asks for (OpenAI's `n`): llama-server
runs each choice in its own slot. The queue is strictly first in, first out,
so a request waiting for several slots is not overtaken by smaller ones.

Slots are handed over directly: when a request releases its slot, the first
waiter is marked running before it even wakes, so nobody can sneak in between.
All methods run on the event loop thread; no locks are needed.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Callable

from .admission import LaneState


class Redirected(Exception):
    """The lane can no longer serve its waiters (e.g. the GPU failed)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class _Waiter:
    request_id: str
    enqueued_at: float
    future: asyncio.Future = field(repr=False)
    slots: int = 1


class Lane:
    def __init__(self, name: str, concurrency: int, queue_limit: int, clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.concurrency = concurrency
        self.queue_limit = queue_limit
        self._clock = clock
        # Slots held, by request id.
        self._running: dict[str, int] = {}
        self._waiting: collections.deque[_Waiter] = collections.deque()
        # When a request last gave its slot back (the clock's time): the
        # start of an idle spell, which a sampler may never see busy.
        self.last_released_at: float | None = None

    @property
    def busy_slots(self) -> int:
        return sum(self._running.values())

    def state(self, context_cap: int, slots_wanted: int = 1) -> LaneState:
        """The lane as admission sees it, for a request that needs `slots_wanted` slots."""
        return LaneState(
            context_cap=context_cap, running=self.busy_slots, concurrency=self.concurrency,
            queued=len(self._waiting), queue_limit=self.queue_limit, slots_wanted=slots_wanted,
        )

    @property
    def running_ids(self) -> list[str]:
        return list(self._running)

    @property
    def waiting_ids(self) -> list[str]:
        return [w.request_id for w in self._waiting]

    def position(self, request_id: str) -> int | None:
        """1-based place in the queue, or None when not waiting."""
        for index, waiter in enumerate(self._waiting):
            if waiter.request_id == request_id:
                return index + 1
        return None

    def oldest_wait_s(self) -> float:
        return round(self._clock() - self._waiting[0].enqueued_at, 3) if self._waiting else 0.0

    def join(self, request_id: str, front: bool = False, slots: int = 1) -> asyncio.Future | None:
        """Take a free slot now (None), or take a place in the queue and get a
        future that resolves when a slot is handed over. Synchronous, so the
        queue never shows a request as waiting without a place.

        `front` puts a replayed request ahead of new arrivals: it was accepted
        earlier and has already waited once. `slots` more than the lane has
        would wait forever: the caller refuses such a request first.
        """
        if slots > self.concurrency:
            raise ValueError(f"{slots} slots asked of the {self.name} lane, which has {self.concurrency}")
        if self.busy_slots + slots <= self.concurrency and not self._waiting:
            self._running[request_id] = slots
            return None
        waiter = _Waiter(request_id, self._clock(), asyncio.get_running_loop().create_future(), slots)
        if front:
            self._waiting.appendleft(waiter)
        else:
            self._waiting.append(waiter)
        return waiter.future

    async def wait(self, request_id: str, place: asyncio.Future) -> float:
        """Wait for the slot promised by join(); returns seconds waited."""
        waiter = next((w for w in self._waiting if w.future is place), None)
        enqueued_at = waiter.enqueued_at if waiter else self._clock()
        try:
            await place
        except asyncio.CancelledError:
            # The caller went away: give the slot on if we had just been handed it.
            if waiter is not None and waiter in self._waiting:
                self._waiting.remove(waiter)
            elif request_id in self._running:
                self.release(request_id)
            raise
        return round(self._clock() - enqueued_at, 3)

    async def acquire(self, request_id: str, front: bool = False, slots: int = 1) -> float:
        """Take `slots` slots, waiting in the queue if needed; returns seconds waited."""
        place = self.join(request_id, front, slots)
        return 0.0 if place is None else await self.wait(request_id, place)

    def release(self, request_id: str) -> None:
        if self._running.pop(request_id, None) is None:
            return
        self.last_released_at = self._clock()
        self._hand_over()

    def _hand_over(self) -> None:
        while self._waiting:
            waiter = self._waiting[0]
            if waiter.future.done():
                self._waiting.popleft()
                continue
            if self.busy_slots + waiter.slots > self.concurrency:
                # The head waits for enough slots; nobody behind it goes first.
                return
            self._waiting.popleft()
            self._running[waiter.request_id] = waiter.slots
            waiter.future.set_result(None)

    def leave(self, request_id: str) -> None:
        """Give up whatever the request holds, a place in the queue or a slot.
        Safe to call twice, and whether or not a wait() ever started."""
        for waiter in list(self._waiting):
            if waiter.request_id == request_id:
                self._waiting.remove(waiter)
                if not waiter.future.done():
                    waiter.future.cancel()
        self.release(request_id)

    def redirect_waiting(self, reason: str, keep: Callable[[str], bool] = lambda request_id: False) -> int:
        """Send every waiter away with `reason`, except those `keep` names
        by request id (they keep their places); returns how many went."""
        count = 0
        kept = collections.deque()
        while self._waiting:
            waiter = self._waiting.popleft()
            if waiter.future.done():
                continue
            if keep(waiter.request_id):
                kept.append(waiter)
                continue
            waiter.future.set_exception(Redirected(reason))
            count += 1
        self._waiting = kept
        return count

    def snapshot(self) -> dict:
        return {
            "running": self.busy_slots,
            "concurrency": self.concurrency,
            "depth": len(self._waiting),
            "limit": self.queue_limit,
            "oldest_age_s": self.oldest_wait_s(),
        }
