"""The soak: concurrent clients while the GPU worker is killed, VRAM pressure
moves and requests are cancelled; nothing lost, nothing run twice.

30 s by default: the chaos loop spaces its faults to fit MIN_FAULTS_EACH of
every kind into it, and where a loaded machine lands fewer faults or fewer
than MIN_COMPLETED answers in the time, the soak goes on until it has them
(see benchmarks/soak.py). TRAY_APP_SOAK_SECONDS runs a longer one, and
`benchmarks/soak.py --seconds 600` longer still."""

import os

import pytest

from benchmarks.soak import FAULT_KINDS, MIN_COMPLETED, MIN_FAULTS_EACH, run_local_soak

pytestmark = [pytest.mark.integration, pytest.mark.long_running]

SOAK_SECONDS = float(os.environ.get("TRAY_APP_SOAK_SECONDS", "30"))


def test_soak_loses_and_duplicates_nothing(tmp_path):
    report = run_local_soak(clients=4, seconds=SOAK_SECONDS, workdir=tmp_path)
    print(report.render())
    assert report.outcomes["lost"] == 0, report.render()
    assert report.duplicated_here == 0 and report.duplicated_service == 0, report.render()
    assert report.outcomes["completed"] >= MIN_COMPLETED, report.render()
    assert all(report.faults[kind] >= MIN_FAULTS_EACH for kind in FAULT_KINDS), report.render()
