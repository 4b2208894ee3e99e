"""The real-GPU check's script, run here on the simulated device so it can't
rot between GPU loans: the same checks, services, signals and report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.long_running]
ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_passes_on_the_simulated_device(tmp_path):
    # The drill has its own tests (test_drill.py); everything else runs here,
    # each check at its smallest size (--quick): the same code paths.
    checks = "estimator,start_oom,pressure,replay,throughput,speculation"
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check.run", "--simulated", "--quick",
                          "--out", str(tmp_path), "--checks", checks],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    failed = {name: result for name, result in report["checks"].items() if not result["ok"]}
    assert run.returncode == 0 and not failed, (failed, run.stdout[-2000:], run.stderr[-2000:])
    assert report["device"]["simulated"] is True and report["quick"] is True
    results = report["checks"]
    assert list(results) == checks.split(",")
    assert results["start_oom"]["exit_kind"] == "out_of_memory" and results["start_oom"]["breaker"] == "open"
    assert results["start_oom"]["request_served_by"] == "cpu"
    assert results["replay"]["lost"] == 0 and results["replay"]["duplicated"] == 0
    assert [r["signal"] for r in results["replay"]["rounds"]] == ["SIGKILL", "SIGABRT"]
    assert results["pressure"]["redirected_at"]["served_by"] == "cpu"
    assert results["pressure"]["yields"] >= 1 and results["pressure"]["reloads"] >= 1
    assert len(results["estimator"]["rows"]) == 3
    # Speculation: the cost of checking a draft, batch by batch, and each type against none.
    batches = results["speculation"]["verify_cost"]["batches"]
    assert [row["batch"] for row in batches] == [1, 2, 4, 8, 16]
    assert all(row["tokens_read"] >= row["batch"] for row in batches)
    assert {(row["workload"], row["setting"]) for row in results["speculation"]["ab"]} == {
        (w, s) for w in ("code", "chat") for s in ("off", "ngram-mod", "ngram-simple")}
    assert "## replay: PASS" in (tmp_path / "gpu_check.md").read_text()


def test_a_check_that_no_longer_fits_the_deadline_is_skipped_and_said(tmp_path):
    """The GPU machine's command limit is hard: a check that can't finish is
    reported as skipped rather than killed half-way with nothing written."""
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check.run", "--simulated", "--out", str(tmp_path),
                          "--checks", "replay", "--deadline-s", "20"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert run.returncode == 1 and report["passed"] is False
    assert "needs ~45 s" in report["checks"]["replay"]["skipped"]
