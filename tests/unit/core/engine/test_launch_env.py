"""Which workers spin their OpenMP threads briefly (they share the cores with
another busy llama.cpp process), and that the process each worker launches
gets exactly that: the pure decision, the host's use of it, and a real launch."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from tests.fakes.service import in_process_service, isolate_user_folders
from tests.harness import BASE_CONFIG
from tray_app.core.engine.launch_env import (OPENMP_SPIN_SHARED, WorkerSpec, openmp_waiting, threads_when_sharing,
                                             worker_environment, worker_threads, workers_oversubscribe,
                                             workers_share_cores)
from tray_app.core.engine.runtime import LaunchRequest
from tray_app.core.memory.telemetry import usable_cores
from tray_app.core.engine.worker import Worker, WorkerState
from tray_app.core.base.policies import RestartPolicy

LAYERS = 25  # SmolLM2-135M: 24 blocks and the output layer


@pytest.mark.parametrize("gpu_worker, simulated, offloaded, shares", [
    (True, True, LAYERS, True),       # a simulated device is a CPU llama-server beside the CPU worker
    (True, False, 10, True),          # a split model decodes its host layers on the CPU
    (True, False, LAYERS, False),     # a fully offloaded real GPU leaves the cores to the CPU worker
    (False, False, 0, False),         # a CPU worker alone
    (False, True, LAYERS, False),     # no GPU path, even on a simulated device: the CPU worker is alone
])
def test_only_workers_beside_another_cpu_bound_worker_share_the_cores(gpu_worker, simulated, offloaded, shares):
    assert workers_share_cores(gpu_worker=gpu_worker, simulated=simulated, layers_offloaded=offloaded,
                               layers_total=LAYERS) is shares


@pytest.mark.parametrize("cores, each", [(1, 1), (2, 1), (3, 1), (8, 4), (16, 8)])
def test_two_workers_sharing_the_cores_get_half_of_them_each(cores, each):
    assert threads_when_sharing(cores) == each
    assert worker_threads(0, shares=True, cores=cores) == each
    assert worker_threads(0, shares=False, cores=cores) == 0  # alone: llama.cpp's default
    assert worker_threads(3, shares=True, cores=cores) == worker_threads(3, shares=False, cores=cores) == 3


@pytest.mark.parametrize("shares, threads, cores, oversubscribed", [
    (True, 1, 2, False),    # the default split: a core each
    (True, 4, 8, False),
    (True, 2, 2, True),     # the user's n_threads = 2 on 2 cores: four threads on two cores
    (True, 5, 8, True),
    (True, 0, 8, True),     # 0 is llama.cpp's default, every core, for each of the two
    (False, 8, 8, False),   # a worker alone, or beside a fully offloaded GPU, has the cores to itself
])
def test_two_workers_oversubscribe_when_their_threads_together_exceed_the_cores(shares, threads, cores,
                                                                                 oversubscribed):
    assert workers_oversubscribe(shares, threads, cores) is oversubscribed


def test_the_low_spin_count_only_when_sharing_and_the_users_own_setting_wins():
    assert openmp_waiting({}, shares=True) == OPENMP_SPIN_SHARED == {"GOMP_SPINCOUNT": "5000"}
    assert openmp_waiting({}, shares=False) == {}  # llama.cpp's (libgomp's) default
    for own in ({"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "300000"}):
        assert openmp_waiting(own, shares=True) == {}
        env = worker_environment({"PATH": "/bin", **own}, {}, shares=True)
        assert env == {"PATH": "/bin", **own}


def test_a_worker_alone_keeps_the_default_and_the_allowlist_still_applies():
    parent = {"PATH": "/bin", "HOST": "0.0.0.0", "OMP_NUM_THREADS": "2"}
    assert worker_environment(parent, {"LLAMA_API_KEY": "k"}) == {
        "PATH": "/bin", "OMP_NUM_THREADS": "2", "LLAMA_API_KEY": "k"}
    assert worker_environment(parent, {"LLAMA_API_KEY": "k"}, shares=True) == {
        **OPENMP_SPIN_SHARED, "PATH": "/bin", "OMP_NUM_THREADS": "2", "LLAMA_API_KEY": "k"}


async def test_on_a_simulated_device_both_workers_share_the_cores(tmp_path, monkeypatch):
    isolate_user_folders(monkeypatch, tmp_path)
    async with in_process_service(tmp_path) as rig:
        assert rig.workers["gpu"].spec.shares_cores and rig.workers["cpu"].spec.shares_cores
        # Half the cores each, so the two never decode on more threads than there are cores.
        half = threads_when_sharing(usable_cores())
        assert rig.workers["gpu"].spec.n_threads == rig.workers["cpu"].spec.n_threads == half


async def test_the_users_own_thread_count_wins_over_the_split(tmp_path, monkeypatch):
    isolate_user_folders(monkeypatch, tmp_path)
    monkeypatch.setattr("tray_app.core.model_host.usable_cores", lambda: 4)
    async with in_process_service(tmp_path, BASE_CONFIG.replace("[cpu]\n", "[cpu]\nn_threads = 3\n", 1)) as rig:
        assert rig.workers["gpu"].spec.n_threads == rig.workers["cpu"].spec.n_threads == 3
        # Six threads on four cores: the GPU's overflow waits for its slots instead of the CPU.
        assert rig.service.default_model_host.dispatcher.limits.cpu_slows_gpu


async def test_the_default_split_leaves_the_cpu_path_as_extra_capacity(tmp_path, monkeypatch):
    isolate_user_folders(monkeypatch, tmp_path)
    monkeypatch.setattr("tray_app.core.model_host.usable_cores", lambda: 4)
    async with in_process_service(tmp_path) as rig:
        assert rig.workers["gpu"].spec.n_threads == rig.workers["cpu"].spec.n_threads == 2
        assert not rig.service.default_model_host.dispatcher.limits.cpu_slows_gpu


async def test_a_cpu_worker_without_a_gpu_path_has_its_cores(tmp_path, monkeypatch):
    isolate_user_folders(monkeypatch, tmp_path)
    config = BASE_CONFIG.replace("simulate_mib = 2048", "simulate_mib = 0").replace("[gpu]\n", "[gpu]\nenabled = false\n", 1)
    async with in_process_service(tmp_path, config) as rig:
        assert "gpu" not in rig.workers.built and not rig.workers["cpu"].spec.shares_cores
        assert rig.workers["cpu"].spec.n_threads == 0  # llama.cpp's default: all the cores


class EnvironmentDumper:
    """A runtime whose 'server' is a Python process that writes the
    environment it was started with and waits to be stopped."""

    name = "env-dumper"
    max_parallel = 1
    supports_logprobs = False
    supports_rpc = False

    def __init__(self, out: Path) -> None:
        self.out = out

    def describe(self) -> str:
        return self.name

    def argv(self, launch: LaunchRequest) -> list[str]:
        script = ("import json, os, sys, time\n"
                  "tmp = sys.argv[1] + '.tmp'\n"
                  "open(tmp, 'w').write(json.dumps(dict(os.environ)))\n"
                  "os.replace(tmp, sys.argv[1])\n"
                  "time.sleep(600)\n")
        return [sys.executable, "-c", script, str(self.out)]

    def environment(self, launch: LaunchRequest) -> dict[str, str]:
        return {"FROM_THE_RUNTIME": "1"}

    async def probe(self, client, base_url: str) -> bool:
        return self.out.exists()


@pytest.mark.parametrize("shares", [True, False])
async def test_the_launched_process_gets_the_spin_count_its_spec_says(tmp_path, monkeypatch, shares):
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "env.json"
    spec = WorkerSpec("cpu", tmp_path / "model.gguf", "model", 512, 0, shares_cores=shares)
    worker = Worker(spec, EnvironmentDumper(out), tmp_path / "logs", RestartPolicy(ready_timeout_s=60))
    try:
        assert await worker.ensure_ready(timeout=60)
        assert worker.state is WorkerState.READY
    finally:
        await worker.close()
    env = json.loads(out.read_text())
    assert env["FROM_THE_RUNTIME"] == "1"
    assert env.get("GOMP_SPINCOUNT") == ("5000" if shares else None)
