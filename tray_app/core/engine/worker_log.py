"""A worker's output: the rotating file it is kept in, and the tail in memory
that exit classification, /status and a request's error detail read."""

from __future__ import annotations

import asyncio
import collections
import logging
from pathlib import Path
from typing import Callable

from ..base.files import PrivateRotatingFileHandler, make_private_dir

LOG_TAIL_LINES = 200
LOG_FILE_BYTES = 2 * 1024 * 1024
LOG_FILE_BACKUPS = 3


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
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
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
        self._logger.info(message, *args)

    def new_process(self) -> None:
        """The tail is one process's: a new one starts it afresh."""
        self._tail.clear()

    async def capture(self, stream: asyncio.StreamReader, on_line: Callable[[str], None]) -> None:
        """Read the process's output to its end into the tail and the file."""
        while True:
            line = await stream.readline()
            if not line:
                return
            text = line.decode("utf-8", "replace").rstrip("\n")
            on_line(text)
            self._tail.append(text)
            self._lines += 1
            self._logger.info("%s", text)

    def close(self) -> None:
        self._logger.removeHandler(self._handler)
        self._handler.close()
