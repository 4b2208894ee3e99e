"""What every phase of the drill shares: the target, the client, the records
and faults so far, and the helpers that send, wait and settle.

The phases themselves are functions of a `DrillSession` (drill/phases/);
`runner.Drill` is the session plus the order they run in.
"""

from __future__ import annotations

import itertools
import secrets
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..core.status_contract import RequestStatus, Status
from . import plan as plans, stats
from .agent import AgentRun, ToolLedger
from .client import DrillClient, DrillClock, DrillTimeout
from .monitor import StatusMonitor
from .progress import Progress
from .prompts import SHORT_PROMPTS, PromptSizer
from .records import INVARIANT, PhaseResult, RequestRecord
from .target import OwnService, Target

STATUS_WAIT_S = 60.0
RECOVERY_WAIT_S = 150.0


class DrillSession:
    def __init__(self, target: Target, initial_status: Status, plan: plans.DrillPlan, *,
                 progress: Progress) -> None:
        self.target = target
        self.plan = plan
        self.progress = progress
        self.clock = DrillClock()
        self.run_tag = f"drill-{secrets.token_hex(2)}"
        self.records: list[RequestRecord] = []
        self._records_lock = threading.Lock()
        self.client = DrillClient(target.url, self.clock, on_done=self._record_done, api_key=target.api_key)
        self.monitor = StatusMonitor(target.url, self.clock, api_key=target.api_key)
        self.ledger = ToolLedger()
        self.faults: list[dict[str, Any]] = []
        self.phases: list[PhaseResult] = []
        self.prefix_pairs: list[dict[str, Any]] = []
        self.agent_runs: list[AgentRun] = []
        self.initial_status = initial_status
        self._seq = itertools.count(1)
        self.sizer: PromptSizer | None = None
        self.started_wall = time.time()
        self.duration_s = 0.0
        workers = {w["role"]: w for w in initial_status["workers"]}
        self.gpu_cap = workers["gpu"]["n_ctx"] if "gpu" in workers else None
        self.cpu_cap = workers["cpu"]["n_ctx"] if "cpu" in workers else None
        self.reserve_mib = initial_status["gpu"]["reserve_mib"]

    def _record_done(self, record: RequestRecord) -> None:
        with self._records_lock:
            self.records.append(record)
        self.progress.advance()

    def record(self, phase: PhaseResult, label: str, *, kind: str = "chat", stream: bool = False,
               max_tokens: int | None = None, prompt_key: str | None = None, forced_cpu: bool = False,
               idempotency_key: str | None = None, expect: str = "answer", retry_of: str | None = None) -> RequestRecord:
        return RequestRecord(
            id=f"{self.run_tag}-p{phase.number}-{next(self._seq):03d}", phase=phase.key, label=label, kind=kind,
            stream=stream, max_tokens=max_tokens or self.plan.answer_tokens, prompt_key=prompt_key,
            forced_cpu=forced_cpu, idempotency_key=idempotency_key, expect=expect, retry_of=retry_of,
        )

    def send(self, record: RequestRecord, body: dict[str, Any],
             on_token: Callable[[int], None] | None = None) -> RequestRecord:
        return self.client.send(record, body, on_token)

    def send_in(self, pool: ThreadPoolExecutor, record: RequestRecord, body: dict[str, Any],
                on_token: Callable[[int], None] | None = None) -> Future:
        return pool.submit(self.client.send, record, body, on_token)

    def ours(self, status: Status) -> list[RequestStatus]:
        return [r for r in status["requests"] if r["id"].startswith(self.run_tag)]

    def wait_running(self, request_id: str, path: str, min_tokens: int = 0, timeout: float = STATUS_WAIT_S) -> Status:
        def running(status: Status) -> bool:
            return any(r["id"] == request_id and r["path"] == path and r["state"] == "running"
                       and r["attempts"] and r["attempts"][-1]["tokens"] >= min_tokens
                       for r in status["requests"])
        return self.client.wait_status(running, timeout, interval=0.02, what=f"{request_id} running on the {path}")

    @staticmethod
    def request_in(status: Status, request_id: str) -> RequestStatus | None:
        return next((r for r in status["requests"] if r["id"] == request_id), None)

    def request_state(self, status: Status, request_id: str) -> str | None:
        request = self.request_in(status, request_id)
        return request["state"] if request is not None else None

    def kill_gpu(self, phase: PhaseResult, status: Status, sig: signal.Signals, request_id: str | None,
                 what: str) -> dict[str, Any]:
        assert isinstance(self.target, OwnService)
        request = self.request_in(status, request_id) if request_id else None
        attempts = request["attempts"] if request is not None else []
        pid = self.target.kill_gpu_worker(status, sig)
        at = round(self.clock.now(), 3)
        fault = {
            "phase": phase.number, "kind": what, "signal": sig.name, "pid": pid, "request_id": request_id,
            # For a kill the fault is over at once; the GPU recovery time runs from here.
            "at_s": at, "cleared_s": at,
            # As /status last showed them, a moment before the kill landed.
            "gpu_tokens_at_kill": attempts[-1]["tokens"] if attempts else None,
        }
        self.faults.append(fault)
        self.progress.note(f"fault: {what} ({sig.name}, pid {pid})")
        return fault

    def settle(self, phase: PhaseResult) -> None:
        """Back to a healthy baseline: no VRAM taken, workers ready, breaker
        closed. A breaker left half-open closes the way it does for users: the
        next GPU request is the probe."""
        if self.target.can_inject and self.target.pressure is not None:
            self.target.pressure.release()

        def calm(status: Status) -> bool:
            if not self.target.can_inject:
                return not self.ours(status)  # a live service's health is not ours to wait for
            return (all(w["state"] == "ready" for w in status["workers"])
                    and status["breaker"]["state"] != "open" and not self.ours(status))
        status = self.client.wait_status(calm, RECOVERY_WAIT_S, interval=0.1, what="workers ready, breaker not open")
        if not self.target.can_inject:
            return
        for _ in range(3):
            if status["breaker"]["state"] == "closed":
                return
            probe = self.record(phase, "breaker probe (half-open)", max_tokens=4)
            self.send(probe, chat_body(SHORT_PROMPTS[0]))
            status = self.client.wait_status(calm, RECOVERY_WAIT_S, interval=0.1, what="breaker closed")
        raise DrillTimeout(f"the breaker stayed {status['breaker']['state']} after three probe requests")

    def check_nothing_lost(self, phase: PhaseResult, result: dict[str, Any], duplicates_before: int) -> None:
        """The phase's invariant: every request it sent answered, none run twice."""
        mine = [r for r in self.records if r.phase == phase.key]
        result["lost"] = len([r for r in mine if not answered(r)])
        result["duplicated"] = self.client.status()["accounting"]["duplicate_executions"] - duplicates_before
        phase.check("no request lost or run twice", result["lost"] == 0 and result["duplicated"] == 0,
                    f"lost {result['lost']}, duplicated {result['duplicated']}", severity=INVARIANT)


def chat_body(content: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


def completion_body(prompt: str) -> dict[str, Any]:
    return {"prompt": prompt, "temperature": 0}


def answered(record: RequestRecord) -> bool:
    return stats.answer_kind(
        status=record.status, stream=record.stream, saw_done=record.saw_done,
        saw_error_event=record.saw_error_event, body_ok=record.body_ok, error_code=record.error_code,
        transport_error=record.transport_error) == "answer"
