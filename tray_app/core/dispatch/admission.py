"""Admission control: a pure function from (request, observed state) to a decision.

It never logs, sleeps or reads anything: the dispatcher gathers the inputs
(VRAM observed free, queue depths, breaker verdict) and applies the result.
That keeps every route reason testable with plain values.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass

from .latency import PathLoad, Work, estimate


class Route(str, enum.Enum):
    GPU = "gpu"          # run now on the GPU worker
    GPU_QUEUE = "gpu_queue"  # wait for a GPU slot (sooner than the CPU would finish it)
    CPU = "cpu"          # run on the CPU path (maybe after waiting in its queue)
    PEER = "peer"        # forward to another server on the LAN ([[peers]])
    REJECT = "reject"    # a controlled error; nothing runs


class Reason(str, enum.Enum):
    ADMITTED = "admitted"
    FORCED_CPU = "forced_cpu"
    GPU_UNAVAILABLE = "gpu_unavailable"
    GPU_CONTEXT_CAP = "gpu_context_cap"
    GPU_VRAM_HEADROOM = "gpu_vram_headroom"
    GPU_BUSY = "gpu_busy"
    GPU_FAILED_REPLAYED = "gpu_failed_replayed"
    # A peer failed before any output: re-run once here, on the CPU.
    PEER_FAILED_REPLAYED = "peer_failed_replayed"
    # The GPU (or a peer) failed partway through a plain answer: the CPU
    # goes on from the text it made (failover.continuation_refused).
    GPU_FAILED_RESUMED = "gpu_failed_resumed"
    PEER_FAILED_RESUMED = "peer_failed_resumed"
    # The GPU worker gave its memory to another app (or the user gave it back).
    GPU_YIELDED = "gpu_yielded"
    # The GPU worker is unloaded, starting or restarting: the CPU answers meanwhile.
    GPU_LOADING = "gpu_loading"
    # This machine has no GPU path (no device, a CPU-only build, [gpu]
    # enabled = false): the CPU is how it serves, not a fallback, so not
    # one of GPU_OUT_REASONS (no degraded mode, no X-Fallback-Model).
    CPU_ONLY = "cpu_only"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    CPU_CONTEXT_CAP = "cpu_context_cap"
    CPU_QUEUE_FULL = "cpu_queue_full"
    RAM_FLOOR = "ram_floor"
    DEADLINE_TOO_SHORT = "deadline_too_short"
    QUEUE_WAIT_TOO_LONG = "queue_wait_too_long"
    NO_WORKER = "no_worker"
    # The request carries images, the GPU path can't take it, and the CPU
    # worker has no projector: refused rather than answered without them.
    CPU_CANNOT_READ_IMAGES = "cpu_cannot_read_images"
    # The local GPU can't take it (or the local CPU can't either) and a peer
    # server on the LAN does ([[peers]]; see offer_to_peer).
    PEER = "peer"


# Reasons under which the CPU serves because the GPU path can't: degraded mode.
GPU_OUT_REASONS = frozenset({
    Reason.GPU_UNAVAILABLE, Reason.GPU_CONTEXT_CAP, Reason.GPU_VRAM_HEADROOM,
    Reason.GPU_BUSY, Reason.GPU_FAILED_REPLAYED, Reason.FORCED_CPU, Reason.GPU_YIELDED, Reason.GPU_LOADING,
    Reason.PEER_FAILED_REPLAYED, Reason.GPU_FAILED_RESUMED, Reason.PEER_FAILED_RESUMED,
})


@dataclass(frozen=True)
class GpuOut:
    """Why the GPU path can't take a request now."""

    reason: "Reason"
    detail: str
    # When it is expected back, in seconds; None = nobody can say.
    back_in_s: float | None = None
    # Not a degraded condition by itself (unloaded while idle): the banner
    # waits until a request is actually served elsewhere.
    quiet: bool = False


# Cells kept free at the end of a context. llama-cpp-python's completion loop
# skips its max_tokens check while a multi-byte UTF-8 character is still
# incomplete (up to 3 byte tokens), and our prompt count can differ from the
# worker's by a token where the chat template meets the BOS. Without this
# margin a generation can run off the end of the KV cache, which kills the
# stream ("failed to find a memory slot") instead of ending it with "length".
CONTEXT_SAFETY_TOKENS = 8
# OpenAI's documented default for the legacy completions API.
COMPLETION_DEFAULT_MAX_TOKENS = 16


def token_limit(prompt_tokens: int, requested: int | None, context_caps: list[int], *,
                chat: bool) -> int:
    """The generation limit a request runs with: sent to the worker as
    max_tokens, and the number admission plans with. Always explicit.

    The client's limit, bounded by the room left after the prompt in the
    largest context; the request then ends with finish_reason "length".
    Without one, a completion gets OpenAI's 16 tokens and a chat may fill the
    smallest context the prompt fits in, so a replay on the other path can
    run with the very same limit. A prompt that fits nowhere keeps a limit of
    1 and admission refuses it as over every context.
    """
    rooms = sorted(cap - CONTEXT_SAFETY_TOKENS - prompt_tokens for cap in context_caps)
    largest = rooms[-1] if rooms else 0
    if requested is None:
        if not chat:
            return max(1, min(COMPLETION_DEFAULT_MAX_TOKENS, largest))
        return max(1, next((room for room in rooms if room >= 1), largest))
    return max(1, min(requested, largest))


@dataclass(frozen=True)
class RequestShape:
    prompt_tokens: int
    max_tokens: int          # tokens the request may generate (already defaulted)
    force_cpu: bool = False
    deadline_s: float | None = None  # the client's X-Request-Timeout
    is_replay: bool = False  # a GPU failure being re-run: must not be refused for queue space
    # Where the failure being re-run happened: "gpu" or "peer".
    replayed_from: str = "gpu"
    # The re-run goes on from the text the failed path made, not from nothing.
    is_continuation: bool = False
    # The longest the request may wait in a queue for a slot: its
    # X-Request-Timeout, else the configured default. None = no time limit.
    queue_budget_s: float | None = None
    # X-Prefer-Path: gpu: wait for a loading GPU rather than take the CPU.
    prefer_gpu: bool = False
    # X-Fallback: never, or [routing] fallback = "never": a 503 instead of the CPU.
    no_fallback: bool = False
    # Why the CPU path can't run this request at all (it carries images and the
    # CPU worker has no projector), or None: then a 503, never a text-only answer.
    cpu_refusal: str | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens


@dataclass(frozen=True)
class LaneState:
    context_cap: int
    running: int
    concurrency: int
    queued: int
    queue_limit: int
    # Slots the request being decided needs: one per answer (OpenAI's n).
    slots_wanted: int = 1

    @property
    def has_free_slot(self) -> bool:
        return self.running + self.slots_wanted <= self.concurrency

    @property
    def has_queue_room(self) -> bool:
        return self.queued < self.queue_limit


@dataclass(frozen=True)
class GpuView:
    """The GPU path as the dispatcher sees it right now."""

    lane: LaneState
    # None when the GPU path can serve; else why not (worker not ready, breaker open, paused, no device).
    out: GpuOut | None
    free_vram_mib: float | None   # None = unknown, which never admits
    reserve_mib: float
    request_vram_mib: float       # what this request would add on the device
    # Seconds until a GPU slot frees up for a new arrival (work ahead, per slot).
    backlog_s: float = 0.0
    # The work on the GPU's slots and in its queue, with its measured speeds:
    # what the latency estimate plays forward (None: no estimate).
    load: PathLoad | None = None


@dataclass(frozen=True)
class CpuView:
    lane: LaneState
    can_serve: bool               # worker ready or starting (requests wait for it)
    out_reason: str | None
    host_available_mib: float
    ram_floor_mib: float
    request_ram_mib: float
    tokens_per_s: float           # measured generation speed (or the configured prior)
    prompt_tokens_per_s: float
    # Seconds of work already ahead in the CPU lane (running + queued), per slot.
    backlog_s: float
    # A CPU worker that loads on demand and is not loaded: the RAM its load
    # takes, and what unloading other models' idle CPU workers would give
    # back to make room (residency.eviction; done just before the load).
    load_ram_mib: float = 0.0
    evictable_ram_mib: float = 0.0
    # The work on the CPU's slots and in its queue, with its measured speeds
    # per busy slot count; None: the single-stream speed and backlog_s.
    load: PathLoad | None = None
    # Its worker and the GPU's oversubscribe the same cores: running here
    # slows every GPU answer down, so it is not where a GPU's overflow goes
    # to finish sooner (earliest_finish).
    slows_gpu: bool = False


@dataclass(frozen=True)
class Decision:
    route: Route
    reason: Reason
    detail: str
    status: int = 200
    retry_after_s: float | None = None
    estimated_latency_s: float | None = None
    # Admitted to wait in the GPU queue for a load (see decide).
    waits_for_load: bool = False

    @property
    def accepted(self) -> bool:
        return self.route is not Route.REJECT


def estimate_cpu_latency_s(request: RequestShape, cpu: CpuView) -> float:
    """Seconds until the last token on the CPU: the work ahead and this
    request's own at the speed each stretch gets with the slots it shares."""
    if cpu.load is not None:
        return latency_on(cpu.load, request)
    service = request.max_tokens / cpu.tokens_per_s + request.prompt_tokens / cpu.prompt_tokens_per_s
    return round(cpu.backlog_s + service, 2)


def latency_on(load: PathLoad, request: RequestShape) -> float:
    """Seconds until the request's last token on a path with this load, if
    it writes all of max_tokens (an answer that stops early comes sooner)."""
    return round(estimate(load, Work(request.prompt_tokens, request.max_tokens)).latency_s, 2)


def decide(request: RequestShape, gpu: GpuView | None, cpu: CpuView) -> Decision:
    """Where this request goes, and why."""
    caps = [cpu.lane.context_cap] + ([gpu.lane.context_cap] if gpu is not None else [])
    if request.total_tokens > max(caps):
        return Decision(
            Route.REJECT, Reason.CONTEXT_LENGTH_EXCEEDED,
            f"prompt ({request.prompt_tokens} tokens) plus max_tokens ({request.max_tokens}) is "
            f"{request.total_tokens} tokens, over the largest context this server offers ({max(caps)}); "
            "shorten the prompt or lower max_tokens",
            status=400,
        )
    if request.is_replay and request.is_continuation:
        reason = Reason.PEER_FAILED_RESUMED if request.replayed_from == "peer" else Reason.GPU_FAILED_RESUMED
        return _to_cpu(request, cpu, reason, f"the {request.replayed_from.upper()} failed partway through the "
                       "answer; the CPU goes on from the text it made")
    if request.is_replay and request.replayed_from == "peer":
        return _to_cpu(request, cpu, Reason.PEER_FAILED_REPLAYED, "the peer failed before any output; re-run once on the CPU")
    if request.is_replay:
        return _to_cpu(request, cpu, Reason.GPU_FAILED_REPLAYED, "the GPU worker failed before any output; re-run once on the CPU")
    if gpu is None:
        return _to_cpu(request, cpu, Reason.CPU_ONLY, "this machine has no GPU path: the CPU serves")
    if request.force_cpu:
        return _to_cpu(request, cpu, Reason.FORCED_CPU, "the GPU path is paused or the client asked for the CPU")
    if gpu.out is not None:
        # A client that would rather wait for the load, or may not use the
        # CPU at all, waits for it (the GPU is seconds away, not gone).
        waits = (request.prefer_gpu or (request.no_fallback and not request.force_cpu)
                 or request.cpu_refusal is not None)
        if gpu.out.reason is Reason.GPU_LOADING and waits and gpu.lane.has_queue_room:
            wait = (gpu.out.back_in_s or 0.0) + gpu.backlog_s
            if request.deadline_s is None or wait <= request.deadline_s:
                why = ("X-Prefer-Path: gpu" if request.prefer_gpu else
                       "no CPU fallback" if request.cpu_refusal is None else request.cpu_refusal)
                return Decision(Route.GPU_QUEUE, Reason.ADMITTED,
                                f"waiting for the GPU to load ({why}): {gpu.out.detail}",
                                estimated_latency_s=round(wait, 2), waits_for_load=True)
        return _to_cpu(request, cpu, gpu.out.reason, gpu.out.detail, gpu.out.back_in_s)
    if request.total_tokens > gpu.lane.context_cap:
        return _to_cpu(
            request, cpu, Reason.GPU_CONTEXT_CAP,
            f"{request.total_tokens} tokens exceed the GPU context cap of {gpu.lane.context_cap}",
        )
    if gpu.free_vram_mib is None:
        return _to_cpu(request, cpu, Reason.GPU_UNAVAILABLE, "free VRAM is unknown, so the GPU is not trusted")
    spare = gpu.free_vram_mib - gpu.reserve_mib
    if spare < gpu.request_vram_mib:
        return _to_cpu(
            request, cpu, Reason.GPU_VRAM_HEADROOM,
            f"needs {gpu.request_vram_mib:.0f} MiB but only {max(spare, 0):.0f} MiB is free above the "
            f"{gpu.reserve_mib:.0f} MiB reserve",
        )
    if gpu.lane.has_free_slot:
        return Decision(Route.GPU, Reason.ADMITTED, "fits on the GPU",
                        estimated_latency_s=latency_on(gpu.load, request) if gpu.load is not None else None)
    if gpu.lane.has_queue_room and _fits_budget(gpu.backlog_s, request):
        wait = Decision(Route.GPU_QUEUE, Reason.ADMITTED, "waiting for a GPU slot",
                        estimated_latency_s=(latency_on(gpu.load, request) if gpu.load is not None
                                             else round(gpu.backlog_s, 2)))
        return earliest_finish(request, gpu, cpu, wait)
    if gpu.lane.has_queue_room:
        return _to_cpu(
            request, cpu, Reason.GPU_BUSY,
            f"all {gpu.lane.concurrency} GPU slots are busy and the wait for one (about {gpu.backlog_s:.0f} s) "
            f"is over the {request.queue_budget_s:g} s queue budget",
        )
    return _to_cpu(
        request, cpu, Reason.GPU_BUSY,
        f"all {gpu.lane.concurrency} GPU slots are busy and the GPU queue is full "
        f"({gpu.lane.queued}/{gpu.lane.queue_limit})",
    )


def earliest_finish(request: RequestShape, gpu: GpuView, cpu: CpuView, gpu_wait: Decision) -> Decision:
    """All GPU slots are busy and the request may wait for one: wait, or
    run on the CPU, whichever is expected to finish it first. Both are the
    queue played forward at each path's measured speed per busy slot count
    (latency.estimate), so a GPU 10x faster is waited for behind a short
    queue and left for an idle CPU behind a long one. The number of requests
    waiting doesn't decide. Without the GPU's load (no speeds to play it
    forward with) the request waits, as it always did; so it does when the
    CPU worker would slow the GPU's (CpuView.slows_gpu): each estimate is
    one path's alone, and can't see that cost. A peer that would finish
    sooner still is offer_to_peer's to choose."""
    if gpu.load is None or gpu_wait.estimated_latency_s is None:
        return gpu_wait
    if cpu.slows_gpu:
        return dataclasses.replace(
            gpu_wait, detail="waiting for a GPU slot: the CPU worker's threads and the GPU worker's share the "
                             "same cores, so running on the CPU would slow the GPU's answers by more than it adds")
    if cpu.lane.slots_wanted > cpu.lane.concurrency:
        # More choices (n) than the CPU has slots: only the GPU can run it.
        return gpu_wait
    gpu_s = gpu_wait.estimated_latency_s
    cpu_s = estimate_cpu_latency_s(request, cpu)
    if gpu_s <= cpu_s:
        return dataclasses.replace(
            gpu_wait, detail=f"waiting for a GPU slot: expected to finish in about {gpu_s:.1f} s, "
                             f"the CPU in {cpu_s:.1f} s")
    on_cpu = _to_cpu(request, cpu, Reason.GPU_BUSY,
                     f"all {gpu.lane.concurrency} GPU slots are busy and the CPU is expected to finish first "
                     f"(about {cpu_s:.1f} s against {gpu_s:.1f} s waiting for the GPU)")
    # The CPU can't take it after all (down, full, too little RAM, the
    # client may not use it): waiting for the GPU still answers.
    return on_cpu if on_cpu.accepted else gpu_wait


def _to_cpu(request: RequestShape, cpu: CpuView, why: Reason, detail: str,
            gpu_back_in_s: float | None = None) -> Decision:
    if request.cpu_refusal is not None:
        return Decision(Route.REJECT, Reason.CPU_CANNOT_READ_IMAGES,
                        f"the GPU path can't serve ({detail}) and {request.cpu_refusal}; "
                        "retry later", status=503,
                        retry_after_s=_retry_after(gpu_back_in_s if gpu_back_in_s is not None else 30.0))
    # No GPU path (CPU_ONLY): the CPU is not a fallback here, so a client's
    # "never fall back" has nothing to refuse.
    if request.no_fallback and not request.is_replay and why is not Reason.CPU_ONLY:
        back = (f"; the GPU is expected back in about {gpu_back_in_s:.0f} s" if gpu_back_in_s is not None
                else "; nobody can say when the GPU is back")
        return Decision(
            Route.REJECT, why,
            f"the GPU path can't serve ({detail}) and this request may not run on the CPU "
            f"(X-Fallback: never, or [routing] fallback = \"never\"){back}",
            status=503, retry_after_s=_retry_after(gpu_back_in_s if gpu_back_in_s is not None else 30.0),
        )
    if not cpu.can_serve:
        return Decision(
            Route.REJECT, Reason.NO_WORKER,
            f"the GPU path can't serve ({detail}) and the CPU worker is down ({cpu.out_reason or 'not running'})",
            status=503, retry_after_s=30.0,
        )
    if request.total_tokens > cpu.lane.context_cap:
        return Decision(
            Route.REJECT, Reason.CPU_CONTEXT_CAP,
            f"the GPU path can't serve ({detail}) and {request.total_tokens} tokens exceed the CPU "
            f"context cap of {cpu.lane.context_cap}; retry later or shorten the request",
            status=503, retry_after_s=30.0,
        )
    left = cpu.host_available_mib - cpu.request_ram_mib - cpu.load_ram_mib
    if left + cpu.evictable_ram_mib < cpu.ram_floor_mib:
        loading = f" and loading the CPU model ({cpu.load_ram_mib:.0f} MiB)" if cpu.load_ram_mib else ""
        return Decision(
            Route.REJECT, Reason.RAM_FLOOR,
            f"the GPU path can't serve ({detail}) and running on the CPU{loading} would leave "
            f"{left:.0f} MiB of RAM, under the {cpu.ram_floor_mib:.0f} MiB floor that keeps the host from swapping",
            status=503, retry_after_s=30.0,
        )
    latency = estimate_cpu_latency_s(request, cpu)
    if not request.is_replay and not cpu.lane.has_free_slot and not cpu.lane.has_queue_room:
        return Decision(
            Route.REJECT, Reason.CPU_QUEUE_FULL,
            f"the GPU path can't serve ({detail}) and the CPU queue is full "
            f"({cpu.lane.queued}/{cpu.lane.queue_limit})",
            status=503, retry_after_s=_retry_after(cpu.backlog_s),
        )
    if not request.is_replay and not cpu.lane.has_free_slot and not _fits_budget(cpu.backlog_s, request):
        return Decision(
            Route.REJECT, Reason.QUEUE_WAIT_TOO_LONG,
            f"the GPU path can't serve ({detail}) and the wait for a CPU slot (about {cpu.backlog_s:.0f} s) is "
            f"over the {request.queue_budget_s:g} s queue budget",
            status=503, retry_after_s=_retry_after(cpu.backlog_s),
        )
    if request.deadline_s is not None and latency > request.deadline_s:
        return Decision(
            Route.REJECT, Reason.DEADLINE_TOO_SHORT,
            f"the GPU path can't serve ({detail}); the CPU would take about {latency:.1f} s, "
            f"longer than the {request.deadline_s:g} s in X-Request-Timeout",
            status=503, retry_after_s=_retry_after(cpu.backlog_s), estimated_latency_s=latency,
        )
    return Decision(Route.CPU, why, detail, estimated_latency_s=latency)


# Refusals of the local CPU path that a peer with room can answer instead.
CPU_OUT_REASONS = frozenset({
    Reason.NO_WORKER, Reason.CPU_CONTEXT_CAP, Reason.RAM_FLOOR, Reason.CPU_QUEUE_FULL,
    Reason.QUEUE_WAIT_TOO_LONG, Reason.DEADLINE_TOO_SHORT,
})


class PeerRole(str, enum.Enum):
    # Preferred to the local CPU whenever the local GPU can't take a request
    # (a second box with a GPU answers faster than this one's CPU).
    FALLBACK = "fallback"
    # Only extra capacity: takes what neither local path can (the local CPU
    # is full, down or too slow for the deadline), instead of a 503.
    OVERFLOW = "overflow"


@dataclass(frozen=True)
class PeerView:
    """One peer server as the dispatcher sees it right now: only peers that
    are healthy, have the model, have room and whose breaker lets a request
    through are offered at all."""

    name: str
    role: PeerRole
    # The measured time to an answer of this size (None until measured).
    estimated_latency_s: float | None = None
    # The measured time to all of max_tokens: the length the local paths'
    # estimates count, so earliest finish compares like with like (None:
    # estimated_latency_s is the one to compare).
    finish_s: float | None = None


def offer_to_peer(decision: Decision, request: RequestShape, peers: list[PeerView]) -> tuple[Decision, str | None]:
    """Admission's local decision, or a better one through a peer: the
    decision and the chosen peer's name (None = stay local).

    A request goes to a peer only instead of a local fallback: when the
    GPU can't take it, a fallback peer comes before the local CPU; when the
    local CPU can't take it either, any peer comes before a 503. Never for
    a replay (the rule is one re-run, on the local CPU), a client that asked
    for the CPU, or one that may not leave the GPU (X-Fallback: never):
    callers say so by passing no peers.
    """
    if not peers or request.is_replay:
        return decision, None
    if decision.route is Route.GPU_QUEUE and not decision.waits_for_load:
        # Waiting for a GPU slot: a fallback peer measured to finish sooner
        # than the wait takes it (earliest expected finish decides).
        candidates = [peer for peer in peers if peer.role is PeerRole.FALLBACK
                      and _finishes_sooner(peer, decision.estimated_latency_s)]
    elif decision.route is Route.CPU and decision.reason is Reason.GPU_BUSY:
        # The CPU was chosen over waiting because it finishes sooner: a peer
        # measured to be slower still than the CPU doesn't take it.
        candidates = [peer for peer in peers if peer.role is PeerRole.FALLBACK
                      and (peer.estimated_latency_s is None
                           or _finishes_sooner(peer, decision.estimated_latency_s, or_equal=True))]
    elif decision.route is Route.CPU and (decision.reason in GPU_OUT_REASONS or decision.reason is Reason.CPU_ONLY):
        candidates = [peer for peer in peers if peer.role is PeerRole.FALLBACK]
    elif decision.route is Route.REJECT and decision.reason in CPU_OUT_REASONS:
        candidates = list(peers)
    else:
        return decision, None
    if not candidates:
        return decision, None
    # The fastest measured first; an unmeasured peer after them, in config order.
    peer = min(candidates, key=lambda p: (p.estimated_latency_s is None, p.estimated_latency_s or 0.0))
    if request.deadline_s is not None and peer.estimated_latency_s is not None \
            and peer.estimated_latency_s > request.deadline_s:
        return decision, None
    detail = (f"{decision.detail}; peer {peer.name} takes it before the local CPU" if decision.route is Route.CPU
              else f"all GPU slots are busy; peer {peer.name} is expected to finish first "
                   f"(about {peer.estimated_latency_s:.1f} s against {decision.estimated_latency_s:.1f} s "
                   "waiting for the GPU)" if decision.route is Route.GPU_QUEUE
              else f"{decision.detail}; peer {peer.name} takes it instead")
    return Decision(Route.PEER, Reason.PEER, detail, estimated_latency_s=peer.estimated_latency_s), peer.name


def _finishes_sooner(peer: PeerView, local_s: float | None, or_equal: bool = False) -> bool:
    """Is the peer measured to answer before the local path's estimate?"""
    peer_s = peer.finish_s if peer.finish_s is not None else peer.estimated_latency_s
    if peer_s is None or local_s is None:
        return False
    return peer_s <= local_s if or_equal else peer_s < local_s


def _fits_budget(wait_s: float, request: RequestShape) -> bool:
    return request.queue_budget_s is None or wait_s <= request.queue_budget_s


def _retry_after(backlog_s: float) -> float:
    return float(max(1, math.ceil(backlog_s)))
