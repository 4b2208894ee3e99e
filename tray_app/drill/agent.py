"""Phase 5's agent: a client that runs a tool when the model asks for one.

The tool is a mock with a real-world shape: `issue_refund(order_id)`. It is
idempotent per tool-call id, the way payment APIs are: a response delivered
twice (an Idempotency-Key replay) carries the same call id and is absorbed.
What it counts is executions per logical action (one agent's refund); two
executions mean a second, fresh execution of the turn reached the client,
which is exactly the duplicated side effect the drill must never see.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

TOOL_NAME = "issue_refund"
TOOLS = [{
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Refund an order. Refunds move money: never issue one twice.",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "string", "description": "the order to refund"}},
            "required": ["order_id"],
        },
    },
}]
FORCE_TOOL = {"type": "function", "function": {"name": TOOL_NAME}}

# SmolLM2-135M is a weak tool caller: for some orders its forced call at
# temperature 0 runs on into text that isn't JSON (A-1003 and A-1008 do).
# These give JSON arguments; the drill tests the service, not the model, and
# a model that still gets it wrong is reported as a finding.
ORDER_IDS = ("A-1001", "A-1002", "A-1004", "A-1005", "A-1006", "A-1007", "A-1009", "A-1010")


class ToolLedger:
    """Counts executions of the mocked tool; thread-safe (agents run in parallel)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen_call_ids: set[str] = set()
        self.executions: dict[str, int] = {}
        self.log: list[dict[str, Any]] = []

    def run(self, action: str, call_id: str | None, arguments: str, request_id: str) -> dict[str, Any]:
        """Execute the tool for one call. A call with arguments that aren't
        JSON still reaches the refund endpoint (which refuses it): it counts."""
        with self._lock:
            if call_id and call_id in self._seen_call_ids:
                # The same call delivered again (a replay): the tool absorbs it.
                self.log.append({"action": action, "call_id": call_id, "request_id": request_id, "executed": False})
                return {"status": "already_done", "call_id": call_id}
            if call_id:
                self._seen_call_ids.add(call_id)
            self.executions[action] = self.executions.get(action, 0) + 1
            try:
                json.loads(arguments)
                status = "refunded"
            except ValueError:
                status = "refused: the arguments are not JSON"
            self.log.append({"action": action, "call_id": call_id, "request_id": request_id, "executed": True,
                             "arguments": arguments, "status": status})
            return {"status": status, "call_id": call_id, "execution": self.executions[action]}


@dataclass
class ToolCallCheck:
    """What the agent made of one tool call it received."""

    name_ok: bool
    arguments_ok: bool
    anomaly: str | None = None


def check_tool_call(call: dict[str, Any]) -> ToolCallCheck:
    """Is this a call of our tool with JSON arguments?

    llama-cpp-python repeats the function name in every streamed delta, while
    the OpenAI format sends it once; a client that appends fragments, as the
    format says, ends up with the name N times over. That is reported as an
    anomaly (a finding in the report), and the call is still recognised,
    because it is a naming quirk, not a second call.
    """
    name = call.get("name") or ""
    anomaly = None
    name_ok = name == TOOL_NAME
    if not name_ok and name and len(name) % len(TOOL_NAME) == 0 and name == TOOL_NAME * (len(name) // len(TOOL_NAME)):
        name_ok = True
        anomaly = f"the function name arrived {len(name) // len(TOOL_NAME)} times over ({name[:40]}...)"
    try:
        json.loads(call.get("arguments") or "")
        arguments_ok = True
    except ValueError:
        arguments_ok = False
    return ToolCallCheck(name_ok, arguments_ok, anomaly)


@dataclass
class AgentRun:
    agent: str
    order_id: str
    stream: bool
    request_ids: list[str] = field(default_factory=list)
    final_answer: str | None = None
    failure: str | None = None
    anomalies: list[str] = field(default_factory=list)       # the wire format (a finding)
    model_mistakes: list[str] = field(default_factory=list)  # the model's own output (a finding)

    def to_dict(self) -> dict[str, Any]:
        return {"agent": self.agent, "order_id": self.order_id, "stream": self.stream,
                "request_ids": self.request_ids, "final_answer": self.final_answer, "failure": self.failure,
                "anomalies": self.anomalies, "model_mistakes": self.model_mistakes}


def first_turn_messages(order_id: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"Order {order_id} arrived broken. Please refund order {order_id}."}]


def second_turn_messages(order_id: str, call: dict[str, Any], result: dict[str, Any]) -> list[dict[str, Any]]:
    call_id = call.get("id") or "call_0"
    return first_turn_messages(order_id) + [
        # content "" rather than null: llama-cpp-python's request model and the
        # chat template both reject an assistant message whose content is null.
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": TOOL_NAME, "arguments": call.get("arguments") or "{}"}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)},
    ]
