"""From what the drill saw to the report: per-request accounting, the
numbers, the checks and the verdict. Plain data in, plain data out; no I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from . import stats
from .records import EXPECTATION, FINDING, INVARIANT
from .units import percent

REPORT_VERSION = 1
# Route reasons under which the CPU serves because the GPU path can't (the
# service's GPU_OUT_REASONS): such an answer must say so in its headers.
GPU_OUT_ROUTE_REASONS = frozenset({
    "gpu_unavailable", "gpu_context_cap", "gpu_vram_headroom", "gpu_busy", "gpu_failed_replayed",
    "gpu_failed_resumed", "forced_cpu",
})
# The /status samples go into report.json as one row per sample under these
# columns: thousands of samples as objects would dwarf everything else.
SAMPLE_FIELDS = ("t", "degraded_active", "cpu_gpu_out", "in_flight", "ram_available_mib", "gpu_free_mib",
                 "gpu_path_out", "breaker", "gpu_worker_state", "gpu_queue_oldest_s", "cpu_queue_oldest_s", "error")


def enrich_records(records: Sequence[dict[str, Any]], monitor: Mapping[str, Any], wall_t0: float) -> list[dict[str, Any]]:
    """Add to each client-side record what only the service could tell:
    whether it was accepted, its first failure, the retry decision and when
    the CPU started on it; then classify its outcome."""
    decisions: dict[str, list[Mapping[str, Any]]] = {}
    for decision in monitor.get("decisions") or ():
        decisions.setdefault(decision.get("id"), []).append(decision)
    failures: dict[str, str] = {}
    replays: dict[str, float] = {}
    for event in monitor.get("events") or ():
        if event.get("kind") == "gpu_failure" and event.get("id"):
            failures.setdefault(event["id"], event.get("reason"))
        if event.get("kind") == "replay" and event.get("id"):
            replays.setdefault(event["id"], round(event["t"] - wall_t0, 3))
    traces = monitor.get("traces") or {}
    retried_as = {r["retry_of"]: r["id"] for r in records if r.get("retry_of")}

    enriched = []
    for original in sorted(records, key=lambda r: r["started_s"]):
        record = dict(original)
        trace = traces.get(record["id"])
        own_decisions = decisions.get(record["id"], [])
        kind = stats.answer_kind(
            status=record["status"], stream=record["stream"], saw_done=record["saw_done"],
            saw_error_event=record["saw_error_event"], body_ok=record["body_ok"], error_code=record["error_code"],
            transport_error=record["transport_error"])
        record["accepted"] = stats.was_accepted(
            status=record["status"], error_code=record["error_code"],
            decision_routes=[d.get("route") for d in own_decisions], seen_in_flight=trace is not None)
        record["outcome"] = stats.outcome(accepted=record["accepted"], kind=kind, error_code=record["error_code"])
        # The connection survived when the client got a whole HTTP answer: a
        # complete body, or a stream closed by [DONE] or an error event.
        record["connection_survived"] = record["transport_error"] is None and (
            not record["stream"] or record["status"] != 200 or record["saw_done"] or record["saw_error_event"])
        record["first_failure"] = (
            (trace or {}).get("first_failure") or failures.get(record["id"])
            or (record["error_message"] if record["outcome"] in (stats.ERROR, stats.LOST) else None)
            or record["transport_error"])
        record["retry_decision"] = _retry_decision(record, own_decisions, record["id"] in replays,
                                                   retried_as.get(record["id"]))
        record["cpu_started_s"], record["cpu_started_source"] = _cpu_start(record, trace, replays.get(record["id"]))
        record["decisions"] = [{"route": d.get("route"), "reason": d.get("reason")} for d in own_decisions]
        enriched.append(record)
    return enriched


def _retry_decision(record: Mapping[str, Any], decisions: Sequence[Mapping[str, Any]], replayed: bool,
                    retried_as: str | None) -> str:
    if record["idempotent_replay"]:
        text = "none: answered with the first result for its Idempotency-Key (X-Idempotent-Replay)"
    elif record["route_reason"] == "gpu_failed_resumed":
        text = ("continued once on the CPU (gpu_failed_resumed): the GPU failed partway through a plain answer, "
                "and the CPU went on from the text it had made")
    elif replayed or record["route_reason"] == "gpu_failed_replayed":
        text = "replayed once on the CPU (gpu_failed_replayed): the GPU failed before any byte reached the client"
    elif record["error_code"] == "gpu_worker_failed":
        text = "not replayed: part of the answer had reached the client, so the stream ended with gpu_worker_failed"
    elif len(decisions) > 1:
        text = f"re-routed before it ran: {decisions[-1].get('reason')} ({decisions[-1].get('detail')})"
    else:
        text = "none needed"
    if retried_as:
        text += f"; the client retried it as {retried_as}"
    return text


def _cpu_start(record: Mapping[str, Any], trace: Mapping[str, Any] | None,
               replay_at: float | None) -> tuple[float | None, str | None]:
    if trace and trace.get("cpu_running_s") is not None:
        return trace["cpu_running_s"], "status sample"
    if record["idempotent_replay"] or record["served_by"] != "cpu":
        return None, None
    if replay_at is not None:
        return replay_at, "replay event"
    if record["outcome"] == stats.OK:
        # Ran and finished between two samples: the client's clock plus the queue wait it was told.
        return round(record["started_s"] + (record["queue_wait_s"] or 0.0), 3), "estimate: sent + X-Queue-Wait"
    return None, None


def build_report(*, records: Sequence[dict[str, Any]], phases: Sequence[dict[str, Any]], monitor: Mapping[str, Any],
                 faults: Sequence[dict[str, Any]], prefix_pairs: Sequence[dict[str, Any]],
                 tool_executions: Mapping[str, int], run: Mapping[str, Any]) -> dict[str, Any]:
    """Everything report.json holds. `records` are already enriched."""
    samples = [s for s in monitor.get("samples") or ()]
    good_samples = [s for s in samples if "error" not in s]
    success = stats.success_summary(records)
    lost = [{"id": r["id"], "phase": r["phase"], "label": r["label"], "why": r["first_failure"]}
            for r in records if r["outcome"] == stats.LOST]
    completed = {request_id: trace.get("max_completed_attempts", 0)
                 for request_id, trace in (monitor.get("traces") or {}).items()}
    duplicates = stats.find_duplicates(records, completed)
    ran_twice = stats.tool_runs_twice(tool_executions)
    pairs = stats.agreement_pairs(records)
    cross_prefix = [p for p in prefix_pairs if p.get("partial_path") != p.get("full_path")]
    agreement = stats.agreement_report(pairs, cross_prefix)
    intervals = stats.degraded_intervals(samples)  # a failed sample ends an interval
    headerless = [r["id"] for r in records
                  if r["outcome"] == stats.OK and r["served_by"] == "cpu" and not r["idempotent_replay"]
                  and r["route_reason"] in GPU_OUT_ROUTE_REASONS
                  and not (r["fallback_model"] and r["estimated_latency"])]
    cpu_degraded_answers = sum(1 for r in records if r["outcome"] == stats.OK and r["served_by"] == "cpu"
                               and r["route_reason"] in GPU_OUT_ROUTE_REASONS and not r["idempotent_replay"])
    recoveries = stats.recovery_times(faults, good_samples)
    oldest = {lane: stats.extreme([{"t": s["t"], "v": (s.get("queue_oldest_s") or {}).get(lane)} for s in good_samples], "v")
              for lane in ("gpu", "cpu")}
    min_ram = stats.extreme(good_samples, "ram_available_mib", pick=min)
    numbers = {
        "success": success,
        "lost_requests": len(lost),
        "lost": lost,
        "duplicated_side_effects": len(duplicates) + len(ran_twice),
        "duplicates": duplicates,
        "tool_calls_ran_twice": ran_twice,
        "tool_executions": dict(tool_executions),
        "token_agreement": agreement,
        "agreement_pairs": pairs,
        "latency_by_path": stats.latency_by_path(records),
        "ttft_by_path": stats.latency_by_path([r for r in records if r["stream"]], field="ttft_s"),
        "oldest_queue_age_s": oldest,
        "min_available_ram_mib": min_ram,
        "gpu_recovery": recoveries,
        "failover_by_fault": failover_by_fault(monitor.get("events") or ()),
        "degraded": {
            "intervals": intervals,
            "visible_intervals": sum(1 for i in intervals if i["visible"]),
            "samples_in_intervals": sum(i["samples"] for i in intervals),
            "cpu_answers_for_gpu_out_reasons": cpu_degraded_answers,
            "cpu_answers_without_fallback_headers": headerless,
            "failed_status_samples": monitor.get("failed_samples", 0),
        },
    }
    checks = global_checks(records, numbers)
    phase_rows = [_phase_row(phase, records) for phase in phases]
    all_checks = checks + [c for phase in phase_rows for c in phase["checks"]]
    verdict, exit_code = decide_verdict(all_checks)
    return {
        "report_version": REPORT_VERSION,
        "verdict": verdict,
        "exit_code": exit_code,
        "run": dict(run),
        "numbers": numbers,
        "checks": checks,
        "phases": phase_rows,
        "faults": list(faults),
        "prefix_pairs": [{k: v for k, v in p.items() if k not in ("partial", "full")}
                         | {"agreement": stats.compare_prefix(p["partial"], p["full"]).__dict__} for p in prefix_pairs],
        "requests": list(records),
        "samples": {"fields": list(SAMPLE_FIELDS), "rows": [_sample_row(s) for s in samples]},
        "service_events": list(monitor.get("events") or ()),
    }


def failover_by_fault(events: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The service's failover times (its "failover" events: a GPU fault to
    the replay's first token on the CPU), per kind of fault."""
    times: dict[str, list[float]] = {}
    for event in events:
        if event.get("kind") == "failover" and isinstance(event.get("seconds"), (int, float)):
            times.setdefault(str(event.get("fault")), []).append(float(event["seconds"]))
    return {fault: {"n": len(values), "p50_s": stats.percentile(values, 50), "max_s": max(values)}
            for fault, values in sorted(times.items())}


def _sample_row(sample: Mapping[str, Any]) -> list[Any]:
    oldest = sample.get("queue_oldest_s") or {}
    flat = {**sample, "gpu_queue_oldest_s": oldest.get("gpu"), "cpu_queue_oldest_s": oldest.get("cpu")}
    return [flat.get(field) for field in SAMPLE_FIELDS]


def sample_dicts(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """report.json's sample rows back as dicts."""
    fields = report["samples"]["fields"]
    return [dict(zip(fields, row)) for row in report["samples"]["rows"]]


def global_checks(records: Sequence[Mapping[str, Any]], numbers: Mapping[str, Any]) -> list[dict[str, Any]]:
    checks = []

    def check(name: str, passed: bool, detail: str, severity: str = EXPECTATION) -> None:
        checks.append({"name": name, "severity": severity, "passed": bool(passed), "detail": detail})

    lost = numbers["lost"]
    check("no accepted request was lost", not lost,
          f"{len(lost)} lost" + (": " + ", ".join(f"{l['id']} ({l['why']})" for l in lost[:5]) if lost else ""),
          INVARIANT)
    duplicates = numbers["duplicates"]
    check("no request ran or was delivered twice", not duplicates,
          f"{len(duplicates)} duplicates" + (": " + "; ".join(d["detail"] for d in duplicates[:5]) if duplicates else ""),
          INVARIANT)
    twice = numbers["tool_calls_ran_twice"]
    check("no tool call ran twice", not twice,
          f"{sum(numbers['tool_executions'].values())} tool executions for {len(numbers['tool_executions'])} actions"
          + (f"; twice: {', '.join(twice)}" if twice else ""), INVARIANT)
    degraded = numbers["degraded"]
    invisible = [i for i in degraded["intervals"] if not i["visible"]]
    check("degraded status visible throughout every degraded interval", not invisible,
          f"{degraded['visible_intervals']}/{len(degraded['intervals'])} intervals "
          f"({degraded['samples_in_intervals']} /status samples)"
          + (f"; degraded.active false at t = {', '.join(str(t) for i in invisible for t in i['invisible_at_s'][:3])} s"
             if invisible else ""))
    headerless = degraded["cpu_answers_without_fallback_headers"]
    check("CPU answers carry X-Fallback-Model and X-Estimated-Latency", not headerless,
          f"{degraded['cpu_answers_for_gpu_out_reasons'] - len(headerless)}/{degraded['cpu_answers_for_gpu_out_reasons']}"
          + (f"; missing on {', '.join(headerless[:5])}" if headerless else ""))
    agreement = numbers["token_agreement"]
    differing = [f"{p['gpu_id']} vs {p['cpu_id']} ({p['prompt_key']})" for p in numbers["agreement_pairs"]
                 if not p["identical"]]
    # Reported, never failed: temperature 0 is deterministic for one worker
    # state, not across states. llama-cpp-python reuses a cached prompt prefix,
    # which changes the floating-point path, so the same request can flip a
    # near-tie token depending on what the worker served just before (and CUDA
    # kernels round differently from CPU ones on a real GPU).
    check("temperature-0 answers agree between the GPU and the CPU path",
          agreement["identical_pairs"] == agreement["pairs"],
          f"{agreement['identical_pairs']}/{agreement['pairs']} pairs identical; "
          f"{percent(agreement['token_agreement'])} of {agreement['tokens_compared']} streamed tokens"
          + (f"; differ: {', '.join(differing[:4])}" if differing else "")
          + ("" if agreement["pairs"] else " (no prompt was served by both paths)"), FINDING)
    unexpected = [f"{r['id']} ({r['label']}): expected {r['expect']}, got {r['outcome']}"
                  + (f" {r['error_code']}" if r.get("error_code") else "")
                  for r in records if not stats.meets_expectation(r["expect"], r["outcome"])]
    check("every request ended the way its phase designed", not unexpected,
          f"{len(records) - len(unexpected)}/{len(records)}" + (f"; {'; '.join(unexpected[:6])}" if unexpected else ""))
    renamed = [r["id"] for r in records if r["status"] is not None and not r["idempotent_replay"]
               and r["response_request_id"] != r["id"]]
    check("X-Request-Id is kept", not renamed, f"{len(renamed)} responses carried another id"
          + (f": {', '.join(renamed[:5])}" if renamed else ""))
    not_recovered = [f"phase {r['phase']} {r['kind']}" for r in numbers["gpu_recovery"] if r["recovery_s"] is None]
    if numbers["gpu_recovery"]:
        check("the GPU path came back after every fault", not not_recovered,
              f"{len(numbers['gpu_recovery']) - len(not_recovered)}/{len(numbers['gpu_recovery'])} recovered"
              + (f"; not seen: {', '.join(not_recovered)}" if not_recovered else ""))
    return checks


def _phase_row(phase: Mapping[str, Any], records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    mine = [r for r in records if r["phase"] == phase["key"]]
    counts = {key: sum(1 for r in mine if r["outcome"] == key)
              for key in (stats.OK, stats.REJECTED, stats.CANCELED, stats.ERROR, stats.LOST)}
    paths = {path: sum(1 for r in mine if r["served_by"] == path) for path in ("gpu", "cpu")}
    return {**phase, "requests": len(mine), "outcomes": counts, "served_by": paths,
            "duration_s": round(phase["ended_s"] - phase["started_s"], 2)}


def decide_verdict(checks: Sequence[Mapping[str, Any]]) -> tuple[str, int]:
    """PASS (0); FAIL with 1 when an invariant broke (a request lost or
    duplicated, a tool run twice); FAIL with 3 when the service did
    something other than designed. Findings never fail the drill."""
    failed = [c for c in checks if not c["passed"] and c["severity"] != FINDING]
    if any(c["severity"] == INVARIANT for c in failed):
        return "FAIL", 1
    if failed:
        return "FAIL", 3
    return "PASS", 0

