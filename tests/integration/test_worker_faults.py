"""The worker owner against real processes that fail in real ways."""

from __future__ import annotations

import asyncio
import sys

import httpx
import pytest

from tray_app.core.config import bundled_model_path
from tray_app.core.engine.exits import ExitKind
from tray_app.core.engine.runtime import LaunchRequest, LlamaCppPythonRuntime
from tray_app.core.engine.worker import RestartPolicy, Worker, WorkerHooks, WorkerSpec, WorkerState, LaunchExtras

pytestmark = pytest.mark.integration


class SilentServer:
    """A runtime whose process starts and runs but never answers: a hung load."""

    name = "never-ready"
    max_parallel = 1

    def argv(self, launch: LaunchRequest) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(600)"]

    def environment(self, launch: LaunchRequest) -> dict[str, str]:
        return {}

    async def probe(self, client: httpx.AsyncClient, base_url: str) -> bool:
        return False


class Recorder(WorkerHooks):
    def __init__(self, extras: LaunchExtras = LaunchExtras()) -> None:
        self.events = []
        self.extras = extras

    async def before_spawn(self, worker):
        return self.extras

    def on_event(self, event):
        self.events.append(event)


def spec(model=None, role="gpu"):
    model = model or bundled_model_path()
    return WorkerSpec(role, model, model.stem, n_ctx=512, n_gpu_layers=-1)


async def test_a_worker_that_never_gets_ready_is_killed_and_retried(tmp_path):
    hooks = Recorder()
    worker = Worker(spec(), SilentServer(), tmp_path, RestartPolicy(ready_timeout_s=1.0, backoff_base_s=0.1,
                                                                   backoff_cap_s=0.2, stop_timeout_s=1.0), hooks)
    worker.start()
    try:
        for _ in range(100):
            if worker.restarts >= 2:
                break
            await asyncio.sleep(0.1)
        assert worker.restarts >= 2
        assert worker.last_exit.kind is ExitKind.ERROR and "ready within 1 s" in worker.last_exit.evidence
        assert WorkerState.UNHEALTHY in [e.state for e in hooks.events]
    finally:
        await worker.close()
    assert worker.state is WorkerState.STOPPED and worker.pid is None


async def test_a_start_that_runs_out_of_memory_is_classified(tmp_path):
    hooks = Recorder(LaunchExtras(simulated_vram_need_mib=900.0, simulated_vram_free_mib=100.0))
    worker = Worker(spec(), LlamaCppPythonRuntime(), tmp_path,
                    RestartPolicy(backoff_base_s=5.0, backoff_cap_s=5.0), hooks)
    worker.start()
    try:
        await worker.wait_for_state(WorkerState.UNHEALTHY, timeout=30)
        assert worker.last_exit.kind is ExitKind.OUT_OF_MEMORY
        assert "cudaMalloc failed: out of memory" in worker.last_exit.evidence or \
            "failed to" in worker.last_exit.evidence
        assert "out of memory" in (tmp_path / "gpu-worker.log").read_text()
    finally:
        await worker.close()


async def test_a_bad_model_is_not_restarted(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\x00" * 64)
    worker = Worker(spec(junk, role="cpu"), LlamaCppPythonRuntime(), tmp_path,
                    RestartPolicy(backoff_base_s=0.1, backoff_cap_s=0.1))
    assert not await worker.ensure_ready(timeout=60)
    assert worker.last_exit.kind is ExitKind.BAD_MODEL
    assert worker.gave_up and worker.restarts == 1
    await worker.close()


async def test_stop_is_graceful_and_sigkills_a_process_that_ignores_sigterm(tmp_path):
    class Stubborn(SilentServer):
        def argv(self, launch):
            return [sys.executable, "-c",
                    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"]

    worker = Worker(spec(), Stubborn(), tmp_path, RestartPolicy(ready_timeout_s=60, stop_timeout_s=0.5))
    worker.start()
    await worker.wait_for_state(WorkerState.STARTING, timeout=5)
    for _ in range(50):
        if worker.pid:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    await asyncio.wait_for(worker.close(), 10)
    assert worker.last_exit.kind is ExitKind.CLEAN_STOP and worker.last_exit.signal_name == "SIGKILL"
