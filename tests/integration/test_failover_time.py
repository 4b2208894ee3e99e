"""Failover time with a real fault: kill -9 the GPU worker while a request
runs on it, and /metrics' histogram and /status's failover numbers count
the replay's wait for its first token on the CPU (issue 32, part 5)."""

from __future__ import annotations

import concurrent.futures
import os
import signal

import pytest

from .test_failover import LONG_ANSWER, chat, running_on

pytestmark = pytest.mark.integration


def crash_failovers(service) -> float:
    prefix = 'tray_app_failover_seconds_count{fault="crash"} '
    metrics = service.http.get("/metrics").text
    return next((float(line[len(prefix):]) for line in metrics.splitlines() if line.startswith(prefix)), 0.0)


def test_a_killed_gpu_worker_shows_up_as_a_timed_failover(fresh):
    counted = crash_failovers(fresh)
    gpu_pid = fresh.worker("gpu")["pid"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(chat, fresh, LONG_ANSWER, 40, {"X-Request-Id": "timed-failover"})
        fresh.wait_for(lambda s: running_on(s, "timed-failover", "gpu"), what="request running on gpu")
        os.kill(gpu_pid, signal.SIGKILL)
        response = future.result()
    # It had made tokens: the CPU went on from them, and that is timed too (the seam).
    assert response.status_code == 200 and response.headers["x-route-reason"] == "gpu_failed_resumed"
    assert crash_failovers(fresh) == counted + 1
    status = fresh.status()
    failover = status["failover"]
    assert failover["last_fault"] == "crash" and failover["last_s"] > 0
    assert failover["by_fault"]["crash"]["count"] >= 1 and failover["p50_s"] is not None
    timed = [e for e in status["events"] if e["kind"] == "failover" and e["id"] == "timed-failover"]
    assert [e["seconds"] for e in timed] == [failover["last_s"]]
