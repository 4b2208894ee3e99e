"""UpstreamWatch: one timer keeps the deadline, the liveness question and the
job's cancel over every wait of an attempt, with no task per wait (issue 32:
a task and an asyncio.wait per chunk were a quarter of the relay's CPU)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Callable

import pytest

from tests.fakes.clock import FakeClock
from tray_app.core.dispatch import upstream as upstream_module
from tray_app.core.dispatch.jobs import WorkerFailure
from tray_app.core.dispatch.upstream import _CANCELED, UpstreamWatch


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    monkeypatch.setattr(upstream_module, "LIVENESS_INTERVAL_S", 0.01)


class Silent:
    """An upstream that never answers; records that its wait was ended."""

    def __init__(self) -> None:
        self.ended = False

    async def next(self) -> bytes:
        try:
            await asyncio.Event().wait()
        finally:
            self.ended = True
        return b""


def run(test) -> None:
    asyncio.run(asyncio.wait_for(test(), 10))


@contextlib.asynccontextmanager
async def watching(liveness: Callable[[], str | None] = lambda: None, clock: FakeClock | None = None,
                   cancel: asyncio.Event | None = None) -> AsyncIterator[UpstreamWatch]:
    """A watch over the job's cancel (`cancel`, set by the test), as stream_attempt keeps one."""
    canceled = asyncio.ensure_future((cancel or asyncio.Event()).wait())
    watch = UpstreamWatch(canceled, liveness, clock or FakeClock())
    try:
        yield watch
    finally:
        watch.close()
        canceled.cancel()


def test_each_wait_returns_what_came_and_starts_no_task() -> None:
    async def test() -> None:
        most_tasks = 0

        async def chunk(i: int) -> int:
            nonlocal most_tasks
            await asyncio.sleep(0)  # a real suspension, as a socket read has
            most_tasks = max(most_tasks, len(asyncio.all_tasks()))
            return i

        async with watching() as watch:
            tasks_before = len(asyncio.all_tasks())
            got = [await watch.wait(chunk(i), 5.0) for i in range(100)]
        assert got == list(range(100))
        # The old wait made a task of every chunk (and asyncio.wait a waiter).
        assert most_tasks == tasks_before

    run(test)


def test_an_iterator_that_ends_is_none() -> None:
    async def test() -> None:
        async def empty():
            return
            yield

        async with watching() as watch:
            assert await watch.wait(empty().__anext__(), 5.0) is None

    run(test)


def test_silence_past_the_deadline_on_the_clock_is_a_timeout() -> None:
    async def test() -> None:
        clock = FakeClock()
        upstream = Silent()
        async with watching(clock=clock) as watch:
            waiting = asyncio.ensure_future(watch.wait(upstream.next(), 30.0))
            await asyncio.sleep(0.05)
            assert not waiting.done()  # the wall clock moved, the path's clock didn't
            clock.advance(30.0)
            with pytest.raises(asyncio.TimeoutError):
                await waiting
        assert upstream.ended

    run(test)


def test_a_liveness_problem_ends_a_silent_wait_as_a_worker_failure() -> None:
    async def test() -> None:
        problem: list[str] = []
        upstream = Silent()
        async with watching(liveness=lambda: problem[0] if problem else None) as watch:
            waiting = asyncio.ensure_future(watch.wait(upstream.next(), 30.0))
            await asyncio.sleep(0.05)
            problem.append("the worker process exited")
            with pytest.raises(WorkerFailure, match="exited"):
                await waiting
        assert upstream.ended

    run(test)


def test_the_jobs_cancel_ends_the_wait_with_canceled() -> None:
    async def test() -> None:
        cancel = asyncio.Event()
        upstream = Silent()
        async with watching(cancel=cancel) as watch:
            waiting = asyncio.ensure_future(watch.wait(upstream.next(), 30.0))
            await asyncio.sleep(0.02)
            cancel.set()
            assert await waiting is _CANCELED
            assert upstream.ended
            # Once canceled, a later wait doesn't start its upstream read at all.
            later = Silent()
            assert await watch.wait(later.next(), 30.0) is _CANCELED
            assert not later.ended

    run(test)


def test_a_cancel_from_outside_goes_on_up_and_is_not_taken_for_ours() -> None:
    async def test() -> None:
        async with watching() as watch:
            task = asyncio.ensure_future(watch.wait(Silent().next(), 30.0))
            await asyncio.sleep(0.02)
            task.cancel()  # a shutdown
            with pytest.raises(asyncio.CancelledError):
                await task

    run(test)


def test_after_an_interruption_the_task_can_wait_again() -> None:
    # The watch takes its own cancel back (uncancel): the attempt's task may
    # still await its cleanup (closing the response) without a stray cancel.
    async def test() -> None:
        clock = FakeClock()

        async def move_the_clock() -> None:
            await asyncio.sleep(0.02)
            clock.advance(31.0)

        async def attempt(watch: UpstreamWatch) -> str:
            mover = asyncio.ensure_future(move_the_clock())
            with pytest.raises(asyncio.TimeoutError):
                await watch.wait(Silent().next(), 30.0)
            await asyncio.sleep(0.01)  # would raise CancelledError if the cancel were left standing
            task = asyncio.current_task()
            assert task is not None and task.cancelling() == 0
            await mover
            return "closed cleanly"

        async with watching(clock=clock) as watch:
            assert await attempt(watch) == "closed cleanly"

    run(test)
