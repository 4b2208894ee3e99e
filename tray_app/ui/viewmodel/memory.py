"""Memory: the VRAM and RAM bars with their headroom, RPC servers, peers and the other apps on the GPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

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
    reserve = as_number(gpu.get("reserve_mib")) or 0.0
    worker = workers_by_role(status).get("gpu")
    worker_mib = as_number((worker or {}).get("estimated_vram_mib")) if worker and worker.get("pid") else 0.0
    devices = gpu.get("devices") or [{
        "index": 0, "name": "GPU", "total_mib": gpu.get("total_mib"),
        "used_mib": gpu.get("used_mib"), "free_mib": gpu.get("free_mib"),
    }]
    bars = []
    for position, device in enumerate(devices):
        total = known_total(device.get("total_mib"))
        free = as_number(device.get("free_mib"))
        used = as_number(device.get("used_mib"))
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
    apps = sorted(((p.get("name") or f"pid {p.get('pid')}", as_number(p.get("used_mib")))
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
        value = as_number(ram.get(key))
        if value is not None:
            return value
    return fallback


def ram_bar(status: Mapping[str, Any], floor_mib: float | None = None) -> Bar:
    """[workers' RSS | other use | floor | free] of host RAM."""
    ram = status.get("ram") or {}
    total = as_number(ram.get("total_mib"))
    available = as_number(ram.get("available_mib"))
    if total is None or available is None:
        return Bar("RAM", total, (), "RAM unknown", note="unknown")
    floor = ram_floor_mib(status, floor_mib) or 0.0
    rss = sum(as_number(v) or 0.0 for v in (ram.get("rss_mib_by_pid") or {}).values())
    used = _clamp(total - available)
    segments, warning = _headroom_segments("workers (RSS)", rss, used, "floor", floor, available, "available RAM")
    caption = f"{fmt_mib(available, total)} available of {fmt_mib(total)}"
    swap = as_number(ram.get("swap_used_mib"))
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
    free, reserve = as_number(gpu.get("free_mib")), as_number(gpu.get("reserve_mib")) or 0.0
    if not gpu.get("available"):
        vram = "VRAM: no GPU"
    elif free is None:
        vram = "VRAM: unknown"
    else:
        vram = f"VRAM {headroom_text(free, reserve, 'reserve')}"
    ram = status.get("ram") or {}
    available = as_number(ram.get("available_mib"))
    floor = ram_floor_mib(status, floor_mib) or 0.0
    ram_text = "RAM unknown" if available is None else f"RAM {headroom_text(available, floor, 'floor')}"
    return f"{vram} · {ram_text}"
