"""The degraded banner and the requests in it: who serves, what a new request waits, what to cancel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .formatting import as_number, fmt_seconds, humanize_reason
from .state import BUSY_TITLE, cpu_only, is_busy_overflow


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
    estimate, age = as_number(request.get("estimated_latency_s")), as_number(request.get("age_s"))
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
    age = as_number(request.get("age_s"))
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


def cpu_idle(status: Mapping[str, Any]) -> bool:
    """The CPU path has a free slot and nobody waiting: a new request starts at once."""
    if any(r.get("path") == "cpu" for r in cpu_requests(status)):
        return False
    queue = (status.get("queues") or {}).get("cpu") or {}
    running, slots, depth = (as_number(queue.get(key)) for key in ("running", "concurrency", "depth"))
    return running is not None and slots is not None and running < slots and not depth


def new_request_wait_text(status: Mapping[str, Any]) -> str:
    """What a new request on the CPU can expect. The service's estimate is
    the whole answer of a typical request (queue included); said as a wait it
    read as a 26-second queue on an idle machine."""
    degraded = status.get("degraded") or {}
    latency_s = as_number(degraded.get("estimated_latency_s"))
    measured = as_number(((status.get("speeds") or {}).get("cpu") or {}).get("samples"))
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
        peer_s = as_number(peer_s)
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
        model = f"{on_peers} · {model} on the CPU" if cpu_serving(status) else on_peers
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
        title=degraded_title(status, peers),
        reason=humanize_reason(reason), model=model, limits=limits, latency=new_request_wait_text(status) or "unknown",
        requests=rows, warning=warning, more=max(0, len(listed) - MAX_BANNER_ROWS),
    )


def serving_peers(status: Mapping[str, Any] | None) -> list[str]:
    """The peers serving the default model's requests now (degraded.peers)."""
    return [str(name) for name in ((status or {}).get("degraded") or {}).get("peers") or ()]


def cpu_serving(status: Mapping[str, Any]) -> bool:
    return any(r.get("path") == "cpu" for r in cpu_requests(status))


def who_serves(status: Mapping[str, Any], peers: list[str], verb: str = "serving") -> str:
    """'the CPU is serving', 'peer desk is serving', 'the CPU and peer desk are serving'."""
    if not peers:
        return f"the CPU is {verb}"
    named = f"peer {', '.join(peers)}"
    if cpu_serving(status):
        named = f"the CPU and {named}"
    plural = " and " in named or len(peers) > 1
    return f"{named} {'are' if plural else 'is'} {verb}"


def degraded_title(status: Mapping[str, Any], peers: list[str]) -> str:
    if is_busy_overflow(status):
        return BUSY_TITLE if not peers else f"Busy: {who_serves(status, peers, 'taking')} the GPU's overflow"
    return "Degraded mode: " + who_serves(status, peers)
