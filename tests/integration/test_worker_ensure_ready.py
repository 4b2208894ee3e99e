"""`Worker.ensure_ready` waits out a stop under way, then starts: callers
never read the state and start themselves (a read that gates a write races
the owner)."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.test_worker_faults import SilentServer
from tray_app.core.config import bundled_model_path
from tray_app.core.engine.worker import RestartPolicy, Worker, WorkerSpec, WorkerState

pytestmark = pytest.mark.integration


class ReadyAtOnce(SilentServer):
    """A real process that is "ready" as soon as it runs: the test is about
    the owner's states, not about llama.cpp."""

    name = "ready-at-once"

    async def probe(self, client: httpx.AsyncClient, base_url: str) -> bool:
        return True


async def test_ensure_ready_during_a_stop_waits_it_out_and_starts_again(tmp_path):
    model = bundled_model_path()
    worker = Worker(WorkerSpec("cpu", model, model.stem, n_ctx=512, n_gpu_layers=0), ReadyAtOnce(), tmp_path,
                    RestartPolicy(ready_timeout_s=30, stop_timeout_s=5))
    try:
        assert await worker.ensure_ready(timeout=30)
        first_pid = worker.pid
        worker.request_stop()  # an idle unload begins
        assert worker.state is WorkerState.STOPPING
        # Before, this started "into" the stop: a no-op that ended with the stop, False.
        assert await worker.ensure_ready(timeout=30)
        assert worker.state is WorkerState.READY and worker.pid not in (None, first_pid)
    finally:
        await worker.close()
