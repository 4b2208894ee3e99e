"""Which loaded models to unload so another one fits: a pure decision.

Other tools evict by count (llama.cpp's router: "count-based... does not
account for VRAM") or by least recent use alone. This one counts memory:
`free_mib` is what the device reading says is free now, so memory that
other processes hold (a game, a browser) is already out of it, and each
resident's `mib` is what that model's worker really holds there.

The rule: take idle residents, least recently used first, until their
memory covers the shortfall; then drop from the chosen set every model the
rest still covers without (a small model that was only old, not in the
way). A model with requests queued or running is never chosen. If even all
the idle ones would not cover it, there is no plan: the caller serves the
request elsewhere or refuses it, never loads into an out-of-memory crash.
The same function serves the RAM side, with available RAM and the floor.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Resident:
    name: str
    mib: float            # what it holds now
    last_used: float      # when it last had a request (any monotonic clock)
    in_flight: int = 0    # requests queued or running on it


@dataclass(frozen=True)
class EvictionPlan:
    victims: tuple[str, ...]   # in the order to unload them
    freed_mib: float
    shortfall_mib: float       # what had to be freed (0: it fits already)


def plan_eviction(need_mib: float, free_mib: float, keep_free_mib: float,
                  residents: list[Resident]) -> EvictionPlan | None:
    """The models to unload so that `need_mib` fits and `keep_free_mib`
    stays free; None when no choice of idle models can do it."""
    shortfall = need_mib + keep_free_mib - free_mib
    if shortfall <= 0:
        return EvictionPlan((), 0.0, 0.0)
    idle = sorted((r for r in residents if r.in_flight == 0 and r.mib > 0), key=lambda r: (r.last_used, r.name))
    chosen: list[Resident] = []
    freed = 0.0
    for resident in idle:
        chosen.append(resident)
        freed += resident.mib
        if freed >= shortfall:
            break
    if freed < shortfall:
        return None
    # The most recently used first: keep it if the others already cover the need.
    for resident in sorted(chosen, key=lambda r: (r.last_used, r.name), reverse=True):
        if freed - resident.mib >= shortfall:
            chosen.remove(resident)
            freed -= resident.mib
    return EvictionPlan(tuple(r.name for r in chosen), freed, shortfall)


def eviction_shortfall_text(name: str, need_mib: float, free_mib: float, keep_free_mib: float,
                            residents: list[Resident]) -> str:
    """Why no plan exists, in words for a 503 or the degraded banner."""
    idle = sum(r.mib for r in residents if r.in_flight == 0)
    busy = [r.name for r in residents if r.in_flight > 0]
    text = (f"not enough VRAM to load {name}: it needs {need_mib:.0f} MiB plus the {keep_free_mib:.0f} MiB "
            f"reserve, {free_mib:.0f} MiB is free")
    text += f", and unloading every idle model would free only {idle:.0f} MiB" if residents else ""
    if busy:
        text += f" ({', '.join(busy)} {'is' if len(busy) == 1 else 'are'} busy)"
    return text
