"""The OpenMP spin count and thread count each real worker process runs with
(read from the process itself, after the wrapper's exec): the low count and
half the cores each where two llama.cpp processes share the cores, llama.cpp's
defaults where a worker has them alone."""

from __future__ import annotations

import psutil
import pytest

from tests.harness import BASE_CONFIG, running
from tray_app.core.engine.launch_env import threads_when_sharing
from tray_app.core.memory.telemetry import usable_cores

pytestmark = pytest.mark.integration


def spin_counts(status: dict) -> dict[str, str | None]:
    return {worker["role"]: psutil.Process(worker["pid"]).environ().get("GOMP_SPINCOUNT")
            for worker in status["workers"] if worker["pid"]}


@pytest.fixture(autouse=True)
def no_openmp_setting_of_our_own(monkeypatch):
    # A developer's own setting would win, as a user's does.
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)


def threads(status: dict) -> dict[str, str | None]:
    """Each worker's --threads, from its process's own command line."""
    found = {}
    for worker in status["workers"]:
        if worker["pid"]:
            argv = psutil.Process(worker["pid"]).cmdline()
            found[worker["role"]] = argv[argv.index("--threads") + 1] if "--threads" in argv else None
    return found


def test_on_the_simulated_device_both_workers_spin_briefly_on_half_the_cores(tmp_path):
    with running(tmp_path) as service:
        status = service.status()
        assert spin_counts(status) == {"gpu": "5000", "cpu": "5000"}
        half = str(threads_when_sharing(usable_cores()))
        assert threads(status) == {"gpu": half, "cpu": half}


def test_a_cpu_worker_alone_keeps_llama_cpps_default(tmp_path):
    config = BASE_CONFIG.replace("simulate_mib = 2048", "simulate_mib = 0").replace("[gpu]\n", "[gpu]\nenabled = false\n", 1)
    with running(tmp_path, config, roles=("cpu",)) as service:
        assert spin_counts(service.status()) == {"cpu": None}
        assert threads(service.status()) == {"cpu": None}
