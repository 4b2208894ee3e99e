"""What the UI shows, computed from /status snapshots: no Qt in here.

Everything the widgets display (icon state, tooltip, bar segments, banner
lines, the per-answer route line) is a pure function of the JSON the service
returns, so it can be unit-tested with plain dicts.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ..core.http_basics import SseLineSplitter
# In core: the note inside a degraded answer says the same words as the banner.
from ..core.route_reasons import ROUTE_REASONS, route_reason_text

# ----- tray state ---------------------------------------------------------------------

# CPU: a machine with no GPU path at all (no usable device, a CPU-only
# build, or the GPU turned off in the config). The CPU serving is its normal
# state, not degraded mode, which is for a GPU path that exists and can't serve.
GPU, CPU, DEGRADED, STARTING, DOWN = "gpu", "cpu", "degraded", "starting", "down"
ICON_KINDS = (GPU, CPU, DEGRADED, STARTING, DOWN)

STATE_TITLES = {
    GPU: "Serving on the GPU",
    CPU: "Serving on the CPU",
    DEGRADED: "Degraded: the CPU is serving",
    STARTING: "Starting",
    DOWN: "Down",
}

BUSY_TITLE = "Busy: the CPU takes the GPU's overflow"

_BUSY_STATES = ("starting", "stopping")


def _workers(status: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {w.get("role"): w for w in status.get("workers") or ()}


def icon_kind(status: Mapping[str, Any] | None, *, host_starting: bool = False) -> str:
    """gpu | degraded | starting | down, from one /status snapshot.

    `status` None means the service did not answer; `host_starting` says the
    in-process service is still coming up, so silence is expected.
    """
    if status is None:
        return STARTING if host_starting else DOWN
    service = status.get("service") or {}
    workers = _workers(status)
    if not service.get("healthy"):
        if not workers or any(w.get("state") in _BUSY_STATES for w in workers.values()):
            return STARTING
        return DOWN
    if cpu_only(status) is not None:
        return CPU
    degraded = (status.get("degraded") or {}).get("active")
    gpu_out = (status.get("gpu") or {}).get("path_out_reason")
    if not degraded and (gpu_out is None or residency_state(status) == "unloaded_idle"):
        # Unloaded while idle is not an outage: the next request loads it.
        return GPU
    gpu = workers.get("gpu")
    if (gpu is not None and gpu.get("state") == "starting" and not gpu.get("restarts")
            and gpu.get("last_exit") is None and not service.get("gpu_paused")):
        # The first start of the GPU worker: the CPU one is usually ready a
        # moment earlier. That is not degraded mode, just not started yet.
        return STARTING
    return DEGRADED


@dataclass(frozen=True)
class CpuOnly:
    """Why this service has no GPU path, and the one step that would give it one."""

    reason: str
    step: str


# The GPU path's absence, as /status words it: the service's own notes that
# the CPU serves, which the state already says, are dropped; so is a long
# reinstall command, as `step` says what to do.
_SAID_BY_THE_STATE = ("running cpu-only", "serving cpu-only", "reinstall with")


def cpu_only(status: Mapping[str, Any] | None) -> CpuOnly | None:
    """The machine has no GPU path at all, or None when it has one (serving
    or not). /status says so by the default model's workers: there is no GPU
    worker to degrade from; gpu.path_out_reason says why."""
    workers = _workers(status or {})
    if not workers or GPU in workers:
        return None
    gpu = (status or {}).get("gpu") or {}
    raw = str(gpu.get("path_out_reason") or gpu.get("reason") or "no GPU path")
    parts = [part.strip() for part in raw.split(";")]
    reason = "; ".join(p for p in parts if p and not p.lower().startswith(_SAID_BY_THE_STATE)) or "no GPU path"
    return CpuOnly(humanize_reason(reason), _gpu_step(gpu, raw))


# The install script's choice of llama.cpp backend for a GPU it can't see
# through NVML: Vulkan runs on every vendor's cards.
INSTALL_COMMAND = "bash packaging/install.sh --backend {backend}"


def _gpu_step(gpu: Mapping[str, Any], reason: str) -> str:
    """The one thing that would give this machine a GPU path."""
    if "[gpu] enabled = false" in reason:
        return "To use the GPU: set [gpu] enabled = true in the config, then restart tray-app"
    if gpu.get("offload_supported") is True:
        # The build can offload, and no device answered: the driver is missing or broken.
        return "To use a GPU: install its driver, then restart tray-app"
    names = " ".join(str(d.get("name") or "") for d in gpu.get("devices") or () if isinstance(d, Mapping))
    if gpu.get("available") and "nvidia" in names.lower():
        return "To use it: rebuild for CUDA with " + INSTALL_COMMAND.format(backend="cuda")
    if gpu.get("available"):
        return "To use it: rebuild for it with " + INSTALL_COMMAND.format(backend="vulkan")
    return "If this machine has a GPU, rebuild for it with " + INSTALL_COMMAND.format(backend="vulkan")


def cpu_only_text(status: Mapping[str, Any] | None) -> str | None:
    """'No usable GPU: ….' and, on a line of its own, 'If this machine has a
    GPU, rebuild …'; None where there is a GPU path."""
    found = cpu_only(status)
    return f"{found.reason}.\n{found.step}" if found is not None else None


IDLE_TITLE = "Idle: the GPU model is unloaded"


def state_title(status: Mapping[str, Any] | None, *, host_starting: bool = False) -> str:
    """The state in a few words; a busy GPU's overflow is not called degraded."""
    peers = serving_peers(status)
    if is_busy_overflow(status):
        return _degraded_title(status, peers) if peers else BUSY_TITLE
    kind = icon_kind(status, host_starting=host_starting)
    if kind == DEGRADED and peers:
        return "Degraded: " + _who_serves(status, peers)
    if kind == CPU and peers:
        # A machine without a GPU path that lends work to another's: say who answers.
        return "No GPU here: " + _who_serves(status, peers)
    if kind == GPU and residency_state(status) == "unloaded_idle":
        # Unloaded to make room for another library model (its name is the hold's "app").
        made_room_for = _residency(status).get("app")
        return f"The GPU model is unloaded for {made_room_for}" if made_room_for else IDLE_TITLE
    return STATE_TITLES[kind]


# ----- sharing the GPU ------------------------------------------------------------------

# /status gpu.residency.state values in which the GPU worker has let go of its memory.
GIVEN_STATES = ("given_away", "given_back_by_user")


def _residency(status: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return ((status or {}).get("gpu") or {}).get("residency") or {}


def residency_state(status: Mapping[str, Any] | None) -> str | None:
    """loaded | loading | given_away | given_back_by_user | unloaded_idle, or None without a GPU path."""
    return _residency(status).get("state")


def _clock_time(wall: Any) -> str:
    value = _num(wall)
    return time.strftime("%H:%M", time.localtime(value)) if value else ""


def residency_text(status: Mapping[str, Any] | None) -> str | None:
    """The menu's GPU line when the GPU worker is not simply loaded:
    "GPU: given to steam (9.1 GiB) since 14:02"; None when it is."""
    residency = _residency(status)
    state = residency.get("state")
    since = _clock_time(residency.get("since"))
    at = f" since {since}" if since else ""
    if state == "unloaded_idle":
        # "GPU unloaded for coder" when another model needed its memory.
        text = str(residency.get("text") or "GPU unloaded (idle)")
        return text.replace("GPU unloaded", "GPU: unloaded", 1) + at
    if state == "given_away":
        text = str(residency.get("text") or "GPU given to another app")
        return text.replace("GPU given to", "GPU: given to", 1) + at
    if state == "given_back_by_user":
        return f"GPU: given back by you{at}"
    if state == "loading":
        eta = _num(residency.get("load_eta_s"))
        return "GPU: loading the model" + (f" (about {fmt_seconds(eta)})" if eta else "")
    return None


def give_back_label(status: Mapping[str, Any] | None) -> str:
    """The menu command: give the GPU back, or take it again once given."""
    return "Use the GPU &again" if residency_state(status) in GIVEN_STATES else "Give the GPU &back now"


class ResidencyNotifier:
    """Notices for the GPU given to another app and taken again; the
    degraded-mode notice stays quiet for these (DegradedNotifier), since
    this one says more. The GPU passes through "loading" on its way back:
    what counts is that it was given, and is loaded again."""

    def __init__(self) -> None:
        self._state: str | None = None
        self._given = False

    def update(self, status: Mapping[str, Any] | None) -> Notice | None:
        if status is None:
            return None
        state = residency_state(status)
        first, self._state = self._state is None, state
        residency = _residency(status)
        fallback = (status.get("degraded") or {}).get("fallback_model") or "the fallback model"
        if state in GIVEN_STATES:
            was_given, self._given = self._given, True
            if first or was_given:
                return None
            if state == "given_away":
                return Notice("GPU given back", f"{residency.get('text') or 'Another app needs the VRAM'}: the GPU "
                              f"model was unloaded. The CPU answers with {fallback} until the memory is free again.",
                              "gpu_given_back")
            return Notice("GPU given back", f"The GPU model was unloaded. The CPU answers with {fallback} until "
                          "you choose \"Use the GPU again\".", "gpu_given_back")
        if state == "loaded" and self._given:
            self._given = False
            load = _num(residency.get("last_load_s"))
            took = f" (loading took {fmt_seconds(load)})" if load else ""
            return Notice("GPU taken again", f"The GPU model is loaded again{took}; the GPU serves.", "gpu_taken_again")
        if state != "loading":
            self._given = False
        return None


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
            on_cpu = _cpu_serving(status)
            named = f"peer {', '.join(peers)} (another machine)"
            text = f"The CPU worker and {named} answer" if on_cpu else f"{named[0].upper()}{named[1:]} answers"
        since = _num(degraded.get("since"))
        if since:
            text += " since " + time.strftime("%H:%M:%S", time.localtime(since))
        return text + "; details below."
    detail = humanize_reason((status.get("service") or {}).get("health_reason") or "")
    if kind == CPU:
        detail = cpu_only_text(status) or detail
    notice = engine_notice(status)
    return f"{detail}. {notice}" if notice and detail else (notice or detail)


def engine_notice(status: Mapping[str, Any] | None) -> str | None:
    """Why the service runs another engine than the config asks for, or None."""
    engine = (status or {}).get("engine") or {}
    reason = engine.get("fallback_reason")
    if not reason:
        return None
    return f"Engine: {engine.get('runtime')} instead of {engine.get('configured')}, because {reason}."


def is_busy_overflow(status: Mapping[str, Any] | None) -> bool:
    """Degraded only because a burst overflowed a busy GPU to the CPU.

    The service counts a `gpu_busy` overflow as degraded mode, but the GPU
    path is up and serving: it comes and goes with every burst, so it must not
    be announced like an outage.
    """
    if not status:
        return False
    degraded = status.get("degraded") or {}
    reason = str(degraded.get("reason") or "")
    return (bool(degraded.get("active")) and reason.partition(":")[0] == "gpu_busy"
            and (status.get("gpu") or {}).get("path_out_reason") is None)


# ----- numbers ------------------------------------------------------------------------

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


FAULT_WORDS = {"crash": "a crash", "hang": "a hang", "give_back": "a give-back"}


def failover_text(status: Mapping[str, Any]) -> str | None:
    """The panel's line on failover time (/status "failover"): how long the
    last replay's client waited for its first token after the GPU's fault,
    and the median; None before any replay has answered."""
    failover = status.get("failover") or {}
    last, count = _num(failover.get("last_s")), failover.get("count") or 0
    if last is None or not count:
        return None
    fault = FAULT_WORDS.get(failover.get("last_fault") or "", "a fault")
    text = f"Last failover: first token on the CPU {fmt_seconds(last)} after {fault}"
    median = _num(failover.get("p50_s"))
    if count > 1 and median is not None:
        text += f" (median {fmt_seconds(median)} over {count})"
    return text


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


# ----- bars ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Segment:
    key: str      # worker | used | reserve | short | free
    label: str
    mib: float    # how much of the bar it takes
    # What the legend says, when that differs from the width: a reserve that
    # free memory only partly covers is still the configured reserve.
    figure_mib: float | None = None

    @property
    def figure(self) -> float:
        return self.mib if self.figure_mib is None else self.figure_mib


@dataclass(frozen=True)
class Bar:
    title: str
    total_mib: float | None
    segments: tuple[Segment, ...]
    caption: str
    note: str = ""         # e.g. "simulated", "unknown"
    warning: str = ""      # e.g. the reserve is not met
    apps: str = ""         # who else holds VRAM on this device, by name


def _clamp(value: float) -> float:
    return max(0.0, value)


def _known_total(value: Any) -> float | None:
    """A device that reports 0 MiB in all has not been read, not filled up."""
    total = _num(value)
    return total if total is not None and total > 0 else None


def vram_bars(status: Mapping[str, Any]) -> list[Bar]:
    """One bar per GPU device: [GPU worker | other use | reserve | free].

    The reserve is kept out of the free memory of the device the GPU worker
    runs on (the first one); when free memory is below the reserve, the part
    that is missing shows as `short`.
    """
    gpu = status.get("gpu") or {}
    simulated = bool(gpu.get("simulated"))
    if not gpu.get("available"):
        if cpu_only(status) is not None:
            return []  # no GPU to show; the state above says why
        # The bar says it in two words; the reason (a driver's error text, often
        # long) wraps on the line under it instead of being cut off inside.
        return [Bar("VRAM", None, (), "no GPU reading", note="unavailable",
                    warning=f"no GPU reading: {gpu.get('reason') or 'unknown'}")]
    reserve = _num(gpu.get("reserve_mib")) or 0.0
    worker = _workers(status).get("gpu")
    worker_mib = _num((worker or {}).get("estimated_vram_mib")) if worker and worker.get("pid") else 0.0
    devices = gpu.get("devices") or [{
        "index": 0, "name": "GPU", "total_mib": gpu.get("total_mib"),
        "used_mib": gpu.get("used_mib"), "free_mib": gpu.get("free_mib"),
    }]
    bars = []
    for position, device in enumerate(devices):
        total = _known_total(device.get("total_mib"))
        free = _num(device.get("free_mib"))
        used = _num(device.get("used_mib"))
        name = device.get("name") or f"GPU {device.get('index', position)}"
        title = f"VRAM · {name}" + (f" (GPU {device.get('index')})" if len(devices) > 1 else "")
        note = "simulated" if simulated else ""
        if total is None or free is None:
            bars.append(Bar(title, total, (), "free VRAM unknown", note=note or "unknown"))
            continue
        if used is None:
            used = _clamp(total - free)
        if position == 0:
            segments, warning = _headroom_segments("GPU worker (est.)", worker_mib or 0.0, used,
                                                   "reserve", reserve, free, "free VRAM")
        else:
            segments, warning = [Segment("used", "used", used), Segment("free", "free", free)], ""
        caption = f"{fmt_mib(free, total)} free of {fmt_mib(total)}"
        apps = other_apps_text(device.get("processes") or (), _worker_pids(status))
        if position == 0:
            apps = "\n".join(line for line in (apps, rpc_servers_text(gpu.get("rpc_servers") or ()),
                                                peers_text(status.get("peers") or ())) if line)
        bars.append(Bar(title, total, tuple(segments), caption, note=note, warning=warning, apps=apps))
    return bars


def rpc_servers_text(servers: Any) -> str:
    """One line per remote device server, its memory first:
    'RPC 10.0.0.2:50052: 7.8 GiB free of 8.0 GiB · 0.4 ms',
    'RPC 10.0.0.2:50052: 23.5 GiB free (read 12 min ago) · in use by the GPU worker',
    'RPC 10.0.0.3:50052: unreachable: [Errno 111] Connection refused'."""
    lines = []
    for server in servers:
        if not isinstance(server, Mapping):
            continue
        reachable = server.get("reachable")
        state = server.get("state") or ("unreachable" if reachable is False else "idle" if reachable else None)
        error = server.get("error")
        latency = _num(server.get("latency_ms"))
        what = {
            None: "not checked yet",
            "idle": f"{latency:g} ms" if latency is not None else "reachable",
            # Its one client slot is taken: the memory shown was read before.
            "in_use": "in use by the GPU worker",
            "busy": "busy with another client",
            "incompatible": f"can't be used: {error}" if error else "can't be used",
        }.get(state, f"unreachable: {error}" if error else "unreachable")
        free, total = _num(server.get("free_mib")), _num(server.get("total_mib"))
        memory = ""
        if free is not None:
            memory = f"{fmt_mib(free, total)} free"
            if total is not None and round(total) != round(free):
                memory += f" of {fmt_mib(total)}"
            devices = [d for d in server.get("devices") or () if isinstance(d, Mapping)]
            if len(devices) > 1:
                # Each device is its own share of the split: name them one by one.
                memory += " (" + " + ".join(f"device {d.get('index')}: {fmt_mib(_num(d.get('free_mib')), total)}"
                                            for d in devices) + ")"
            age = _num(server.get("memory_age_s"))
            if age is not None and age >= 60:
                memory += f" (read {fmt_seconds(age)} ago)"
        lines.append(f"RPC {server.get('address')}: " + " · ".join(part for part in (memory, what) if part))
    return "\n".join(lines)


def peers_text(peers: Any) -> str:
    """'Peers: desk healthy, 2.1 ms, 3 served · attic: it refused our API key ...'."""
    parts = []
    for peer in peers:
        if not isinstance(peer, Mapping):
            continue
        if peer.get("healthy"):
            state = "healthy" + (f", {peer['latency_ms']:g} ms" if peer.get("latency_ms") is not None else "")
            if peer.get("served"):
                state += f", {peer['served']} served"
            parts.append(f"{peer.get('name')} {state}")
            continue
        breaker = (peer.get("breaker") or {}).get("state")
        state = peer.get("problem") or (f"breaker {breaker}" if breaker and breaker != "closed" else "not healthy")
        parts.append(f"{peer.get('name')}: {state}")
    return "Peers: " + " · ".join(parts) if parts else ""


# Apps named on a VRAM bar; the rest are counted.
MAX_APPS_SHOWN = 4


def _worker_pids(status: Mapping[str, Any]) -> set[int]:
    return {w["pid"] for w in status.get("workers") or () if isinstance(w.get("pid"), int)}


def other_apps_text(processes: Any, ours: set[int]) -> str:
    """'Other apps: firefox 412 MiB · steam 300 MiB · 2 more', largest first,
    like nvitop: who holds the VRAM our workers can't have."""
    apps = sorted(((p.get("name") or f"pid {p.get('pid')}", _num(p.get("used_mib")))
                   for p in processes if isinstance(p, Mapping) and p.get("pid") not in ours),
                  key=lambda app: -(app[1] or 0.0))
    if not apps:
        return ""
    shown = [f"{name} {fmt_mib(used)}" if used is not None else name for name, used in apps[:MAX_APPS_SHOWN]]
    more = len(apps) - MAX_APPS_SHOWN
    return "Other apps: " + " · ".join(shown) + (f" · {more} more" if more > 0 else "")


def _headroom_segments(worker_label: str, worker_mib: float, used: float, kept_label: str, kept: float,
                       free: float, what: str) -> tuple[list[Segment], str]:
    """[our workers | other use | kept back | headroom] of one device, and a
    warning when free memory has dipped into what is kept back."""
    mine = min(worker_mib, used)
    segments: list[Segment] = []
    if mine > 0:
        segments.append(Segment("worker", worker_label, mine))
    segments.append(Segment("used", "other use" if mine > 0 else "used", _clamp(used - mine)))
    if free >= kept:
        return [*segments, Segment("reserve", kept_label, kept), Segment("free", "headroom", free - kept)], ""
    warning = f"{what} is {fmt_mib(kept - free)} below the {fmt_mib(kept)} {kept_label}"
    return [*segments, Segment("reserve", kept_label, free, figure_mib=kept),
            Segment("free", "headroom", 0.0)], warning


def ram_floor_mib(status: Mapping[str, Any], fallback: float | None = None) -> float | None:
    """The CPU path's RAM floor: from /status when the service reports it,
    else what the local config says."""
    ram = status.get("ram") or {}
    for key in ("floor_mib", "ram_floor_mib"):
        value = _num(ram.get(key))
        if value is not None:
            return value
    return fallback


def ram_bar(status: Mapping[str, Any], floor_mib: float | None = None) -> Bar:
    """[workers' RSS | other use | floor | free] of host RAM."""
    ram = status.get("ram") or {}
    total = _num(ram.get("total_mib"))
    available = _num(ram.get("available_mib"))
    if total is None or available is None:
        return Bar("RAM", total, (), "RAM unknown", note="unknown")
    floor = ram_floor_mib(status, floor_mib) or 0.0
    rss = sum(_num(v) or 0.0 for v in (ram.get("rss_mib_by_pid") or {}).values())
    used = _clamp(total - available)
    segments, warning = _headroom_segments("workers (RSS)", rss, used, "floor", floor, available, "available RAM")
    caption = f"{fmt_mib(available, total)} available of {fmt_mib(total)}"
    swap = _num(ram.get("swap_used_mib"))
    if swap:
        caption += f" · swap in use {fmt_mib(swap)}"
    return Bar("RAM · host", total, tuple(segments), caption, warning=warning)


def headroom_text(free: float, kept: float, kept_label: str) -> str:
    """'703 MiB headroom', or '0 MiB headroom (197 MiB short of the reserve)':
    headroom is never negative."""
    if free >= kept:
        return f"{fmt_mib(free - kept)} headroom"
    return f"0 MiB headroom ({fmt_mib(kept - free)} short of the {kept_label})"


def menu_headroom_text(status: Mapping[str, Any] | None, floor_mib: float | None = None) -> str:
    """One line for the tray menu, under the state: what fits right now.
    Not every tray host shows tooltips, so the menu says it too."""
    if not status:
        return "Memory: no reading yet"
    gpu = status.get("gpu") or {}
    free, reserve = _num(gpu.get("free_mib")), _num(gpu.get("reserve_mib")) or 0.0
    if not gpu.get("available"):
        vram = "VRAM: no GPU"
    elif free is None:
        vram = "VRAM: unknown"
    else:
        vram = f"VRAM {headroom_text(free, reserve, 'reserve')}"
    ram = status.get("ram") or {}
    available = _num(ram.get("available_mib"))
    floor = ram_floor_mib(status, floor_mib) or 0.0
    ram_text = "RAM unknown" if available is None else f"RAM {headroom_text(available, floor, 'floor')}"
    return f"{vram} · {ram_text}"


# ----- tooltip ------------------------------------------------------------------------

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
        free, total = _num(gpu.get("free_mib")), _known_total(gpu.get("total_mib"))
        reserve = _num(gpu.get("reserve_mib")) or 0.0
        sim = " (simulated)" if gpu.get("simulated") else ""
        if free is not None and total is not None:
            lines.append(f"VRAM{sim}: {headroom_text(free, reserve, 'reserve')} "
                         f"({fmt_mib(free, total)} free of {fmt_mib(total)}, {fmt_mib(reserve)} reserved)")
        else:
            lines.append(f"VRAM{sim}: unknown")
    elif kind != CPU:  # there, the reason is the state's own line
        lines.append(f"VRAM: no GPU ({gpu.get('reason') or 'unknown'})")
    ram = status.get("ram") or {}
    available, total = _num(ram.get("available_mib")), _num(ram.get("total_mib"))
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


# ----- degraded banner ----------------------------------------------------------------

# More rows than this would push the panel off a 768-pixel-high screen when
# the CPU queue is full; the rest are counted instead.
MAX_BANNER_ROWS = 3


@dataclass(frozen=True)
class BannerRequest:
    id: str
    text: str
    cancelable: bool = True


@dataclass(frozen=True)
class Banner:
    title: str
    reason: str
    model: str
    limits: str
    latency: str
    requests: tuple[BannerRequest, ...] = ()
    warning: str = ""
    more: int = 0   # requests not listed in `requests`


def time_left_text(request: Mapping[str, Any]) -> str:
    """'about 12 s left' or 'overdue by 4 s', from the admission estimate and
    the request's age now; '' when the service gave no estimate."""
    estimate, age = _num(request.get("estimated_latency_s")), _num(request.get("age_s"))
    if estimate is None:
        return ""
    left = estimate - (age or 0.0)
    if left >= 0.5:
        return f"about {fmt_seconds(left)} left"
    if left > -0.5:
        return "due now"
    return f"overdue by {fmt_seconds(-left)}"


def request_line(request: Mapping[str, Any], *, own: bool = False) -> str:
    state = request.get("state")
    position = request.get("queue_position")
    if state == "queued" and position:
        where = f"{_ordinal(position)} in the CPU queue" if request.get("path") == "cpu" else f"{_ordinal(position)} in the GPU queue"
    elif state == "running" and request.get("path") == "peer":
        where = f"running on peer {request.get('peer') or '?'}"
    elif state == "running":
        where = f"running on the {str(request.get('path') or '?').upper()}"
    else:
        where = str(state or "?")
    # Named by its client (X-Client-Name, else the User-Agent) where known.
    parts = ["Your request" if own else str(request.get("client") or request.get("id")), where]
    left = time_left_text(request)
    if left:
        parts.append(left)
    age = _num(request.get("age_s"))
    if age is not None and not own:
        parts.append(f"{fmt_seconds(age)} old")
    return " · ".join(parts)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def cpu_requests(status: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Requests on the CPU path, as a queue reads: the running ones (oldest
    first), then the waiting ones by position. Past the rows shown, the
    banner counts the rest, so what is being served is never the hidden one."""
    found = [r for r in status.get("requests") or () if r.get("path") in ("cpu", "peer")
             and r.get("state") in ("queued", "running")]
    return sorted(found, key=lambda r: (r.get("state") == "queued", r.get("queue_position") or 0, -(r.get("age_s") or 0)))


def interruption_warning(status: Mapping[str, Any] | None, action: str) -> str | None:
    """The question to ask before `action` (e.g. "Restart the workers") stops
    the requests the last /status shows, or None when nothing would be
    interrupted: an idle service restarts without a dialog."""
    requests = list((status or {}).get("requests") or ())
    if not requests:
        return None
    running = sum(1 for r in requests if r.get("state") == "running")
    queued = len(requests) - running  # a request not yet running waits in a queue
    counts = [f"{n} {state}" for n, state in ((running, "running"), (queued, "queued")) if n]
    noun = "request is" if len(requests) == 1 else "requests are"
    them = "it" if len(requests) == 1 else "them"
    return (f"{' and '.join(counts).capitalize()} {noun} in the service. "
            f"{action} now will stop {them}; the clients get an error. Continue?")


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


def cpu_idle(status: Mapping[str, Any]) -> bool:
    """The CPU path has a free slot and nobody waiting: a new request starts at once."""
    if any(r.get("path") == "cpu" for r in cpu_requests(status)):
        return False
    queue = (status.get("queues") or {}).get("cpu") or {}
    running, slots, depth = (_num(queue.get(key)) for key in ("running", "concurrency", "depth"))
    return running is not None and slots is not None and running < slots and not depth


def new_request_wait_text(status: Mapping[str, Any]) -> str:
    """What a new request on the CPU can expect. The service's estimate is
    the whole answer of a typical request (queue included); said as a wait it
    read as a 26-second queue on an idle machine."""
    degraded = status.get("degraded") or {}
    latency_s = _num(degraded.get("estimated_latency_s"))
    measured = _num(((status.get("speeds") or {}).get("cpu") or {}).get("samples"))
    if cpu_idle(status):
        text = "a new request starts at once"
        if latency_s is not None and measured:
            # Before the first answer the CPU's speed is a guess: say nothing of it.
            text += f"; a typical answer takes about {fmt_seconds(latency_s)}"
    elif latency_s is not None:
        text = f"a new request would be answered in about {fmt_seconds(latency_s)}, queue included"
    else:
        text = ""
    # A peer serving now answers in its own time, measured on its answers.
    for name, peer_s in (degraded.get("peer_latency_s") or {}).items():
        peer_s = _num(peer_s)
        text += f" · on peer {name} about {fmt_seconds(peer_s)}" if peer_s is not None else ""
    return text


def degraded_banner(status: Mapping[str, Any] | None, *, own_request_id: str | None = None,
                    only_own: bool = False) -> Banner | None:
    """The banner's content, or None when there is nothing to warn about.

    `only_own` (the chat window): the rows are the chat's own request only,
    none while it is idle, so no Cancel there can touch another client's
    request; the banner also shows when that request was sent to the CPU
    outside degraded mode. Otherwise (the panel) it lists every CPU request.
    """
    if status is None or cpu_only(status) is not None:
        # Without a GPU path the CPU is not a fallback: nothing to warn about.
        return None
    degraded = status.get("degraded") or {}
    requests = {r.get("id"): r for r in status.get("requests") or ()}
    own = requests.get(own_request_id) if own_request_id else None
    own_on_cpu = own is not None and own.get("path") in ("cpu", "peer")
    if not degraded.get("active") and not own_on_cpu:
        return None
    reason = degraded.get("reason") or (own or {}).get("detail") or "the GPU path can't take this request"
    if own_on_cpu and not degraded.get("active"):
        reason = f"{own.get('reason')}: {own.get('detail')}"
    model = str(degraded.get("fallback_model") or "unknown")
    warning = ""
    if degraded.get("fallback_equivalent") is False:
        model += " (a different model)"
        warning = f"Answers may differ from the GPU model: {degraded.get('fallback_detail')}"
    # Peers serving now are named: the answers come from another machine.
    peers = serving_peers(status)
    if peers:
        on_peers = f"{degraded.get('model') or 'the model'} on peer {', '.join(peers)}"
        model = f"{on_peers} · {model} on the CPU" if _cpu_serving(status) else on_peers
    cap = degraded.get("cpu_context_cap")
    queues = (status.get("queues") or {}).get("cpu") or {}
    depth = degraded.get("cpu_queue_depth", queues.get("depth", 0))
    limit = queues.get("limit")
    limits = f"context up to {cap:,} tokens" if isinstance(cap, int) else "context cap unknown"
    if own is not None and own.get("state") == "queued" and own.get("queue_position"):
        limits += f" · you are {_ordinal(own['queue_position'])} in the queue"
    else:
        limits += f" · {depth} waiting" + (f" (limit {limit})" if limit is not None else "")
    if only_own or own_request_id is not None:
        listed = [own] if own is not None else []
    else:
        listed = cpu_requests(status)
    rows = tuple(BannerRequest(str(r.get("id")), request_line(r, own=r is own)) for r in listed[:MAX_BANNER_ROWS])
    return Banner(
        title=_degraded_title(status, peers),
        reason=humanize_reason(reason), model=model, limits=limits, latency=new_request_wait_text(status) or "unknown",
        requests=rows, warning=warning, more=max(0, len(listed) - MAX_BANNER_ROWS),
    )


def serving_peers(status: Mapping[str, Any] | None) -> list[str]:
    """The peers serving the default model's requests now (degraded.peers)."""
    return [str(name) for name in ((status or {}).get("degraded") or {}).get("peers") or ()]


def _cpu_serving(status: Mapping[str, Any]) -> bool:
    return any(r.get("path") == "cpu" for r in cpu_requests(status))


def _who_serves(status: Mapping[str, Any], peers: list[str], verb: str = "serving") -> str:
    """'the CPU is serving', 'peer desk is serving', 'the CPU and peer desk are serving'."""
    if not peers:
        return f"the CPU is {verb}"
    named = f"peer {', '.join(peers)}"
    if _cpu_serving(status):
        named = f"the CPU and {named}"
    plural = " and " in named or len(peers) > 1
    return f"{named} {'are' if plural else 'is'} {verb}"


def _degraded_title(status: Mapping[str, Any], peers: list[str]) -> str:
    if is_busy_overflow(status):
        return BUSY_TITLE if not peers else f"Busy: {_who_serves(status, peers, 'taking')} the GPU's overflow"
    return "Degraded mode: " + _who_serves(status, peers)


# ----- chat ---------------------------------------------------------------------------

def route_line(served_by: str | None, reason: str | None, fallback_model: str | None = None, *,
               progress: str = "", took_s: float | None = None, peer: str | None = None) -> str:
    """'served by GPU · admitted', 'served by CPU · GPU busy · Small · about 3.2 s left'
    or 'served by peer desk · sent to a peer'.

    `progress` is the live part (time left or overdue, from the latest poll);
    the estimate in the response headers is fixed at admission, so it is not used.
    """
    if served_by == "peer":
        parts = [f"served by peer {peer or 'unknown'}"]
    else:
        parts = [f"served by {(served_by or 'unknown').upper()}"]
    if reason:
        parts.append(route_reason_text(reason))
    if served_by == "cpu" and fallback_model:
        parts.append(fallback_model)
    if progress:
        parts.append(progress)
    if took_s is not None:
        parts.append(f"took {fmt_seconds(took_s)}")
    return " · ".join(parts)


DONE = "[DONE]"


class SseParser:
    """Incremental `text/event-stream` parser: feed bytes, get events.

    Each event is the decoded JSON of its `data:` lines, or DONE.
    """

    def __init__(self) -> None:
        self._lines = SseLineSplitter()
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[Any]:
        events: list[Any] = []
        for line in self._lines.feed(chunk):
            if not line:
                event = self._dispatch()
                if event is not None:
                    events.append(event)
            elif line.startswith(":"):
                continue
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)
        return events

    def close(self) -> list[Any]:
        """Whatever is left when the stream ends without a blank line."""
        return self.feed(b"\n\n")

    def _dispatch(self) -> Any:
        if not self._data:
            return None
        payload = "\n".join(self._data)
        self._data = []
        if payload.strip() == DONE:
            return DONE
        try:
            return json.loads(payload)
        except ValueError:
            return {"error": {"message": f"unreadable event from the service: {payload[:200]}", "code": "bad_event"}}


def delta_text(event: Mapping[str, Any]) -> str:
    out = []
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content"):
            out.append(delta["content"])
        elif choice.get("text"):
            out.append(choice["text"])
    return "".join(out)


def error_message(body: Any, status_code: int | None = None) -> tuple[str, str]:
    """(message, code) from an OpenAI-style error body, or a fallback."""
    if isinstance(body, (bytes, bytearray)):
        try:
            body = json.loads(body.decode("utf-8", errors="replace") or "null")
        except ValueError:
            body = None
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        error = body["error"]
        return str(error.get("message") or "unknown error"), str(error.get("code") or "")
    return (f"HTTP {status_code}" if status_code else "no answer from the service"), ""


# ----- history ------------------------------------------------------------------------

@dataclass
class Sample:
    t: float
    vram_free_mib: float | None
    vram_total_mib: float | None
    vram_reserve_mib: float | None
    ram_available_mib: float | None
    ram_total_mib: float | None


class History:
    """The last `window_s` seconds of free VRAM and available RAM, from polls."""

    def __init__(self, window_s: float = 300.0, clock=time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self.samples: deque[Sample] = deque()

    def add(self, status: Mapping[str, Any], now: float | None = None) -> Sample:
        now = self._clock() if now is None else now
        gpu = status.get("gpu") or {}
        ram = status.get("ram") or {}
        available = bool(gpu.get("available"))
        sample = Sample(
            t=now,
            vram_free_mib=_num(gpu.get("free_mib")) if available else None,
            vram_total_mib=_known_total(gpu.get("total_mib")) if available else None,
            vram_reserve_mib=_num(gpu.get("reserve_mib")),
            ram_available_mib=_num(ram.get("available_mib")),
            ram_total_mib=_num(ram.get("total_mib")),
        )
        self.samples.append(sample)
        while self.samples and self.samples[0].t < now - self.window_s:
            self.samples.popleft()
        return sample

    def series(self, attr: str) -> list[tuple[float, float | None]]:
        return [(s.t, getattr(s, attr)) for s in self.samples]

    def latest(self) -> Sample | None:
        return self.samples[-1] if self.samples else None


# ----- notifications ------------------------------------------------------------------

@dataclass(frozen=True)
class Notice:
    title: str
    message: str
    kind: str  # "degraded_start" | "degraded_end" | "gpu_given_back" | "gpu_taken_again"


class DegradedNotifier:
    """Turns a stream of snapshots into 'degraded mode started/ended' notices.

    Debounced: degraded mode is announced only once it has lasted
    `settle_s`, and not again within `quiet_s` of the last announcement, so a
    flapping path doesn't post pairs of notices. A busy GPU overflowing to the
    CPU is not announced at all (see is_busy_overflow).
    """

    def __init__(self, settle_s: float = 5.0, quiet_s: float = 60.0, clock=time.monotonic) -> None:
        self.settle_s = settle_s
        self.quiet_s = quiet_s
        self._clock = clock
        self.notified_start = False
        self._degraded_since: float | None = None
        self._last_start_notice: float | None = None

    def update(self, status: Mapping[str, Any] | None, host_starting: bool = False,
               now: float | None = None) -> Notice | None:
        now = self._clock() if now is None else now
        kind = icon_kind(status, host_starting=host_starting)
        # ResidencyNotifier speaks for a GPU given away, and a load is over in seconds.
        degraded = (kind == DEGRADED and not is_busy_overflow(status)
                    and residency_state(status) not in GIVEN_STATES + ("loading",))
        if not degraded:
            self._degraded_since = None
        elif self._degraded_since is None:
            self._degraded_since = now
        if degraded and not self.notified_start:
            settled = now - self._degraded_since >= self.settle_s
            quiet = self._last_start_notice is None or now - self._last_start_notice >= self.quiet_s
            if not (settled and quiet):
                return None
            self.notified_start = True
            self._last_start_notice = now
            info = (status or {}).get("degraded") or {}
            reason = humanize_reason(info.get("reason") or "the GPU path is out")
            wait = new_request_wait_text(status or {})
            message = f"{reason}.\nThe CPU serves {info.get('fallback_model')}" + (f"; {wait}" if wait else "")
            return Notice("Degraded mode: the CPU is serving", message + ".", "degraded_start")
        if kind == GPU and self.notified_start:
            self.notified_start = False
            return Notice("Back on the GPU", "Degraded mode ended: the GPU path is serving again.", "degraded_end")
        return None


class TimedNote:
    """A message that stays for `hold_s` before what the polls say takes over
    again, so an error isn't overwritten by the next poll a second later."""

    def __init__(self, hold_s: float = 6.0, clock=time.monotonic) -> None:
        self.hold_s = hold_s
        self._clock = clock
        self._text = ""
        self._until = 0.0

    def show(self, text: str) -> None:
        self._text = text
        self._until = self._clock() + self.hold_s

    def text(self) -> str:
        """The message while it holds, else ''."""
        return self._text if self._text and self._clock() < self._until else ""


# ----- settings -----------------------------------------------------------------------

@dataclass(frozen=True)
class SettingField:
    name: str
    section: str
    key: str
    label: str
    kind: str  # "path" | "int" | "check"
    help: str = ""
    minimum: int | None = None  # narrower than the config's own bounds, where the UI wants it
    maximum: int | None = None
    minimum_text: str = ""      # shown instead of the lowest value, when it means something special


SETTINGS_FIELDS: tuple[SettingField, ...] = (
    # The labels' '&' marks each field's Alt+letter (mnemonic); they are unique in the dialog.
    SettingField("model_path", "model", "path", "&Model (GGUF)", "path",
                 "Served by both workers. Empty = the bundled SmolLM2-135M-Instruct."),
    SettingField("fallback_path", "model", "fallback_path", "CPU &fallback model", "path",
                 "Optional smaller model for the CPU path. Empty = the same file."),
    SettingField("gpu_ctx", "gpu", "n_ctx", "&GPU context (tokens)", "int",
                 "Context of one GPU request; each slot has its own."),
    SettingField("cpu_ctx", "cpu", "n_ctx", "C&PU context (tokens)", "int",
                 "Context of one CPU request; each slot has its own."),
    SettingField("reserve", "gpu", "reserve_mib", "VRAM &reserve (MiB)", "int",
                 "Kept free on the GPU for other apps."),
    SettingField("gpu_layers", "gpu", "n_gpu_layers", "GPU &layers", "int",
                 "Layers offloaded to the GPU; -1 = all.", minimum_text="all (-1)"),
    SettingField("port", "server", "port", "P&ort", "int",
                 "Port of the OpenAI-compatible API.", minimum=1, maximum=65535),
    SettingField("yield", "gpu", "yield_to_other_apps", "Give VRAM to other &apps", "check",
                 "Unload the GPU model when a game or another app needs the memory; the CPU answers meanwhile."),
    SettingField("idle_unload", "gpu", "idle_unload_s", "&Unload when idle (s)", "int",
                 "Unload the GPU model after this long without a request; the next one loads it.",
                 maximum=7 * 24 * 3600, minimum_text="never (0)"),
)


def setting_bounds(field: SettingField) -> tuple[int, int]:
    """The lowest and highest value a number field accepts: the config's own
    bounds (what apply_overrides enforces), narrowed by the field's."""
    from ..core.config import whole_number_bounds

    low, high = whole_number_bounds(field.section, field.key)
    if field.minimum is not None:
        low = max(low, field.minimum)
    if field.maximum is not None:
        high = min(high, field.maximum)
    return low, high


def settings_values(config: Any) -> dict[str, str]:
    """Every field as the text its input starts with ("true"/"false" for a check)."""
    values = {}
    for f in SETTINGS_FIELDS:
        value = getattr(getattr(config, f.section), f.key)
        if f.kind == "check":
            values[f.name] = "true" if value else "false"
        elif f.kind == "int":
            values[f.name] = str(int(value))  # a number of seconds is stored as a float
        else:
            values[f.name] = str(value)
    return values


def validate_settings(config: Any, values: Mapping[str, str],
                      fields: Iterable[SettingField] = SETTINGS_FIELDS) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Check each field; return (overrides for apply_overrides, {field: message}).

    A message is only for its own field, so the dialog can show it next to it.
    Values equal to the current config are still returned in the overrides.
    Model paths are checked by reading the file's header, which can take
    seconds for a stranger's file: call this off the GUI thread.
    """
    from ..core.config import ConfigError, apply_overrides
    from ..core.memory.gguf_info import ModelFileError, read_model_info

    overrides: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for f in fields:
        raw = (values.get(f.name) or "").strip()
        if f.kind == "check":
            value: Any = raw == "true"
        elif f.kind == "int":
            try:
                value = int(raw)
            except ValueError:
                errors[f.name] = f"must be a whole number, got {raw!r}" if raw else "must not be empty"
                continue
            if f.minimum is not None and value < f.minimum or f.maximum is not None and value > f.maximum:
                errors[f.name] = f"must be from {f.minimum} to {f.maximum}, got {value}"
                continue
        else:
            value = raw
            if raw:
                try:
                    read_model_info(raw)
                except ModelFileError as exc:
                    errors[f.name] = str(exc)
                    continue
        try:
            apply_overrides(config, {f.section: {f.key: value}})
        except ConfigError as exc:
            errors[f.name] = str(exc)
            continue
        overrides.setdefault(f.section, {})[f.key] = value
    if not errors:
        try:
            apply_overrides(config, overrides)
        except ConfigError as exc:  # a cross-field rule
            errors["_form"] = str(exc)
    return overrides, errors


def changed_overrides(config: Any, overrides: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Only the values that differ from `config`."""
    out: dict[str, dict[str, Any]] = {}
    for section, values in overrides.items():
        for key, value in values.items():
            if getattr(getattr(config, section), key) != value:
                out.setdefault(section, {})[key] = value
    return out


@dataclass
class WorkerRow:
    role: str
    state: str
    pid: str
    rss: str
    vram: str
    ram: str
    ctx: str
    restarts: str
    last_exit: str = ""


def worker_rows(status: Mapping[str, Any]) -> list[WorkerRow]:
    rows = []
    for w in status.get("workers") or ():
        last_exit = w.get("last_exit") or {}
        rows.append(WorkerRow(
            role=str(w.get("role", "?")).upper(),
            state=str(w.get("state", "?")),
            pid=str(w.get("pid") or "-"),
            rss=fmt_mib(_num(w.get("rss_mib"))) if w.get("rss_mib") is not None else "-",
            vram=fmt_mib(_num(w.get("estimated_vram_mib"))) if _num(w.get("estimated_vram_mib")) else "-",
            ram=fmt_mib(_num(w.get("estimated_ram_mib"))) if _num(w.get("estimated_ram_mib")) else "-",
            ctx=f"{w.get('n_ctx'):,}" if isinstance(w.get("n_ctx"), int) else "-",
            restarts=str(w.get("restarts", 0)),
            last_exit=str(last_exit.get("description") or last_exit.get("kind") or "") if last_exit else "",
        ))
    return rows


# ----- the model library (issue 14) ---------------------------------------------------------

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


@dataclass(frozen=True)
class ModelView:
    """One library model, as the tray menu and the panel show it."""

    name: str
    where: str        # "on the GPU", "on the CPU", "loading", "unloaded", "GPU given away"
    memory: str       # what it holds now, or its size on disk when unloaded
    can_load: bool    # its GPU worker is unloaded and may load now
    can_unload: bool  # it holds memory and nothing of it is queued or running
    busy: int         # requests queued or running on its GPU path
    is_default: bool
    tooltip: str

    @property
    def label(self) -> str:
        """The menu's line: a long file name shortened in the middle (the tooltip has it whole)."""
        default = " (default)" if self.is_default else ""
        return f"{elide_middle(self.name, MENU_NAME_CHARS)}{default}: {self.where}, {self.memory}"


def model_views(status: Mapping[str, Any] | None) -> list[ModelView]:
    views = []
    for model in (status or {}).get("models") or ():
        location = str(model.get("location") or "unloaded")
        gpu = str(model.get("gpu") or "")
        if gpu == "loaded":
            where = "on the GPU"
        elif "cpu" in location.split("+"):
            where = "on the CPU"
        elif gpu == "loading" or location == "loading":
            where = "loading"
        elif gpu == "given_away":
            where = "GPU given away"
        else:
            where = "unloaded"
        vram = _num(model.get("vram_mib")) or 0.0
        if where == "on the GPU" and vram > 0:
            memory = f"{fmt_mib(vram)} VRAM"
        elif where == "on the CPU":
            memory = f"{fmt_mib(_num(model.get('estimated_ram_mib')))} RAM"
        else:
            size = _num(model.get("size_bytes"))
            memory = f"{fmt_mib(size / (1024 * 1024))} on disk" if size else "size unknown"
        busy = int(model.get("in_flight") or 0)
        aliases = ", ".join(model.get("aliases") or ())
        source = {"default": "the default model", "config": "a [[models]] entry", "folder": "from the models folder"}
        tip = [f"{model.get('name')} ({source[model['source']]})" if model.get("source") in source
               else str(model.get("name")), str(model.get("path") or "")]
        if aliases:
            tip.append(f"also called: {aliases}")
        tip.append(f"loads {model.get('loads', 0)}, unloaded for other models {model.get('evictions', 0)} times")
        if model.get("degraded"):
            tip.append(f"degraded: {model['degraded']}")
        views.append(ModelView(
            name=str(model.get("name")), where=where, memory=memory,
            can_load=gpu in ("unloaded_idle",) and where not in ("loading", "on the GPU"),
            can_unload=where in ("on the GPU", "on the CPU") and busy == 0, busy=busy,
            is_default=model.get("source") == "default", tooltip="\n".join(t for t in tip if t)))
    return views


def model_names(status: Mapping[str, Any] | None) -> list[str]:
    """The names a chat may pick, the default model first."""
    return [view.name for view in model_views(status)]
