"""The /status contract: the shape of the JSON `Service.status()` returns,
as TypedDicts, and `validate_status`, which checks a snapshot against them.

The service builds it (`status_build.py`); the tray's view model, the drill,
the CLI and the web page read it. A key renamed or dropped on one side then
fails in a type check and in one unit test, not silently in three packages.

Conventions, for readers:
- A key that is always there is a plain annotation: read it with `[...]`.
  Its value may still be None where the annotation says `| None`.
- `NotRequired[...]`: the key is sometimes absent (say when); read it with `.get`.
- Numbers a reading measures are `float`; JSON may carry a whole one as an
  int, which the check accepts. Counts are `int`.
- `rss_mib_by_pid` is keyed by pid: ints in the process, strings once JSON.

Imports typing only: every layer may read it. No `from __future__ import
annotations` here: Python 3.11's TypedDict sees NotRequired only in evaluated
annotations.
"""

import functools
import types
import typing
from typing import Any, Literal, NotRequired, TypedDict, Union

# ----- the service and its workers ------------------------------------------------------------


class ServiceInfo(TypedDict):
    pid: int
    version: str  # tray-app's own (pyproject.toml); /api/version is the Ollama API's
    started_at: float  # time.time()
    model: str  # the default model's name
    healthy: bool
    health_reason: str
    gpu_paused: bool  # "Force CPU" from the tray: every model's GPU path skipped


class LastExit(TypedDict):
    kind: str  # engine.exits.ExitKind's value
    returncode: int | None
    signal: str | None
    evidence: str | None
    description: str


class DraftStatus(TypedDict):
    """Speculative decoding on a worker's path (`/status["workers"][i]["drafts"]`)."""

    answers: int  # answers in the window that drafted
    drafted: int  # tokens drafted
    accepted: int  # of those, accepted by the model
    acceptance: float | None  # accepted / drafted; None before any draft
    window_s: float


class WorkerStatus(TypedDict):
    """One of the default model's workers (`/status["workers"]`)."""

    role: str  # "gpu" | "cpu"
    state: str  # engine.worker.WorkerState's value
    pid: int | None
    port: int | None
    model: str
    model_path: str
    n_ctx: int
    n_gpu_layers: int
    speculative: str | None  # llama-server's --spec-type it runs with; None = no speculative decoding
    drafts: DraftStatus | None  # how its drafts fared over the last minutes; None without speculation
    draft_model: str | None  # the draft model's file it speculates with ([gpu] draft_model); None = none
    draft_refused: str | None  # why the configured draft model isn't used; None when it is, or none is set
    devices: list[dict[str, Any]]  # what the process's llama.cpp printed about its devices
    runtime: str
    restarts: int
    unhealthy_reason: str | None
    gave_up: str | None
    last_exit: LastExit | None
    last_load_s: float | None
    log: str
    rss_mib: float | None
    estimated_vram_mib: float
    estimated_ram_mib: float


class EngineSlots(TypedDict):
    gpu: int
    cpu: int


class EngineStatus(TypedDict):
    runtime: str
    version: str
    configured: str
    fallback_reason: str | None  # why the configured runtime is not the one running
    slots: EngineSlots
    cpu_keep: str
    fallback_policy: str


# ----- memory ----------------------------------------------------------------------------------


class GpuProcessStatus(TypedDict):
    pid: int
    used_mib: float | None
    name: str | None


class GpuDeviceStatus(TypedDict):
    index: int
    name: str
    total_mib: float | None
    used_mib: float | None
    free_mib: float | None
    processes: list[GpuProcessStatus]
    processes_reported: bool


class ResidencyStatus(TypedDict):
    """The default model's GPU residency (`gpu.residency`): loaded, given
    away, unloaded for idleness or given back by the user."""

    state: str  # "loaded" | "loading" | "given_away" | "unloaded_idle" | "given_back_by_user" | a worker state
    text: str | None
    detail: str | None
    since: float | None
    app: str | None
    app_mib: float | None
    reload_in_s: float | None
    settle_s: float | None
    load_eta_s: float | None
    last_release_s: float | None
    last_load_s: float | None
    yields: int
    reloads: int
    yield_to_other_apps: bool
    idle_unload_s: float | None
    idle_limit_s: float | None
    no_room: str | None
    unload_in_s: float | None


class RpcDeviceStatus(TypedDict):
    index: int
    free_mib: float
    total_mib: float


class RpcServerStatus(TypedDict):
    address: str
    reachable: bool | None
    latency_ms: float | None
    error: str | None
    since: float | None
    state: str | None
    checked_at: float | None
    devices: list[RpcDeviceStatus]
    free_mib: float | None
    total_mib: float | None
    protocol: str | None
    memory_read_at: float | None
    memory_age_s: float | None
    query_ms: float | None


class RpcSplit(TypedDict):
    """What admission charges the local GPU with when RPC servers lend devices."""

    offloaded_layers: int
    local_layers: int | None
    local_share: float | None
    local_gpu_mib: float
    all_local_gpu_mib: float
    basis: str


# "local": the default model has a GPU worker; "none": it has none (no usable
# device, a CPU-only build, or [gpu] enabled = false), and path_out_reason says why.
GpuPath = Literal["local", "none"]


class GpuStatus(TypedDict):
    # The device reading (memory.telemetry.GpuReading.to_status).
    available: bool
    simulated: bool
    total_mib: float | None
    free_mib: float | None
    used_mib: float | None
    reason: str | None
    devices: list[GpuDeviceStatus]
    # The default model's GPU path.
    path: GpuPath
    reserve_mib: float
    path_out_reason: str | None
    offload_supported: bool | None
    offload_message: str | None
    pressure_mib: NotRequired[float]  # only on a simulated device
    simulated_device_dir: NotRequired[str]  # only on a simulated device
    residency: ResidencyStatus | None  # None without a GPU path
    rpc_servers: list[RpcServerStatus]
    rpc_split: RpcSplit | None  # None without [gpu] rpc_servers


class RamStatus(TypedDict):
    total_mib: float | None
    available_mib: float | None
    swap_total_mib: float | None
    swap_used_mib: float | None
    rss_mib_by_pid: dict[Any, float | None]
    floor_mib: float


# ----- routing ---------------------------------------------------------------------------------


class BreakerStatus(TypedDict):
    state: str  # "closed" | "open" | "half_open"
    recent_failures: int
    last_failure_reason: str | None
    opened_for_s: float | None
    retry_in_s: float | None


class LaneStatus(TypedDict):
    running: int
    concurrency: int
    depth: int
    limit: int
    oldest_age_s: float


class Queues(TypedDict):
    gpu: LaneStatus  # all zeros without a GPU path
    cpu: LaneStatus


class DegradedStatus(TypedDict):
    active: bool
    reason: str | None
    since: float | None
    model: str
    fallback_model: str
    fallback_equivalent: bool
    fallback_detail: str
    estimated_latency_s: float
    cpu_context_cap: int
    cpu_queue_depth: int
    peers: list[str]  # the peers serving this model's requests now
    peer_latency_s: dict[str, float | None]


class AttemptStatus(TypedDict):
    path: str
    outcome: str | None
    tokens: int


class RequestStatus(TypedDict):
    """One request in flight, on any model."""

    id: str
    client: str | None
    model: str | None
    kind: str
    stream: bool
    state: str
    path: str | None  # "gpu" | "cpu" | "peer"
    peer: str | None
    reason: str | None
    detail: str | None
    age_s: float
    prompt_tokens: int
    max_tokens: int
    estimated_latency_s: float | None
    replayed: bool
    resumed: bool  # a continued answer: the CPU went on from the text the GPU made
    first_failure: str | None
    attempts: list[AttemptStatus]
    queue_position: int | None


class DecisionRecord(TypedDict):
    """One admission decision, on any model (`/status["recent_decisions"]`)."""

    t: float
    id: str
    route: str
    reason: str
    detail: str | None
    client: str | None  # who sent it (X-Client-Name, else the User-Agent's product); None: unnamed
    # Admission's estimate of the seconds to its last token (None: none made). The answer's
    # X-Estimated-Latency is made again at its first event, once the requests after it are known.
    estimated_latency_s: float | None
    model: str | None  # the library model it was for


class PathSpeedStatus(TypedDict):
    tokens_per_s: float
    samples: int


class Speeds(TypedDict):
    gpu: NotRequired[PathSpeedStatus]  # absent without a GPU path
    cpu: PathSpeedStatus


class FailoverFaultStatus(TypedDict):
    count: int
    last_s: float
    p50_s: float   # over the last 50 of this kind


class FailoverStatus(TypedDict):
    """Seconds from a GPU fault to the first token of its replay on the CPU
    (the first byte a streaming client gets), by fault: crash, hang, give_back."""

    count: int
    last_s: float | None       # None until a replay has answered
    last_fault: str | None
    p50_s: float | None
    by_fault: dict[str, FailoverFaultStatus]
    # Of those, the ones that continued a cut answer from its text (the seam:
    # from the fault to the continuation's first new token).
    resumes: int
    resume_last_s: float | None


class UsagePathCounts(TypedDict):
    requests: int
    tokens_in: int
    tokens_out: int


class UsageCounts(TypedDict):
    """One name's counts over a period (core/access/usage.py's empty_counts)."""

    requests: int
    tokens_in: int
    tokens_out: int
    degraded: int  # answered by the CPU fallback or a peer instead of the GPU
    refused: int
    cancelled: int
    paths: dict[str, UsagePathCounts]  # "gpu" | "cpu" | "peer"


class UsageEntry(TypedDict):
    today: UsageCounts
    last_7_days: UsageCounts  # today included


class UsageDay(TypedDict):
    day: str  # ISO date
    by_name: dict[str, UsageCounts]


class UsageStatus(TypedDict):
    """Per API key's name (or app name without keys): what it used, today and
    over the last 7 days, and each day's (oldest first)."""

    today: str  # ISO date
    by_name: dict[str, UsageEntry]
    days: list[UsageDay]


class Accounting(TypedDict):
    completed_executions: int
    duplicate_executions: int


class Event(TypedDict):
    """One line of the event log: a time and a kind, then that kind's own
    keys (open: see _OPEN)."""

    t: float
    kind: str


# ----- embeddings, models, peers -------------------------------------------------------------


class EmbeddingsOff(TypedDict):
    enabled: Literal[False]
    reason: str | None


class EmbeddingsOn(TypedDict):
    enabled: Literal[True]
    state: str
    pid: int | None
    model: str
    pooling: str
    n_ctx: int
    dimensions: int
    requests_served: int
    inputs_served: int
    failures: int
    last_used: float | None
    idle_unload_s: float
    queue: LaneStatus
    rss_mib: float | None
    estimated_ram_mib: float
    last_load_s: float | None
    restarts: int
    unhealthy_reason: str | None
    gave_up: str | None
    log: str


EmbeddingsStatus = Union[EmbeddingsOff, EmbeddingsOn]


class ModelContext(TypedDict):
    gpu: int
    cpu: int


class ServedContext(TypedDict):
    """One path's context of one request, and how it came about."""

    n_ctx: int
    kv_cache: str  # llama.cpp's KV cache type: "f16", or "q8_0" where that let a larger context fit
    automatic: bool  # sized from memory (the config's n_ctx = 0)
    why: str


class ModelSummary(TypedDict):
    """One library model's line in /status["models"] (and /v1/models)."""

    name: str
    aliases: list[str]
    source: str
    path: str
    size_bytes: int
    cpu_fallback: str | None
    location: str  # "gpu" | "cpu" | "gpu+cpu" | "loading" | "unloaded"
    gpu: str  # its residency state, or "unavailable"
    cpu: str | None
    gpu_pid: int | None
    estimated_vram_mib: float
    estimated_ram_mib: float
    vram_mib: float
    context: ModelContext
    served_context: dict[str, ServedContext]  # by path; no "gpu" when the model has no GPU path
    draft_model: str | None  # the GPU worker's draft model file ([gpu] draft_model); None = none
    idle_unload_s: float | None
    last_used: float
    loads: int
    last_load_s: float | None
    evictions: int
    requests: dict[str, int]  # by path
    in_flight: int
    breaker: str
    degraded: str | None
    logs: dict[str, str]  # by worker role


class PeerStatus(TypedDict):
    name: str
    url: str
    role: str
    models: list[str]
    healthy: bool
    reachable: bool | None
    problem: str | None
    latency_ms: float | None
    smoothed_latency_ms: float | None
    checked_at: float | None
    since: float
    breaker: BreakerStatus
    in_flight: int
    max_concurrency: int
    served: int
    failures: int
    last_failure: str | None
    tokens_per_s: float | None
    key_in_cleartext: bool
    warning: str | None


# ----- the whole ------------------------------------------------------------------------------


class Status(TypedDict):
    """/status: the default model's paths at the top level, every model's line under "models"."""

    service: ServiceInfo
    workers: list[WorkerStatus]
    engine: EngineStatus
    gpu: GpuStatus
    ram: RamStatus
    breaker: BreakerStatus
    queues: Queues
    degraded: DegradedStatus
    requests: list[RequestStatus]
    recent_decisions: list[DecisionRecord]  # every model's, oldest first, the newest 20 (status_build)
    speeds: Speeds
    gpu_recovery_s: float | None
    accounting: Accounting
    events: list[Event]
    embeddings: EmbeddingsStatus
    models: list[ModelSummary]
    library_problems: list[str]
    peers: list[PeerStatus]
    # Per API key's name: requests and tokens today and this week. The HTTP
    # app's /status adds it (core/access/usage.py's book); Service.status() has none.
    usage: NotRequired[UsageStatus]
    # Failover time (core/dispatch/failover_time.py); Service.status() always has it.
    failover: NotRequired[FailoverStatus]


# ----- the check ------------------------------------------------------------------------------

# TypedDicts that may carry keys beyond their annotations: an event's own data.
_OPEN: frozenset[type] = frozenset({Event})


def validate_status(obj: object) -> list[str]:
    """Every way `obj` differs from the contract, one sentence each with its
    place ("gpu.residency.state: missing"); empty when it conforms. It
    accepts /status as the service builds it and as JSON carries it."""
    return _check(obj, Status, "status")


def _check(value: object, kind: Any, where: str) -> list[str]:
    if kind is Any:
        return []
    origin = typing.get_origin(kind)
    if origin is Union or origin is types.UnionType:
        options = typing.get_args(kind)
        if value is not None and len(options) > 1:
            # A value that is there is checked against what it may be, not against null.
            options = tuple(option for option in options if option is not type(None))
        found = [_check(value, option, where) for option in options]
        if any(not problems for problems in found):
            return []
        # Name the closest alternative's problems, not every alternative's.
        return min(found, key=len)
    if origin is Literal:
        allowed = typing.get_args(kind)
        return [] if value in allowed and type(value) in {type(a) for a in allowed} else \
            [f"{where}: {value!r} is not one of {list(allowed)}"]
    if kind is type(None):
        return [] if value is None else [f"{where}: {_name(value)}, expected null"]
    if typing.is_typeddict(kind):
        return _check_typeddict(value, kind, where)
    if origin is list:
        if not isinstance(value, list):
            return [f"{where}: {_name(value)}, expected a list"]
        (item,) = typing.get_args(kind)
        return [problem for i, element in enumerate(value) for problem in _check(element, item, f"{where}[{i}]")]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{where}: {_name(value)}, expected an object"]
        _, item = typing.get_args(kind)
        return [problem for key, element in value.items() for problem in _check(element, item, f"{where}.{key}")]
    return _check_scalar(value, kind, where)


def _check_typeddict(value: object, kind: Any, where: str) -> list[str]:
    if not isinstance(value, dict):
        return [f"{where}: {_name(value)}, expected an object ({kind.__name__})"]
    hints = _hints(kind)
    problems = [f"{where}.{key}: missing" for key in sorted(kind.__required_keys__) if key not in value]
    for key, element in value.items():
        if key in hints:
            problems += _check(element, hints[key], f"{where}.{key}")
        elif kind not in _OPEN:
            problems.append(f"{where}.{key}: not in the contract ({kind.__name__})")
    return problems


@functools.lru_cache(maxsize=None)
def _hints(kind: Any) -> dict[str, Any]:
    # Evaluated once per TypedDict: the drill's monitor checks every sample.
    return typing.get_type_hints(kind)


def _check_scalar(value: object, kind: Any, where: str) -> list[str]:
    # bool is an int to Python, never to the contract; an int stands for a whole float.
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    return [] if ok else [f"{where}: {_name(value)}, expected {kind.__name__}"]


def _name(value: object) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"[:80]
