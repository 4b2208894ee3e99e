"""What the drill writes down: one record per request, one result per phase."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

INVARIANT = "invariant"      # lost / duplicated / tool run twice: exit code 1
EXPECTATION = "expectation"  # the service did something other than designed: exit code 3
FINDING = "finding"          # worth knowing, not a failure of the drill (e.g. a protocol quirk)


@dataclass
class RequestRecord:
    id: str
    phase: str
    label: str
    kind: str                      # "chat" | "completion"
    stream: bool
    max_tokens: int
    # Requests with the same prompt_key sent the same prompt and parameters at
    # temperature 0, so their answers must agree whichever path served them.
    prompt_key: str | None = None
    forced_cpu: bool = False
    idempotency_key: str | None = None
    # What the phase designed this request to end as: "answer", "answer_or_rejected",
    # "canceled", "error_event" or "any".
    expect: str = "answer"
    # The request this one retries, when the client retried after a failure.
    retry_of: str | None = None

    started_s: float = 0.0         # seconds since the drill started
    ended_s: float | None = None
    latency_s: float | None = None
    ttft_s: float | None = None

    status: int | None = None
    response_request_id: str | None = None
    served_by: str | None = None
    route_reason: str | None = None
    fallback_model: str | None = None
    estimated_latency: str | None = None
    queue_wait_s: float | None = None
    retry_after: str | None = None
    idempotent_replay: bool = False

    saw_done: bool = False
    saw_error_event: bool = False
    body_ok: bool = False
    transport_error: str | None = None
    error_code: str | None = None
    error_message: str | None = None

    output_text: str = ""
    output_tokens: list[str] | None = None   # one entry per SSE event that carried a token
    prompt_tokens: int | None = None         # from `usage` (JSON answers only)
    completion_tokens: int | None = None
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_calls_signature: str | None = None

    # Filled in after the run, from the client's facts and the /status samples.
    accepted: bool | None = None
    outcome: str | None = None
    connection_survived: bool | None = None
    first_failure: str | None = None
    retry_decision: str | None = None
    cpu_started_s: float | None = None
    cpu_started_source: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Check:
    name: str
    severity: str
    passed: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class PhaseResult:
    number: int
    key: str
    title: str
    started_s: float = 0.0
    ended_s: float = 0.0
    skipped: str | None = None
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def check(self, name: str, passed: bool, detail: str, severity: str = EXPECTATION) -> bool:
        self.checks.append(Check(name, severity, bool(passed), detail))
        return bool(passed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "number": self.number, "key": self.key, "title": self.title,
            "started_s": round(self.started_s, 3), "ended_s": round(self.ended_s, 3),
            "skipped": self.skipped, "checks": [c.to_dict() for c in self.checks],
            "notes": list(self.notes), "data": self.data,
        }
