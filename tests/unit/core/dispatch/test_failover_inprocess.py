"""Failover time through the real Service and app, in-process (tests/fakes):
a GPU failure before the first byte is replayed on the CPU, and /metrics,
/status and the event log say how long the client waited for its first
byte after the fault. The real kill -9 is in tests/integration/test_failover_time.py."""

from __future__ import annotations

import pytest

from tests.fakes.service import in_process_service, isolate_user_folders


@pytest.fixture
async def rig(tmp_path, monkeypatch):
    isolate_user_folders(monkeypatch, tmp_path)
    async with in_process_service(tmp_path) as running:
        yield running


def failover_count(metrics_text: str, fault: str) -> float:
    prefix = f'tray_app_failover_seconds_count{{fault="{fault}"}} '
    return next((float(line[len(prefix):]) for line in metrics_text.splitlines() if line.startswith(prefix)), 0.0)


async def test_a_replay_after_a_gpu_failure_is_timed_in_metrics_status_and_the_event_log(rig):
    before = (await rig.client.get("/status")).json()["failover"]
    assert before == {"count": 0, "last_s": None, "last_fault": None, "p50_s": None, "by_fault": {}, "resumes": 0,
                      "resume_last_s": None}
    assert failover_count((await rig.client.get("/metrics")).text, "crash") == 0
    rig.upstream.script("gpu").fail_before_first_byte = True
    answer = await rig.client.post("/v1/chat/completions", json={
        "model": rig.service.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "stream": True})
    assert answer.headers["x-route-reason"] == "gpu_failed_replayed"
    assert failover_count((await rig.client.get("/metrics")).text, "crash") == 1
    status = (await rig.client.get("/status")).json()
    failover = status["failover"]
    assert (failover["count"], failover["last_fault"]) == (1, "crash")
    assert failover["last_s"] >= 0 and failover["p50_s"] == failover["last_s"]
    assert failover["by_fault"] == {"crash": {"count": 1, "last_s": failover["last_s"], "p50_s": failover["last_s"]}}
    timed = [e for e in status["events"] if e["kind"] == "failover"]
    assert [(e["fault"], e["id"]) for e in timed] == [("crash", answer.headers["x-request-id"])]
    # A plain answer on the GPU is no failover.
    rig.upstream.script("gpu").fail_before_first_byte = False
    await rig.client.post("/v1/chat/completions", json={
        "model": rig.service.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    assert (await rig.client.get("/status")).json()["failover"]["count"] == 1
