"""How a worker's owner task is told what to do, and how it restarts.

The commands are a mailbox only the owner reads; the backoff and the rules
for what an exit means next are pure, so they are tested without a process.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import Callable

from .exits import ExitKind, ExitReport, classify_exit


class Command(enum.Enum):
    STOP = "stop"
    RESTART = "restart"
    FAILED = "failed"


def backoff_delay(attempt: int, base_s: float, cap_s: float) -> float:
    """Delay before restart number `attempt` (0-based): base * 2^attempt, capped."""
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    return min(cap_s, base_s * (2 ** min(attempt, 30)))


@dataclass(frozen=True)
class Outcome:
    """How one process's life ended, for the owner's next step."""
    exit: ExitReport
    stop: bool       # a stop was asked for: the owner ends
    immediate: bool  # a restart was asked for: no backoff
    was_ready: bool  # it served before it ended: the backoff starts over


def ending_report(returncode: int | None, log_tail: list[str], command: Command | None,
                  why_replaced: str | None) -> ExitReport:
    """What the process's exit was: its own classification, except that a
    process we ended because it failed a request or never got ready did not
    stop cleanly, whatever its exit code says."""
    report = classify_exit(returncode, log_tail, stop_requested=why_replaced is not None)
    if report.kind is ExitKind.CLEAN_STOP and command not in (Command.STOP, Command.RESTART) and why_replaced:
        return ExitReport(ExitKind.ERROR, report.returncode, report.signal_name, why_replaced)
    return report


class Commands:
    """The owner's mailbox: callers put, the owner alone takes."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[tuple[Command, str]] = asyncio.Queue()

    def put(self, command: Command, reason: str) -> None:
        self._queue.put_nowait((command, reason))

    def pending(self) -> bool:
        return not self._queue.empty()

    def take_nowait(self) -> tuple[Command, str]:
        return self._queue.get_nowait()

    async def take(self) -> tuple[Command, str]:
        return await self._queue.get()

    def drop_stale(self) -> None:
        """Before a new process: failure reports about one that is already gone
        are moot; a stop is not."""
        pending = []
        while not self._queue.empty():
            pending.append(self._queue.get_nowait())
        for command, reason in pending:
            if command is Command.STOP:
                self._queue.put_nowait((command, reason))

    async def sleep_unless_stopped(self, delay: float, clock: Callable[[], float]) -> bool:
        """Sleep for the backoff; True if a stop arrived meanwhile. A restart ends the sleep early."""
        deadline = clock() + delay
        while True:
            remaining = deadline - clock()
            if remaining <= 0:
                return False
            try:
                command, _ = await asyncio.wait_for(self._queue.get(), remaining)
            except asyncio.TimeoutError:
                return False
            if command is Command.STOP:
                return True
            if command is Command.RESTART:
                return False
