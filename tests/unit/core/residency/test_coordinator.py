"""Residency across models, without llama.cpp: which model looks at a memory
reading first, and what making room in VRAM unloads. The models are plain
stand-ins that record what the coordinator asked of them."""

from __future__ import annotations

from types import SimpleNamespace

from tray_app.core.residency.coordinator import MIB, ResidencyCoordinator


class Sharing:
    """A model's GPU residency as the coordinator sees it; `releases` says
    whether a reading makes it start giving its memory back."""

    def __init__(self, last_activity: float, seen: list[str], name: str, releases: bool = False) -> None:
        self.last_activity = last_activity
        self.releasing = False
        self.evicted_for: list[str | None] = []
        self.releases = releases
        self._seen, self._name = seen, name

    def on_sample(self, snapshot) -> None:
        self._seen.append(self._name)
        self.releasing = self.releases

    async def evict(self, why: str, for_model: str | None = None) -> None:
        self.evicted_for.append(for_model)


class Model:
    def __init__(self, name: str, *, last_activity: float = 0.0, mib: float = 0.0, in_flight: int = 0,
                 need_mib: float = 0.0, releases: bool = False, seen: list[str] | None = None) -> None:
        self.name = self.model_id = name
        self.sharing = Sharing(last_activity, seen if seen is not None else [], name, releases)
        self.on_demand_cpu = None
        self.gpu_footprint = SimpleNamespace(gpu=SimpleNamespace(total=need_mib * MIB))
        self._mib, self._in_flight = mib, in_flight

    def gpu_loaded(self) -> bool:
        return self._mib > 0

    def vram_mib(self, reading=None) -> float:
        return self._mib

    def in_flight(self) -> int:
        return self._in_flight

    def rest_tokenizer_if_cold(self) -> None:
        self.tokenizer_looks = getattr(self, "tokenizer_looks", 0) + 1


def coordinator(models: list[Model], *, free_mib: float = 0.0, reserve_mib: float = 512.0):
    notes: list[tuple[str, dict]] = []
    counted: list[str] = []
    chosen = ResidencyCoordinator(
        {m.name: m for m in models}, read_gpu=lambda: SimpleNamespace(free_mib=free_mib), sample=lambda: None,
        latest=lambda: None, note=lambda kind, **data: notes.append((kind, data)), evicted=counted.append,
        reserve_mib=reserve_mib, ram_floor_mib=1024.0)
    return chosen, notes, counted


def test_the_least_recently_used_model_looks_first_and_the_others_wait_while_it_releases():
    seen: list[str] = []
    models = [Model("recent", last_activity=5, mib=800, seen=seen),
              Model("oldest", last_activity=1, mib=800, seen=seen, releases=True),
              Model("middle", last_activity=3, mib=800, seen=seen)]
    chosen, _, _ = coordinator(models)
    chosen.on_sample("crowded")
    # The oldest gave way; the others look again once its memory is back.
    assert seen == ["oldest"]
    seen.clear()
    chosen.on_sample("still releasing")
    assert seen == ["oldest"]
    # Its memory is back.
    models[1].sharing.releasing = models[1].sharing.releases = False
    seen.clear()
    chosen.on_sample("released")
    assert seen == ["oldest", "middle", "recent"]


def test_an_unloaded_model_still_looks_while_another_releases():
    seen: list[str] = []
    models = [Model("releasing", last_activity=1, mib=800, seen=seen, releases=True),
              Model("unloaded", last_activity=2, mib=0, seen=seen)]
    chosen, _, _ = coordinator(models)
    chosen.on_sample("crowded")
    # It holds nothing, so it can't add to the crowd; it must still see the reading (to reload later).
    assert seen == ["releasing", "unloaded"]


async def test_making_room_unloads_the_idle_model_that_covers_it_and_names_the_new_one():
    big = Model("big", need_mib=1500)
    old = Model("old", last_activity=1, mib=1200)
    recent = Model("recent", last_activity=9, mib=1200)
    chosen, notes, counted = coordinator([big, old, recent], free_mib=1000)
    assert await chosen.make_vram_room(big) is None
    assert old.sharing.evicted_for == ["big"] and recent.sharing.evicted_for == []
    assert counted == ["old"]
    assert notes == [("model_evicted", {"model": "old", "for_model": "big", "freed_mib": 1200.0})]


async def test_when_only_busy_models_could_make_room_nothing_is_unloaded_and_the_reason_says_so():
    big = Model("big", need_mib=1500)
    busy = Model("busy", last_activity=1, mib=4000, in_flight=1)
    chosen, notes, counted = coordinator([big, busy], free_mib=1000)
    reason = await chosen.make_vram_room(big)
    assert reason is not None and "not enough VRAM to load big" in reason and "busy is busy" in reason
    assert busy.sharing.evicted_for == [] and counted == [] and notes == []


async def test_a_model_that_fits_unloads_nothing():
    big = Model("big", need_mib=500)
    idle = Model("idle", last_activity=1, mib=4000)
    chosen, _, counted = coordinator([big, idle], free_mib=1000, reserve_mib=500)
    assert await chosen.make_vram_room(big) is None
    assert idle.sharing.evicted_for == [] and counted == []


def test_every_reading_lets_each_model_rest_its_tokenizer_if_it_is_cold():
    models = [Model("a", mib=100.0), Model("b")]
    chosen, _, _ = coordinator(models)
    chosen.on_sample(None)
    chosen.on_sample(None)
    assert [m.tokenizer_looks for m in models] == [2, 2]
