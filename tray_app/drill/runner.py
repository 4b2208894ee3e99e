"""Runs the ten phases against a target and keeps everything that happened.

Each phase sends ordinary OpenAI requests (every one becomes a
RequestRecord), injects its fault where the target allows it, and adds
checks of what the service did. The numbers of the report are computed
afterwards, by report.py, from the records and the /status samples.
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

import httpx

from ..core.status_contract import ModelSummary, RequestStatus, Status
from . import plan as plans, stats
from .agent import (
    FORCE_TOOL, ORDER_IDS, TOOLS, AgentRun, ToolLedger, check_tool_call, first_turn_messages, second_turn_messages,
)
from .client import DrillClient, DrillClock, DrillTimeout
from .monitor import StatusMonitor
from .pressure import PressureError
from .progress import Progress
from .prompts import (
    COMPLETION_PROMPTS, OVER_CAP_QUESTIONS, SHORT_ANSWER_QUESTIONS, SHORT_PROMPTS, STORY, PromptSizer, sized_message,
)
from .records import FINDING, INVARIANT, PhaseResult, RequestRecord
from .target import OwnService, Target, TargetError, gpu_worker

PHASES = (
    (1, "over_gpu_profile", "Over the GPU profile, within RAM (JSON)"),
    (2, "over_gpu_profile_stream", "Over the GPU profile, within RAM (streaming)"),
    (3, "cancel_in_cpu_queue", "Cancel while waiting in the CPU queue"),
    (4, "concurrent_clients", "Concurrent traffic from 8 clients"),
    (5, "agent_tools", "Agents with a counted mock tool"),
    (6, "shrinking_vram", "Short, long and parallel prompts as free VRAM shrinks"),
    (7, "alloc_failure", "Allocation failure before generation"),
    (8, "gpu_worker_reset", "GPU worker killed mid-request"),
    (9, "poison_request", "A request that crashes the GPU worker, among normal traffic"),
    (10, "other_app_takes_vram", "Another app takes the VRAM while requests stream, holds it, lets go"),
    (11, "second_model", "A second model loads on demand; a tight GPU unloads the idle one for the other"),
)

OVER_CAP_MAX_TOKENS = 16
# How far over the GPU context cap an over-profile request goes (tokens).
OVER_CAP_MARGIN = 24
AGREEMENT_TOKENS = 24
BLOCKER_TOKENS = 64
AGENT_TOOL_TOKENS = 64
AGENT_ANSWER_TOKENS = 32
RESET_TOKENS = 48
# Requests sent while the poison request crashes the GPU worker.
POISON_NEIGHBOURS = 4
KILL_AFTER_STREAMED_TOKENS = 3
STATUS_WAIT_S = 60.0
RECOVERY_WAIT_S = 150.0
# Phase 10: the other app, what it is called, and how long it keeps the memory.
OTHER_APP_NAME = "game"
OTHER_APP_HOLD_S = 2.0
OTHER_APP_STREAMS = 2
REQUESTS_WHILE_HELD = 2


class Drill:
    def __init__(self, target: Target, initial_status: Status, plan: plans.DrillPlan, *,
                 progress: Progress, phases: set[int] | None = None) -> None:
        self.target = target
        self.plan = plan
        self.progress = progress
        self.selected = phases or {number for number, _, _ in PHASES}
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

    # ----- the run ------------------------------------------------------------------

    def run(self) -> None:
        self.monitor.start()
        try:
            setup = PhaseResult(0, "setup", "Prompt-size calibration")
            self.progress.phase("calibrating prompt sizes")
            setup.started_s = self.clock.now()
            self._calibrate(setup)
            setup.ended_s = self.clock.now()
            self.phases.append(setup)
            for number, key, title in PHASES:
                if number not in self.selected:
                    continue
                self._run_phase(PhaseResult(number, key, title))
        finally:
            self.monitor.sample_now()
            self.monitor.stop()
            self.client.close()
            self.duration_s = self.clock.now()

    def _run_phase(self, result: PhaseResult) -> None:
        self.progress.phase(f"phase {result.number}/{len(PHASES)}: {result.title}")
        result.started_s = self.clock.now()
        result.skipped = self._skip_reason(result.number)
        try:
            if result.skipped is None:
                getattr(self, f"_phase_{result.key}")(result)
        except (DrillTimeout, PressureError, TargetError, httpx.HTTPError) as exc:
            result.check("phase ran to the end", False, f"{type(exc).__name__}: {exc}")
        finally:
            if result.skipped is None:
                try:
                    self._settle(result)
                except (DrillTimeout, PressureError, httpx.HTTPError) as exc:
                    result.check("service healthy again after the phase", False, f"{type(exc).__name__}: {exc}")
            result.ended_s = self.clock.now()
            self.phases.append(result)
            if result.skipped:
                self.progress.note(f"phase {result.number} skipped: {result.skipped}")

    def _skip_reason(self, number: int) -> str | None:
        has_gpu_path = self.gpu_cap is not None
        if number in (1, 2):
            if not has_gpu_path:
                return "the service has no GPU worker, so no request can exceed the GPU profile"
            if self.cpu_cap is None or self.cpu_cap <= self.gpu_cap + OVER_CAP_MARGIN:
                return (f"the GPU context cap ({self.gpu_cap}) is not below the CPU's ({self.cpu_cap}): no request "
                        "exceeds the GPU profile but fits in RAM")
        if number == 6 and not has_gpu_path:
            return "the service has no GPU worker"
        if number == 10 and has_gpu_path and self.initial_status["gpu"]["residency"] is None:
            return "the service does not report GPU residency (an older version)"
        if number == 11 and len(self.initial_status["models"]) < 2:
            return "the service has one model (the drill's own service has two)"
        if number == 11 and not has_gpu_path:
            return "the service has no GPU worker"
        if number in (7, 8, 9, 10, 11):
            if not self.target.can_inject:
                return "fault injection is off against a live service (--url)"
            if not has_gpu_path:
                return "the service has no GPU worker to fail"
        return None

    # ----- helpers ----------------------------------------------------------------------

    def _record_done(self, record: RequestRecord) -> None:
        with self._records_lock:
            self.records.append(record)
        self.progress.advance()

    def _record(self, phase: PhaseResult, label: str, *, kind: str = "chat", stream: bool = False,
                max_tokens: int | None = None, prompt_key: str | None = None, forced_cpu: bool = False,
                idempotency_key: str | None = None, expect: str = "answer", retry_of: str | None = None) -> RequestRecord:
        return RequestRecord(
            id=f"{self.run_tag}-p{phase.number}-{next(self._seq):03d}", phase=phase.key, label=label, kind=kind,
            stream=stream, max_tokens=max_tokens or self.plan.answer_tokens, prompt_key=prompt_key,
            forced_cpu=forced_cpu, idempotency_key=idempotency_key, expect=expect, retry_of=retry_of,
        )

    @staticmethod
    def _chat(content: str, **extra: Any) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": content}], "temperature": 0, **extra}

    @staticmethod
    def _completion(prompt: str) -> dict[str, Any]:
        return {"prompt": prompt, "temperature": 0}

    def _send(self, record: RequestRecord, body: dict[str, Any],
              on_token: Callable[[int], None] | None = None) -> RequestRecord:
        return self.client.send(record, body, on_token)

    def _send_in(self, pool: ThreadPoolExecutor, record: RequestRecord, body: dict[str, Any],
                 on_token: Callable[[int], None] | None = None) -> Future:
        return pool.submit(self.client.send, record, body, on_token)

    def _ours(self, status: Status) -> list[RequestStatus]:
        return [r for r in status["requests"] if r["id"].startswith(self.run_tag)]

    def _wait_running(self, request_id: str, path: str, min_tokens: int = 0, timeout: float = STATUS_WAIT_S) -> dict:
        def running(status: Status) -> bool:
            return any(r["id"] == request_id and r["path"] == path and r["state"] == "running"
                       and r["attempts"] and r["attempts"][-1]["tokens"] >= min_tokens
                       for r in status["requests"])
        return self.client.wait_status(running, timeout, interval=0.02, what=f"{request_id} running on the {path}")

    def _request_in(self, status: Status, request_id: str) -> RequestStatus | None:
        return next((r for r in status["requests"] if r["id"] == request_id), None)

    @staticmethod
    def _answered(record: RequestRecord) -> bool:
        return stats.answer_kind(
            status=record.status, stream=record.stream, saw_done=record.saw_done,
            saw_error_event=record.saw_error_event, body_ok=record.body_ok, error_code=record.error_code,
            transport_error=record.transport_error) == "answer"

    def _request_state(self, status: Status, request_id: str) -> str | None:
        request = self._request_in(status, request_id)
        return request["state"] if request is not None else None

    def _kill_gpu(self, phase: PhaseResult, status: Status, sig: signal.Signals, request_id: str | None,
                  what: str) -> dict[str, Any]:
        assert isinstance(self.target, OwnService)
        request = self._request_in(status, request_id) if request_id else None
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

    def _settle(self, phase: PhaseResult) -> None:
        """Back to a healthy baseline: no VRAM taken, workers ready, breaker
        closed. A breaker left half-open closes the way it does for users: the
        next GPU request is the probe."""
        if self.target.can_inject and self.target.pressure is not None:
            self.target.pressure.release()

        def calm(status: Status) -> bool:
            if not self.target.can_inject:
                return not self._ours(status)  # a live service's health is not ours to wait for
            return (all(w["state"] == "ready" for w in status["workers"])
                    and status["breaker"]["state"] != "open" and not self._ours(status))
        status = self.client.wait_status(calm, RECOVERY_WAIT_S, interval=0.1, what="workers ready, breaker not open")
        if not self.target.can_inject:
            return
        for _ in range(3):
            if status["breaker"]["state"] == "closed":
                return
            probe = self._record(phase, "breaker probe (half-open)", max_tokens=4)
            self._send(probe, self._chat(SHORT_PROMPTS[0]))
            status = self.client.wait_status(calm, RECOVERY_WAIT_S, interval=0.1, what="breaker closed")
        raise DrillTimeout(f"the breaker stayed {status['breaker']['state']} after three probe requests")

    # ----- setup ------------------------------------------------------------------------------

    def _calibrate(self, phase: PhaseResult) -> None:
        """Two one-token requests: how many prompt tokens a filler word costs."""
        question = OVER_CAP_QUESTIONS[0]
        counts = []
        for words in (0, PromptSizer.CALIBRATION_WORDS):
            record = self._record(phase, f"calibration, {words} filler words", max_tokens=1, forced_cpu=True)
            self._send(record, self._chat(sized_message(words, question)))
            if not self._answered(record) or record.prompt_tokens is None:
                raise TargetError(f"the calibration request failed: {record.status} {record.error_code} "
                                  f"{record.error_message or record.transport_error or ''}")
            counts.append(record.prompt_tokens)
        self.sizer = PromptSizer(counts[0], counts[1])
        phase.data["calibration"] = {"base_tokens": counts[0], "tokens_per_word": round(self.sizer.tokens_per_word, 3)}

    # ----- phases 1 and 2 -------------------------------------------------------------------

    def _phase_over_gpu_profile(self, phase: PhaseResult, stream: bool = False) -> None:
        assert self.sizer is not None and self.gpu_cap is not None
        mode = "stream" if stream else "json"
        over_total = self.gpu_cap + OVER_CAP_MARGIN
        over: list[RequestRecord] = []
        for i in range(self.plan.over_cap_requests):
            # Alternately a long prompt and a short prompt with a big answer
            # budget: admission counts prompt + max_tokens against the cap.
            if (i + stream) % 2 == 0:
                question = OVER_CAP_QUESTIONS[i % len(OVER_CAP_QUESTIONS)]
                content = self.sizer.message(over_total - OVER_CAP_MAX_TOKENS, question)
                max_tokens, label = OVER_CAP_MAX_TOKENS, f"over the GPU cap #{i + 1}: long prompt"
            else:
                content = SHORT_ANSWER_QUESTIONS[i % len(SHORT_ANSWER_QUESTIONS)]
                max_tokens = over_total - self.sizer.base_tokens
                label = f"over the GPU cap #{i + 1}: max_tokens {max_tokens}"
            record = self._record(phase, label, stream=stream, max_tokens=max_tokens, prompt_key=f"over-cap-{i}-{mode}")
            over.append(self._send(record, self._chat(content)))
        wrong = [f"{r.id}: {r.status} {r.served_by}/{r.route_reason}" for r in over
                 if not (self._answered(r) and r.served_by == "cpu" and r.route_reason == "gpu_context_cap")]
        phase.check("served by the CPU for gpu_context_cap", not wrong,
                    f"{len(over) - len(wrong)}/{len(over)} answered by the CPU with gpu_context_cap"
                    + (f"; not: {', '.join(wrong)}" if wrong else ""))
        for j in range(self.plan.agreement_pairs):
            prompt = SHORT_PROMPTS[j % len(SHORT_PROMPTS)]
            key = f"pair-{j}-{mode}"
            on_gpu = self._send(self._record(phase, f"agreement pair {j + 1}: GPU", stream=stream,
                                             max_tokens=AGREEMENT_TOKENS, prompt_key=key), self._chat(prompt))
            on_cpu = self._send(self._record(phase, f"agreement pair {j + 1}: forced CPU", stream=stream,
                                             max_tokens=AGREEMENT_TOKENS, prompt_key=key, forced_cpu=True),
                                self._chat(prompt))
            if on_gpu.served_by != "gpu":
                phase.notes.append(f"agreement pair {j + 1}: the GPU request was served by {on_gpu.served_by} "
                                   f"({on_gpu.route_reason}), so it compares nothing")
            phase.check(f"agreement pair {j + 1} routed as asked",
                        on_cpu.route_reason == "forced_cpu" and self._answered(on_cpu) and self._answered(on_gpu),
                        f"GPU request: {on_gpu.served_by}/{on_gpu.route_reason}; "
                        f"CPU request: {on_cpu.served_by}/{on_cpu.route_reason}")

    def _phase_over_gpu_profile_stream(self, phase: PhaseResult) -> None:
        self._phase_over_gpu_profile(phase, stream=True)

    # ----- phase 3 ------------------------------------------------------------------------------

    def _phase_cancel_in_cpu_queue(self, phase: PhaseResult) -> None:
        # X-Force-Path: cpu puts them all on the CPU lane without touching the
        # service's settings, so this runs live too: one blocker per CPU slot
        # (llama-server decodes several at once), then the ones that must wait.
        slots = self.client.status()["engine"]["slots"]["cpu"]
        with ThreadPoolExecutor(slots + self.plan.queued_cancels) as pool:
            blockers = [self._record(phase, f"CPU lane blocker #{n + 1}", max_tokens=BLOCKER_TOKENS, forced_cpu=True)
                        for n in range(slots)]
            blockers_done = [self._send_in(pool, blocker, self._chat(STORY)) for blocker in blockers]
            for blocker in blockers:
                self._wait_running(blocker.id, "cpu")
            for i in range(self.plan.queued_cancels):
                queued = self._record(phase, f"queued, then canceled #{i + 1}", stream=i % 2 == 1, max_tokens=40,
                                      forced_cpu=True, expect="canceled")
                queued_done = self._send_in(pool, queued, self._chat(SHORT_PROMPTS[i % len(SHORT_PROMPTS)]))
                status = self.client.wait_status(
                    lambda s, queued_id=queued.id: self._request_state(s, queued_id) == "queued",
                    STATUS_WAIT_S,
                    interval=0.05, what=f"{queued.id} waiting in the CPU queue")
                request = self._request_in(status, queued.id)
                position = request["queue_position"] if request is not None else None
                cancel = self.client.cancel(queued.id)
                state_was = cancel.json().get("state_was") if cancel.status_code == 200 else None
                queued_done.result()
                again = self.client.cancel(queued.id)
                phase.check(f"queued request #{i + 1} canceled",
                            cancel.status_code == 200 and state_was == "queued" and queued.status == 499
                            and queued.error_code == "request_canceled" and again.status_code == 404,
                            f"queue position {position}; DELETE -> {cancel.status_code} (state_was {state_was}); "
                            f"client got {queued.status} {queued.error_code}; second DELETE -> {again.status_code}")
            for done in blockers_done:
                done.result()
        phase.check("the requests ahead were not affected", all(self._answered(b) for b in blockers),
                    "; ".join(f"{b.id}: {b.status}, {b.completion_tokens} tokens" for b in blockers))

    # ----- phase 4 --------------------------------------------------------------------------------

    def _phase_concurrent_clients(self, phase: PhaseResult) -> None:
        clients = self.plan.concurrent_clients
        # Clients 1 and 5 send the same request under one Idempotency-Key at
        # the same moment, as a client retrying on a timeout does.
        shared_key = f"{self.run_tag}-p4-shared"
        start = threading.Barrier(clients)

        def client(c: int) -> None:
            start.wait()
            for k in range(self.plan.requests_per_client):
                kind = "completion" if c % 4 == 3 else "chat"
                stream = c % 2 == 1
                shared = k == 0 and c in (0, 4)
                p = 0 if shared else (c + k) % len(SHORT_PROMPTS)
                record = self._record(
                    phase, f"client {c + 1} request {k + 1}" + (" (shared Idempotency-Key)" if shared else ""),
                    kind=kind, stream=stream, prompt_key=f"short-{p}-{kind}-{'stream' if stream else 'json'}",
                    idempotency_key=shared_key if shared else None, expect="answer_or_rejected")
                body = self._chat(SHORT_PROMPTS[p]) if kind == "chat" else self._completion(COMPLETION_PROMPTS[p])
                self._send(record, body)

        with ThreadPoolExecutor(clients) as pool:
            for future in [pool.submit(client, c) for c in range(clients)]:
                future.result()
        mine = [r for r in self.records if r.phase == phase.key]
        rejected = [r for r in mine if r.status and r.status >= 400]
        bad_rejections = [f"{r.id}: {r.status} {r.error_code}" for r in rejected
                          if r.error_code != "cpu_queue_full" or not r.retry_after]
        phase.check("rejections are clean 503s with Retry-After", not bad_rejections,
                    f"{len(rejected)} rejected" + (f"; unexpected: {', '.join(bad_rejections)}" if bad_rejections else ""))
        shared = [r for r in mine if r.idempotency_key == shared_key and self._answered(r)]
        fresh = [r for r in shared if not r.idempotent_replay]
        phase.check("the shared Idempotency-Key ran once", len(shared) == 2 and len(fresh) == 1
                    and len({(r.output_text, r.tool_calls_signature) for r in shared}) == 1,
                    f"{len(shared)} answers, {len(fresh)} fresh, "
                    f"{len({r.output_text for r in shared})} distinct outputs")
        routes: dict[str, int] = {}
        for r in mine:
            routes[f"{r.served_by}/{r.route_reason}"] = routes.get(f"{r.served_by}/{r.route_reason}", 0) + 1
        phase.data["routes"] = routes

    # ----- phase 5 ------------------------------------------------------------------------------------

    def _phase_agent_tools(self, phase: PhaseResult) -> None:
        agents = list(range(self.plan.agents))
        if self.target.can_inject and agents:
            # The first agent runs alone so its turn is on the GPU when the worker dies.
            self.agent_runs.append(self._agent(phase, agents[0], kill_first_turn=True))
            self._settle(phase)
            agents = agents[1:]
        with ThreadPoolExecutor(max(1, len(agents))) as pool:
            for run in pool.map(lambda i: self._agent(phase, i), agents):
                self.agent_runs.append(run)
        runs = list(self.agent_runs)
        executions = self.ledger.executions
        missing = [r.agent for r in runs if executions.get(self._action(r), 0) == 0]
        twice = [action for action, count in executions.items() if count > 1]
        phase.check("no tool call ran twice", not twice,
                    f"{sum(executions.values())} executions for {len(executions)} actions"
                    + (f"; twice: {', '.join(twice)}" if twice else ""), severity=INVARIANT)
        phase.check("every agent's tool ran exactly once", not missing and not twice,
                    f"{len(runs) - len(missing)}/{len(runs)} agents' refunds executed"
                    + (f"; never: {', '.join(missing)}" if missing else ""))
        failed = [f"{r.agent}: {r.failure}" for r in runs if r.failure]
        phase.check("every agent got its final answer", not failed,
                    f"{len(runs) - len(failed)}/{len(runs)} finished" + (f"; {'; '.join(failed)}" if failed else ""))
        anomalies = sorted({a for r in runs for a in r.anomalies})
        if anomalies:
            phase.check("tool calls arrive in the OpenAI shape", False,
                        f"{sum(len(r.anomalies) for r in runs)} tool calls: " + "; ".join(anomalies[:3]),
                        severity=FINDING)
        mistakes = [m for r in runs for m in r.model_mistakes]
        if mistakes:
            phase.check("the model's tool arguments are JSON", False,
                        f"{len(mistakes)} calls (the model's doing, not the service's): " + "; ".join(mistakes[:2]),
                        severity=FINDING)
        phase.data["agents"] = [r.to_dict() for r in runs]
        phase.data["tool_log"] = list(self.ledger.log)

    @staticmethod
    def _action(run: AgentRun) -> str:
        return f"{run.agent}: refund {run.order_id}"

    def _agent(self, phase: PhaseResult, i: int, kill_first_turn: bool = False) -> AgentRun:
        run = AgentRun(agent=f"agent-{i + 1}", order_id=ORDER_IDS[i % len(ORDER_IDS)],
                       stream=i % 2 == 1 and not kill_first_turn)
        mode = "stream" if run.stream else "json"
        key = f"{self.run_tag}-{run.agent}"
        body = {"messages": first_turn_messages(run.order_id), "tools": TOOLS, "tool_choice": FORCE_TOOL,
                "temperature": 0}
        first = self._record(phase, f"{run.agent} turn 1", stream=run.stream, max_tokens=AGENT_TOOL_TOKENS,
                             idempotency_key=f"{key}-turn1", prompt_key=f"agent-{run.order_id}-turn1-{mode}")
        again = self._record(phase, f"{run.agent} turn 1 resent (client retry)", stream=run.stream,
                             max_tokens=AGENT_TOOL_TOKENS, idempotency_key=f"{key}-turn1", retry_of=first.id)
        with ThreadPoolExecutor(2) as pool:
            first_done = self._send_in(pool, first, body)
            if kill_first_turn:
                try:
                    status = self._wait_running(first.id, "gpu", timeout=30)
                    self._kill_gpu(phase, status, signal.SIGKILL, first.id, "GPU worker killed during an agent turn")
                except DrillTimeout:
                    phase.notes.append(f"{first.id} was not seen running on the GPU; no worker was killed")
            else:
                time.sleep(0.15)
            again_done = self._send_in(pool, again, body)
            responses = [first_done.result(), again_done.result()]
        run.request_ids += [r.id for r in responses]
        calls: list[tuple[dict[str, Any], dict[str, Any]]] = []
        for record in responses:
            if not self._answered(record):
                continue
            for call in record.tool_calls:
                verdict = check_tool_call(call)
                if verdict.anomaly:
                    run.anomalies.append(verdict.anomaly)
                if not verdict.name_ok:
                    run.failure = f"{record.id} asked for a tool that doesn't exist: {call.get('name', '')[:80]!r}"
                    continue
                if not verdict.arguments_ok:
                    run.model_mistakes.append(f"{record.id}: the arguments are not JSON: {call['arguments'][:60]!r}")
                calls.append((call, self.ledger.run(self._action(run), call.get("id"), call["arguments"], record.id)))
        if kill_first_turn and first.served_by == "cpu":
            phase.check("the killed agent turn was replayed on the CPU", first.route_reason == "gpu_failed_replayed",
                        f"{first.id}: {first.served_by}/{first.route_reason}")
        elif kill_first_turn:
            phase.notes.append(f"{first.id} finished on the {first.served_by} before the kill landed; nothing to replay")
        if not calls:
            run.failure = run.failure or "no usable tool call in turn 1 (" + ", ".join(
                f"{r.id}: {r.status} {r.error_code or ''}" for r in responses) + ")"
            return run
        call, result = calls[0]
        second = self._record(phase, f"{run.agent} turn 2", stream=run.stream, max_tokens=AGENT_ANSWER_TOKENS,
                              idempotency_key=f"{key}-turn2", prompt_key=f"agent-{run.order_id}-turn2-{mode}")
        self._send(second, {"messages": second_turn_messages(run.order_id, call, result), "tools": TOOLS,
                            "tool_choice": "none", "temperature": 0})
        run.request_ids.append(second.id)
        if self._answered(second):
            run.final_answer = second.output_text
        else:
            run.failure = f"turn 2 ({second.id}) ended with {second.status} {second.error_code or second.transport_error}"
        return run

    # ----- phase 6 ------------------------------------------------------------------------------------

    def _phase_shrinking_vram(self, phase: PhaseResult) -> None:
        assert self.sizer is not None and self.gpu_cap is not None
        pressure = self.target.pressure if self.target.can_inject else None
        if pressure is None:
            steps: tuple[float | None, ...] = (None,)
            phase.notes.append("live service: the prompts are replayed once, at the free VRAM it has now")
        else:
            spares = self.plan.vram_steps_spare_mib if self.target.simulated else plans.REAL_GPU_STEPS_SPARE_MIB
            steps = (None, *spares)
        long_tokens = self.gpu_cap - self.plan.answer_tokens - 30
        long_prompt = self.sizer.message(long_tokens, OVER_CAP_QUESTIONS[1])
        rows = []
        for number, spare in enumerate(steps):
            taken = pressure.squeeze_to_spare(spare, self.reserve_mib) if (pressure and spare is not None) else {}
            if pressure is not None and pressure.kind == "real":
                time.sleep(1.2)  # the service reads NVML once a second
            free = self.client.status()["gpu"]["free_mib"]
            label = "no pressure" if spare is None else f"{spare:g} MiB spare"
            short = self._send(self._record(phase, f"step {number} ({label}): short", stream=True,
                                            prompt_key="vram-short"), self._chat(SHORT_PROMPTS[3]))
            long = self._send(self._record(phase, f"step {number} ({label}): long", stream=True,
                                           prompt_key="vram-long"), self._chat(long_prompt))
            parallel = [self._record(phase, f"step {number} ({label}): parallel {j + 1}", stream=True,
                                     prompt_key=f"vram-parallel-{j}", expect="answer_or_rejected")
                        for j in range(self.plan.parallel_per_step)]
            with ThreadPoolExecutor(max(1, len(parallel))) as pool:
                for future in [self._send_in(pool, r, self._chat(SHORT_PROMPTS[(4 + j) % len(SHORT_PROMPTS)]))
                               for j, r in enumerate(parallel)]:
                    future.result()
            rows.append({
                "step": number, "spare_mib": spare, "free_mib": free, **taken,
                "short": f"{short.served_by}/{short.route_reason}", "long": f"{long.served_by}/{long.route_reason}",
                "parallel": [f"{r.served_by}/{r.route_reason}" for r in parallel],
            })
        if pressure is not None:
            pressure.release()
        phase.data["steps"] = rows
        if len(rows) < 2:
            return
        phase.check("with no pressure, short and long prompts run on the GPU",
                    rows[0]["short"] == "gpu/admitted" and rows[0]["long"] == "gpu/admitted",
                    f"short {rows[0]['short']}, long {rows[0]['long']}")
        last = rows[-1]
        everything = [last["short"], last["long"], *last["parallel"]]
        phase.check("with no spare VRAM, everything goes to the CPU for gpu_vram_headroom",
                    all(route == "cpu/gpu_vram_headroom" for route in everything), ", ".join(everything))
        for kind in ("short", "long"):
            routes = [row[kind] for row in rows]
            first_out = next((i for i, route in enumerate(routes) if route == "cpu/gpu_vram_headroom"), len(routes))
            monotonic = all(route == "cpu/gpu_vram_headroom" for route in routes[first_out:])
            phase.check(f"{kind} prompt: once VRAM is short it stays on the CPU", monotonic, " -> ".join(routes))

    # ----- phase 7 ------------------------------------------------------------------------------------

    def _phase_alloc_failure(self, phase: PhaseResult) -> None:
        assert isinstance(self.target, OwnService) and self.target.pressure is not None and self.sizer is not None
        pressure = self.target.pressure
        status = self.client.status()
        worker = gpu_worker(status)
        need = worker["estimated_vram_mib"]
        devices = status["gpu"]["devices"]
        for process in devices[0]["processes"] if devices else ():
            if process["pid"] == worker["pid"] and process["used_mib"]:
                need = max(need, process["used_mib"])
        phase.data["gpu_worker_need_mib"] = need
        # A prompt that takes a moment to read, so the worker dies before its first token.
        prompt = self.sizer.message(self.gpu_cap - OVER_CAP_MAX_TOKENS - 24, OVER_CAP_QUESTIONS[2])
        victim = self._record(phase, "in flight when the GPU worker dies", max_tokens=OVER_CAP_MAX_TOKENS)
        with ThreadPoolExecutor(1) as pool:
            victim_done = self._send_in(pool, victim, self._chat(prompt))
            status = self._wait_running(victim.id, "gpu")
            if pressure.starve_before_kill:
                phase.data["pressure"] = pressure.starve_restart(need)
            fault = self._kill_gpu(phase, status, signal.SIGKILL, victim.id,
                                   "GPU worker killed; its restart can't allocate")
            if not pressure.starve_before_kill:
                self._wait_vram_back(need)
                phase.data["pressure"] = pressure.starve_restart(need)
            victim_done.result()
        phase.check("the request in flight was replayed on the CPU",
                    self._answered(victim) and victim.served_by == "cpu" and victim.route_reason == "gpu_failed_replayed",
                    f"{victim.status} {victim.served_by}/{victim.route_reason}; GPU tokens at the kill: "
                    f"{fault['gpu_tokens_at_kill']}")
        status = self.client.wait_status(
            lambda s: s["breaker"]["state"] == "open"
            and (gpu_worker(s)["last_exit"] or {}).get("kind") == "out_of_memory",
            STATUS_WAIT_S, interval=0.05, what="the GPU restart failing out of memory and the breaker open")
        last_exit = gpu_worker(status)["last_exit"] or {}
        phase.check("the restart failed with an out-of-memory exit and the breaker opened", True,
                    f"last exit: {last_exit.get('description')}; evidence: {str(last_exit.get('evidence'))[:160]}")
        phase.data["oom_exit"] = last_exit
        while_open = []
        for i in range(self.plan.requests_while_open):
            record = self._record(phase, f"while the breaker is open #{i + 1}", stream=i % 2 == 1,
                                  prompt_key=f"short-{i}-chat-{'stream' if i % 2 else 'json'}")
            while_open.append(self._send(record, self._chat(SHORT_PROMPTS[i % len(SHORT_PROMPTS)])))
        wrong = [f"{r.id}: {r.served_by}/{r.route_reason}" for r in while_open
                 if not (self._answered(r) and r.served_by == "cpu" and r.route_reason == "gpu_unavailable")]
        phase.check("while the GPU can't allocate, the CPU serves (gpu_unavailable)", not wrong,
                    f"{len(while_open) - len(wrong)}/{len(while_open)}" + (f"; not: {', '.join(wrong)}" if wrong else ""))
        pressure.release()
        fault["cleared_s"] = round(self.clock.now(), 3)
        status = self.client.wait_status(
            lambda s: gpu_worker(s)["state"] == "ready" and s["breaker"]["state"] == "half_open",
            RECOVERY_WAIT_S, interval=0.05, what="GPU worker back and the breaker half-open")
        probe = self._send(self._record(phase, "first request after the memory came back (probe)", max_tokens=8),
                           self._chat(SHORT_PROMPTS[1]))
        status = self.client.status()
        phase.check("the probe ran on the GPU and closed the breaker",
                    probe.served_by == "gpu" and status["breaker"]["state"] == "closed",
                    f"probe {probe.served_by}/{probe.route_reason}; breaker {status['breaker']['state']}; "
                    f"service's gpu_recovery_s {status['gpu_recovery_s']}")

    def _wait_vram_back(self, need_mib: float) -> None:
        """Real GPU: the killed worker's memory shows up as free again."""
        before = self.client.status()["gpu"]["free_mib"] or 0.0
        try:
            self.client.wait_status(lambda s: (s["gpu"]["free_mib"] or 0.0) >= before + 0.75 * need_mib,
                                    15.0, interval=0.1, what="the killed worker's VRAM to come back")
        except DrillTimeout:
            pass  # NVML lagging is not the drill's business; the holder is sized from what it reads

    # ----- phase 8 ------------------------------------------------------------------------------------

    def _phase_gpu_worker_reset(self, phase: PhaseResult) -> None:
        reference = self._send(self._record(phase, "reference answer on the GPU", max_tokens=RESET_TOKENS,
                                            prompt_key="reset-story-json"), self._chat(STORY))
        if reference.served_by != "gpu":
            phase.notes.append(f"the reference answer came from {reference.served_by}; "
                               "the replayed answer is compared with nothing")
        for n, reset in enumerate(self.plan.resets, start=1):
            sig_name, mode = reset.split(":")
            sig = signal.Signals[sig_name]
            if mode == "json":
                self._reset_json(phase, n, sig)
            else:
                self._reset_stream(phase, n, sig)
            self._settle(phase)

    def _reset_json(self, phase: PhaseResult, n: int, sig: signal.Signals) -> None:
        victim = self._record(phase, f"reset {n}: JSON request, worker killed ({sig.name})", max_tokens=RESET_TOKENS,
                              prompt_key="reset-story-json")
        with ThreadPoolExecutor(1) as pool:
            done = self._send_in(pool, victim, self._chat(STORY))
            status = self._wait_running(victim.id, "gpu", min_tokens=1)
            fault = self._kill_gpu(phase, status, sig, victim.id, "GPU worker killed mid-generation")
            done.result()
        phase.check(f"reset {n}: replayed once on the CPU, whole answer",
                    self._answered(victim) and victim.served_by == "cpu" and victim.route_reason == "gpu_failed_replayed"
                    and victim.completion_tokens == RESET_TOKENS and victim.response_request_id == victim.id,
                    f"{victim.status} {victim.served_by}/{victim.route_reason}, {victim.completion_tokens} tokens "
                    f"(GPU had produced {fault['gpu_tokens_at_kill']} when killed)")

    def _reset_stream(self, phase: PhaseResult, n: int, sig: signal.Signals) -> None:
        key = f"{self.run_tag}-reset-{n}"
        victim = self._record(phase, f"reset {n}: stream, worker killed after {KILL_AFTER_STREAMED_TOKENS} tokens",
                              stream=True, max_tokens=RESET_TOKENS, idempotency_key=key, expect="error_event")
        streamed = threading.Event()

        def on_token(count: int) -> None:
            if count >= KILL_AFTER_STREAMED_TOKENS:
                streamed.set()

        with ThreadPoolExecutor(1) as pool:
            done = self._send_in(pool, victim, self._chat(STORY), on_token)
            if not streamed.wait(STATUS_WAIT_S):
                raise DrillTimeout(f"{victim.id} streamed no tokens")
            status = self.client.status()
            if victim.served_by != "gpu":
                phase.notes.append(f"reset {n}: the stream was served by {victim.served_by}; no worker was killed")
                done.result()
                return
            self._kill_gpu(phase, status, sig, victim.id, "GPU worker killed mid-stream")
            done.result()
        phase.check(f"reset {n}: the stream ended with an explicit gpu_worker_failed event",
                    victim.saw_error_event and victim.error_code == "gpu_worker_failed" and victim.transport_error is None,
                    f"{len(victim.output_tokens or [])} tokens, then {victim.error_code}; connection "
                    f"{'kept' if victim.transport_error is None else 'broken: ' + victim.transport_error}")
        # The error says it is safe to retry. A careful client retries with the
        # same Idempotency-Key, so that a retry can never run twice.
        same_key = self._record(phase, f"reset {n}: retry with the same Idempotency-Key", stream=True,
                                max_tokens=RESET_TOKENS, idempotency_key=key, retry_of=victim.id)
        self._send(same_key, self._chat(STORY))
        phase.check(f"reset {n}: a retry with the same Idempotency-Key gets an answer", self._answered(same_key),
                    f"{same_key.status}, idempotent replay: {same_key.idempotent_replay}, "
                    + ("answered" if self._answered(same_key) else f"got {same_key.error_code or 'no answer'}"))
        final = same_key
        if not self._answered(same_key):
            final = self._record(phase, f"reset {n}: retry with a new Idempotency-Key", stream=True,
                                 max_tokens=RESET_TOKENS, idempotency_key=f"{key}-new", retry_of=victim.id)
            self._send(final, self._chat(STORY))
        if self._answered(final) and victim.output_tokens:
            self.prefix_pairs.append({
                "partial_id": victim.id, "full_id": final.id, "partial": list(victim.output_tokens),
                "full": list(final.output_tokens or []), "partial_path": victim.served_by, "full_path": final.served_by,
            })

    # ----- phase 9 ------------------------------------------------------------------------------------

    def _phase_poison_request(self, phase: PhaseResult) -> None:
        """A request that crashes the worker serving it (a segfault, which is
        what bad input does to llama.cpp) is not replayed onto the CPU, is
        refused when retried, and costs the GPU worker one restart; the
        requests around it are all answered."""
        before = self.client.status()
        gpu_before = gpu_worker(before)
        cpu_before = next(w for w in before["workers"] if w["role"] == "cpu")
        poison_body = self._chat(STORY + " (poison)")
        poison = self._record(phase, "poison: the GPU worker segfaults serving it", max_tokens=RESET_TOKENS,
                              expect="error")
        # The traffic around it runs on the CPU: llama-server decodes its slots
        # together, so a crash is pinned on a request only when it was alone in
        # the process; with others inside, all of them are replayed instead
        # (tests/unit/test_dispatcher.py covers that case).
        normal = [self._record(phase, f"normal traffic #{i + 1}", stream=i % 2 == 1, forced_cpu=True,
                               max_tokens=8, prompt_key=f"poison-neighbour-{i}") for i in range(POISON_NEIGHBOURS)]
        with ThreadPoolExecutor(1 + len(normal)) as pool:
            done = self._send_in(pool, poison, poison_body)
            status = self._wait_running(poison.id, "gpu", min_tokens=1)
            neighbours = [self._send_in(pool, record, self._chat(SHORT_PROMPTS[i % len(SHORT_PROMPTS)]))
                          for i, record in enumerate(normal)]
            self._kill_gpu(phase, status, signal.SIGSEGV, poison.id, "GPU worker segfaults on one request")
            done.result()
            for neighbour in neighbours:
                neighbour.result()
        phase.check("the poison request failed with request_crashed_worker and was not replayed",
                    poison.error_code == "request_crashed_worker" and poison.route_reason != "gpu_failed_replayed",
                    f"{poison.status} {poison.error_code}, served by {poison.served_by}/{poison.route_reason}")
        retry = self._send(self._record(phase, "poison retried unchanged", max_tokens=RESET_TOKENS,
                                        expect="rejected", retry_of=poison.id), poison_body)
        phase.check("its unchanged retry is refused at once, no worker touched",
                    retry.error_code == "request_crashed_worker", f"{retry.status} {retry.error_code}")
        unanswered = [r.id for r in normal if not self._answered(r)]
        phase.check("every request around it was answered", not unanswered,
                    f"{len(normal) - len(unanswered)}/{len(normal)}" + (f"; not: {unanswered}" if unanswered else ""))
        after = self.client.wait_status(lambda s: gpu_worker(s)["state"] == "ready", RECOVERY_WAIT_S,
                                        interval=0.1, what="GPU worker back")
        cpu_after = next(w for w in after["workers"] if w["role"] == "cpu")
        restarts = gpu_worker(after)["restarts"] - gpu_before["restarts"]
        phase.check("the GPU worker restarted once and the CPU worker not at all",
                    restarts == 1 and cpu_after["pid"] == cpu_before["pid"],
                    f"GPU restarts: {restarts}; CPU pid {cpu_before['pid']} -> {cpu_after['pid']}")

    # ----- phase 10 -----------------------------------------------------------------------------------

    def _phase_other_app_takes_vram(self, phase: PhaseResult) -> None:
        """Another app (a real second process: a game starting) takes the GPU's
        memory while requests stream on it, holds it, then lets go. The GPU
        worker must finish or replay what runs, send new work to the CPU,
        unload and really release its VRAM, then reload once the memory has
        stayed free, with nothing lost or run twice."""
        from .vram_hog import OtherApp, crowding_mib

        before = self.client.status()
        yielding_before = before["gpu"]["residency"]["yield_to_other_apps"]
        duplicates_before = before["accounting"]["duplicate_executions"]
        self.client.admin_gpu({"yield_to_other_apps": True})
        app: OtherApp | None = None
        result: dict[str, Any] = {"app": OTHER_APP_NAME}
        phase.data["other_app"] = result
        try:
            streams = [self._record(phase, f"stream #{i + 1} running when the other app starts", stream=True,
                                    max_tokens=RESET_TOKENS, prompt_key=f"other-app-stream-{i}")
                       for i in range(OTHER_APP_STREAMS)]
            with ThreadPoolExecutor(len(streams)) as pool:
                done = [self._send_in(pool, record, self._chat(STORY)) for record in streams]
                self._wait_running(streams[0].id, "gpu", min_tokens=1)
                status = self.client.status()
                gpu = status["gpu"]
                take = crowding_mib(status)
                app = OtherApp(take, OTHER_APP_NAME,
                               simulated_dir=gpu.get("simulated_device_dir") if self.target.simulated else None)
                allocated_at = self.clock.now()
                result["took_mib"] = round(take, 1)
                # Its recovery runs from when the app lets go (cleared_s, set then).
                fault = {"phase": phase.number, "kind": "another app took the VRAM", "signal": None,
                         "pid": app.pid, "request_id": None, "at_s": round(allocated_at, 3),
                         "cleared_s": round(allocated_at, 3)}
                self.faults.append(fault)
                given = self.client.wait_status(
                    lambda s: s["gpu"]["residency"]["state"] == "given_away" and gpu_worker(s)["state"] == "stopped"
                    and s["gpu"]["residency"]["last_release_s"] is not None, RECOVERY_WAIT_S, interval=0.1,
                    what="the GPU worker to give its VRAM back")
                result["release_s"] = round(self.clock.now() - allocated_at, 3)
                result["service_release_s"] = given["gpu"]["residency"]["last_release_s"]
                # The settle time of this give-back (after the reload, /status
                # shows what the next one would get).
                result["settle_s"] = given["gpu"]["residency"]["settle_s"]
                for future in done:
                    future.result()
            residency = given["gpu"]["residency"]
            phase.check("the GPU names the app that took it",
                        residency["app"] == OTHER_APP_NAME and OTHER_APP_NAME in (given["degraded"]["reason"] or ""),
                        f"{residency['text']}; banner: {given['degraded']['reason']}")
            unanswered = [r.id for r in streams if not self._answered(r)]
            phase.check("the requests running when it came finished or were replayed", not unanswered,
                        ", ".join(f"{r.served_by}/{r.route_reason}: {r.outcome}" for r in streams))
            during = [self._send(self._record(phase, f"while the other app holds the VRAM #{i + 1}", max_tokens=8,
                                              prompt_key=f"other-app-during-{i}"),
                                 self._chat(SHORT_PROMPTS[i % len(SHORT_PROMPTS)]))
                      for i in range(REQUESTS_WHILE_HELD)]
            phase.check("new requests go to the CPU as gpu_yielded",
                        all(r.served_by == "cpu" and r.route_reason == "gpu_yielded" and self._answered(r)
                            for r in during),
                        ", ".join(f"{r.served_by}/{r.route_reason}" for r in during))
            time.sleep(OTHER_APP_HOLD_S)
            app.quit()
            let_go_at = self.clock.now()
            fault["cleared_s"] = round(let_go_at, 3)
            back = self.client.wait_status(
                lambda s: s["gpu"]["residency"]["state"] == "loaded" and gpu_worker(s)["state"] == "ready",
                RECOVERY_WAIT_S, interval=0.1, what="the GPU worker to reload")
            result["reload_s"] = round(self.clock.now() - let_go_at, 3)
            result["service_load_s"] = back["gpu"]["residency"]["last_load_s"]
            first = self._send(self._record(phase, "first request after the reload", max_tokens=8,
                                            prompt_key="other-app-after"), self._chat(SHORT_PROMPTS[0]))
            result["first_gpu_answer_after_let_go_s"] = round(self.clock.now() - let_go_at, 3)
            phase.check("the first request after the reload is served by the GPU",
                        first.served_by == "gpu" and self._answered(first), f"{first.served_by}/{first.route_reason}")
        finally:
            if app is not None:
                app.crash()
            self.client.admin_gpu({"yield_to_other_apps": yielding_before})
        self._check_nothing_lost(phase, result, duplicates_before)
        phase.notes.append(
            f"the other app took {result['took_mib']:.0f} MiB; VRAM released {result['release_s']:.2f} s after it "
            f"allocated (the service measured {result['service_release_s']:.2f} s); reloaded "
            f"{result['reload_s']:.2f} s after it let go (settle {result['settle_s']:g} s, load "
            f"{result['service_load_s']:.2f} s); first GPU answer {result['first_gpu_answer_after_let_go_s']:.2f} s "
            "after it let go")

    def _check_nothing_lost(self, phase: PhaseResult, result: dict[str, Any], duplicates_before: int) -> None:
        """The phase's invariant: every request it sent answered, none run twice."""
        mine = [r for r in self.records if r.phase == phase.key]
        result["lost"] = len([r for r in mine if not self._answered(r)])
        result["duplicated"] = self.client.status()["accounting"]["duplicate_executions"] - duplicates_before
        phase.check("no request lost or run twice", result["lost"] == 0 and result["duplicated"] == 0,
                    f"lost {result['lost']}, duplicated {result['duplicated']}", severity=INVARIANT)

    # ----- phase 11 -----------------------------------------------------------------------------------

    def _phase_second_model(self, phase: PhaseResult) -> None:
        """The library's second model loads on its first request, its CPU
        fallback answering meanwhile; then, with the default model unloaded
        and another app holding enough VRAM that both can't fit, a request
        for the default model unloads the idle second one to make room.
        Nothing is lost or run twice."""
        from .vram_hog import OtherApp

        before = self.client.status()
        default = before["service"]["model"]
        second = next(m["name"] for m in before["models"] if m["source"] != "default")
        duplicates_before = before["accounting"]["duplicate_executions"]
        result: dict[str, Any] = {"second_model": second}
        phase.data["second_model"] = result

        def model(status: Status, name: str) -> ModelSummary:
            return next(m for m in status["models"] if m["name"] == name)

        app: OtherApp | None = None
        try:
            self.client.admin_model(second, False)
            first = self._send(self._record(phase, f"first request for {second}", max_tokens=8,
                                            prompt_key="second-model-first"),
                               self._chat(SHORT_PROMPTS[0], model=second))
            phase.check(f"the first request for {second} is answered by its CPU fallback while its GPU loads",
                        self._answered(first) and first.served_by == "cpu" and first.route_reason == "gpu_loading",
                        f"{first.served_by}/{first.route_reason}: {first.outcome}")
            loading_from = self.clock.now()
            loaded = self.client.wait_status(lambda s: model(s, second)["gpu"] == "loaded", RECOVERY_WAIT_S,
                                             interval=0.1, what=f"{second} to load on the GPU")
            result["load_s"] = model(loaded, second)["last_load_s"]
            result["loaded_after_first_answer_s"] = round(self.clock.now() - loading_from, 3)
            with ThreadPoolExecutor(2) as pool:
                both = [self._record(phase, f"{name} with both loaded", max_tokens=8, prompt_key=f"both-{i}")
                        for i, name in enumerate((default, second))]
                done = [self._send_in(pool, record, self._chat(SHORT_PROMPTS[1], model=name))
                        for record, name in zip(both, (default, second))]
                for future in done:
                    future.result()
            phase.check("both models answer from the GPU at once",
                        all(r.served_by == "gpu" and self._answered(r) for r in both),
                        ", ".join(f"{r.served_by}/{r.route_reason}" for r in both))

            # Tight memory: the default model unloaded, another app holding enough that it can
            # only come back if the idle second model goes.
            loaded_status = self.client.status()
            held = model(loaded_status, default)["vram_mib"]
            free_loaded = loaded_status["gpu"]["free_mib"] or 0.0
            unloaded = self.client.admin_model(default, False)
            phase.check("the idle default model unloads on request", unloaded.status_code == 200, unloaded.text[:200])
            # Until the device reading shows its memory back (a reading lags an exit).
            status = self.client.wait_status(
                lambda s: model(s, default)["gpu"] == "unloaded_idle"
                and (s["gpu"]["free_mib"] or 0.0) >= free_loaded + 0.8 * held, STATUS_WAIT_S, interval=0.1,
                what="the default model's VRAM back")
            free = status["gpu"]["free_mib"] or 0.0
            need = model(status, default)["estimated_vram_mib"] + status["gpu"]["reserve_mib"]
            second_holds = model(status, second)["vram_mib"]
            take = max(0.0, free - need + second_holds / 2)
            app = OtherApp(take, OTHER_APP_NAME,
                           simulated_dir=status["gpu"].get("simulated_device_dir") if self.target.simulated else None)
            result["other_app_mib"] = round(take, 1)
            evictions_before = model(status, second)["evictions"]
            asked_at = self.clock.now()
            back = self._send(self._record(phase, f"{default} while memory is tight", max_tokens=8,
                                           prompt_key="second-model-tight"), self._chat(SHORT_PROMPTS[2]))
            reloaded = self.client.wait_status(lambda s: model(s, default)["gpu"] == "loaded", RECOVERY_WAIT_S,
                                               interval=0.1, what=f"{default} to load again")
            result["default_back_s"] = round(self.clock.now() - asked_at, 3)
            phase.check(f"{default} comes back by unloading the idle {second}, counting the other app's VRAM",
                        model(reloaded, second)["evictions"] == evictions_before + 1
                        and model(reloaded, second)["gpu"] != "loaded" and self._answered(back),
                        f"{second}: {model(reloaded, second)['gpu']}, evictions "
                        f"{model(reloaded, second)['evictions']}; {back.served_by}/{back.route_reason}")
            after = self._send(self._record(phase, f"{default} after it came back", max_tokens=8,
                                            prompt_key="second-model-after"), self._chat(SHORT_PROMPTS[0]))
            phase.check(f"{default} serves from the GPU again", after.served_by == "gpu" and self._answered(after),
                        f"{after.served_by}/{after.route_reason}")
        finally:
            if app is not None:
                app.quit()
        self._check_nothing_lost(phase, result, duplicates_before)
        phase.notes.append(
            f"{second} loaded {result.get('loaded_after_first_answer_s', 0):.2f} s after its first (CPU) answer "
            f"(the service measured {result.get('load_s') or 0:.2f} s); with another app holding "
            f"{result.get('other_app_mib', 0):.0f} MiB, {default} was back on the GPU "
            f"{result.get('default_back_s', 0):.2f} s after it was asked for")
