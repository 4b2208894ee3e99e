"""A one-line progress bar on stderr; plain lines when stderr is not a terminal."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

BAR_WIDTH = 28


class Progress:
    def __init__(self, planned: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        self._stream = stream or sys.stderr
        self._tty = self._stream.isatty()
        self._enabled = enabled
        self._planned = max(1, planned)
        self._done = 0
        self._phase = ""
        self._started = time.monotonic()
        self._lock = threading.Lock()

    def phase(self, text: str) -> None:
        with self._lock:
            self._phase = text
            if not self._enabled:
                return
            if self._tty:
                self._draw()
            else:
                print(f"[drill {time.monotonic() - self._started:6.1f} s] {text}", file=self._stream, flush=True)

    def advance(self, count: int = 1) -> None:
        with self._lock:
            self._done += count
            if self._enabled and self._tty:
                self._draw()

    def note(self, text: str) -> None:
        with self._lock:
            if not self._enabled:
                return
            if self._tty:
                self._stream.write("\r\033[K")
            print(f"  {text}", file=self._stream, flush=True)
            if self._tty:
                self._draw()

    def finish(self) -> None:
        with self._lock:
            if self._enabled and self._tty:
                self._stream.write("\r\033[K")
                self._stream.flush()

    def _draw(self) -> None:
        # The plan's count is an estimate (retries, probes): never show past full.
        fraction = min(1.0, self._done / self._planned)
        filled = int(fraction * BAR_WIDTH)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        elapsed = time.monotonic() - self._started
        self._stream.write(f"\r\033[K[{bar}] {self._done:>3} requests  {elapsed:6.1f} s  {self._phase}"[:160])
        self._stream.flush()
