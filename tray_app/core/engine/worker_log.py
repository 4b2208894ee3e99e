"""A worker's output: the rotating file it is kept in, and the tail in memory
that exit classification, /status and a request's error detail read."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from pathlib import Path
from typing import Callable

from ..base.files import PrivateRotatingFileHandler, make_private_dir

LOG_TAIL_LINES = 200
LOG_FILE_BYTES = 2 * 1024 * 1024
LOG_FILE_BACKUPS = 3
# Read at once from the worker's output: every whole line in it goes to the file in one write.
READ_BYTES = 64 * 1024
# A line longer than this (no newline in sight) is cut and kept in pieces of this size.
MAX_LINE_BYTES = 64 * 1024


class WorkerLog:
    def __init__(self, log_dir: Path, name: str) -> None:
        """`name`: the file's, "<name>-worker.log" in `log_dir` (owner-only: it holds prompts)."""
        make_private_dir(log_dir)
        self._tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._lines = 0
        # A logger of its own, not propagated: the worker's lines go to its
        # file only, never into the service's log.
        self._logger = logging.getLogger(f"tray_app.worker_output.{name}.{id(self)}")
        self._logger.propagate = False
        self._logger.setLevel(logging.INFO)
        self._handler = PrivateRotatingFileHandler(
            log_dir / f"{name}-worker.log", maxBytes=LOG_FILE_BYTES, backupCount=LOG_FILE_BACKUPS,
            encoding="utf-8",
        )
        # Each line carries its time, written here (_stamped): a batch of lines is one record.
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        self._logger.addHandler(self._handler)

    @property
    def path(self) -> Path:
        return Path(self._handler.baseFilename)

    def tail(self, lines: int = 50) -> list[str]:
        return list(self._tail)[-lines:]

    @property
    def lines(self) -> int:
        """How many lines the worker has written so far (a mark for since)."""
        return self._lines

    def since(self, mark: int) -> list[str]:
        """The lines written after `mark` (as many as the tail still holds)."""
        count = min(self._lines - mark, len(self._tail))
        return list(self._tail)[-count:] if count > 0 else []

    def note(self, message: str, *args: object) -> None:
        """A line of ours in the file (a start, an exit), not in the tail."""
        self._logger.info("%s", _stamped([message % args if args else message]))

    def new_process(self) -> None:
        """The tail is one process's: a new one starts it afresh."""
        self._tail.clear()

    async def capture(self, stream: asyncio.StreamReader, on_line: Callable[[str], None]) -> None:
        """Read the process's output to its end into the tail and the file:
        whatever is there at each read, whole lines, in one record. A line
        each took a logging record, its rollover check (two stats and a
        seek) and a write: llama-server writes its lines about a request
        together, and every wake-up of the service comes out of that
        request's time."""
        partial = b""
        while True:
            chunk = await stream.read(READ_BYTES)
            data = partial + chunk
            if chunk:
                *whole, partial = data.split(b"\n")
                if len(partial) > MAX_LINE_BYTES:
                    whole.append(partial)
                    partial = b""
            else:
                whole, partial = ([data] if data else []), b""
            if whole:
                self._take([raw.decode("utf-8", "replace") for raw in whole], on_line)
            if not chunk:
                return

    def _take(self, lines: list[str], on_line: Callable[[str], None]) -> None:
        for text in lines:
            on_line(text)
            self._tail.append(text)
        self._lines += len(lines)
        self._logger.info("%s", _stamped(lines))

    def close(self) -> None:
        self._logger.removeHandler(self._handler)
        self._handler.close()


def _stamped(lines: list[str]) -> str:
    """The lines, each after the time it was read (as logging's asctime writes it)."""
    now = time.time()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now * 1000) % 1000:03d}"
    return "\n".join(f"{stamp} {line}" for line in lines)
