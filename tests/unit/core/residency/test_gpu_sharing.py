"""The GPU residency's status as the drill and the panel read it: the real
Service and app in-process (tests/fakes/), the GPU worker a FakeWorker."""

from __future__ import annotations

import asyncio

from tests.fakes.service import in_process_service, isolate_user_folders
from tray_app.core.engine.worker import WorkerState


async def test_loaded_is_never_shown_before_the_loads_own_time(tmp_path, monkeypatch):
    """The worker turns ready a moment before the load's task writes how long it took; a
    status read in between said "loaded" with last_load_s None (the drill's report crashed
    on it once in CI) or, on a later reload, the previous load's time."""
    isolate_user_folders(monkeypatch, tmp_path)
    async with in_process_service(tmp_path) as rig:
        sharing, worker = rig.service.default_model_host.sharing, rig.workers["gpu"]
        sharing.give_back()
        while worker.state is not WorkerState.STOPPED:
            await asyncio.sleep(0.01)
        assert sharing.last_load_s is None and sharing.state() == "given_back_by_user"
        sharing.take_again()
        seen: list[tuple[str, float | None, WorkerState]] = []
        for _ in range(100_000):
            seen.append((sharing.state(), sharing.last_load_s, worker.state))
            if seen[-1][0] == "loaded":
                break
            await asyncio.sleep(0)
        assert seen[-1][0] == "loaded" and seen[-1][1] is not None, seen[-5:]
        # The window the old status showed "loaded" in: ready, the load's time not yet written.
        assert any(state is WorkerState.READY and load_s is None for _, load_s, state in seen), seen[-5:]
