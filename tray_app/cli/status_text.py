"""A terminal rendering of /status for `tray-app status`."""

from __future__ import annotations

from typing import Any

from ..ui.viewmodel import cpu_only  # Qt-free: the tray and this text agree on what the state is


def _mib(value: Any) -> str:
    return "unknown" if value is None else f"{value:,.0f} MiB"


def render_status(status: dict[str, Any]) -> str:
    lines: list[str] = []
    service = status.get("service", {})
    # No GPU path at all (no device, a CPU-only build): the CPU serving is
    # this machine's normal state, not degraded mode, as in the tray.
    no_gpu = cpu_only(status) if service.get("healthy") else None
    health = "serving on the CPU" if no_gpu else service.get("health_reason")
    lines.append(f"model:     {service.get('model')}   healthy: {service.get('healthy')} ({health})")
    engine = status.get("engine") or {}
    if engine:
        slots = engine.get("slots") or {}
        lines.append(f"engine:    {engine.get('version')}; slots: GPU {slots.get('gpu')}, CPU {slots.get('cpu')}")
        if engine.get("fallback_reason"):
            lines.append(f"           not {engine.get('configured')}: {engine['fallback_reason']}")
    gpu = status.get("gpu", {})
    if no_gpu:
        lines.append(f"GPU:       none: {no_gpu.reason}")
        lines.append(f"           {no_gpu.step}")
    elif gpu.get("available"):
        kind = "simulated " if gpu.get("simulated") else ""
        lines.append(f"GPU:       {kind}{_mib(gpu.get('free_mib'))} free of {_mib(gpu.get('total_mib'))}, "
                     f"reserve {_mib(gpu.get('reserve_mib'))}")
    else:
        lines.append(f"GPU:       unavailable: {gpu.get('reason')}")
    if gpu.get("path_out_reason") and not no_gpu:
        lines.append(f"GPU path:  out: {gpu['path_out_reason']}")
    ram = status.get("ram", {})
    lines.append(f"RAM:       {_mib(ram.get('available_mib'))} available of {_mib(ram.get('total_mib'))}")
    breaker = status.get("breaker", {})
    lines.append(f"breaker:   {breaker.get('state')}")
    degraded = status.get("degraded", {})
    if degraded.get("active") and not no_gpu:
        lines.append(f"DEGRADED:  CPU serving {degraded.get('fallback_model')}: {degraded.get('reason')}; "
                     f"about {degraded.get('estimated_latency_s')} s per answer")
        if degraded.get("peers"):
            lines.append(f"           peer serving: {', '.join(degraded['peers'])}")
    peers = status.get("peers") or []
    if peers:
        lines.append("peers:")
    for peer in peers:
        state = "healthy" if peer.get("healthy") else f"out: {peer.get('problem') or peer.get('breaker', {}).get('state')}"
        latency = f"{peer['latency_ms']:g} ms" if peer.get("latency_ms") is not None else "-"
        lines.append(f"  {peer.get('name')}  {peer.get('role')}  {peer.get('url')}  {state}  rtt {latency}  "
                     f"served {peer.get('served')}  failures {peer.get('failures')}")
    lines.append("workers:")
    for worker in status.get("workers", []):
        lines.append(f"  {worker['role']:<4} {worker['state']:<10} pid {worker.get('pid') or '-':<8} "
                     f"port {worker.get('port') or '-':<6} ctx {worker.get('n_ctx')}  "
                     f"RSS {_mib(worker.get('rss_mib'))}  restarts {worker.get('restarts')}")
    lines.append("queues:")
    for name, queue in status.get("queues", {}).items():
        lines.append(f"  {name:<4} running {queue['running']}/{queue['concurrency']}  "
                     f"waiting {queue['depth']}/{queue['limit']}  oldest {queue['oldest_age_s']} s")
    requests = status.get("requests", [])
    lines.append(f"requests in flight: {len(requests)}")
    for request in requests:
        lines.append(f"  {request['id']}  {request['path']}  {request['state']}  {request['reason']}  {request['age_s']} s")
    return "\n".join(lines)
