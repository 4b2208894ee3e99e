"""The drill's /status monitor reads a status through the contract: a real
one is boiled down to its numbers; an error body or another version's shape
is a failed sample that says why, not a sample of Nones."""

from __future__ import annotations

import httpx

from tests.status_sample import sample_status
from tray_app.drill.client import DrillClock
from tray_app.drill.monitor import StatusMonitor


def monitor_answering(*answers: dict) -> StatusMonitor:
    queue = list(answers)
    monitor = StatusMonitor("http://service", DrillClock())
    monitor._http.close()
    monitor._http = httpx.Client(base_url="http://service",
                                 transport=httpx.MockTransport(lambda request: httpx.Response(200, json=queue.pop(0))))
    return monitor


def test_a_status_is_boiled_down_and_another_shape_is_a_failed_sample():
    queued = sample_status()
    queued["queues"]["cpu"].update(depth=2, oldest_age_s=1.5)
    monitor = monitor_answering(queued, {"error": {"message": "missing or wrong API key"}})
    digest = monitor._sample()
    assert digest is not None and monitor.failed_samples == 0
    assert digest["breaker"] == "closed" and digest["gpu_worker_state"] == "ready" and not digest["degraded_active"]
    assert digest["queue_depth"] == {"gpu": 0, "cpu": 2} and digest["queue_oldest_s"]["cpu"] == 1.5
    assert monitor.decisions == queued["recent_decisions"]
    assert monitor._sample() is None and monitor.failed_samples == 1
    assert monitor.samples[-1]["error"] == "not a /status this drill reads: status.accounting: missing"
