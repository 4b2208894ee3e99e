"""Failover time as a number users can see: from the GPU's fault to the
first token of the request's replay on the CPU (the first byte a streaming
client gets), by kind of fault.

Pure: `fault_of` reads a failed attempt; `FailoverTimes` keeps the last
values for /status. The histogram for /metrics is the metrics module's.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass
from typing import Any, Protocol

FAULT_KINDS = ("crash", "hang", "give_back")
# Enough replays for a stable median, few enough that an old bad day ages out.
KEPT_PER_KIND = 50


class FailedAttempt(Protocol):
    """What fault_of reads of a jobs.Attempt (jobs.Job holds a Fault)."""

    outcome: str
    started_at: float
    first_token_at: float | None
    last_token_at: float
    ended_at: float | None


@dataclass(frozen=True)
class Fault:
    kind: str     # one of FAULT_KINDS
    at: float     # the backends' clock


def fault_of(attempt: FailedAttempt, *, gave_back: bool) -> Fault:
    """When and how the GPU failed this attempt. A crash or a give-back is
    seen as it happens (the connection breaks). A hang is seen only when a
    deadline runs out, but the client has waited since the worker went
    quiet: its last token, or the request going in when none came."""
    assert attempt.ended_at is not None, "a failed attempt has ended"
    if gave_back:
        return Fault("give_back", attempt.ended_at)
    if attempt.outcome == "failed: hang":
        silent_from = attempt.last_token_at if attempt.first_token_at is not None else attempt.started_at
        return Fault("hang", silent_from)
    return Fault("crash", attempt.ended_at)


class FailoverTimes:
    """The last failover times per kind of fault, for /status and the panel."""

    def __init__(self) -> None:
        self._times: dict[str, collections.deque[float]] = {}
        self._counts: dict[str, int] = {}
        self._last: tuple[str, float] | None = None
        # Failovers that continued a cut answer from its text, and the last one's seam.
        self._resumes = 0
        self._last_resume_s: float | None = None

    def record(self, kind: str, seconds: float, *, resumed: bool = False) -> None:
        self._times.setdefault(kind, collections.deque(maxlen=KEPT_PER_KIND)).append(seconds)
        self._counts[kind] = self._counts.get(kind, 0) + 1
        self._last = (kind, seconds)
        if resumed:
            self._resumes += 1
            self._last_resume_s = seconds

    def snapshot(self) -> dict[str, Any]:
        every = [seconds for times in self._times.values() for seconds in times]
        return {
            "count": sum(self._counts.values()),
            "last_s": round(self._last[1], 3) if self._last else None,
            "last_fault": self._last[0] if self._last else None,
            "p50_s": round(statistics.median(every), 3) if every else None,
            "by_fault": {kind: {"count": self._counts[kind], "last_s": round(times[-1], 3),
                                "p50_s": round(statistics.median(times), 3)}
                         for kind, times in sorted(self._times.items())},
            "resumes": self._resumes,
            "resume_last_s": round(self._last_resume_s, 3) if self._last_resume_s is not None else None,
        }
