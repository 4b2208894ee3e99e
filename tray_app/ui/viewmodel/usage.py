"""What the service has done: failover time, and usage per key or app today and this week."""

from __future__ import annotations

from dataclasses import dataclass

from ...core.status_contract import Status, UsageCounts
from .formatting import fmt_seconds


FAULT_WORDS = {"crash": "a crash", "hang": "a hang", "give_back": "a give-back"}


def failover_text(status: Status) -> str | None:
    """The panel's line on failover time (/status "failover"): how long the
    last replay's client waited for its first token after the GPU's fault,
    and the median; None before any replay has answered."""
    failover = status.get("failover")
    if failover is None:
        return None
    last, count = failover["last_s"], failover["count"]
    if last is None or not count:
        return None
    fault = FAULT_WORDS.get(failover["last_fault"] or "", "a fault")
    text = f"Last failover: first token on the CPU {fmt_seconds(last)} after {fault}"
    median = failover["p50_s"]
    if count > 1 and median is not None:
        text += f" (median {fmt_seconds(median)} over {count})"
    return text


# The panel lists the busiest names; a service with a key per app may have
# dozens, and the web page lists them all.
MAX_USAGE_ROWS = 5


@dataclass(frozen=True)
class UsageRow:
    name: str
    today: str
    week: str


@dataclass(frozen=True)
class UsageView:
    rows: tuple[UsageRow, ...]
    more: int  # names not listed, the quietest over the week


def fmt_count(value: int) -> str:
    """3,456 below ten thousand, then 12.3k, 232k and 4.5M: a usage cell stays short."""
    if value >= 1_000_000:
        return f"{value / 1_000_000:.1f}M"
    if value >= 100_000:
        return f"{value / 1000:.0f}k"
    if value >= 10_000:
        return f"{value / 1000:.1f}k"
    return f"{value:,}"


def usage_counts_text(counts: UsageCounts) -> str:
    """'12 requests · 3,456 tokens · 2 degraded'; 'none' for a quiet period."""
    if not counts["requests"]:
        return "none"
    parts = [f"{fmt_count(counts['requests'])} request{'' if counts['requests'] == 1 else 's'}",
             f"{fmt_count(counts['tokens_in'] + counts['tokens_out'])} tokens"]
    if counts["degraded"]:
        parts.append(f"{fmt_count(counts['degraded'])} degraded")
    return " · ".join(parts)


def usage_view(status: Status) -> UsageView | None:
    """The panel's usage table: per key or app, today and the last 7 days,
    busiest first over the week; None when the service keeps no usage
    (Service.status() without the HTTP app) or nothing was counted yet."""
    usage = status.get("usage")
    if usage is None or not usage["by_name"]:
        return None
    entries = sorted(usage["by_name"].items(), key=lambda item: (-item[1]["last_7_days"]["requests"], item[0]))
    rows = tuple(UsageRow(name, usage_counts_text(entry["today"]), usage_counts_text(entry["last_7_days"]))
                 for name, entry in entries[:MAX_USAGE_ROWS])
    return UsageView(rows, max(0, len(entries) - MAX_USAGE_ROWS))
