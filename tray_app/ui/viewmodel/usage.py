"""What the service has done: failover time, and usage per key or app today and this week."""

from __future__ import annotations

from typing import Any, Mapping

from .formatting import as_number, fmt_seconds


FAULT_WORDS = {"crash": "a crash", "hang": "a hang", "give_back": "a give-back"}


def failover_text(status: Mapping[str, Any]) -> str | None:
    """The panel's line on failover time (/status "failover"): how long the
    last replay's client waited for its first token after the GPU's fault,
    and the median; None before any replay has answered."""
    failover = status.get("failover") or {}
    last, count = as_number(failover.get("last_s")), failover.get("count") or 0
    if last is None or not count:
        return None
    fault = FAULT_WORDS.get(failover.get("last_fault") or "", "a fault")
    text = f"Last failover: first token on the CPU {fmt_seconds(last)} after {fault}"
    median = as_number(failover.get("p50_s"))
    if count > 1 and median is not None:
        text += f" (median {fmt_seconds(median)} over {count})"
    return text
