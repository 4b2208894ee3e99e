"""The degraded banner and the requests in it: who serves, what a new request waits, what to cancel."""

from __future__ import annotations

from dataclasses import dataclass
from ...core.status_contract import RequestStatus, Status
from .formatting import fmt_seconds, humanize_reason
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


def time_left_text(request: RequestStatus) -> str:
    """'about 12 s left' or 'overdue by 4 s', from the admission estimate and
    the request's age now; '' when the service gave no estimate."""
    estimate = request["estimated_latency_s"]
    if estimate is None:
        return ""
    left = estimate - request["age_s"]
    if left >= 0.5:
        return f"about {fmt_seconds(left)} left"
    if left > -0.5:
        return "due now"
    return f"overdue by {fmt_seconds(-left)}"


def request_line(request: RequestStatus, *, own: bool = False) -> str:
    state, path = request["state"], request["path"]
    position = request["queue_position"]
    if state == "queued" and position:
        where = f"{_ordinal(position)} in the {'CPU' if path == 'cpu' else 'GPU'} queue"
    elif state == "running" and path == "peer":
        where = f"running on peer {request['peer'] or '?'}"
    elif state == "running":
        where = f"running on the {(path or '?').upper()}"
    else:
        where = state
    # Named by its client (X-Client-Name, else the User-Agent) where known.
    parts = ["Your request" if own else request["client"] or request["id"], where]
    left = time_left_text(request)
    if left:
        parts.append(left)
    if not own:
        parts.append(f"{fmt_seconds(request['age_s'])} old")
    return " · ".join(parts)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def cpu_requests(status: Status) -> list[RequestStatus]:
    """Requests on the CPU path, as a queue reads: the running ones (oldest
    first), then the waiting ones by position. Past the rows shown, the
    banner counts the rest, so what is being served is never the hidden one."""
    found = [r for r in status["requests"] if r["path"] in ("cpu", "peer") and r["state"] in ("queued", "running")]
    return sorted(found, key=lambda r: (r["state"] == "queued", r["queue_position"] or 0, -r["age_s"]))


def interruption_warning(status: Status | None, action: str) -> str | None:
    """The question to ask before `action` (e.g. "Restart the workers") stops
    the requests the last /status shows, or None when nothing would be
    interrupted: an idle service restarts without a dialog."""
    requests = status["requests"] if status is not None else []
    if not requests:
        return None
    running = sum(1 for r in requests if r["state"] == "running")
    queued = len(requests) - running  # a request not yet running waits in a queue
    counts = [f"{n} {state}" for n, state in ((running, "running"), (queued, "queued")) if n]
    noun = "request is" if len(requests) == 1 else "requests are"
    them = "it" if len(requests) == 1 else "them"
    return (f"{' and '.join(counts).capitalize()} {noun} in the service. "
            f"{action} now will stop {them}; the clients get an error. Continue?")


def cpu_idle(status: Status) -> bool:
    """The CPU path has a free slot and nobody waiting: a new request starts at once."""
    if any(r["path"] == "cpu" for r in cpu_requests(status)):
        return False
    queue = status["queues"]["cpu"]
    return queue["running"] < queue["concurrency"] and not queue["depth"]


def new_request_wait_text(status: Status) -> str:
    """What a new request on the CPU can expect. The service's estimate is
    the whole answer of a typical request (queue included); said as a wait it
    read as a 26-second queue on an idle machine."""
    degraded = status["degraded"]
    latency_s = degraded["estimated_latency_s"]
    measured = status["speeds"]["cpu"]["samples"]
    if cpu_idle(status):
        text = "a new request starts at once"
        if measured:
            # Before the first answer the CPU's speed is a guess: say nothing of it.
            text += f"; a typical answer takes about {fmt_seconds(latency_s)}"
    else:
        text = f"a new request would be answered in about {fmt_seconds(latency_s)}, queue included"
    # A peer serving now answers in its own time, measured on its answers.
    for name, peer_s in degraded["peer_latency_s"].items():
        text += f" · on peer {name} about {fmt_seconds(peer_s)}" if peer_s is not None else ""
    return text


def degraded_banner(status: Status | None, *, own_request_id: str | None = None,
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
    degraded = status["degraded"]
    requests = {r["id"]: r for r in status["requests"]}
    own = requests.get(own_request_id) if own_request_id else None
    own_on_cpu = own is not None and own["path"] in ("cpu", "peer")
    if not degraded["active"] and not own_on_cpu:
        return None
    reason = degraded["reason"] or (own["detail"] if own is not None else None) or "the GPU path can't take this request"
    if own is not None and own_on_cpu and not degraded["active"]:
        reason = f"{own['reason']}: {own['detail']}"
    model = degraded["fallback_model"] or "unknown"
    warning = ""
    if not degraded["fallback_equivalent"]:
        model += " (a different model)"
        warning = f"Answers may differ from the GPU model: {degraded['fallback_detail']}"
    # Peers serving now are named: the answers come from another machine.
    peers = serving_peers(status)
    if peers:
        on_peers = f"{degraded['model'] or 'the model'} on peer {', '.join(peers)}"
        model = f"{on_peers} · {model} on the CPU" if cpu_serving(status) else on_peers
    limits = f"context up to {degraded['cpu_context_cap']:,} tokens"
    if own is not None and own["state"] == "queued" and own["queue_position"]:
        limits += f" · you are {_ordinal(own['queue_position'])} in the queue"
    else:
        limits += f" · {degraded['cpu_queue_depth']} waiting (limit {status['queues']['cpu']['limit']})"
    if only_own or own_request_id is not None:
        listed = [own] if own is not None else []
    else:
        listed = cpu_requests(status)
    rows = tuple(BannerRequest(r["id"], request_line(r, own=r is own)) for r in listed[:MAX_BANNER_ROWS])
    return Banner(
        title=degraded_title(status, peers),
        reason=humanize_reason(reason), model=model, limits=limits, latency=new_request_wait_text(status) or "unknown",
        requests=rows, warning=warning, more=max(0, len(listed) - MAX_BANNER_ROWS),
    )


def serving_peers(status: Status | None) -> list[str]:
    """The peers serving the default model's requests now (degraded.peers)."""
    return list(status["degraded"]["peers"]) if status is not None else []


def cpu_serving(status: Status) -> bool:
    return any(r["path"] == "cpu" for r in cpu_requests(status))


def who_serves(status: Status, peers: list[str], verb: str = "serving") -> str:
    """'the CPU is serving', 'peer desk is serving', 'the CPU and peer desk are serving'."""
    if not peers:
        return f"the CPU is {verb}"
    named = f"peer {', '.join(peers)}"
    if cpu_serving(status):
        named = f"the CPU and {named}"
    plural = " and " in named or len(peers) > 1
    return f"{named} {'are' if plural else 'is'} {verb}"


def degraded_title(status: Status, peers: list[str]) -> str:
    if is_busy_overflow(status):
        return BUSY_TITLE if not peers else f"Busy: {who_serves(status, peers, 'taking')} the GPU's overflow"
    return "Degraded mode: " + who_serves(status, peers)
