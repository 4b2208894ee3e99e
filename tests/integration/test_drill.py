"""`tray-app drill --short` end to end: its own real service, real workers on
SmolLM2, real faults on the simulated GPU, and the report it writes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.long_running]

# The drill does little work (~45 requests), but on a busy 2-core machine
# each one can take seconds; the limit is for a stuck drill, not a slow one.
DRILL_TIMEOUT_S = 600


@pytest.mark.timeout(DRILL_TIMEOUT_S + 60)
def test_short_drill_passes_and_writes_its_report(tmp_path):
    out = tmp_path / "drill"
    result = subprocess.run(
        [sys.executable, "-m", "tray_app.drill", "--short", "--simulated-gpu", "--no-progress", "--out", str(out)],
        capture_output=True, text=True, timeout=DRILL_TIMEOUT_S, check=False,
    )
    assert (out / "report.json").exists(), f"no report (exit {result.returncode}):\n{result.stderr[-3000:]}"
    report = json.loads((out / "report.json").read_text())
    failed = [f"[{c['severity']}] {c['name']}: {c['detail']}"
              for c in report["checks"] + [c for p in report["phases"] for c in p["checks"]]
              if not c["passed"] and c["severity"] != "finding"]
    assert result.returncode == 0 and report["verdict"] == "PASS", (
        f"exit {result.returncode}; failed checks:\n" + "\n".join(failed) + f"\n\n{result.stdout[-4000:]}")

    # Every phase ran; none was skipped on the drill's own service.
    ran = {p["number"]: p for p in report["phases"] if p["number"]}
    assert sorted(ran) == list(range(1, 12)) and not any(p["skipped"] for p in ran.values())
    numbers = report["numbers"]
    assert numbers["lost_requests"] == 0 and numbers["duplicated_side_effects"] == 0
    assert numbers["tool_calls_ran_twice"] == [] and len(numbers["tool_executions"]) >= 2
    # The faults happened and were survived: answers cut partway continued on
    # the CPU, a breaker opened by an out-of-memory restart.
    routes = {(r["served_by"], r["route_reason"]) for r in report["requests"]}
    assert {("cpu", "gpu_context_cap"), ("cpu", "gpu_failed_resumed"), ("cpu", "gpu_vram_headroom"),
            ("cpu", "gpu_unavailable"), ("gpu", "admitted"), ("cpu", "gpu_yielded")} <= routes
    # Another app took the VRAM: it was released, reloaded after, and nothing was lost or run twice.
    other_app = next(p for p in report["phases"] if p["key"] == "other_app_takes_vram")["data"]["other_app"]
    assert other_app["release_s"] > 0 and other_app["reload_s"] >= other_app["settle_s"]
    assert other_app["lost"] == 0 and other_app["duplicated"] == 0
    # The second model loaded on demand, and was unloaded to bring the default back under pressure.
    second = next(p for p in report["phases"] if p["key"] == "second_model")["data"]["second_model"]
    assert second["load_s"] > 0 and second["other_app_mib"] > 0 and second["default_back_s"] > 0
    assert second["lost"] == 0 and second["duplicated"] == 0
    # A stream cut mid-answer went on to its end: no stream ended with gpu_worker_failed.
    assert not any(r["error_code"] == "gpu_worker_failed" for r in report["requests"])
    assert any(r["outcome"] == "canceled" for r in report["requests"])
    # The poison request failed alone, and its retry was refused without running.
    poisoned = [r for r in report["requests"] if r["error_code"] == "request_crashed_worker"]
    assert [r["outcome"] for r in poisoned] == ["error", "rejected"]
    assert all(f["recovery_s"] is not None for f in numbers["gpu_recovery"]) and len(numbers["gpu_recovery"]) >= 3
    assert numbers["token_agreement"]["pairs"] >= 2
    assert numbers["degraded"]["intervals"] and numbers["min_available_ram_mib"]["value"] > 0
    # Every request says what happened to it.
    for request in report["requests"]:
        assert request["outcome"] in ("ok", "rejected", "canceled", "error") and request["retry_decision"]
        assert request["connection_survived"] is not None
    replayed = [r for r in report["requests"] if r["route_reason"] in ("gpu_failed_replayed", "gpu_failed_resumed")
                and not r["idempotent_replay"]]
    assert replayed and all(r["first_failure"] and r["cpu_started_s"] is not None for r in replayed)

    # The files people read: the table on the terminal, report.md with its plot.
    assert "lost requests" in result.stdout and "PASS" in result.stdout
    markdown = (out / "report.md").read_text()
    assert "![Latency" in markdown and "| lost requests | 0 |" in markdown
    assert (out / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
