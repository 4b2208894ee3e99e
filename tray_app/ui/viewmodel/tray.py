"""The tray's words: the state's title and detail line, and the tooltip."""

from __future__ import annotations

import time

from ...core.status_contract import Status
from .formatting import fmt_mib, humanize_reason, reason_in_words
from .state import (BUSY_TITLE, CPU, DEGRADED, DOWN, GPU, STATE_TITLES, cpu_only_text, engine_notice, icon_kind,
                    is_busy_overflow, residency_of)
from .memory import headroom_text, known_total, ram_floor_mib
from .banner import cpu_serving, degraded_title, serving_peers, who_serves


IDLE_TITLE = "Idle: the GPU model is unloaded"


def state_title(status: Status | None, *, service_starting: bool = False) -> str:
    """The state in a few words; a busy GPU's overflow is not called degraded."""
    peers = serving_peers(status)
    if is_busy_overflow(status):
        return degraded_title(status, peers) if peers else BUSY_TITLE
    kind = icon_kind(status, service_starting=service_starting)
    if kind == DEGRADED and peers:
        return "Degraded: " + who_serves(status, peers)
    if kind == CPU and peers:
        # A machine without a GPU path that lends work to another's: say who answers.
        return "No GPU here: " + who_serves(status, peers)
    residency = residency_of(status)
    if kind == GPU and residency is not None and residency["state"] == "unloaded_idle":
        # Unloaded to make room for another library model (its name is the hold's "app").
        made_room_for = residency["app"]
        return f"The GPU model is unloaded for {made_room_for}" if made_room_for else IDLE_TITLE
    return STATE_TITLES[kind]


def state_detail(status: Status | None, error: str | None = None) -> str:
    """One line under the state title: why the state is what it is."""
    if status is None:
        return error or "the service is not answering"
    kind = icon_kind(status)
    if kind == DEGRADED and is_busy_overflow(status):
        return "The GPU is busy; the CPU takes the overflow."
    if kind == DEGRADED:
        # The model is named in the banner below, where a long name is elided
        # to fit; here it would widen the window.
        text = "The CPU worker answers with the fallback model"
        peers = serving_peers(status)
        if peers:
            on_cpu = cpu_serving(status)
            named = f"peer {', '.join(peers)} (another machine)"
            text = f"The CPU worker and {named} answer" if on_cpu else f"{named[0].upper()}{named[1:]} answers"
        since = status["degraded"]["since"]
        if since:
            text += " since " + time.strftime("%H:%M:%S", time.localtime(since))
        return text + "; details below."
    detail = humanize_reason(status["service"]["health_reason"])
    if kind == CPU:
        detail = cpu_only_text(status) or detail
    notice = engine_notice(status)
    return f"{detail}. {notice}" if notice and detail else (notice or detail)


def tooltip_text(status: Status | None, *, error: str | None = None,
                 service_starting: bool = False, floor_mib: float | None = None) -> str:
    kind = icon_kind(status, service_starting=service_starting)
    state = state_title(status, service_starting=service_starting)
    # Lower-case only the first letter: "GPU" and "CPU" stay capitals.
    title = f"tray-app: {state[:1].lower()}{state[1:]}"
    if kind == DEGRADED and not is_busy_overflow(status):
        title = "tray-app: degraded, the CPU is serving"
    if status is None:
        return f"{title}\n{error or ('starting the service' if service_starting else 'the service is not answering')}"
    lines = [title]
    gpu = status["gpu"]
    if gpu["available"]:
        free, total = gpu["free_mib"], known_total(gpu["total_mib"])
        reserve = gpu["reserve_mib"]
        sim = " (simulated)" if gpu["simulated"] else ""
        if free is not None and total is not None:
            lines.append(f"VRAM{sim}: {headroom_text(free, reserve, 'reserve')} "
                         f"({fmt_mib(free, total)} free of {fmt_mib(total)}, {fmt_mib(reserve)} reserved)")
        else:
            lines.append(f"VRAM{sim}: unknown")
    elif kind != CPU:  # there, the reason is the state's own line
        lines.append(f"VRAM: no GPU ({gpu['reason'] or 'unknown'})")
    available, ram_total = status["ram"]["available_mib"], status["ram"]["total_mib"]
    floor = ram_floor_mib(status, floor_mib)
    if available is not None and ram_total is not None:
        if floor:
            lines.append(f"RAM: {headroom_text(available, floor, 'floor')} "
                         f"({fmt_mib(available, ram_total)} available of {fmt_mib(ram_total)}, {fmt_mib(floor)} floor)")
        else:
            lines.append(f"RAM: {fmt_mib(available)} available of {fmt_mib(ram_total)}")
    if kind == DEGRADED:
        reason = status["degraded"]["reason"]
        if reason:
            lines.append(f"Why: {reason_in_words(reason)}")
    elif kind == CPU:
        lines[1:1] = (cpu_only_text(status) or "").split("\n")
    elif kind == DOWN:
        lines.append(status["service"]["health_reason"])
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
