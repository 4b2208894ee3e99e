"""The policies the config hands over as they are, and the defaults it shares.

A leaf: it imports nothing of tray_app. The config reads these as its
[breaker] and [worker] sections and its [gpu] reserve, and dispatch, engine
and memory use them, so each is written once without the config (the layer
every other one reads) importing upward or engine and dispatch importing
the config.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BreakerPolicy:
    # The circuit breaker's (dispatch/breaker.py), and the [breaker] section of the config, as it is.
    failure_threshold: int = 3
    window_s: float = 60.0
    cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(f"failure_threshold must be at least 1, got {self.failure_threshold}")
        if self.window_s <= 0 or self.cooldown_s < 0:
            raise ValueError(f"window_s must be > 0 and cooldown_s >= 0, got {self.window_s}, {self.cooldown_s}")


@dataclass(frozen=True)
class RestartPolicy:
    # A worker's (engine/worker.py); also the [worker] section of the config (config.WorkerConfig extends it).
    ready_timeout_s: float = 180.0
    stop_timeout_s: float = 5.0
    backoff_base_s: float = 0.5
    backoff_cap_s: float = 30.0


# Free GPU memory admission control leaves untouched.  The worker's own CUDA
# context is already charged (estimate.GPU_RUNTIME_OVERHEAD_MIB), so this covers
# what we do not see: the desktop compositor and browsers allocating after we
# read free memory, driver-side fragmentation, and error in the estimate
# itself.  1 GiB is ~8% of a 12 GiB card and ~4% of a 24 GiB one.
DEFAULT_GPU_RESERVE_MIB = 1024


# llama-server's draft-free speculative decoding (--spec-type): it drafts
# tokens from n-grams of the text it has seen, so no second model takes
# memory. What the config accepts and the llama-server runtime runs.
SPECULATIVE_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
