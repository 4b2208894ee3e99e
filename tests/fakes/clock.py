"""A clock that moves only when a test moves it."""

from __future__ import annotations


class FakeClock:
    # Not zero by default, so an "it happened at 0" bug cannot hide.
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
