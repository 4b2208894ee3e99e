"""Numbers as the drill's reports write them. A value that was never
measured (None: the phase stopped early, or the service didn't say) reads
"n/a" instead of crashing the report that would have said why."""

from __future__ import annotations


def quantity(value: float | None, unit: str, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f} {unit}".strip()


def seconds(value: float | None, digits: int = 2) -> str:
    return quantity(value, "s", digits)


def mib(value: float | None) -> str:
    return quantity(value, "MiB", 0)


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.1f}%"
