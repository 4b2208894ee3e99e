"""Whether the GPU path takes work now, and if not why: the order in which
its reasons count (missing, paused, residency, the worker, the breaker, the
memory reading). A read of its inputs; it changes nothing."""

from __future__ import annotations

from typing import Callable

from ..memory.telemetry import MemorySnapshot
from .admission import GpuOut, Reason
from .backend import Backend
from .breaker import BreakerState, CircuitBreaker
from .ports import GpuResidency


def gpu_out(gpu: Backend | None, missing_reason: str | None, paused: bool, residency: GpuResidency,
            breaker: CircuitBreaker, memory: Callable[[], MemorySnapshot]) -> GpuOut | None:
    """Why the GPU path can't take work right now, or None if it can."""
    if gpu is None:
        # No GPU path at all (no device, a CPU-only build, [gpu] enabled =
        # false): the CPU is how this machine serves, not a fallback, so it
        # is quiet: no degraded mode, as the tray and the web page show it.
        return GpuOut(Reason.GPU_UNAVAILABLE, missing_reason or "no GPU path", quiet=True)
    if paused:
        return GpuOut(Reason.FORCED_CPU, "the GPU path is paused (force CPU)")
    resident = residency.gpu_out()
    open_breaker = breaker_out(breaker)
    if resident is not None and not (resident.reason is Reason.GPU_LOADING and open_breaker):
        # (A worker restarting after failures may be loading, but the GPU
        # takes no work until the breaker's cooldown is over: that comes first.)
        return resident
    out = gpu.out_reason()
    if out is not None and resident is None:
        return GpuOut(Reason.GPU_UNAVAILABLE, out)
    if open_breaker is not None:
        return open_breaker
    reading = memory().gpu
    if not reading.available:
        return GpuOut(Reason.GPU_UNAVAILABLE, f"GPU memory can't be read: {reading.reason}")
    return None


def breaker_out(breaker: CircuitBreaker) -> GpuOut | None:
    """An open breaker as the reason the GPU takes no work, or None."""
    if breaker.state is not BreakerState.OPEN:
        return None
    snap = breaker.snapshot()
    return GpuOut(Reason.GPU_UNAVAILABLE,
                  f"the circuit breaker is open after repeated GPU failures "
                  f"({snap.get('last_failure_reason')}); retrying in {snap.get('retry_in_s')} s",
                  back_in_s=snap.get("retry_in_s"))
