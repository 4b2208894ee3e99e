"""Residency across models: which model's memory gives way for which.

Each model's `GpuSharing` keeps its own GPU worker's residency; this is the
part that weighs the models against each other:
- before a model's GPU worker loads, other models' idle GPU workers unload
  until it fits with the reserve free (`eviction.plan_eviction`);
- before an on-demand CPU worker loads, other models' idle CPU workers
  unload until the RAM floor stays free, by the same policy;
- on each memory reading, the least recently used model looks first, and
  one release runs at a time.
The decisions are the pure functions in `eviction`; this carries them out.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Mapping, Protocol

from ..memory.telemetry import GpuReading, MemorySnapshot
from .eviction import Resident, eviction_shortfall_text, plan_eviction
from .gpu import GpuSharing
from .on_demand import OnDemandWorker

MIB = 1024 * 1024


class ResidentModel(Protocol):
    """What the coordinator reads of a model host (model_host.ModelHost)."""

    name: str
    model_id: str
    sharing: GpuSharing | None
    on_demand_cpu: OnDemandWorker | None
    dispatcher: Any
    cpu_worker: Any
    gpu_footprint: Any
    cpu_footprint: Any

    def gpu_loaded(self) -> bool: ...

    def vram_mib(self, reading: GpuReading | None = None) -> float: ...

    def in_flight(self) -> int: ...

    def cpu_idle(self) -> bool: ...

    def cpu_ram_mib(self, snapshot: MemorySnapshot | None = None) -> float: ...

    def cpu_load_ram_mib(self) -> float: ...

    def rest_tokenizer_if_cold(self) -> None: ...


class ResidencyCoordinator:
    def __init__(self, models: Mapping[str, ResidentModel], *, read_gpu: Callable[[], GpuReading],
                 sample: Callable[[], MemorySnapshot], latest: Callable[[], MemorySnapshot],
                 note: Callable[..., None], evicted: Callable[[str], None], reserve_mib: float,
                 ram_floor_mib: float) -> None:
        # The service's own mapping: a model added by a rescan is seen at once.
        self._models = models
        self._read_gpu = read_gpu
        self._sample = sample
        self._latest = latest
        self._note = note
        self._evicted = evicted  # counts an eviction of the model with this id (the metrics)
        self._reserve_mib = reserve_mib
        self._ram_floor_mib = ram_floor_mib
        # Loads of library models run one at a time: two at once would each
        # plan their eviction against the same free memory.
        self._load_lock = asyncio.Lock()

    def on_sample(self, snapshot: MemorySnapshot) -> None:
        # Least recently used first, and one release at a time: when a game
        # crowds several loaded models, the one used longest ago gives its
        # memory back first, and the others look again once it is back
        # (often that was enough). Without this every model saw the same
        # crowded reading and all of them unloaded at once.
        models = sorted(self._models.values(), key=lambda m: m.sharing.last_activity if m.sharing else 0.0)
        releasing = any(m.sharing is not None and m.sharing.releasing for m in models)
        for model in models:
            sharing = model.sharing
            if sharing is not None and not (releasing and model.gpu_loaded() and not sharing.releasing):
                sharing.on_sample(snapshot)
                releasing = releasing or sharing.releasing
            if model.on_demand_cpu is not None:
                model.on_demand_cpu.on_sample()
            model.rest_tokenizer_if_cold()

    async def make_vram_room(self, model: ResidentModel) -> str | None:
        """Before `model`'s GPU worker loads: unload other models until it
        fits with the reserve free. None when it fits now; the reason when
        no set of idle models would make it fit."""
        async with self._load_lock:
            reading = await asyncio.to_thread(self._read_gpu)
            if reading.free_mib is None:
                return None  # nothing to plan with; the load's own checks decide
            need = model.gpu_footprint.gpu.total / MIB
            residents = {m.name: Resident(m.name, m.vram_mib(reading), m.sharing.last_activity, m.in_flight())
                         for m in self._models.values()
                         if m is not model and m.gpu_loaded() and m.sharing is not None}
            plan = plan_eviction(need, reading.free_mib, self._reserve_mib, list(residents.values()))
            if plan is None:
                return eviction_shortfall_text(model.model_id, need, reading.free_mib, self._reserve_mib,
                                               list(residents.values()))
            for name in plan.victims:
                victim = self._models[name]
                assert victim.sharing is not None
                await victim.sharing.evict(f"making room for {model.model_id}", for_model=model.model_id)
                self._evicted(victim.model_id)
                self._note("model_evicted", model=victim.model_id, for_model=model.model_id,
                           freed_mib=round(residents[name].mib, 1))
            return None

    async def make_ram_room(self, model: ResidentModel) -> None:
        """Before `model`'s CPU worker loads on demand: unload other models'
        idle CPU workers until its load leaves the RAM floor free, by the
        same policy as VRAM. When nothing can, the load goes ahead: admission
        already refused what would cross the floor (RAM_FLOOR)."""
        async with self._load_lock:
            snapshot = await asyncio.to_thread(self._sample)
            residents = self._idle_cpu_residents(model, snapshot)
            need = model.cpu_footprint.host.total / MIB
            plan = plan_eviction(need, snapshot.host.available_mib, self._ram_floor_mib, list(residents.values()))
            for name in plan.victims if plan is not None else ():
                victim = self._models[name]
                await victim.cpu_worker.stop()
                self._note("model_evicted", model=victim.model_id, for_model=model.model_id, path="cpu",
                           freed_mib=round(residents[name].mib, 1))

    def vram_of_other_models(self, model: ResidentModel, reading: GpuReading) -> float:
        """What the other models' GPU workers hold on the device now."""
        return sum(m.vram_mib(reading) for m in self._models.values() if m is not model)

    def evictable_cpu_ram_mib(self, model: ResidentModel) -> float:
        """The RAM other models' idle on-demand CPU workers hold (admission
        counts it as room a CPU load can make)."""
        if model.cpu_load_ram_mib() == 0:
            return 0.0
        return sum(r.mib for r in self._idle_cpu_residents(model, self._latest()).values())

    def _idle_cpu_residents(self, model: ResidentModel, snapshot: MemorySnapshot) -> dict[str, Resident]:
        # Least recently used: when each last gave a CPU slot back (the lanes share one clock).
        return {m.name: Resident(m.name, m.cpu_ram_mib(snapshot), m.dispatcher.cpu.lane.last_released_at or 0.0)
                for m in self._models.values() if m is not model and m.cpu_idle()}
