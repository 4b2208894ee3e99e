"""The two-minute soak: concurrent clients, GPU kills, VRAM pressure, cancels."""

import os

import pytest

from benchmarks.soak import run_local_soak

pytestmark = pytest.mark.integration

SOAK_SECONDS = float(os.environ.get("TRAY_APP_SOAK_SECONDS", "120"))


def test_soak_loses_and_duplicates_nothing(tmp_path):
    report = run_local_soak(clients=4, seconds=SOAK_SECONDS, workdir=tmp_path)
    print(report.render())
    assert report.outcomes["lost"] == 0, report.render()
    assert report.duplicated_here == 0 and report.duplicated_service == 0, report.render()
    assert report.outcomes["completed"] > 20, report.render()
    assert sum(report.faults.values()) >= 3, report.render()
