"""Requests that crashed a worker, kept out for a while.

A request that segfaults a healthy worker would segfault the next one too, so
it is neither replayed nor let through again soon: a client that retries it
gets the same clear error at once, and the GPU is not taken down twice.
"""

from __future__ import annotations

import collections
import hashlib
import json
import time
from typing import Any, Callable

from .jobs import JobFailed

QUARANTINE_S = 600.0
MAX_ENTRIES = 256
# How the answer is delivered, not what is asked: a streamed retry of a
# request that crashed a worker is the same request.
_DELIVERY_FIELDS = ("stream", "stream_options")


def request_fingerprint(kind: str, body: dict[str, Any]) -> str:
    asked = {key: value for key, value in body.items() if key not in _DELIVERY_FIELDS}
    return hashlib.sha256(json.dumps([kind, asked], sort_keys=True, default=str).encode()).hexdigest()


class Quarantine:
    def __init__(self, clock: Callable[[], float] = time.monotonic, ttl_s: float = QUARANTINE_S) -> None:
        self._clock = clock
        self._ttl_s = ttl_s
        # fingerprint -> (when it was added, what it did); insertion order is expiry order.
        self._entries: collections.OrderedDict[str, tuple[float, str]] = collections.OrderedDict()
        # fingerprint -> (its latest hang, how many): see failover's HANGS_BEFORE_QUARANTINE.
        self._hangs: collections.OrderedDict[str, tuple[float, int]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def note_hang(self, fingerprint: str) -> int:
        """Count a hang of this request; how many it has made lately."""
        now = self._clock()
        for old in [fp for fp, (when, _) in self._hangs.items() if when <= now - self._ttl_s]:
            del self._hangs[old]
        count = self._hangs.pop(fingerprint, (now, 0))[1] + 1
        self._hangs[fingerprint] = (now, count)
        while len(self._hangs) > MAX_ENTRIES:
            self._hangs.popitem(last=False)
        return count

    def add(self, fingerprint: str, what_it_did: str) -> None:
        self._entries.pop(fingerprint, None)
        self._entries[fingerprint] = (self._clock(), what_it_did)
        while len(self._entries) > MAX_ENTRIES:
            self._entries.popitem(last=False)

    def refusal(self, fingerprint: str, request_id: str) -> JobFailed | None:
        """The error for a quarantined request, None if it may run."""
        self._expire()
        entry = self._entries.get(fingerprint)
        if entry is None:
            return None
        added, what_it_did = entry
        left_s = max(0.0, self._ttl_s - (self._clock() - added))
        return JobFailed(
            400, "request_crashed_worker",
            f"request {request_id} was not run: this request (or one identical to it) {what_it_did}, so it is not "
            f"re-run on another worker and is refused for {self._ttl_s / 60:g} minutes (another {left_s:.0f} s). "
            "Retrying it unchanged will not help; change the request or report it as a bug in the model server.")

    def _expire(self) -> None:
        cutoff = self._clock() - self._ttl_s
        while self._entries and next(iter(self._entries.values()))[0] <= cutoff:
            self._entries.popitem(last=False)
