"""The tray's state from /status: the icon's kind, CPU-only machines, the GPU's residency, the engine notice."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .formatting import as_number, clock_time, fmt_seconds, humanize_reason


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


def workers_by_role(status: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {w.get("role"): w for w in status.get("workers") or ()}


def icon_kind(status: Mapping[str, Any] | None, *, host_starting: bool = False) -> str:
    """gpu | degraded | starting | down, from one /status snapshot.

    `status` None means the service did not answer; `host_starting` says the
    in-process service is still coming up, so silence is expected.
    """
    if status is None:
        return STARTING if host_starting else DOWN
    service = status.get("service") or {}
    workers = workers_by_role(status)
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
    workers = workers_by_role(status or {})
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


# /status gpu.residency.state values in which the GPU worker has let go of its memory.
GIVEN_STATES = ("given_away", "given_back_by_user")


def residency_of(status: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return ((status or {}).get("gpu") or {}).get("residency") or {}


def residency_state(status: Mapping[str, Any] | None) -> str | None:
    """loaded | loading | given_away | given_back_by_user | unloaded_idle, or None without a GPU path."""
    return residency_of(status).get("state")


def residency_text(status: Mapping[str, Any] | None) -> str | None:
    """The menu's GPU line when the GPU worker is not simply loaded:
    "GPU: given to steam (9.1 GiB) since 14:02"; None when it is."""
    residency = residency_of(status)
    state = residency.get("state")
    since = clock_time(residency.get("since"))
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
        eta = as_number(residency.get("load_eta_s"))
        return "GPU: loading the model" + (f" (about {fmt_seconds(eta)})" if eta else "")
    return None


def give_back_label(status: Mapping[str, Any] | None) -> str:
    """The menu command: give the GPU back, or take it again once given."""
    return "Use the GPU &again" if residency_state(status) in GIVEN_STATES else "Give the GPU &back now"


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
