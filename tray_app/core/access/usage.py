"""Who used what: requests and tokens per key (or per app name when no keys
are set), by path, with how many were degraded, refused or cancelled.

`UsageBook` is the counting, pure: a bucket per local day, today and the 7
before kept, and a since-start total for /metrics (counters must only grow).
The number of names per bucket is bounded, the rest counted as "other", so a
client making up names can't grow the file, /status or /metrics.
`UsageStore` keeps the book in a small JSON file, written atomically and at
most every SAVE_INTERVAL_S (and at shutdown), so a restart loses nothing.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import Any, Callable

from ..base.files import write_atomically

log = logging.getLogger(__name__)

PATHS = ("gpu", "cpu", "peer")
MAX_NAMES = 64
OTHER = "other"
# Today and the 7 days before it.
HISTORY_DAYS = 8
SAVE_INTERVAL_S = 10.0
USAGE_FILE = "usage.json"
_FORMAT = 1


@dataclass(frozen=True)
class Outcome:
    """What one request did, as usage counts it."""

    path: str | None = None     # gpu, cpu or peer; None = it never ran
    tokens_in: int = 0
    tokens_out: int = 0
    degraded: bool = False      # served by the CPU or a peer because the GPU couldn't
    refused: bool = False       # turned away (a limit, a full queue) without running
    cancelled: bool = False


def empty_counts() -> dict[str, Any]:
    return {"requests": 0, "tokens_in": 0, "tokens_out": 0, "degraded": 0, "refused": 0, "cancelled": 0,
            "paths": {path: {"requests": 0, "tokens_in": 0, "tokens_out": 0} for path in PATHS}}


def add_outcome(counts: dict[str, Any], outcome: Outcome) -> None:
    counts["requests"] += 1
    counts["tokens_in"] += outcome.tokens_in
    counts["tokens_out"] += outcome.tokens_out
    counts["degraded"] += int(outcome.degraded)
    counts["refused"] += int(outcome.refused)
    counts["cancelled"] += int(outcome.cancelled)
    if outcome.path in PATHS:
        by_path = counts["paths"][outcome.path]
        by_path["requests"] += 1
        by_path["tokens_in"] += outcome.tokens_in
        by_path["tokens_out"] += outcome.tokens_out


def add_counts(total: dict[str, Any], more: dict[str, Any]) -> None:
    for field in ("requests", "tokens_in", "tokens_out", "degraded", "refused", "cancelled"):
        total[field] += more[field]
    for path in PATHS:
        for field in ("requests", "tokens_in", "tokens_out"):
            total["paths"][path][field] += more["paths"][path][field]


def _bounded_name(bucket: dict[str, Any], name: str, max_names: int) -> str:
    """`name`, or OTHER once the bucket holds max_names others."""
    if name in bucket or len(bucket) < max_names:
        return name
    return OTHER


class UsageBook:
    def __init__(self, days: dict[str, dict[str, Any]] | None = None, max_names: int = MAX_NAMES) -> None:
        # {"2026-12-01": {name: counts}}, ISO local dates.
        self.days: dict[str, dict[str, Any]] = days or {}
        self.since_start: dict[str, Any] = {}
        self.max_names = max_names

    def record(self, name: str, outcome: Outcome, today: date) -> None:
        bucket = self.days.setdefault(today.isoformat(), {})
        # One fewer than the limit for real names, so OTHER itself fits.
        for counts_by_name in (bucket, self.since_start):
            who = _bounded_name(counts_by_name, name, self.max_names - 1) if name != OTHER else OTHER
            add_outcome(counts_by_name.setdefault(who, empty_counts()), outcome)
        self.prune(today)

    def prune(self, today: date) -> None:
        oldest = (today - timedelta(days=HISTORY_DAYS - 1)).isoformat()
        for day in [d for d in self.days if d < oldest]:
            del self.days[day]

    def snapshot(self, today: date) -> dict[str, Any]:
        """/status["usage"]: per name, today's counts and the last 7 days'
        (today included), and each day's, oldest first."""
        self.prune(today)
        today_key = today.isoformat()
        week = (today - timedelta(days=6)).isoformat()
        by_name: dict[str, dict[str, Any]] = {}
        for day, bucket in sorted(self.days.items()):
            for name, counts in bucket.items():
                entry = by_name.setdefault(name, {"today": empty_counts(), "last_7_days": empty_counts()})
                if day == today_key:
                    add_counts(entry["today"], counts)
                if day >= week:
                    add_counts(entry["last_7_days"], counts)
        return {"today": today_key, "by_name": by_name,
                "days": [{"day": day, "by_name": bucket} for day, bucket in sorted(self.days.items())]}

    def to_json(self) -> dict[str, Any]:
        return {"format": _FORMAT, "days": self.days}

    @classmethod
    def from_json(cls, data: Any, max_names: int = MAX_NAMES) -> "UsageBook":
        """A book from the file; whatever doesn't look like one starts a new
        book (the file is a record of use, not configuration worth failing
        a start over)."""
        if not isinstance(data, dict) or data.get("format") != _FORMAT or not isinstance(data.get("days"), dict):
            return cls(max_names=max_names)
        days: dict[str, dict[str, Any]] = {}
        for day, bucket in data["days"].items():
            if not isinstance(bucket, dict):
                continue
            try:
                date.fromisoformat(day)
                days[day] = {str(name): _checked_counts(counts) for name, counts in list(bucket.items())[:max_names]}
            except (ValueError, TypeError, KeyError):
                continue
        return cls(days, max_names)


def _checked_counts(counts: Any) -> dict[str, Any]:
    checked = empty_counts()
    add_counts(checked, counts)  # raises on a missing or non-numeric field
    return checked


def default_usage_path() -> Path:
    import platformdirs

    from ..config import APP_NAME

    return Path(platformdirs.user_state_dir(APP_NAME)) / USAGE_FILE


class UsageStore:
    """The book and its file. `record` counts at once and says when a save is
    due (at most every SAVE_INTERVAL_S); the caller writes on a thread, since
    an fsync must not hold up the event loop. `save` writes what is left."""

    def __init__(self, path: Path | None = None, clock: Callable[[], float] | None = None,
                 today: Callable[[], date] = date.today) -> None:
        import time

        self.path = path or default_usage_path()
        self._clock = clock or time.monotonic
        self._today = today
        self.book = UsageBook.from_json(self._read())
        self._dirty = False
        self._last_save = self._clock()
        self._lock = threading.Lock()

    def _read(self) -> Any:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("usage file %s unreadable (%s); starting a new one", self.path, exc)
            return None

    def record(self, name: str, outcome: Outcome) -> bool:
        """Count one request; True when a save is due now (the caller runs
        `save` off the event loop)."""
        self.book.record(name, outcome, self._today())
        self._dirty = True
        return self._clock() - self._last_save >= SAVE_INTERVAL_S

    def snapshot(self) -> dict[str, Any]:
        return self.book.snapshot(self._today())

    def take_unsaved(self) -> bytes | None:
        """The book as the file's bytes, if it changed since the last save;
        made on the event loop, where the book is changed, and written by
        `write` anywhere."""
        if not self._dirty:
            return None
        self._dirty = False
        self._last_save = self._clock()
        return json.dumps(self.book.to_json(), separators=(",", ":")).encode()

    def write(self, data: bytes) -> None:
        # Two saves on two threads must not interleave their temp files.
        with self._lock:
            try:
                write_atomically(self.path, data, mode=0o600)
            except OSError as exc:
                self._dirty = True
                log.warning("can't save usage to %s: %s", self.path, exc)

    def save(self) -> None:
        data = self.take_unsaved()
        if data is not None:
            self.write(data)
