"""The panel's memory history: samples for the charts."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from ...core.status_contract import Status
from .memory import known_total


@dataclass
class Sample:
    t: float
    vram_free_mib: float | None
    vram_total_mib: float | None
    vram_reserve_mib: float | None
    ram_available_mib: float | None
    ram_total_mib: float | None


class History:
    """The last `window_s` seconds of free VRAM and available RAM, from polls."""

    def __init__(self, window_s: float = 300.0, clock=time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self.samples: deque[Sample] = deque()

    def add(self, status: Status, now: float | None = None) -> Sample:
        now = self._clock() if now is None else now
        gpu, ram = status["gpu"], status["ram"]
        available = gpu["available"]
        sample = Sample(
            t=now,
            vram_free_mib=gpu["free_mib"] if available else None,
            vram_total_mib=known_total(gpu["total_mib"]) if available else None,
            vram_reserve_mib=gpu["reserve_mib"],
            ram_available_mib=ram["available_mib"],
            ram_total_mib=ram["total_mib"],
        )
        self.samples.append(sample)
        while self.samples and self.samples[0].t < now - self.window_s:
            self.samples.popleft()
        return sample

    def series(self, attr: str) -> list[tuple[float, float | None]]:
        return [(s.t, getattr(s, attr)) for s in self.samples]

    def latest(self) -> Sample | None:
        return self.samples[-1] if self.samples else None
