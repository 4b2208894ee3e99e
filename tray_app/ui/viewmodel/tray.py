"""The tray's words: the state's title and detail line, and the tooltip."""

from __future__ import annotations

import time
from typing import Any, Mapping

from .formatting import as_number, fmt_mib, humanize_reason, reason_in_words
from .state import BUSY_TITLE, CPU, DEGRADED, DOWN, GPU, STATE_TITLES, cpu_only_text, engine_notice, icon_kind, is_busy_overflow, residency_of, residency_state
from .memory import headroom_text, known_total, ram_floor_mib
from .banner import cpu_serving, degraded_title, serving_peers, who_serves


IDLE_TITLE = "Idle: the GPU model is unloaded"


def state_title(status: Mapping[str, Any] | None, *, host_starting: bool = False) -> str:
    """The state in a few words; a busy GPU's overflow is not called degraded."""
    peers = serving_peers(status)
    if is_busy_overflow(status):
        return degraded_title(status, peers) if peers else BUSY_TITLE
    kind = icon_kind(status, host_starting=host_starting)
    if kind == DEGRADED and peers:
        return "Degraded: " + who_serves(status, peers)
    if kind == CPU and peers:
        # A machine without a GPU path that lends work to another's: say who answers.
        return "No GPU here: " + who_serves(status, peers)
    if kind == GPU and residency_state(status) == "unloaded_idle":
        # Unloaded to make room for another library model (its name is the hold's "app").
        made_room_for = residency_of(status).get("app")
        return f"The GPU model is unloaded for {made_room_for}" if made_room_for else IDLE_TITLE
    return STATE_TITLES[kind]


def state_detail(status: Mapping[str, Any] | None, error: str | None = None) -> str:
    """One line under the state title: why the state is what it is."""
    if status is None:
        return error or "the service is not answering"
    kind = icon_kind(status)
    if kind == DEGRADED and is_busy_overflow(status):
        return "The GPU is busy; the CPU takes the overflow."
    if kind == DEGRADED:
        degraded = status.get("degraded") or {}
        # The model is named in the banner below, where a long name is elided
        # to fit; here it would widen the window.
        text = "The CPU worker answers with the fallback model"
        peers = serving_peers(status)
        if peers:
            on_cpu = cpu_serving(status)
            named = f"peer {', '.join(peers)} (another machine)"
            text = f"The CPU worker and {named} answer" if on_cpu else f"{named[0].upper()}{named[1:]} answers"
        since = as_number(degraded.get("since"))
        if since:
            text += " since " + time.strftime("%H:%M:%S", time.localtime(since))
        return text + "; details below."
    detail = humanize_reason((status.get("service") or {}).get("health_reason") or "")
    if kind == CPU:
        detail = cpu_only_text(status) or detail
    notice = engine_notice(status)
    return f"{detail}. {notice}" if notice and detail else (notice or detail)


def tooltip_text(status: Mapping[str, Any] | None, *, error: str | None = None,
                 host_starting: bool = False, floor_mib: float | None = None) -> str:
    kind = icon_kind(status, host_starting=host_starting)
    state = state_title(status, host_starting=host_starting)
    # Lower-case only the first letter: "GPU" and "CPU" stay capitals.
    title = f"tray-app: {state[:1].lower()}{state[1:]}"
    if kind == DEGRADED and not is_busy_overflow(status):
        title = "tray-app: degraded, the CPU is serving"
    if status is None:
        return f"{title}\n{error or ('starting the service' if host_starting else 'the service is not answering')}"
    lines = [title]
    gpu = status.get("gpu") or {}
    if gpu.get("available"):
        free, total = as_number(gpu.get("free_mib")), known_total(gpu.get("total_mib"))
        reserve = as_number(gpu.get("reserve_mib")) or 0.0
        sim = " (simulated)" if gpu.get("simulated") else ""
        if free is not None and total is not None:
            lines.append(f"VRAM{sim}: {headroom_text(free, reserve, 'reserve')} "
                         f"({fmt_mib(free, total)} free of {fmt_mib(total)}, {fmt_mib(reserve)} reserved)")
        else:
            lines.append(f"VRAM{sim}: unknown")
    elif kind != CPU:  # there, the reason is the state's own line
        lines.append(f"VRAM: no GPU ({gpu.get('reason') or 'unknown'})")
    ram = status.get("ram") or {}
    available, total = as_number(ram.get("available_mib")), as_number(ram.get("total_mib"))
    floor = ram_floor_mib(status, floor_mib)
    if available is not None and total is not None:
        if floor:
            lines.append(f"RAM: {headroom_text(available, floor, 'floor')} "
                         f"({fmt_mib(available, total)} available of {fmt_mib(total)}, {fmt_mib(floor)} floor)")
        else:
            lines.append(f"RAM: {fmt_mib(available)} available of {fmt_mib(total)}")
    if kind == DEGRADED:
        reason = (status.get("degraded") or {}).get("reason")
        if reason:
            lines.append(f"Why: {reason_in_words(reason)}")
    elif kind == CPU:
        lines[1:1] = (cpu_only_text(status) or "").split("\n")
    elif kind == DOWN:
        lines.append((status.get("service") or {}).get("health_reason") or "")
    lines.append(engine_notice(status) or "")
    return "\n".join(line for line in lines if line)


# The panel's title when /status breaks the contract: the tray and the
# service are of different versions (or something else answers the port).
SHAPE_MISMATCH_TITLE = "A service of another version"


def shape_mismatch_text(base_url: str, problems: list[str]) -> str:
    """The line under that title: where, and the first difference the
    contract check found (the rest counted), so a bug report can name it."""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return (f"The service at {base_url} answers /status in a shape this tray does not know: "
            f"{problems[0]}{more}. Update the tray and the service to the same version.")
