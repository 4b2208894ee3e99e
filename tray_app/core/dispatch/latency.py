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
class FirstToken:
    """Time to first token as a line fitted to the prompt's length: a fixed
    part (the request's way in, one decode step beside the others) and a part
    per prompt token. Prompt tokens over that time alone called a 38-token
    prompt's 0.1 s "380 tokens/s" and so priced a 366-token prompt at a
    second that llama-server (which also keeps a slot's prompt cached) took
    a tenth of."""

    fixed_s: float
    per_token_s: float

    def seconds(self, prompt_tokens: float) -> float:
        return self.fixed_s + self.per_token_s * prompt_tokens if prompt_tokens > 0 else 0.0


@dataclass(frozen=True)
class SpeedCurve:
    """One stream's decode speed by the number of busy slots, as measured,
    with the single-stream speed (measured, or the configured prior) for
    counts not measured yet."""

    single_tokens_per_s: float
    prompt_tokens_per_s: float
    # (busy slots, tokens/s of one stream), measured.
    measured: tuple[tuple[int, float], ...] = ()
    # Measured time to first token; None: the prompt at prompt_tokens_per_s.
    first_token: FirstToken | None = None

    def prompt_s(self, prompt_tokens: float) -> float:
        """Seconds from a slot to the first token for a prompt this long."""
        if self.first_token is not None:
            return self.first_token.seconds(prompt_tokens)
        return prompt_tokens / max(1e-6, self.prompt_tokens_per_s)

    def decode_tokens_per_s(self, busy: int) -> float:
        """One stream's speed with `busy` slots decoding. Not measured at this
        count: between two measured counts, the aggregate (all streams
        together) drawn straight from one to the other; above them all, the
        highest's aggregate (the cores are shared, not multiplied); below
        them all, see below_measured."""
        busy = max(1, min(busy, MAX_TRACKED_BUSY))
        table = dict(self.measured)
        if busy in table:
            return table[busy]
        below = [count for count in table if count < busy]
        above = [count for count in table if count > busy]
        if below and above:
            low, high = max(below), min(above)
            low_total, high_total = table[low] * low, table[high] * high
            return (low_total + (high_total - low_total) * (busy - low) / (high - low)) / busy
        if below:
            count = max(below)
            return table[count] * count / busy
        if table:
            lowest = min(table)
            return below_measured(busy, lowest, table[lowest])
        return self.single_tokens_per_s / busy


def below_measured(busy: int, lowest: int, lowest_tokens_per_s: float) -> float:
    """One stream's speed with fewer slots busy than any measured: no slower
    than among `lowest` (fewer streams don't slow each other more) and no
    faster than `lowest`'s aggregate split among `busy` (fewer streams don't
    compute more in all). Between those bounds lies the truth: cores that
    are shared put it at the fast one, a GPU that batches at the slow one.
    Their geometric middle is never off by more than the square root of
    their ratio either way. Taking the slow bound (the speed among more
    slots, as before) made the tail of a queue on the simulated GPU, where
    only 3 and 4 busy slots were ever measured, take twice its time."""
    return lowest_tokens_per_s * (lowest / busy) ** 0.5


class BusySpeeds:
    """Decode speed of one worker per number of busy slots, each count its
    own EWMA so one odd request can't swing it; and its time to first token
    by prompt length."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self._speeds: dict[int, float] = {}
        self._samples: dict[int, int] = {}
        self.first_token = FirstTokenFit()

    def observe(self, busy: float, tokens_per_s: float) -> None:
        count = max(1, min(MAX_TRACKED_BUSY, round(busy)))
        if tokens_per_s <= 0:
            return
        previous = self._speeds.get(count)
        self._speeds[count] = tokens_per_s if previous is None else \
            self.alpha * tokens_per_s + (1 - self.alpha) * previous
        self._samples[count] = self._samples.get(count, 0) + 1

    def curve(self, single_tokens_per_s: float, prompt_tokens_per_s: float) -> SpeedCurve:
        return SpeedCurve(single_tokens_per_s, prompt_tokens_per_s, tuple(sorted(self._speeds.items())),
                          self.first_token.fit(prompt_tokens_per_s))

    def snapshot(self) -> dict[str, dict[str, float | int]]:
        """For /status: tokens/s of one stream and samples, by busy slots."""
        return {str(count): {"tokens_per_s": round(speed, 2), "samples": self._samples[count]}
                for count, speed in sorted(self._speeds.items())}


class FirstTokenFit:
    """Time to first token against prompt length, a straight line fitted by
    least squares over the recent requests (each sample's weight decays by
    `1 - alpha` per newer one), so short and long prompts both shape it and
    a cached prompt's quick start counts as often as it happens."""

    def __init__(self, alpha: float = 0.1) -> None:
        self.alpha = alpha
        # Decayed sums: weight, x, y, x*x, x*y (x prompt tokens, y seconds).
        self._sums = [0.0] * 5

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        if prompt_tokens <= 0 or seconds <= 0:
            return
        x, y = float(prompt_tokens), seconds
        keep = 1 - self.alpha
        self._sums = [keep * total + part for total, part in zip(self._sums, (1.0, x, y, x * x, x * y))]

    def fit(self, prior_prompt_tokens_per_s: float) -> FirstToken | None:
        """The line, or None before any sample. With one prompt length seen
        (no slope to fit) or a slope the samples make negative, the line
        goes through their mean at the prior speed per token."""
        weight, sum_x, sum_y, sum_xx, sum_xy = self._sums
        if weight <= 0:
            return None
        mean_x, mean_y = sum_x / weight, sum_y / weight
        spread = sum_xx / weight - mean_x * mean_x
        # Lengths that differ by under a token or so: no slope to read.
        slope = (sum_xy / weight - mean_x * mean_y) / spread if spread > 1.0 else -1.0
        if slope < 0:
            slope = 1 / max(1e-6, prior_prompt_tokens_per_s)
        fixed = mean_y - slope * mean_x
        if fixed < 0:
            # The line would start below zero: through the origin instead.
            return FirstToken(0.0, mean_y / mean_x)
        return FirstToken(fixed, slope)


def mean_busy(start: float, end: float, others: Iterable[tuple[float, float | None]]) -> float:
    """How many requests were inside the process over [start, end], as the
    speed table needs it: this one plus the others there, averaged as a
    harmonic mean over time. Where the slots share the cores, one stream's
    speed is the aggregate over the busy count, so an answer's average speed
    is that of the harmonic mean; the plain mean booked an answer that ran
    half alone and half among four (0.62 of the aggregate) against 2.5 busy
    slots, whose speed is 0.4 of it. An other still running (end None) runs
    to `end`."""
    span = end - start
    if span <= 0:
        return 1.0
    # +1 where another enters, -1 where it leaves, within [start, end].
    changes: list[tuple[float, int]] = []
    for other_start, other_end in others:
        enter = max(start, other_start)
        leave = min(end, other_end if other_end is not None else end)
        if leave > enter:
            changes += [(enter, 1), (leave, -1)]
    changes.sort()
    busy, at, inverse = 1, start, 0.0
    for when, change in changes:
        inverse += (when - at) / busy
        busy, at = busy + change, when
    inverse += (end - at) / busy
    return span / inverse


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


def estimate(load: PathLoad, own: Work, *, holds_slot: bool = False) -> Estimate:
    """When a new request behind everything in `load` gets a slot and
    finishes: the queue played forward, each request reading its prompt and
    then writing its answer at the speed for the number of slots busy at
    the time, a freed slot going to the next in line. `holds_slot`: the
    request is already running (`load` is the others): it keeps its slot
    and the queue fills the others' as they free up."""
    slots = max(1, load.slots)
    speeds = load.speeds
    queued = list(load.queued)
    skipped_s = 0.0
    if len(queued) > MAX_SIMULATED_AHEAD:
        # Far back in a long queue: the work beyond the bound at the full
        # lane's aggregate speed, added to the wait.
        rest, queued = queued[MAX_SIMULATED_AHEAD:], queued[:MAX_SIMULATED_AHEAD]
        aggregate = speeds.decode_tokens_per_s(slots) * slots
        skipped_s = sum(w.answer_tokens / aggregate + speeds.prompt_s(w.prompt_tokens) / slots for w in rest)
    # Each running entry: [seconds to its first token, answer tokens left, is it ours].
    others = slots - 1 if holds_slot else slots
    running = [[speeds.prompt_s(w.prompt_tokens), float(w.answer_tokens), False] for w in load.running[:others]]
    queued = list(load.running[others:]) + queued
    pending = [[speeds.prompt_s(w.prompt_tokens), float(w.answer_tokens), False] for w in queued]
    ours = [speeds.prompt_s(own.prompt_tokens), float(own.answer_tokens), True]
    now = load.not_before_s + skipped_s
    wait = None
    if holds_slot:
        running.append(ours)
        wait = now
    else:
        pending.append(ours)
    while True:
        while pending and len(running) < slots:
            entry = pending.pop(0)
            if entry[2]:
                wait = now
            running.append(entry)
        decode_speed = max(1e-6, speeds.decode_tokens_per_s(len(running)))
        step = min(p + a / decode_speed for p, a, _ in running)
        now += step
        still = []
        finished_own = False
        for entry in running:
            left = step
            read = min(entry[0], left)
            entry[0] -= read
            left -= read
            entry[1] = max(0.0, entry[1] - left * decode_speed)
            if entry[0] <= 1e-9 and entry[1] <= 1e-9:
                finished_own = finished_own or entry[2]
            else:
                still.append(entry)
        running = still
        if finished_own:
            assert wait is not None
            return Estimate(round(wait, 3), round(now, 3))
