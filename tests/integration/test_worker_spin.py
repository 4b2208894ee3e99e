"""The OpenMP spin count each real worker process runs with (read from the
process itself, after the wrapper's exec): the low count where two llama.cpp
processes share the cores, llama.cpp's default where a worker has them alone."""

from __future__ import annotations

import psutil
import pytest

from tests.harness import BASE_CONFIG, running

pytestmark = pytest.mark.integration


def spin_counts(status: dict) -> dict[str, str | None]:
    return {worker["role"]: psutil.Process(worker["pid"]).environ().get("GOMP_SPINCOUNT")
            for worker in status["workers"] if worker["pid"]}


@pytest.fixture(autouse=True)
def no_openmp_setting_of_our_own(monkeypatch):
    # A developer's own setting would win, as a user's does.
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)


def test_on_the_simulated_device_both_workers_spin_briefly(tmp_path):
    with running(tmp_path) as service:
        assert spin_counts(service.status()) == {"gpu": "5000", "cpu": "5000"}


def test_a_cpu_worker_alone_keeps_llama_cpps_default(tmp_path):
    config = BASE_CONFIG.replace("simulate_mib = 2048", "simulate_mib = 0").replace("[gpu]\n", "[gpu]\nenabled = false\n", 1)
    with running(tmp_path, config, roles=("cpu",)) as service:
        assert spin_counts(service.status()) == {"cpu": None}
