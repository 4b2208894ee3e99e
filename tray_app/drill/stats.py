"""The drill's arithmetic, on plain values: percentiles, outcome accounting,
duplicates, token agreement and degraded-status intervals.

Nothing here does I/O or knows about HTTP clients; every function takes
lists, dicts and numbers, so each number in the report can be checked by a
unit test on hand-made values.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Codes the service answers at admission, before anything runs: a request
# refused with one of these was never accepted, so it can't be lost.
ADMISSION_REJECTION_CODES = frozenset({
    "cpu_queue_full", "ram_floor", "deadline_too_short", "cpu_context_cap", "context_length_exceeded",
    "no_worker", "invalid_json", "invalid_type", "invalid_value", "invalid_header", "missing_field",
    "too_many_messages", "unsupported_parameter", "invalid_messages", "model_not_found", "body_too_large",
    "duplicate_request_id", "idempotency_key_reused", "request_crashed_worker",
})

# What a request ended as, from the client's side.
OK, REJECTED, CANCELED, ERROR, LOST = "ok", "rejected", "canceled", "error", "lost"


# ----- percentiles ----------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile: the smallest value with at least q% of the
    values at or below it. None for no values. Nearest-rank never invents a
    latency nobody saw, which interpolation does with few samples."""
    if not 0 < q <= 100:
        raise ValueError(f"q must be in (0, 100], got {q}")
    ordered = sorted(values)
    if not ordered:
        return None
    rank = math.ceil(q / 100 * len(ordered))
    return ordered[max(rank, 1) - 1]


def latency_summary(latencies: Sequence[float]) -> dict[str, Any]:
    return {
        "n": len(latencies),
        "p50_s": _round(percentile(latencies, 50)),
        "p95_s": _round(percentile(latencies, 95)),
        "max_s": _round(max(latencies)) if latencies else None,
    }


def latency_by_path(records: Iterable[Mapping[str, Any]], field: str = "latency_s") -> dict[str, dict[str, Any]]:
    """p50/p95 of `field` per serving path, over requests that got an answer."""
    by_path: dict[str, list[float]] = {}
    for record in records:
        value = record.get(field)
        if record.get("outcome") != OK or value is None or record.get("idempotent_replay"):
            continue
        by_path.setdefault(record.get("served_by") or "unknown", []).append(value)
    return {path: latency_summary(values) for path, values in sorted(by_path.items())}


# ----- outcome accounting ---------------------------------------------------------


def answer_kind(*, status: int | None, stream: bool, saw_done: bool, saw_error_event: bool,
                body_ok: bool, error_code: str | None, transport_error: str | None) -> str:
    """What the client ended up holding: "answer", "clean_error" or "none".

    A clean error is one the client can act on: an HTTP error with the OpenAI
    envelope, or an SSE error event. Anything else (a reset connection, a
    stream that stops without [DONE] or an error event, a body that isn't the
    promised JSON) leaves the client with nothing: "none".
    """
    if status is None:
        return "none"
    if status == 200:
        if stream:
            if saw_error_event:
                return "clean_error"
            return "answer" if saw_done and transport_error is None else "none"
        return "answer" if body_ok and transport_error is None else "none"
    return "clean_error" if error_code else "none"


def was_accepted(*, status: int | None, error_code: str | None, decision_routes: Sequence[str],
                 seen_in_flight: bool) -> bool:
    """Whether the service took the request on (so it owes an answer or a clean error).

    The service's own decisions are the best evidence: any non-"reject" route
    for this id means it was admitted. Without them, an admission rejection
    code means it was refused. A request that left no evidence either way
    counts as accepted, so a silent failure shows up as lost rather than
    disappearing into "rejected".
    """
    if seen_in_flight or any(route != "reject" for route in decision_routes):
        return True
    if decision_routes:
        return False
    if status is not None and status >= 400 and error_code in ADMISSION_REJECTION_CODES:
        return False
    return True


def outcome(*, accepted: bool, kind: str, error_code: str | None) -> str:
    if not accepted:
        return REJECTED
    if kind == "answer":
        return OK
    if kind == "clean_error":
        return CANCELED if error_code == "request_canceled" else ERROR
    return LOST


def success_summary(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    counts = {OK: 0, REJECTED: 0, CANCELED: 0, ERROR: 0, LOST: 0}
    for record in records:
        counts[record["outcome"]] = counts.get(record["outcome"], 0) + 1
    accepted = counts[OK] + counts[CANCELED] + counts[ERROR] + counts[LOST]
    return {
        "sent": sum(counts.values()),
        "accepted": accepted,
        "answered": counts[OK],
        "rejected": counts[REJECTED],
        "canceled": counts[CANCELED],
        "clean_errors": counts[ERROR],
        "lost": counts[LOST],
        # Of the requests the service took on, the share that got an answer.
        "success_rate": round(counts[OK] / accepted, 4) if accepted else None,
    }


# ----- duplicates -------------------------------------------------------------------


def find_duplicates(records: Sequence[Mapping[str, Any]],
                    completed_attempts_by_id: Mapping[str, int]) -> list[dict[str, Any]]:
    """Every sign that one request was executed (or delivered) more than once.

    - the service showed more than one completed attempt for one id;
    - more than one fresh (not X-Idempotent-Replay) answer for one Idempotency-Key;
    - a replay under an Idempotency-Key whose output differs from the original's;
    - a stream that delivered more tokens than max_tokens (two runs in one stream).
    """
    found: list[dict[str, Any]] = []
    for request_id, completed in sorted(completed_attempts_by_id.items()):
        if completed > 1:
            found.append({"kind": "completed_twice", "id": request_id,
                          "detail": f"/status showed {completed} completed attempts for {request_id}"})
    by_key: dict[str, list[Mapping[str, Any]]] = {}
    for record in records:
        if record.get("idempotency_key") and record.get("outcome") == OK:
            by_key.setdefault(record["idempotency_key"], []).append(record)
    for key, group in sorted(by_key.items()):
        fresh = [r for r in group if not r.get("idempotent_replay")]
        if len(fresh) > 1:
            found.append({"kind": "idempotency_key_ran_twice", "id": key,
                          "detail": f"{len(fresh)} fresh answers for Idempotency-Key {key}: "
                                    + ", ".join(r["id"] for r in fresh)})
        if fresh:
            original = _output_of(fresh[0])
            for replay in (r for r in group if r.get("idempotent_replay")):
                if _output_of(replay) != original:
                    found.append({"kind": "replay_differs", "id": replay["id"],
                                  "detail": f"the replay for Idempotency-Key {key} differs from the original answer"})
    for record in records:
        tokens = record.get("output_tokens")
        limit = record.get("max_tokens")
        if record.get("stream") and tokens is not None and limit and len(tokens) > limit:
            found.append({"kind": "stream_overran", "id": record["id"],
                          "detail": f"{len(tokens)} tokens streamed for max_tokens {limit}"})
    return found


def _output_of(record: Mapping[str, Any]) -> Any:
    return record.get("output_text"), record.get("tool_calls_signature")


def tool_runs_twice(executions: Mapping[str, int]) -> list[str]:
    """Logical side effects (one per agent action) that ran more than once."""
    return sorted(key for key, count in executions.items() if count > 1)


# ----- token agreement ----------------------------------------------------------------


@dataclass(frozen=True)
class Agreement:
    compared: int   # token positions compared
    agreeing: int   # positions that agree (the common prefix: after a divergence nothing lines up)
    identical: bool

    @property
    def rate(self) -> float | None:
        return None if self.compared == 0 else self.agreeing / self.compared


def common_prefix_len(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare_outputs(reference: Sequence[Any], other: Sequence[Any]) -> Agreement:
    """Two complete answers to the same prompt at temperature 0."""
    agreeing = common_prefix_len(reference, other)
    compared = max(len(reference), len(other))
    return Agreement(compared, agreeing, identical=list(reference) == list(other))


def compare_prefix(partial: Sequence[Any], full: Sequence[Any]) -> Agreement:
    """A stream cut short by a GPU failure against a complete answer: the
    partial tokens must be the start of the complete ones."""
    agreeing = common_prefix_len(partial, full)
    return Agreement(len(partial), agreeing, identical=agreeing == len(partial) and len(partial) <= len(full))


def agreement_summary(agreements: Sequence[Agreement]) -> dict[str, Any]:
    compared = sum(a.compared for a in agreements)
    agreeing = sum(a.agreeing for a in agreements)
    return {
        "pairs": len(agreements),
        "identical_pairs": sum(1 for a in agreements if a.identical),
        "tokens_compared": compared,
        "tokens_agreeing": agreeing,
        "token_agreement": round(agreeing / compared, 4) if compared else None,
    }


# ----- degraded-status visibility ----------------------------------------------------------


def degraded_intervals(samples: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Group consecutive /status samples in which a CPU-served request with a
    GPU-out reason was in flight, and say for each group whether
    degraded.active was true in every one of its samples.

    Each sample: {"t": seconds, "cpu_gpu_out": bool, "degraded_active": bool}.
    A sample that failed to arrive (no "cpu_gpu_out" key) ends a group: we
    can't claim visibility for time we didn't look at, nor invent a gap.
    """
    intervals: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for sample in samples:
        if sample.get("cpu_gpu_out"):
            if current is None:
                current = {"start_s": sample["t"], "end_s": sample["t"], "samples": 0, "visible_samples": 0,
                           "invisible_at_s": []}
                intervals.append(current)
            current["end_s"] = sample["t"]
            current["samples"] += 1
            if sample.get("degraded_active"):
                current["visible_samples"] += 1
            else:
                current["invisible_at_s"].append(sample["t"])
        else:
            current = None
    for interval in intervals:
        interval["visible"] = interval["visible_samples"] == interval["samples"]
    return intervals


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


# ----- expectations, agreement pairs, recovery ---------------------------------------------


def meets_expectation(expect: str, result: str) -> bool:
    """Did a request end the way its phase designed it to?"""
    allowed = {
        "answer": {OK},
        "answer_or_rejected": {OK, REJECTED},
        "canceled": {CANCELED},
        "error_event": {ERROR},
        "error": {ERROR},
        "rejected": {REJECTED},
        "any": {OK, REJECTED, CANCELED, ERROR, LOST},
    }
    return result in allowed.get(expect, {OK})


def _visible_answer(record: Mapping[str, Any]) -> tuple[str, str]:
    """An answer as the user sees it: text, and tool calls without their
    per-execution call ids (two runs of one prompt get different ids)."""
    calls = [(c.get("name"), c.get("arguments")) for c in record.get("tool_calls") or ()]
    return record.get("output_text") or "", repr(calls)


def agreement_pairs(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """GPU-vs-CPU pairs: answers to one prompt_key (same prompt, same
    parameters, temperature 0) that one path and the other served. Streamed
    pairs are compared token by token; JSON answers by their text."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for record in records:
        if (record.get("outcome") == OK and record.get("prompt_key") and not record.get("idempotent_replay")
                and record.get("served_by") in ("gpu", "cpu")):
            groups.setdefault(record["prompt_key"], []).append(record)
    pairs: list[dict[str, Any]] = []
    for key, group in sorted(groups.items()):
        on_gpu = [r for r in group if r["served_by"] == "gpu"]
        on_cpu = [r for r in group if r["served_by"] == "cpu"]
        if not on_gpu:
            continue
        reference = on_gpu[0]
        for other in on_cpu:
            if reference.get("output_tokens") is not None and other.get("output_tokens") is not None:
                agreement = compare_outputs(reference["output_tokens"], other["output_tokens"])
                by = "tokens"
            else:
                agreement = Agreement(0, 0, identical=_visible_answer(reference) == _visible_answer(other))
                by = "text"
            pairs.append({"prompt_key": key, "gpu_id": reference["id"], "cpu_id": other["id"], "by": by,
                          "identical": agreement.identical, "tokens_compared": agreement.compared,
                          "tokens_agreeing": agreement.agreeing})
    return pairs


def agreement_report(pairs: Sequence[Mapping[str, Any]], prefix_pairs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The numbers over full-answer pairs and cut-short-stream pairs together."""
    agreements = [Agreement(p["tokens_compared"], p["tokens_agreeing"], p["identical"]) for p in pairs]
    for prefix in prefix_pairs:
        agreements.append(compare_prefix(prefix["partial"], prefix["full"]))
    summary = agreement_summary(agreements)
    summary["text_pairs"] = sum(1 for p in pairs if p["by"] == "text")
    summary["prefix_pairs"] = len(prefix_pairs)
    return summary


def recovery_times(faults: Sequence[Mapping[str, Any]], samples: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """For each fault: seconds from the moment it was over (the kill, or the
    memory given back) until /status showed the GPU path serving again
    (worker ready, breaker closed, no out reason). The outage must have been
    seen first, or a sample taken before the service noticed would count as
    an instant recovery."""
    seen = [s for s in samples if "gpu_worker_state" in s]
    results = []
    for fault in faults:
        after = [s for s in seen if s["t"] >= fault["at_s"]]
        out_at = next((i for i, s in enumerate(after) if not _gpu_serving(s)), None)
        back = None
        if out_at is not None:
            back = next((s for s in after[out_at:] if s["t"] >= fault["cleared_s"] and _gpu_serving(s)), None)
        results.append({
            **{k: fault[k] for k in ("phase", "kind", "signal", "at_s", "cleared_s") if k in fault},
            "outage_seen": out_at is not None,
            "recovered_at_s": back["t"] if back else None,
            "recovery_s": round(back["t"] - fault["cleared_s"], 3) if back else None,
            "service_gpu_recovery_s": back.get("gpu_recovery_s") if back else None,
        })
    return results


def _gpu_serving(sample: Mapping[str, Any]) -> bool:
    return (sample.get("gpu_path_out") is None and sample.get("breaker") == "closed"
            and sample.get("gpu_worker_state") == "ready")


def extreme(samples: Sequence[Mapping[str, Any]], field: str, pick=max) -> dict[str, Any] | None:
    """The largest (or smallest) value of `field` over samples, and when."""
    values = [(s[field], s["t"]) for s in samples if s.get(field) is not None]
    if not values:
        return None
    value, t = pick(values, key=lambda pair: pair[0])
    return {"value": value, "at_s": t}
