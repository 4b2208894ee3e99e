"""The tray's state from /status: the icon's kind, CPU-only machines, the GPU's residency, the engine notice."""

from __future__ import annotations

from dataclasses import dataclass
from ...core.status_contract import GpuStatus, ResidencyStatus, Status, WorkerStatus
from .formatting import clock_time, fmt_seconds, humanize_reason


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


def workers_by_role(status: Status) -> dict[str, WorkerStatus]:
    return {w["role"]: w for w in status["workers"]}


def icon_kind(status: Status | None, *, service_starting: bool = False) -> str:
    """gpu | degraded | starting | down, from one /status snapshot.

    `status` None means the service did not answer; `service_starting` says the
    in-process service is still coming up, so silence is expected.
    """
    if status is None:
        return STARTING if service_starting else DOWN
    service = status["service"]
    workers = workers_by_role(status)
    if not service["healthy"]:
        if not workers or any(w["state"] in _BUSY_STATES for w in workers.values()):
            return STARTING
        return DOWN
    if cpu_only(status) is not None:
        return CPU
    degraded = status["degraded"]["active"]
    gpu_out = status["gpu"]["path_out_reason"]
    if not degraded and (gpu_out is None or residency_state(status) == "unloaded_idle"):
        # Unloaded while idle is not an outage: the next request loads it.
        return GPU
    gpu = workers.get("gpu")
    if (gpu is not None and gpu["state"] == "starting" and not gpu["restarts"]
            and gpu["last_exit"] is None and not service["gpu_paused"]):
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


def cpu_only(status: Status | None) -> CpuOnly | None:
    """The machine has no GPU path at all, or None when it has one (serving
    or not). /status says so by the default model's workers: there is no GPU
    worker to degrade from; gpu.path_out_reason says why."""
    if status is None:
        return None
    workers = workers_by_role(status)
    if not workers or GPU in workers:
        return None
    gpu = status["gpu"]
    raw = str(gpu["path_out_reason"] or gpu["reason"] or "no GPU path")
    parts = [part.strip() for part in raw.split(";")]
    reason = "; ".join(p for p in parts if p and not p.lower().startswith(_SAID_BY_THE_STATE)) or "no GPU path"
    return CpuOnly(humanize_reason(reason), _gpu_step(gpu, raw))


# The install script's choice of llama.cpp backend for a GPU it can't see
# through NVML: Vulkan runs on every vendor's cards.
INSTALL_COMMAND = "bash packaging/install.sh --backend {backend}"


def _gpu_step(gpu: GpuStatus, reason: str) -> str:
    """The one thing that would give this machine a GPU path."""
    if "[gpu] enabled = false" in reason:
        return "To use the GPU: set [gpu] enabled = true in the config, then restart tray-app"
    if gpu["offload_supported"] is True:
        # The build can offload, and no device answered: the driver is missing or broken.
        return "To use a GPU: install its driver, then restart tray-app"
    names = " ".join(device["name"] for device in gpu["devices"])
    if gpu["available"] and "nvidia" in names.lower():
        return "To use it: rebuild for CUDA with " + INSTALL_COMMAND.format(backend="cuda")
    if gpu["available"]:
        return "To use it: rebuild for it with " + INSTALL_COMMAND.format(backend="vulkan")
    return "If this machine has a GPU, rebuild for it with " + INSTALL_COMMAND.format(backend="vulkan")


def cpu_only_text(status: Status | None) -> str | None:
    """'No usable GPU: ….' and, on a line of its own, 'If this machine has a
    GPU, rebuild …'; None where there is a GPU path."""
    found = cpu_only(status)
    return f"{found.reason}.\n{found.step}" if found is not None else None


# /status gpu.residency.state values in which the GPU worker has let go of its memory.
GIVEN_STATES = ("given_away", "given_back_by_user")


def residency_of(status: Status | None) -> ResidencyStatus | None:
    """The default model's GPU residency; None without a GPU path (or a status)."""
    return status["gpu"]["residency"] if status is not None else None


def residency_state(status: Status | None) -> str | None:
    """loaded | loading | given_away | given_back_by_user | unloaded_idle, or None without a GPU path."""
    residency = residency_of(status)
    return residency["state"] if residency is not None else None


def residency_text(status: Status | None) -> str | None:
    """The menu's GPU line when the GPU worker is not simply loaded:
    "GPU: given to steam (9.1 GiB) since 14:02"; None when it is."""
    residency = residency_of(status)
    if residency is None:
        return None
    state = residency["state"]
    since = clock_time(residency["since"])
    at = f" since {since}" if since else ""
    if state == "unloaded_idle":
        # "GPU unloaded for coder" when another model needed its memory.
        text = residency["text"] or "GPU unloaded (idle)"
        return text.replace("GPU unloaded", "GPU: unloaded", 1) + at
    if state == "given_away":
        text = residency["text"] or "GPU given to another app"
        return text.replace("GPU given to", "GPU: given to", 1) + at
    if state == "given_back_by_user":
        return f"GPU: given back by you{at}"
    if state == "loading":
        eta = residency["load_eta_s"]
        return "GPU: loading the model" + (f" (about {fmt_seconds(eta)})" if eta else "")
    return None


def give_back_label(status: Status | None) -> str:
    """The menu command: give the GPU back, or take it again once given."""
    return "Use the GPU &again" if residency_state(status) in GIVEN_STATES else "Give the GPU &back now"


def engine_notice(status: Status | None) -> str | None:
    """Why the service runs another engine than the config asks for, or None."""
    if status is None or not status["engine"]["fallback_reason"]:
        return None
    engine = status["engine"]
    return f"Engine: {engine['runtime']} instead of {engine['configured']}, because {engine['fallback_reason']}."


def is_busy_overflow(status: Status | None) -> bool:
    """Degraded only because a burst overflowed a busy GPU to the CPU.

    The service counts a `gpu_busy` overflow as degraded mode, but the GPU
    path is up and serving: it comes and goes with every burst, so it must not
    be announced like an outage.
    """
    if not status:
        return False
    degraded = status["degraded"]
    reason = degraded["reason"] or ""
    return degraded["active"] and reason.partition(":")[0] == "gpu_busy" and status["gpu"]["path_out_reason"] is None
