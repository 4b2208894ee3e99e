"""How long a request will take on one path: measured decode speed by how
many slots are busy, and the finish time of a request behind a queue.

Slots running together share the cores (on a GPU, the memory bandwidth), so
one stream's speed is not what each of four streams gets. Each path keeps a
small table of decode speed per number of busy slots, fed by every finished
request, and the estimate plays the queue forward with the speed that each
stretch of it will actually see. Pure, apart from `BusySpeeds` keeping its
own table; the dispatcher feeds it and reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

# Speeds per busy count are kept up to this many slots; more share this row.
MAX_TRACKED_BUSY = 64
# The simulation stops after this many requests ahead and counts the rest at
# the aggregate speed (a bound on the work per estimate, not a cap on queues).
MAX_SIMULATED_AHEAD = 512


@dataclass(frozen=True)
class Work:
    """What one request still has to do."""

    prompt_tokens: int   # still to read (0 once its first token came)
    answer_tokens: int   # still to write (its expected length, less what it wrote)


@dataclass(frozen=True)
class SpeedCurve:
    """One stream's decode speed by the number of busy slots, as measured,
    with the single-stream speed (measured, or the configured prior) for
    counts not measured yet."""

    single_tokens_per_s: float
    prompt_tokens_per_s: float
    # (busy slots, tokens/s of one stream), measured.
    measured: tuple[tuple[int, float], ...] = ()

    def decode_tokens_per_s(self, busy: int) -> float:
        """One stream's speed with `busy` slots decoding. Not measured at this
        count: the nearest measured count below it with the same aggregate
        (the cores are shared, not multiplied), or the single-stream speed
        shared the same way (a stream among fewer slots is no slower than one
        among more)."""
        busy = max(1, min(busy, MAX_TRACKED_BUSY))
        table = dict(self.measured)
        if busy in table:
            return table[busy]
        below = [count for count in table if count < busy]
        if below:
            count = max(below)
            return table[count] * count / busy
        # Only counts above were measured: the single-stream speed shared the
        # same way, but no slower than a stream among more slots measured.
        shared = self.single_tokens_per_s / busy
        return max(shared, table[min(table)]) if table else shared


class BusySpeeds:
    """Decode speed of one worker per number of busy slots, each count its
    own EWMA so one odd request can't swing it."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self._speeds: dict[int, float] = {}
        self._samples: dict[int, int] = {}

    def observe(self, busy: float, tokens_per_s: float) -> None:
        count = max(1, min(MAX_TRACKED_BUSY, round(busy)))
        if tokens_per_s <= 0:
            return
        previous = self._speeds.get(count)
        self._speeds[count] = tokens_per_s if previous is None else \
            self.alpha * tokens_per_s + (1 - self.alpha) * previous
        self._samples[count] = self._samples.get(count, 0) + 1

    def curve(self, single_tokens_per_s: float, prompt_tokens_per_s: float) -> SpeedCurve:
        return SpeedCurve(single_tokens_per_s, prompt_tokens_per_s, tuple(sorted(self._speeds.items())))

    def snapshot(self) -> dict[str, dict[str, float | int]]:
        """For /status: tokens/s of one stream and samples, by busy slots."""
        return {str(count): {"tokens_per_s": round(speed, 2), "samples": self._samples[count]}
                for count, speed in sorted(self._speeds.items())}


def mean_busy(start: float, end: float, others: Iterable[tuple[float, float | None]]) -> float:
    """How many requests were inside the process on average over [start, end]:
    this one plus each other's overlap with it, weighted by time. An other
    still running (end None) runs to `end`."""
    span = end - start
    if span <= 0:
        return 1.0
    shared = 0.0
    for other_start, other_end in others:
        overlap = min(end, other_end if other_end is not None else end) - max(start, other_start)
        if overlap > 0:
            shared += overlap
    return 1.0 + shared / span


@dataclass(frozen=True)
class PathLoad:
    """One path's slots and the work on them and queued for them, in order."""

    slots: int
    running: tuple[Work, ...]
    queued: tuple[Work, ...]
    speeds: SpeedCurve
    # Seconds before the path can start anything (a worker still loading).
    not_before_s: float = 0.0


@dataclass(frozen=True)
class Estimate:
    wait_s: float      # until a slot is this request's
    latency_s: float   # until its last token


def estimate(load: PathLoad, own: Work) -> Estimate:
    """When a new request behind everything in `load` gets a slot and
    finishes: the queue played forward, each request reading its prompt and
    then writing its answer at the speed for the number of slots busy at
    the time, a freed slot going to the next in line."""
    slots = max(1, load.slots)
    speeds = load.speeds
    prompt_speed = max(1e-6, speeds.prompt_tokens_per_s)
    queued = list(load.queued)
    skipped_s = 0.0
    if len(queued) > MAX_SIMULATED_AHEAD:
        # Far back in a long queue: the work beyond the bound at the full
        # lane's aggregate speed, added to the wait.
        rest, queued = queued[MAX_SIMULATED_AHEAD:], queued[:MAX_SIMULATED_AHEAD]
        aggregate = speeds.decode_tokens_per_s(slots) * slots
        skipped_s = sum(w.answer_tokens / aggregate + w.prompt_tokens / prompt_speed / slots for w in rest)
    # Each running entry: [prompt tokens left, answer tokens left, is it ours].
    running = [[float(w.prompt_tokens), float(w.answer_tokens), False] for w in load.running[:slots]]
    queued = list(load.running[slots:]) + queued
    pending = [[float(w.prompt_tokens), float(w.answer_tokens), False] for w in queued]
    pending.append([float(own.prompt_tokens), float(own.answer_tokens), True])
    now = load.not_before_s + skipped_s
    wait = None
    while True:
        while pending and len(running) < slots:
            entry = pending.pop(0)
            if entry[2]:
                wait = now
            running.append(entry)
        decode_speed = max(1e-6, speeds.decode_tokens_per_s(len(running)))
        step = min(p / prompt_speed + a / decode_speed for p, a, _ in running)
        now += step
        still = []
        finished_own = False
        for entry in running:
            left = step
            read = min(entry[0], left * prompt_speed)
            entry[0] -= read
            left -= read / prompt_speed
            entry[1] = max(0.0, entry[1] - left * decode_speed)
            if entry[0] <= 1e-9 and entry[1] <= 1e-9:
                finished_own = finished_own or entry[2]
            else:
                still.append(entry)
        running = still
        if finished_own:
            assert wait is not None
            import os, json, time as _t  # TEMP DEBUG
            if os.environ.get("ESTIMATE_DEBUG"):
                with open(os.environ["ESTIMATE_DEBUG"], "a") as f:
                    f.write(json.dumps({"t": _t.time(), "slots": load.slots, "running": [[w.prompt_tokens, w.answer_tokens] for w in load.running], "queued": [[w.prompt_tokens, w.answer_tokens] for w in load.queued], "own": [own.prompt_tokens, own.answer_tokens], "single": speeds.single_tokens_per_s, "prompt": speeds.prompt_tokens_per_s, "measured": speeds.measured, "nb": load.not_before_s, "wait": wait, "latency": now}) + "\n")
            return Estimate(round(wait, 3), round(now, 3))
