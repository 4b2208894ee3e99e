"""Numbers and reasons in words: MiB, seconds, elided names, route reasons."""

from __future__ import annotations

import time
from typing import Any

# In core: the note inside a degraded answer says the same words as the banner.
from ...core.base.route_reasons import ROUTE_REASONS


def clock_time(wall: Any) -> str:
    value = as_number(wall)
    return time.strftime("%H:%M", time.localtime(value)) if value else ""


def fmt_mib(value: float | None, scale: float | None = None) -> str:
    """1,215 MiB below 10 GiB, then 21.5 GiB; 'unknown' for None.

    With `scale` (e.g. the total it is a part of), the unit follows the scale,
    so "2.1 GiB free of 24.0 GiB" doesn't mix units.
    """
    if value is None:
        return "unknown"
    if abs(value if scale is None else scale) >= 10 * 1024:
        return f"{value / 1024:,.1f} GiB"
    return f"{value:,.0f} MiB"


def fmt_seconds(value: float | None) -> str:
    if value is None:
        return "unknown"
    if value < 10:
        return f"{value:.1f} s"
    if value < 120:
        return f"{value:.0f} s"
    return f"{value / 60:.0f} min"


def as_number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def reason_in_words(reason: str | None) -> str:
    """'gpu_vram_headroom: needs 27 MiB ...' -> 'not enough VRAM headroom: needs 27 MiB ...'."""
    if not reason:
        return ""
    code, sep, detail = reason.partition(": ")
    if sep and code in ROUTE_REASONS:
        reason = f"{ROUTE_REASONS[code]}: {detail}"
    return reason


def humanize_reason(reason: str | None) -> str:
    """reason_in_words, as a sentence."""
    words = reason_in_words(reason)
    return words[:1].upper() + words[1:]


# Community GGUF names run to 80 characters; a menu line longer than this
# pushes the menu off a laptop screen.
MENU_NAME_CHARS = 40


def elide_middle(text: str, limit: int) -> str:
    """`text` in at most `limit` characters, its middle replaced by an ellipsis
    (a model's family and its quantization are at the two ends)."""
    if len(text) <= limit:
        return text
    keep = limit - 1
    return text[: (keep + 1) // 2] + "…" + text[len(text) - keep // 2:]
