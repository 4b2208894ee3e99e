"""Phase 5: agents with a counted mock tool; with fault injection, the first
agent's tool-call turn has its GPU worker killed under it."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..agent import (
    FORCE_TOOL, ORDER_IDS, TOOLS, AgentRun, check_tool_call, first_turn_messages, second_turn_messages,
)
from ..client import DrillTimeout
from ..records import FINDING, INVARIANT, PhaseResult
from ..session import DrillSession, answered

AGENT_TOOL_TOKENS = 64
AGENT_ANSWER_TOKENS = 32


def agent_tools(drill: DrillSession, phase: PhaseResult) -> None:
    agents = list(range(drill.plan.agents))
    if drill.target.can_inject and agents:
        # The first agent runs alone so its turn is on the GPU when the worker dies.
        drill.agent_runs.append(_agent(drill, phase, agents[0], kill_first_turn=True))
        drill.settle(phase)
        agents = agents[1:]
    with ThreadPoolExecutor(max(1, len(agents))) as pool:
        for run in pool.map(lambda i: _agent(drill, phase, i), agents):
            drill.agent_runs.append(run)
    runs = list(drill.agent_runs)
    executions = drill.ledger.executions
    missing = [r.agent for r in runs if executions.get(_action(r), 0) == 0]
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
    phase.data["tool_log"] = list(drill.ledger.log)


def _action(run: AgentRun) -> str:
    return f"{run.agent}: refund {run.order_id}"


def _agent(drill: DrillSession, phase: PhaseResult, i: int, kill_first_turn: bool = False) -> AgentRun:
    run = AgentRun(agent=f"agent-{i + 1}", order_id=ORDER_IDS[i % len(ORDER_IDS)],
                   stream=i % 2 == 1 and not kill_first_turn)
    mode = "stream" if run.stream else "json"
    key = f"{drill.run_tag}-{run.agent}"
    body = {"messages": first_turn_messages(run.order_id), "tools": TOOLS, "tool_choice": FORCE_TOOL,
            "temperature": 0}
    first = drill.record(phase, f"{run.agent} turn 1", stream=run.stream, max_tokens=AGENT_TOOL_TOKENS,
                         idempotency_key=f"{key}-turn1", prompt_key=f"agent-{run.order_id}-turn1-{mode}")
    again = drill.record(phase, f"{run.agent} turn 1 resent (client retry)", stream=run.stream,
                         max_tokens=AGENT_TOOL_TOKENS, idempotency_key=f"{key}-turn1", retry_of=first.id)
    with ThreadPoolExecutor(2) as pool:
        first_done = drill.send_in(pool, first, body)
        if kill_first_turn:
            try:
                status = drill.wait_running(first.id, "gpu", timeout=30)
                drill.kill_gpu(phase, status, signal.SIGKILL, first.id, "GPU worker killed during an agent turn")
            except DrillTimeout:
                phase.notes.append(f"{first.id} was not seen running on the GPU; no worker was killed")
        else:
            time.sleep(0.15)
        again_done = drill.send_in(pool, again, body)
        responses = [first_done.result(), again_done.result()]
    run.request_ids += [r.id for r in responses]
    calls: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for record in responses:
        if not answered(record):
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
            calls.append((call, drill.ledger.run(_action(run), call.get("id"), call["arguments"], record.id)))
    if kill_first_turn and first.served_by == "cpu":
        phase.check("the killed agent turn was replayed or continued on the CPU",
                    first.route_reason in ("gpu_failed_replayed", "gpu_failed_resumed"),
                    f"{first.id}: {first.served_by}/{first.route_reason}")
    elif kill_first_turn:
        phase.notes.append(f"{first.id} finished on the {first.served_by} before the kill landed; nothing to replay")
    if not calls:
        run.failure = run.failure or "no usable tool call in turn 1 (" + ", ".join(
            f"{r.id}: {r.status} {r.error_code or ''}" for r in responses) + ")"
        return run
    call, result = calls[0]
    second = drill.record(phase, f"{run.agent} turn 2", stream=run.stream, max_tokens=AGENT_ANSWER_TOKENS,
                          idempotency_key=f"{key}-turn2", prompt_key=f"agent-{run.order_id}-turn2-{mode}")
    drill.send(second, {"messages": second_turn_messages(run.order_id, call, result), "tools": TOOLS,
                        "tool_choice": "none", "temperature": 0})
    run.request_ids.append(second.id)
    if answered(second):
        run.final_answer = second.output_text
    else:
        run.failure = f"turn 2 ({second.id}) ended with {second.status} {second.error_code or second.transport_error}"
    return run
