"""Memory: the VRAM and RAM bars with their headroom, RPC servers, peers and the other apps on the GPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ...core.status_contract import GpuProcessStatus, PeerStatus, Status
from .formatting import as_number, fmt_mib, fmt_seconds
from .state import cpu_only, workers_by_role


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


def known_total(value: Any) -> float | None:
    """A device that reports 0 MiB in all has not been read, not filled up."""
    total = as_number(value)
    return total if total is not None and total > 0 else None


def vram_bars(status: Status) -> list[Bar]:
    """One bar per GPU device: [GPU worker | other use | reserve | free].

    The reserve is kept out of the free memory of the device the GPU worker
    runs on (the first one); when free memory is below the reserve, the part
    that is missing shows as `short`.
    """
    gpu = status["gpu"]
    simulated = gpu["simulated"]
    if not gpu["available"]:
        if cpu_only(status) is not None:
            return []  # no GPU to show; the state above says why
        # The bar says it in two words; the reason (a driver's error text, often
        # long) wraps on the line under it instead of being cut off inside.
        return [Bar("VRAM", None, (), "no GPU reading", note="unavailable",
                    warning=f"no GPU reading: {gpu['reason'] or 'unknown'}")]
    reserve = gpu["reserve_mib"]
    worker = workers_by_role(status).get("gpu")
    worker_mib = worker["estimated_vram_mib"] if worker is not None and worker["pid"] else 0.0
    # A reading of the whole (a simulated device's, say) without a device list is one device.
    devices: list[Mapping[str, Any]] = list(gpu["devices"]) or [{
        "index": 0, "name": "GPU", "total_mib": gpu["total_mib"],
        "used_mib": gpu["used_mib"], "free_mib": gpu["free_mib"], "processes": [],
    }]
    bars = []
    for position, device in enumerate(devices):
        total = known_total(device["total_mib"])
        free = as_number(device["free_mib"])
        used = as_number(device["used_mib"])
        name = device["name"] or f"GPU {device['index']}"
        title = f"VRAM · {name}" + (f" (GPU {device['index']})" if len(devices) > 1 else "")
        note = "simulated" if simulated else ""
        if total is None or free is None:
            bars.append(Bar(title, total, (), "free VRAM unknown", note=note or "unknown"))
            continue
        if used is None:
            used = _clamp(total - free)
        if position == 0:
            segments, warning = _headroom_segments("GPU worker (est.)", worker_mib, used,
                                                   "reserve", reserve, free, "free VRAM")
        else:
            segments, warning = [Segment("used", "used", used), Segment("free", "free", free)], ""
        caption = f"{fmt_mib(free, total)} free of {fmt_mib(total)}"
        apps = other_apps_text(device["processes"], _worker_pids(status))
        if position == 0:
            apps = "\n".join(line for line in (apps, rpc_servers_text(gpu["rpc_servers"]),
                                                peers_text(status["peers"])) if line)
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
        latency = as_number(server.get("latency_ms"))
        what = {
            None: "not checked yet",
            "idle": f"{latency:g} ms" if latency is not None else "reachable",
            # Its one client slot is taken: the memory shown was read before.
            "in_use": "in use by the GPU worker",
            "busy": "busy with another client",
            "incompatible": f"can't be used: {error}" if error else "can't be used",
        }.get(state, f"unreachable: {error}" if error else "unreachable")
        free, total = as_number(server.get("free_mib")), as_number(server.get("total_mib"))
        memory = ""
        if free is not None:
            memory = f"{fmt_mib(free, total)} free"
            if total is not None and round(total) != round(free):
                memory += f" of {fmt_mib(total)}"
            devices = [d for d in server.get("devices") or () if isinstance(d, Mapping)]
            if len(devices) > 1:
                # Each device is its own share of the split: name them one by one.
                memory += " (" + " + ".join(f"device {d.get('index')}: {fmt_mib(as_number(d.get('free_mib')), total)}"
                                            for d in devices) + ")"
            age = as_number(server.get("memory_age_s"))
            if age is not None and age >= 60:
                memory += f" (read {fmt_seconds(age)} ago)"
        lines.append(f"RPC {server.get('address')}: " + " · ".join(part for part in (memory, what) if part))
    return "\n".join(lines)


def peers_text(peers: Iterable[PeerStatus]) -> str:
    """'Peers: desk healthy, 2.1 ms, 3 served · attic: it refused our API key ...'."""
    parts = []
    for peer in peers:
        if peer["healthy"]:
            latency = peer["latency_ms"]
            state = "healthy" + (f", {latency:g} ms" if latency is not None else "")
            if peer["served"]:
                state += f", {peer['served']} served"
            parts.append(f"{peer['name']} {state}")
            continue
        breaker = peer["breaker"]["state"]
        state = peer["problem"] or (f"breaker {breaker}" if breaker != "closed" else "not healthy")
        parts.append(f"{peer['name']}: {state}")
    return "Peers: " + " · ".join(parts) if parts else ""


# Apps named on a VRAM bar; the rest are counted.
MAX_APPS_SHOWN = 4


def _worker_pids(status: Status) -> set[int]:
    return {w["pid"] for w in status["workers"] if w["pid"] is not None}


def other_apps_text(processes: Iterable[GpuProcessStatus], ours: set[int]) -> str:
    """'Other apps: firefox 412 MiB · steam 300 MiB · 2 more', largest first,
    like nvitop: who holds the VRAM our workers can't have."""
    apps = sorted(((p["name"] or f"pid {p['pid']}", p["used_mib"]) for p in processes if p["pid"] not in ours),
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


def ram_floor_mib(status: Status | None, fallback: float | None = None) -> float | None:
    """The CPU path's RAM floor: the service's; the local config's
    (`fallback`) only while there is no status to read."""
    return status["ram"]["floor_mib"] if status is not None else fallback


def ram_bar(status: Status, floor_mib: float | None = None) -> Bar:
    """[workers' RSS | other use | floor | free] of host RAM."""
    ram = status["ram"]
    total, available = ram["total_mib"], ram["available_mib"]
    if total is None or available is None:
        return Bar("RAM", total, (), "RAM unknown", note="unknown")
    floor = ram_floor_mib(status, floor_mib) or 0.0
    rss = sum(v or 0.0 for v in ram["rss_mib_by_pid"].values())
    used = _clamp(total - available)
    segments, warning = _headroom_segments("workers (RSS)", rss, used, "floor", floor, available, "available RAM")
    caption = f"{fmt_mib(available, total)} available of {fmt_mib(total)}"
    swap = ram["swap_used_mib"]
    if swap:
        caption += f" · swap in use {fmt_mib(swap)}"
    return Bar("RAM · host", total, tuple(segments), caption, warning=warning)


def headroom_text(free: float, kept: float, kept_label: str) -> str:
    """'703 MiB headroom', or '0 MiB headroom (197 MiB short of the reserve)':
    headroom is never negative."""
    if free >= kept:
        return f"{fmt_mib(free - kept)} headroom"
    return f"0 MiB headroom ({fmt_mib(kept - free)} short of the {kept_label})"


def menu_headroom_text(status: Status | None, floor_mib: float | None = None) -> str:
    """One line for the tray menu, under the state: what fits right now.
    Not every tray host shows tooltips, so the menu says it too."""
    if not status:
        return "Memory: no reading yet"
    gpu = status["gpu"]
    free, reserve = gpu["free_mib"], gpu["reserve_mib"]
    if not gpu["available"]:
        vram = "VRAM: no GPU"
    elif free is None:
        vram = "VRAM: unknown"
    else:
        vram = f"VRAM {headroom_text(free, reserve, 'reserve')}"
    available = status["ram"]["available_mib"]
    floor = ram_floor_mib(status, floor_mib) or 0.0
    ram_text = "RAM unknown" if available is None else f"RAM {headroom_text(available, floor, 'floor')}"
    return f"{vram} · {ram_text}"
