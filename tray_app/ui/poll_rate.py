"""How often the tray asks the service for /status: every second while
someone looks or something moves, seldom when neither: polling every
second with the panel closed made the tray cost twice what `serve` does at idle.

Qt-free, so its rule is tested with plain values; ui/app.py applies it.
"""

from __future__ import annotations

from typing import Any, Mapping

ACTIVE_POLL_MS = 1000
# With the panel and the chat closed and nothing happening, the icon only has
# to notice the next change: a request another app sends, a worker that
# stops. Five seconds is what that may take, and what the service's own
# sampler drops to when nobody reads it faster (core/observe.py).
IDLE_POLL_MS = 5000
# Worker states that are steady: anything else (starting, loading, restarting,
# stopping, unhealthy) is about to change, and the icon should show it soon.
STEADY_WORKER_STATES = frozenset({"ready", "stopped"})


def is_quiet(status: Mapping[str, Any] | None) -> bool:
    """Nothing in flight and nothing about to change: no request queued or
    running, every worker steady, the service healthy and not degraded."""
    if status is None:
        return False  # not answering (yet): keep asking every second
    if status.get("requests"):
        return False
    if not (status.get("service") or {}).get("healthy"):
        return False
    if (status.get("degraded") or {}).get("active"):
        return False
    return all(worker.get("state") in STEADY_WORKER_STATES for worker in status.get("workers") or [])


def poll_interval_ms(*, window_open: bool, status: Mapping[str, Any] | None) -> int:
    """Every second while a window shows the numbers or the service is
    busy; IDLE_POLL_MS otherwise."""
    return ACTIVE_POLL_MS if window_open or not is_quiet(status) else IDLE_POLL_MS
