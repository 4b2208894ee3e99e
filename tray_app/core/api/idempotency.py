"""Idempotency-Key: one execution per key, its result handed to every retry.

The store is bounded in every direction a client controls: how many keys it
keeps, how many bytes of recorded answers it holds, how long a key may be,
how long an entry lives, and how long a twin waits for the first request's
result. Entries sit in insertion order, which is also expiry order (one TTL
for all), so expiring, and making room, is a pop from the front, never a
scan of the whole store.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..dispatch.jobs import JobFailed

IDEMPOTENCY_TTL_S = 600.0
MAX_ENTRIES = 2048
# 2048 long streamed answers would be gigabytes: the recorded answers share
# this many bytes, and past it the oldest are let go (their keys run afresh).
MAX_RECORDED_BYTES = 64 * 1024 * 1024
# Stripe allows 255; a UUID is 36. Longer keys only cost memory.
MAX_KEY_LENGTH = 255
# A twin waits this long for the first request's result, then gets a 409 it
# can retry; the first request keeps running and its result is kept.
WAIT_TIMEOUT_S = 900.0


@dataclass
class IdempotencyEntry:
    fingerprint: str
    created: float
    job_id: str
    done: asyncio.Future
    recorded_bytes: int = 0  # what its answer holds, once it has one


def recorded_size(result: Any) -> int:
    """Bytes a recorded answer keeps alive: its body, stream chunks and
    headers. The store knows nothing of their shape, so it counts every
    string and bytes object inside."""
    if isinstance(result, (bytes, bytearray, memoryview, str)):
        return len(result)
    if isinstance(result, Mapping):
        return sum(recorded_size(k) + recorded_size(v) for k, v in result.items())
    if isinstance(result, (list, tuple)):
        return sum(recorded_size(item) for item in result)
    return 0


class IdempotencyStore:
    def __init__(self, clock: Callable[[], float] = time.monotonic, *, ttl_s: float = IDEMPOTENCY_TTL_S,
                 max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_RECORDED_BYTES,
                 wait_timeout_s: float = WAIT_TIMEOUT_S) -> None:
        self._clock = clock
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._wait_timeout_s = wait_timeout_s
        # (owner, key) -> its entry: an owner is an API key's identity ("" with
        # no keys), so one key's Idempotency-Keys are not another's.
        self._entries: collections.OrderedDict[tuple[str, str], IdempotencyEntry] = collections.OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def recorded_bytes(self) -> int:
        return self._bytes

    @staticmethod
    def check_key(key: str) -> None:
        # Printable ASCII only: the key is forwarded to peers as a header, and
        # httpx can't encode anything else (the peer would be blamed for it).
        if len(key) > MAX_KEY_LENGTH or not all(" " <= c <= "~" for c in key):
            raise JobFailed(400, "invalid_idempotency_key",
                            f"Idempotency-Key must be at most {MAX_KEY_LENGTH} printable ASCII characters "
                            f"(this one has {len(key)}); a UUID is a good key",
                            param="Idempotency-Key")

    def lookup(self, key: str, fingerprint: str, owner: str = "") -> IdempotencyEntry | None:
        """The entry a retry should answer from, None if the key is new to
        its owner. Raises JobFailed (422) for a key reused with another body."""
        self.check_key(key)
        self._expire()
        entry = self._entries.get((owner, key))
        if entry is not None and entry.fingerprint != fingerprint:
            raise JobFailed(422, "idempotency_key_reused",
                            f"Idempotency-Key {key!r} was already used with a different request body in the last "
                            f"{self._ttl_s / 60:g} minutes; use a new key for a new request")
        return entry

    def claim(self, key: str, fingerprint: str, job_id: str, owner: str = "") -> asyncio.Future:
        """Take the key for a request about to run. Call with no await since
        lookup(), so a twin arriving meanwhile finds the claim and waits."""
        future = asyncio.get_running_loop().create_future()
        key = (owner, key)
        self._drop(key)
        entry = IdempotencyEntry(fingerprint, self._clock(), job_id, future)
        self._entries[key] = entry
        future.add_done_callback(lambda done: self._recorded(key, entry))
        while len(self._entries) > self._max_entries:
            # The oldest recorded answer goes first: under a flood of fresh keys a
            # retry of a recent request still finds its result, and a claim still
            # running keeps its key (dropping it would let a twin run a second
            # time), unless every entry is running: the count bound holds anyway.
            oldest_recorded = next((k for k, e in self._entries.items() if e.done.done()), None)
            if oldest_recorded is not None:
                self._drop(oldest_recorded)
            else:
                self._drop_oldest()
        return future

    def forget(self, key: str, job_id: str | None = None, owner: str = "") -> None:
        """Let go of a key after a failure, so a retry with it runs for real.
        With job_id, only that request's claim (not a newer one) is dropped."""
        entry = self._entries.get((owner, key))
        if entry is not None and (job_id is None or entry.job_id == job_id):
            self._drop((owner, key))

    def _recorded(self, key: tuple[str, str], entry: IdempotencyEntry) -> None:
        """Count an answer's bytes once it is recorded, and make room for it.
        Twins already waiting have it through the future either way."""
        if self._entries.get(key) is not entry or entry.done.cancelled() or entry.done.exception() is not None:
            return  # forgotten or replaced before its answer came
        entry.recorded_bytes = recorded_size(entry.done.result())
        self._bytes += entry.recorded_bytes
        if entry.recorded_bytes > self._max_bytes:
            self._drop(key)  # larger than the whole store: kept by nobody
            return
        # The oldest answers go first. A claim still running holds no bytes
        # and keeps its key: dropping it would let a twin run a second time.
        recorded = (k for k, e in list(self._entries.items()) if e.done.done())
        while self._bytes > self._max_bytes:
            self._drop(next(recorded))

    def _drop(self, key: tuple[str, str]) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.recorded_bytes

    def _drop_oldest(self) -> None:
        self._drop(next(iter(self._entries)))

    async def wait(self, entry: IdempotencyEntry) -> Any:
        """The first request's recorded result; JobFailed (409) if it is still
        running after the wait deadline."""
        try:
            return await asyncio.wait_for(asyncio.shield(entry.done), self._wait_timeout_s)
        except asyncio.TimeoutError:
            raise JobFailed(409, "idempotency_key_in_progress",
                            f"the first request with this Idempotency-Key ({entry.job_id}) is still running after "
                            f"{self._wait_timeout_s:g} s; retry later with the same key to get its result",
                            retry_after_s=30.0) from None

    def _expire(self) -> None:
        cutoff = self._clock() - self._ttl_s
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.created > cutoff:
                return
            self._drop_oldest()
