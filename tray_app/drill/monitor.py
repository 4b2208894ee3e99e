"""Samples GET /status in the background while the drill runs.

Each sample is boiled down to the few numbers the report needs (degraded
flag, CPU requests in flight for a GPU-out reason, free RAM and VRAM, queue
ages, breaker and GPU worker state). Requests are followed by id, because the
service forgets a request the moment it finishes: what /status showed while
it ran (first failure, attempts, when the CPU picked it up) is only known if
someone looked.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..core.api.security import bearer_header
from ..core.dispatch.admission import GPU_OUT_REASONS
from ..core.status_contract import Status
from .client import DrillClock, status_problem

GPU_OUT_REASON_CODES = frozenset(reason.value for reason in GPU_OUT_REASONS)
SAMPLE_INTERVAL_S = 0.15


@dataclass
class RequestTrace:
    """What /status showed about one request id over its life."""

    first_seen_s: float
    gpu_running_s: float | None = None
    cpu_running_s: float | None = None
    first_failure: str | None = None
    replayed: bool = False
    attempts: list[dict[str, Any]] = field(default_factory=list)
    max_completed_attempts: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "first_seen_s": self.first_seen_s, "gpu_running_s": self.gpu_running_s,
            "cpu_running_s": self.cpu_running_s, "first_failure": self.first_failure, "replayed": self.replayed,
            "attempts": self.attempts, "max_completed_attempts": self.max_completed_attempts,
        }


class StatusMonitor:
    def __init__(self, base_url: str, clock: DrillClock, interval_s: float = SAMPLE_INTERVAL_S,
                 api_key: str = "") -> None:
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=bearer_header(api_key), timeout=5.0)
        self._clock = clock
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drill-status-monitor", daemon=True)
        self._lock = threading.Lock()
        self.samples: list[dict[str, Any]] = []
        self.traces: dict[str, RequestTrace] = {}
        self.decisions: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.failed_samples = 0
        self.last_status: Status | None = None
        self._seen_decisions: set[str] = set()
        self._seen_events: set[str] = set()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._http.close()

    def sample_now(self) -> dict[str, Any] | None:
        """Take one sample in the caller's thread (used to close a phase cleanly)."""
        return self._sample()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self._sample()
            self._stop.wait(max(0.0, self._interval - (time.monotonic() - started)))

    def _sample(self) -> dict[str, Any] | None:
        t = round(self._clock.now(), 3)
        try:
            status = self._http.get("/status").json()
        except (httpx.HTTPError, ValueError) as exc:
            self._failed(t, f"{type(exc).__name__}: {exc}")
            return None
        # An error body, or another version's shape: read as a failed sample, not half-read.
        problem = status_problem(status)
        if problem:
            self._failed(t, problem)
            return None
        with self._lock:
            self.last_status = status
            sample = self._digest(t, status)
            self.samples.append(sample)
            self._follow_requests(t, status)
            self._collect(status["recent_decisions"], self.decisions, self._seen_decisions)
            self._collect(status["events"], self.events, self._seen_events)
        return sample

    def _failed(self, t: float, error: str) -> None:
        with self._lock:
            self.failed_samples += 1
            # A sample with no "cpu_gpu_out" breaks degraded intervals (see stats).
            self.samples.append({"t": t, "error": error})

    @staticmethod
    def _digest(t: float, status: Status) -> dict[str, Any]:
        requests = status["requests"]
        cpu_gpu_out = sorted(r["id"] for r in requests
                             if r["path"] == "cpu" and r["state"] in ("queued", "running")
                             and r["reason"] in GPU_OUT_REASON_CODES)
        gpu_worker = next((w for w in status["workers"] if w["role"] == "gpu"), None)
        queues = status["queues"]
        gpu = status["gpu"]
        degraded = status["degraded"]
        last_exit = gpu_worker["last_exit"] if gpu_worker is not None else None
        return {
            "t": t,
            "degraded_active": degraded["active"],
            "degraded_reason": degraded["reason"],
            "cpu_gpu_out": bool(cpu_gpu_out),
            "cpu_gpu_out_ids": cpu_gpu_out,
            "in_flight": len(requests),
            "ram_available_mib": status["ram"]["available_mib"],
            "gpu_free_mib": gpu["free_mib"],
            "gpu_path_out": gpu["path_out_reason"],
            "pressure_mib": gpu.get("pressure_mib"),  # a simulated device only
            "breaker": status["breaker"]["state"],
            "gpu_worker_state": gpu_worker["state"] if gpu_worker is not None else None,
            "gpu_worker_pid": gpu_worker["pid"] if gpu_worker is not None else None,
            "gpu_worker_last_exit": last_exit["kind"] if last_exit is not None else None,
            "queue_oldest_s": {"gpu": queues["gpu"]["oldest_age_s"], "cpu": queues["cpu"]["oldest_age_s"]},
            "queue_depth": {"gpu": queues["gpu"]["depth"], "cpu": queues["cpu"]["depth"]},
            "gpu_recovery_s": status["gpu_recovery_s"],
        }

    def _follow_requests(self, t: float, status: Status) -> None:
        for request in status["requests"]:
            trace = self.traces.get(request["id"])
            if trace is None:
                trace = self.traces[request["id"]] = RequestTrace(first_seen_s=t)
            running = request["state"] == "running"
            if running and request["path"] == "gpu" and trace.gpu_running_s is None:
                trace.gpu_running_s = t
            if running and request["path"] == "cpu" and trace.cpu_running_s is None:
                trace.cpu_running_s = t
            trace.first_failure = trace.first_failure or request["first_failure"]
            trace.replayed = trace.replayed or request["replayed"]
            attempts = request["attempts"]
            if len(attempts) >= len(trace.attempts):
                trace.attempts = [dict(a) for a in attempts]
            completed = sum(1 for a in attempts if a["outcome"] == "completed")
            trace.max_completed_attempts = max(trace.max_completed_attempts, completed)

    @staticmethod
    def _collect(items: Any, into: list[dict[str, Any]], seen: set[str]) -> None:
        for item in items:
            key = json.dumps(item, sort_keys=True, default=str)
            if key not in seen:
                seen.add(key)
                into.append(item)

    # ----- read-outs (thread-safe copies) --------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "samples": list(self.samples),
                "traces": {k: v.to_dict() for k, v in self.traces.items()},
                "decisions": list(self.decisions),
                "events": list(self.events),
                "failed_samples": self.failed_samples,
            }
