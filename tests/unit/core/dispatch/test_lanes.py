import asyncio

import pytest

from tray_app.core.dispatch.lanes import Lane, Redirected


async def test_slots_are_handed_over_in_order():
    lane = Lane("cpu", concurrency=1, queue_limit=4)
    assert await lane.acquire("a") == 0.0
    second = asyncio.ensure_future(lane.acquire("b"))
    third = asyncio.ensure_future(lane.acquire("c"))
    await asyncio.sleep(0)
    assert lane.waiting_ids == ["b", "c"] and lane.position("c") == 2
    lane.release("a")
    await second
    assert lane.running_ids == ["b"] and not third.done()
    lane.release("b")
    await third
    assert lane.running_ids == ["c"]


async def test_front_of_queue_for_replays():
    lane = Lane("cpu", concurrency=1, queue_limit=4)
    await lane.acquire("a")
    new = asyncio.ensure_future(lane.acquire("new"))
    await asyncio.sleep(0)
    replay = asyncio.ensure_future(lane.acquire("replay", front=True))
    await asyncio.sleep(0)
    assert lane.waiting_ids == ["replay", "new"]
    lane.release("a")
    await replay
    assert not new.done()
    new.cancel()


async def test_cancelled_waiter_leaves_the_queue_and_slot_passes_on():
    lane = Lane("cpu", concurrency=1, queue_limit=4)
    await lane.acquire("a")
    waiting = asyncio.ensure_future(lane.acquire("b"))
    later = asyncio.ensure_future(lane.acquire("c"))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert lane.waiting_ids == ["c"]
    lane.release("a")
    await later
    assert lane.running_ids == ["c"]


async def test_redirect_sends_every_waiter_away():
    lane = Lane("gpu", concurrency=1, queue_limit=4)
    await lane.acquire("a")
    waiters = [asyncio.ensure_future(lane.acquire(x)) for x in "bc"]
    await asyncio.sleep(0)
    assert lane.redirect_waiting("gpu died") == 2
    for waiter in waiters:
        with pytest.raises(Redirected, match="gpu died"):
            await waiter
    assert lane.snapshot()["depth"] == 0 and lane.snapshot()["running"] == 1


async def test_oldest_wait_uses_the_clock():
    now = [100.0]
    lane = Lane("cpu", concurrency=1, queue_limit=4, clock=lambda: now[0])
    await lane.acquire("a")
    waiter = asyncio.ensure_future(lane.acquire("b"))
    await asyncio.sleep(0)
    now[0] = 103.5
    assert lane.oldest_wait_s() == 3.5
    lane.release("a")
    assert await waiter == 3.5


async def test_join_is_synchronous_and_leave_gives_back_place_or_slot():
    lane = Lane("cpu", concurrency=1, queue_limit=4)
    assert lane.join("a") is None and lane.running_ids == ["a"]
    place = lane.join("b")
    # Visible in the queue at once, before anyone awaits anything.
    assert place is not None and lane.position("b") == 1
    lane.leave("b")
    assert lane.waiting_ids == [] and place.cancelled()
    lane.leave("a")
    assert lane.running_ids == []
    lane.leave("a")  # twice is harmless
    assert lane.join("c") is None
