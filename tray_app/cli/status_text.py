"""A terminal rendering of /status for `tray-app status`."""

from __future__ import annotations

from ..core.status_contract import Status, validate_status
from ..ui.viewmodel import cpu_only  # Qt-free: the tray and this text agree on what the state is


def _mib(value: float | None) -> str:
    return "unknown" if value is None else f"{value:,.0f} MiB"


def status_mismatch(url: str, data: object) -> str | None:
    """Why `data` can't be rendered: a /status in another shape than this
    version reads (another version's service, or not a tray-app); None when it conforms."""
    problems = validate_status(data)
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return (f"{url} answered /status in a shape this tray-app does not read: {problems[0]}{more}; "
            "is it a tray-app service of the same version? `tray-app status --json` shows it as it is")


def render_status(status: Status) -> str:
    lines: list[str] = []
    service = status["service"]
    # No GPU path at all (no device, a CPU-only build): the CPU serving is
    # this machine's normal state, not degraded mode, as in the tray.
    no_gpu = cpu_only(status) if service["healthy"] else None
    health = "serving on the CPU" if no_gpu else service["health_reason"]
    lines.append(f"model:     {service['model']}   healthy: {service['healthy']} ({health})")
    engine = status["engine"]
    slots = engine["slots"]
    lines.append(f"engine:    {engine['version']}; slots: GPU {slots['gpu']}, CPU {slots['cpu']}")
    if engine["fallback_reason"]:
        lines.append(f"           not {engine['configured']}: {engine['fallback_reason']}")
    gpu = status["gpu"]
    if no_gpu:
        lines.append(f"GPU:       none: {no_gpu.reason}")
        lines.append(f"           {no_gpu.step}")
    elif gpu["available"]:
        kind = "simulated " if gpu["simulated"] else ""
        lines.append(f"GPU:       {kind}{_mib(gpu['free_mib'])} free of {_mib(gpu['total_mib'])}, "
                     f"reserve {_mib(gpu['reserve_mib'])}")
    else:
        lines.append(f"GPU:       unavailable: {gpu['reason']}")
    if gpu["path_out_reason"] and not no_gpu:
        lines.append(f"GPU path:  out: {gpu['path_out_reason']}")
    ram = status["ram"]
    lines.append(f"RAM:       {_mib(ram['available_mib'])} available of {_mib(ram['total_mib'])}")
    lines.append(f"breaker:   {status['breaker']['state']}")
    degraded = status["degraded"]
    if degraded["active"] and not no_gpu:
        lines.append(f"DEGRADED:  CPU serving {degraded['fallback_model']}: {degraded['reason']}; "
                     f"about {degraded['estimated_latency_s']} s per answer")
        if degraded["peers"]:
            lines.append(f"           peer serving: {', '.join(degraded['peers'])}")
    peers = status["peers"]
    if peers:
        lines.append("peers:")
    for peer in peers:
        state = "healthy" if peer["healthy"] else f"out: {peer['problem'] or peer['breaker']['state']}"
        latency = f"{peer['latency_ms']:g} ms" if peer["latency_ms"] is not None else "-"
        lines.append(f"  {peer['name']}  {peer['role']}  {peer['url']}  {state}  rtt {latency}  "
                     f"served {peer['served']}  failures {peer['failures']}")
    lines.append("workers:")
    for worker in status["workers"]:
        lines.append(f"  {worker['role']:<4} {worker['state']:<10} pid {worker['pid'] or '-':<8} "
                     f"port {worker['port'] or '-':<6} ctx {worker['n_ctx']}  "
                     f"RSS {_mib(worker['rss_mib'])}  restarts {worker['restarts']}")
    lines.append("queues:")
    queues = status["queues"]
    for name, queue in (("gpu", queues["gpu"]), ("cpu", queues["cpu"])):
        lines.append(f"  {name:<4} running {queue['running']}/{queue['concurrency']}  "
                     f"waiting {queue['depth']}/{queue['limit']}  oldest {queue['oldest_age_s']} s")
    requests = status["requests"]
    lines.append(f"requests in flight: {len(requests)}")
    for request in requests:
        lines.append(f"  {request['id']}  {request['path']}  {request['state']}  {request['reason']}  {request['age_s']} s")
    return "\n".join(lines)
