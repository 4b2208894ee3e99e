"""The Idempotency-Key store's bounds: the bytes its recorded answers hold,
and which keys it takes at all. (Twins, reuse and expiry: test_dispatcher.py.)"""

from __future__ import annotations

import asyncio

import pytest

from tests.fakes.clock import FakeClock
from tray_app.core.api.idempotency import IdempotencyStore, recorded_size
from tray_app.core.dispatch.jobs import JobFailed


def json_answer(body_bytes: int) -> tuple:
    """The shape app.py records for a JSON answer."""
    return ("json", 200, {"x-request-id": "r"}, b"x" * body_bytes)


async def record(store: IdempotencyStore, key: str, answer) -> None:
    store.claim(key, "fp", f"req-{key}").set_result(answer)
    await asyncio.sleep(0)  # the store counts an answer's bytes in the future's callback


def test_recorded_size_counts_bodies_chunks_and_headers():
    assert recorded_size(("json", 200, {"ab": "cd"}, b"12345")) == len("json") + 4 + 5
    assert recorded_size(("stream", {}, [b"abc", b"de"], "text/event-stream")) == 6 + 5 + 17
    assert recorded_size({"answer": 42}) == len("answer")


async def test_recorded_answers_share_a_byte_cap_and_the_oldest_go_first():
    store = IdempotencyStore(FakeClock(), max_bytes=10_000)
    for key in ("a", "b", "c"):
        await record(store, key, json_answer(4_000))
    # "c" would make 12 KB: "a", the oldest, makes room for it.
    assert store.lookup("a", "fp") is None
    assert store.lookup("b", "fp") is not None and store.lookup("c", "fp") is not None
    assert store.recorded_bytes <= 10_000 and len(store) == 2


async def test_a_running_claim_keeps_its_key_when_room_is_made():
    store = IdempotencyStore(FakeClock(), max_bytes=10_000)
    running = store.claim("running", "fp", "req-running")  # the oldest entry, no answer yet
    await record(store, "done-1", json_answer(6_000))
    await record(store, "done-2", json_answer(6_000))
    assert store.lookup("running", "fp") is not None  # a twin still waits for it, not runs again
    assert store.lookup("done-1", "fp") is None and store.lookup("done-2", "fp") is not None
    running.set_result(json_answer(1_000))
    await asyncio.sleep(0)
    assert store.recorded_bytes == 7_000 + 2 * len("json") + 2 * len("x-request-id") + 2


async def test_a_flood_of_new_keys_drops_recorded_answers_before_a_running_claim():
    """A claim may run for a while (its remote images fetched first): fresh keys
    arriving meanwhile push recorded answers out, not the claim a twin waits on."""
    store = IdempotencyStore(FakeClock(), max_entries=3)
    running = store.claim("running", "fp", "req-running")
    for key in ("done-1", "done-2", "done-3"):
        await record(store, key, json_answer(10))
    assert store.lookup("running", "fp") is not None and store.lookup("done-1", "fp") is None
    assert len(store) == 3
    # All running: the oldest claim goes, so the count bound still holds.
    store = IdempotencyStore(FakeClock(), max_entries=2)
    for key in ("a", "b", "c"):
        store.claim(key, "fp", f"req-{key}")
    assert store.lookup("a", "fp") is None and len(store) == 2


async def test_an_answer_larger_than_the_cap_is_not_kept_but_its_twins_get_it():
    store = IdempotencyStore(FakeClock(), max_bytes=10_000)
    await record(store, "small", json_answer(100))
    done = store.claim("huge", "fp", "req-huge")
    twin = asyncio.create_task(store.wait(store.lookup("huge", "fp")))
    await asyncio.sleep(0)
    done.set_result(json_answer(50_000))
    assert (await twin)[3] == b"x" * 50_000
    assert store.lookup("huge", "fp") is None and store.lookup("small", "fp") is not None
    assert store.recorded_bytes == recorded_size(json_answer(100))


async def test_forgetting_and_expiry_give_the_bytes_back():
    clock = FakeClock()
    store = IdempotencyStore(clock, ttl_s=600.0)
    await record(store, "failed", json_answer(500))
    store.forget("failed", "req-failed")
    assert store.recorded_bytes == 0
    await record(store, "old", json_answer(500))
    clock.now += 601
    assert store.lookup("old", "fp") is None and store.recorded_bytes == 0


@pytest.mark.parametrize("key", ["ключ-1", "caf\u00e9", "\u00c3\u00a9", "tab\there", "nul\x00"])
def test_a_key_that_is_not_printable_ascii_is_a_400(key):
    for fine in ("550e8400-e29b-41d4-a716-446655440000", "order 42: retry ~1", "!" * 255):
        IdempotencyStore.check_key(fine)
    # Starlette hands header bytes over as latin-1: "é" sent as UTF-8 arrives as "Ã©".
    with pytest.raises(JobFailed) as caught:
        IdempotencyStore.check_key(key)
    assert (caught.value.status, caught.value.code) == (400, "invalid_idempotency_key")
    assert "printable ASCII" in caught.value.message


async def test_each_owner_has_its_own_keys():
    """Key B sending key A's Idempotency-Key and body used to get A's answer;
    with another body, a 422 that told B the key was in use."""
    store = IdempotencyStore(FakeClock())
    store.claim("k", "fp", "req-a", owner="key-a").set_result(json_answer(10))
    await asyncio.sleep(0)
    assert store.lookup("k", "fp", owner="key-a") is not None
    assert store.lookup("k", "fp", owner="key-b") is None
    assert store.lookup("k", "other body", owner="key-b") is None
    with pytest.raises(JobFailed):
        store.lookup("k", "other body", owner="key-a")
