"""Which ways of running a model fit this machine, and at what context.

Pure: it takes a ``ModelInfo`` and the memory headroom and asks the estimator
(``estimate.estimate_worker``) the same questions the service asks before it
launches a worker.  Reading files, NVML or a running service's /status is the
caller's job (``models_cli`` for the terminal, the UI panel for the window).

Three profiles, the three ways the app can run a model:

- GPU resident: every layer on the GPU (``n_gpu_layers = -1``).
- Split: the largest ``n_gpu_layers`` that fits, the rest on the host.
- CPU only: nothing on the GPU (the CPU worker's setting).

A profile fits when its worker's GPU need is within free VRAM minus the
reserve, and its host need within available RAM minus the RAM floor -- the
margins admission control keeps.  An unknown VRAM reading never yields
"fits" for a GPU profile: the answer is "unknown".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from .context_size import largest_fitting
from .estimate import KV_CELL_PADDING, MIB, WorkerSettings, estimate_worker, layers_offloaded
from .gguf_info import ModelInfo

# Contexts are suggested in llama.cpp's own KV cell padding: anything between
# two multiples costs the same memory as the larger one.
CONTEXT_STEP = KV_CELL_PADDING


class Profile(StrEnum):
    GPU_RESIDENT = "gpu_resident"
    SPLIT = "split"
    CPU_ONLY = "cpu_only"

    @property
    def label(self) -> str:
        return {"gpu_resident": "GPU resident", "split": "split", "cpu_only": "CPU only"}[self.value]


class Verdict(StrEnum):
    FITS = "fits"
    DOES_NOT_FIT = "does_not_fit"
    UNKNOWN = "unknown"  # no VRAM reading: a GPU profile cannot be judged
    NOT_NEEDED = "not_needed"  # a split, when the whole model fits on the GPU


@dataclass(frozen=True)
class Headroom:
    """Memory the machine has for a new worker, and the margins to keep."""

    vram_free_mib: float | None  # None = unknown (no GPU, NVML failed, ...)
    ram_available_mib: float
    vram_reserve_mib: float
    ram_floor_mib: float
    vram_unknown_reason: str = "not measured"

    @property
    def vram_room_mib(self) -> float | None:
        return None if self.vram_free_mib is None else self.vram_free_mib - self.vram_reserve_mib

    @property
    def ram_room_mib(self) -> float:
        return self.ram_available_mib - self.ram_floor_mib


@dataclass(frozen=True)
class ProfileFit:
    profile: Profile
    verdict: Verdict
    n_ctx: int  # the context the verdict is for
    max_n_ctx: int | None  # the largest context that fits with the same layers; None = none / unknown
    n_gpu_layers: int  # the setting to use: -1 all, 0 none, g for a split
    layers_on_gpu: int  # llama.cpp's "offloaded X/Y" X ...
    layers_total: int  # ... and Y (n_layer + 1: the output layer counts)
    vram_need_mib: float  # at n_ctx
    ram_need_mib: float  # at n_ctx
    vram_room_mib: float | None  # free VRAM above the reserve; None = unknown
    ram_room_mib: float  # available RAM above the floor
    reason: str  # why it does not fit / is unknown / is not needed; "" when it fits

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile.value,
            "verdict": self.verdict.value,
            "n_ctx": self.n_ctx,
            "max_n_ctx": self.max_n_ctx,
            "n_gpu_layers": self.n_gpu_layers,
            "layers_on_gpu": self.layers_on_gpu,
            "layers_total": self.layers_total,
            "vram_need_mib": round(self.vram_need_mib, 1),
            "ram_need_mib": round(self.ram_need_mib, 1),
            "vram_room_mib": None if self.vram_room_mib is None else round(self.vram_room_mib, 1),
            "ram_room_mib": round(self.ram_room_mib, 1),
            "reason": self.reason,
            "summary": describe_fit(self),
        }


@dataclass(frozen=True)
class ModelFit:
    info: ModelInfo
    profiles: tuple[ProfileFit, ...]  # gpu_resident, split, cpu_only

    def profile(self, profile: Profile) -> ProfileFit:
        return next(fit for fit in self.profiles if fit.profile is profile)


@dataclass(frozen=True)
class _Need:
    vram_mib: float
    ram_mib: float


def fit_model(info: ModelInfo, headroom: Headroom, *, gpu_n_ctx: int, cpu_n_ctx: int, n_batch: int = 512,
              gpu_slots: int = 1, cpu_slots: int = 1) -> ModelFit:
    """Judge the three profiles; GPU ones at gpu_n_ctx, CPU only at cpu_n_ctx,
    each context per slot (every slot has its own KV cache).

    Each context is capped at the model's trained context when the file
    states one: past it a model produces garbage, so there is nothing to
    suggest there.
    """
    judge = _Judge(info, headroom, n_batch, gpu_slots=gpu_slots, cpu_slots=cpu_slots)
    resident = judge.gpu_resident(judge.reference_ctx(gpu_n_ctx))
    split = judge.split(judge.reference_ctx(gpu_n_ctx), resident)
    cpu_only = judge.cpu_only(judge.reference_ctx(cpu_n_ctx))
    return ModelFit(info=info, profiles=(resident, split, cpu_only))


class _Judge:
    def __init__(self, info: ModelInfo, headroom: Headroom, n_batch: int, *, gpu_slots: int = 1,
                 cpu_slots: int = 1) -> None:
        self.info = info
        self.gpu_slots = gpu_slots
        self.cpu_slots = cpu_slots
        self.headroom = headroom
        self.n_batch = n_batch
        self.layers_total = info.n_layer + 1

    def reference_ctx(self, configured: int) -> int:
        return min(configured, self.info.n_ctx_train) if self.info.n_ctx_train > 0 else configured

    def context_cap(self, reference: int) -> int:
        # Without a trained context in the file, going past the configured
        # one would be a guess about the model, so the search stops there.
        return self.info.n_ctx_train if self.info.n_ctx_train > 0 else reference

    def need(self, n_ctx: int, n_gpu_layers: int) -> _Need:
        # logits_all=False and n_ctx per slot: how the runtimes launch workers (runtime.py).
        slots = self.cpu_slots if n_gpu_layers == 0 else self.gpu_slots
        settings = WorkerSettings(n_ctx=n_ctx * slots, n_gpu_layers=n_gpu_layers, n_batch=self.n_batch,
                                  n_parallel=slots, logits_all=False)
        footprint = estimate_worker(self.info, settings)
        return _Need(vram_mib=footprint.gpu.total / MIB, ram_mib=footprint.host.total / MIB)

    def fits(self, need: _Need, uses_gpu: bool) -> bool:
        if need.ram_mib > self.headroom.ram_room_mib:
            return False
        if not uses_gpu:
            return True
        room = self.headroom.vram_room_mib
        return room is not None and need.vram_mib <= room

    def max_ctx(self, n_gpu_layers: int, cap: int) -> int | None:
        """Largest multiple of CONTEXT_STEP up to cap that fits; None if none does."""
        uses_gpu = n_gpu_layers != 0
        # "Fits" as a number for the shared search: 0 fits, 1 does not.
        return largest_fitting(cap, 0.0, lambda n_ctx: 0.0 if self.fits(self.need(n_ctx, n_gpu_layers), uses_gpu)
                               else 1.0)

    def result(self, profile: Profile, n_ctx: int, n_gpu_layers: int, need: _Need,
               verdict: Verdict | None = None, reason: str | None = None) -> ProfileFit:
        uses_gpu = n_gpu_layers != 0
        if verdict is None:
            verdict = Verdict.FITS if self.fits(need, uses_gpu) else Verdict.DOES_NOT_FIT
        if reason is None:
            reason = "" if verdict is Verdict.FITS else self.shortfall(need, uses_gpu)
        judgeable = verdict in (Verdict.FITS, Verdict.DOES_NOT_FIT)
        return ProfileFit(
            profile=profile,
            verdict=verdict,
            n_ctx=n_ctx,
            max_n_ctx=self.max_ctx(n_gpu_layers, self.context_cap(n_ctx)) if judgeable else None,
            n_gpu_layers=n_gpu_layers,
            layers_on_gpu=layers_offloaded(self.info, n_gpu_layers),
            layers_total=self.layers_total,
            vram_need_mib=need.vram_mib,
            ram_need_mib=need.ram_mib,
            vram_room_mib=self.headroom.vram_room_mib,
            ram_room_mib=self.headroom.ram_room_mib,
            reason=reason,
        )

    def shortfall(self, need: _Need, uses_gpu: bool) -> str:
        parts = []
        room = self.headroom.vram_room_mib
        if uses_gpu and room is not None and need.vram_mib > room:
            parts.append(f"needs {format_mib(need.vram_mib)} VRAM, {_room_text(room)} free above the "
                         f"{format_mib(self.headroom.vram_reserve_mib)} reserve")
        if need.ram_mib > self.headroom.ram_room_mib:
            parts.append(f"needs {format_mib(need.ram_mib)} RAM, {_room_text(self.headroom.ram_room_mib)} available "
                         f"above the {format_mib(self.headroom.ram_floor_mib)} floor")
        return "; ".join(parts)

    def unknown_reason(self) -> str:
        return f"no GPU reading: {self.headroom.vram_unknown_reason}"

    def gpu_resident(self, n_ctx: int) -> ProfileFit:
        need = self.need(n_ctx, -1)
        if self.headroom.vram_room_mib is None:
            return self.result(Profile.GPU_RESIDENT, n_ctx, -1, need, Verdict.UNKNOWN, self.unknown_reason())
        return self.result(Profile.GPU_RESIDENT, n_ctx, -1, need)

    def split(self, n_ctx: int, resident: ProfileFit) -> ProfileFit:
        if self.headroom.vram_room_mib is None:
            return self.result(Profile.SPLIT, n_ctx, self.info.n_layer, self.need(n_ctx, self.info.n_layer),
                               Verdict.UNKNOWN, self.unknown_reason())
        if resident.verdict is Verdict.FITS:
            return self.result(Profile.SPLIT, n_ctx, -1, self.need(n_ctx, -1), Verdict.NOT_NEEDED,
                               "the whole model fits on the GPU")
        # n_gpu_layers = g offloads the last g of n_layer + 1 layers, output
        # first; g = n_layer + 1 is the resident profile, so a split is 1..n_layer.
        # A linear scan from the top: at most ~130 cheap estimates, and the
        # host side is not monotone in g (a GPU worker carries CUDA's host
        # overhead), so the first fit from the top is the best split.
        for layers in range(max(self.info.n_layer, 1), 0, -1):
            need = self.need(n_ctx, layers)
            if self.fits(need, uses_gpu=True):
                return self.result(Profile.SPLIT, n_ctx, layers, need)
        # Nothing fits; report the smallest split, the one closest to fitting on the GPU.
        return self.result(Profile.SPLIT, n_ctx, 1, self.need(n_ctx, 1))

    def cpu_only(self, n_ctx: int) -> ProfileFit:
        return self.result(Profile.CPU_ONLY, n_ctx, 0, self.need(n_ctx, 0))


def _room_text(room_mib: float) -> str:
    return format_mib(room_mib) if room_mib > 0 else "nothing"


def format_mib(mib: float) -> str:
    """1536 -> '1.5 GiB', 612.4 -> '612 MiB'."""
    if abs(mib) >= 1024:
        return f"{mib / 1024:.1f} GiB"
    return f"{mib:.0f} MiB"


def describe_fit(fit: ProfileFit) -> str:
    """One line for a person, shared by `tray-app models` and the UI panel."""
    layers = ""
    if fit.profile is Profile.SPLIT and fit.verdict in (Verdict.FITS, Verdict.DOES_NOT_FIT):
        layers = f" with {fit.layers_on_gpu} of {fit.layers_total} layers on the GPU (--gpu-layers {fit.n_gpu_layers})"
    if fit.verdict is Verdict.FITS:
        return f"fits at {fit.n_ctx}{layers} (max {fit.max_n_ctx})"
    if fit.verdict is Verdict.DOES_NOT_FIT:
        smaller = f"; fits at up to {fit.max_n_ctx}" if fit.max_n_ctx is not None else ""
        return f"does not fit at {fit.n_ctx}{layers}: {fit.reason}{smaller}"
    if fit.verdict is Verdict.UNKNOWN:
        # The reason (NVML's words) is long and the same for every GPU
        # profile; callers show it once, next to the headroom.
        return "unknown (no GPU reading)"
    return f"not needed: {fit.reason}"


def headroom_from_status(status: Mapping[str, Any], *, ram_floor_mib: float, default_reserve_mib: float) -> Headroom:
    """Headroom from a running service's GET /status.

    The running workers' memory is already counted as used in these numbers,
    so the answer is "what fits next to them", not "what fits instead".
    """
    gpu = status.get("gpu") or {}
    ram = status.get("ram") or {}
    free = gpu.get("free_mib") if gpu.get("available") else None
    reserve = gpu.get("reserve_mib")
    return Headroom(
        vram_free_mib=float(free) if isinstance(free, (int, float)) else None,
        ram_available_mib=float(ram.get("available_mib") or 0.0),
        vram_reserve_mib=float(reserve) if isinstance(reserve, (int, float)) else default_reserve_mib,
        ram_floor_mib=ram_floor_mib,
        vram_unknown_reason=str(gpu.get("reason") or "the service reports no GPU"),
    )
