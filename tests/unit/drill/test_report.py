"""The drill report's arithmetic, on plain values: percentiles, outcome
accounting, duplicates, token agreement, degraded intervals, recovery times
and the verdict."""

from __future__ import annotations

import pytest

from tray_app.drill import stats
from tray_app.drill.agent import ToolLedger
from tray_app.drill.report import decide_verdict


def rec(request_id: str, **fields):
    base = {"id": request_id, "outcome": "ok", "served_by": "gpu", "stream": False, "latency_s": 1.0,
            "idempotency_key": None, "idempotent_replay": False, "output_text": "", "tool_calls": [],
            "tool_calls_signature": None, "output_tokens": None, "max_tokens": 16, "prompt_key": None}
    return {**base, **fields}


# ----- percentiles -------------------------------------------------------------------


def test_nearest_rank_percentiles():
    values = list(range(1, 21))  # 1..20
    assert stats.percentile(values, 50) == 10
    assert stats.percentile(values, 95) == 19
    assert stats.percentile(values, 100) == 20
    assert stats.percentile(reversed(values), 95) == 19  # order of arrival doesn't matter


def test_percentile_of_few_values_is_a_value_that_was_seen():
    assert stats.percentile([0.4, 9.0], 95) == 9.0
    assert stats.percentile([0.4, 9.0], 50) == 0.4
    assert stats.percentile([3.0], 95) == 3.0
    assert stats.percentile([], 95) is None
    with pytest.raises(ValueError):
        stats.percentile([1.0], 0)


def test_latency_by_path_counts_answers_only_and_not_replays():
    records = [
        rec("a", latency_s=1.0), rec("b", latency_s=3.0), rec("c", served_by="cpu", latency_s=10.0),
        rec("d", served_by="cpu", latency_s=99.0, outcome="error"),
        rec("e", latency_s=0.001, idempotent_replay=True),
    ]
    summary = stats.latency_by_path(records)
    assert summary["gpu"] == {"n": 2, "p50_s": 1.0, "p95_s": 3.0, "max_s": 3.0}
    assert summary["cpu"]["n"] == 1 and summary["cpu"]["p95_s"] == 10.0


# ----- outcome accounting ---------------------------------------------------------------


def kind(**overrides):
    facts = {"status": 200, "stream": False, "saw_done": False, "saw_error_event": False, "body_ok": True,
             "error_code": None, "transport_error": None}
    return stats.answer_kind(**{**facts, **overrides})


def test_answer_kinds():
    assert kind() == "answer"
    assert kind(stream=True, saw_done=True) == "answer"
    assert kind(stream=True, saw_done=False) == "none"          # stopped without [DONE] or an error event
    assert kind(stream=True, saw_error_event=True, error_code="gpu_worker_failed") == "clean_error"
    assert kind(status=503, body_ok=False, error_code="cpu_queue_full") == "clean_error"
    assert kind(status=None, transport_error="ReadError") == "none"
    assert kind(body_ok=False) == "none"                        # 200 with a body that isn't an answer
    assert kind(status=502, error_code=None) == "none"          # an error without the envelope


def test_admission_rejection_is_not_accepted_but_a_failed_replay_is():
    assert not stats.was_accepted(status=503, error_code="cpu_queue_full", decision_routes=[], seen_in_flight=False)
    assert not stats.was_accepted(status=503, error_code="cpu_queue_full", decision_routes=["reject"],
                                  seen_in_flight=False)
    # Admitted to the GPU, then the replay was refused: the router owed it an answer.
    assert stats.was_accepted(status=503, error_code="cpu_context_cap", decision_routes=["gpu", "reject"],
                              seen_in_flight=False)
    assert stats.was_accepted(status=503, error_code="no_worker", decision_routes=[], seen_in_flight=True)
    # No evidence either way: counted as accepted, so a silent failure shows up as lost.
    assert stats.was_accepted(status=None, error_code=None, decision_routes=[], seen_in_flight=False)


def test_outcomes():
    assert stats.outcome(accepted=False, kind="clean_error", error_code="cpu_queue_full") == "rejected"
    assert stats.outcome(accepted=True, kind="answer", error_code=None) == "ok"
    assert stats.outcome(accepted=True, kind="clean_error", error_code="request_canceled") == "canceled"
    assert stats.outcome(accepted=True, kind="clean_error", error_code="gpu_worker_failed") == "error"
    assert stats.outcome(accepted=True, kind="none", error_code=None) == "lost"


def test_success_rate_is_over_accepted_requests():
    records = [rec("a"), rec("b"), rec("c", outcome="rejected"), rec("d", outcome="canceled"),
               rec("e", outcome="error"), rec("f", outcome="lost")]
    summary = stats.success_summary(records)
    assert summary == {"sent": 6, "accepted": 5, "answered": 2, "rejected": 1, "canceled": 1, "clean_errors": 1,
                       "lost": 1, "success_rate": 0.4}
    assert stats.success_summary([])["success_rate"] is None


def test_expectations():
    assert stats.meets_expectation("answer", "ok")
    assert not stats.meets_expectation("answer", "rejected")
    assert stats.meets_expectation("answer_or_rejected", "rejected")
    assert stats.meets_expectation("canceled", "canceled") and not stats.meets_expectation("canceled", "ok")
    assert stats.meets_expectation("error_event", "error") and not stats.meets_expectation("error_event", "lost")


# ----- duplicates -------------------------------------------------------------------------


def test_no_duplicates_in_a_clean_run():
    records = [rec("a", idempotency_key="k", output_text="4"),
               rec("b", idempotency_key="k", output_text="4", idempotent_replay=True),
               rec("c", stream=True, output_tokens=["x"] * 16)]
    assert stats.find_duplicates(records, {"a": 1, "c": 1}) == []


def test_duplicates_of_every_kind_are_found():
    records = [
        rec("a", idempotency_key="k", output_text="4"),
        rec("b", idempotency_key="k", output_text="4"),                                # ran again
        rec("c", idempotency_key="j", output_text="yes"),
        rec("d", idempotency_key="j", output_text="no", idempotent_replay=True),      # replay differs
        rec("e", stream=True, max_tokens=16, output_tokens=["x"] * 20),               # two runs in one stream
        rec("f", idempotency_key="m", outcome="error"), rec("g", idempotency_key="m"),  # a failed first try is no duplicate
    ]
    found = stats.find_duplicates(records, {"z": 2, "a": 1})
    assert sorted((d["kind"], d["id"]) for d in found) == [
        ("completed_twice", "z"), ("idempotency_key_ran_twice", "k"), ("replay_differs", "d"), ("stream_overran", "e"),
    ]


def test_tool_runs_twice():
    assert stats.tool_runs_twice({"agent-1: refund A": 1, "agent-2: refund B": 2, "agent-3": 0}) == ["agent-2: refund B"]


def test_tool_ledger_absorbs_a_redelivered_call_but_counts_a_second_execution():
    ledger = ToolLedger()
    ledger.run("refund A", "call_1", "{}", "r1")
    ledger.run("refund A", "call_1", "{}", "r2")   # the same call delivered again (an idempotent replay)
    assert ledger.executions == {"refund A": 1}
    ledger.run("refund A", "call_2", "{}", "r3")   # a second, fresh execution of the turn
    assert stats.tool_runs_twice(ledger.executions) == ["refund A"]


# ----- token agreement ----------------------------------------------------------------------


def test_agreement_of_two_answers():
    same = stats.compare_outputs(["a", "b", "c"], ["a", "b", "c"])
    assert same.identical and same.rate == 1.0
    diverged = stats.compare_outputs(["a", "b", "c", "d"], ["a", "x", "c", "d"])
    # Nothing after the first divergence counts: the rest is conditioned on a different token.
    assert not diverged.identical and (diverged.agreeing, diverged.compared) == (1, 4)
    shorter = stats.compare_outputs(["a", "b"], ["a", "b", "c"])
    assert not shorter.identical and (shorter.agreeing, shorter.compared) == (2, 3)


def test_agreement_of_a_cut_short_stream():
    assert stats.compare_prefix(["a", "b"], ["a", "b", "c"]).identical
    wrong = stats.compare_prefix(["a", "x"], ["a", "b", "c"])
    assert not wrong.identical and (wrong.agreeing, wrong.compared) == (1, 2)
    assert not stats.compare_prefix(["a", "b", "c"], ["a", "b"]).identical


def test_agreement_summary():
    summary = stats.agreement_summary([stats.Agreement(10, 10, True), stats.Agreement(10, 5, False)])
    assert summary == {"pairs": 2, "identical_pairs": 1, "tokens_compared": 20, "tokens_agreeing": 15,
                       "token_agreement": 0.75}
    assert stats.agreement_summary([])["token_agreement"] is None


def test_agreement_pairs_match_gpu_and_cpu_answers_to_one_prompt():
    records = [
        rec("g1", prompt_key="p", stream=True, output_tokens=["A", "B"]),
        rec("c1", prompt_key="p", served_by="cpu", stream=True, output_tokens=["A", "B"]),
        rec("c2", prompt_key="p", served_by="cpu", stream=True, output_tokens=["A", "C"]),
        rec("c3", prompt_key="p", served_by="cpu", idempotent_replay=True, stream=True, output_tokens=["Z"]),
        rec("c4", prompt_key="p", served_by="cpu", outcome="error", stream=True, output_tokens=["Z"]),
        rec("g2", prompt_key="t", tool_calls=[{"id": "call_a", "name": "f", "arguments": "{}"}]),
        rec("c5", prompt_key="t", served_by="cpu", tool_calls=[{"id": "call_b", "name": "f", "arguments": "{}"}]),
        rec("c6", prompt_key="only-cpu", served_by="cpu"),
    ]
    pairs = stats.agreement_pairs(records)
    assert [(p["gpu_id"], p["cpu_id"], p["by"], p["identical"]) for p in pairs] == [
        ("g1", "c1", "tokens", True), ("g1", "c2", "tokens", False),
        ("g2", "c5", "text", True),  # tool calls compared without their per-execution ids
    ]
    summary = stats.agreement_report(pairs, [{"partial": ["A"], "full": ["A", "B"]}])
    assert summary["pairs"] == 4 and summary["identical_pairs"] == 3
    assert (summary["tokens_compared"], summary["tokens_agreeing"]) == (5, 4)
    assert summary["text_pairs"] == 1 and summary["prefix_pairs"] == 1


# ----- degraded intervals and recovery ----------------------------------------------------------


def test_degraded_intervals():
    samples = [
        {"t": 0.0, "cpu_gpu_out": False, "degraded_active": False},
        {"t": 0.1, "cpu_gpu_out": True, "degraded_active": True},
        {"t": 0.2, "cpu_gpu_out": True, "degraded_active": True},
        {"t": 0.3, "cpu_gpu_out": False, "degraded_active": True},
        {"t": 0.4, "cpu_gpu_out": True, "degraded_active": False},   # CPU serving, status says all is well
        {"t": 0.5, "cpu_gpu_out": True, "degraded_active": True},
        {"t": 0.6, "error": "ReadTimeout"},                            # a missing sample ends an interval
        {"t": 0.7, "cpu_gpu_out": True, "degraded_active": True},
    ]
    intervals = stats.degraded_intervals(samples)
    assert [(i["start_s"], i["end_s"], i["samples"], i["visible"]) for i in intervals] == [
        (0.1, 0.2, 2, True), (0.4, 0.5, 2, False), (0.7, 0.7, 1, True),
    ]
    assert intervals[1]["invisible_at_s"] == [0.4]


def serving(t, ok, **extra):
    sample = {"t": t, "gpu_path_out": None if ok else "the GPU worker is starting", "breaker": "closed",
              "gpu_worker_state": "ready" if ok else "starting"}
    return {**sample, **extra}


def test_recovery_is_measured_from_the_end_of_the_fault_after_the_outage_was_seen():
    samples = [serving(9.9, True), serving(10.05, True), serving(10.2, False), serving(11.0, False),
               serving(12.5, True, gpu_recovery_s=2.4), serving(13.0, True)]
    kill = {"phase": 8, "kind": "kill", "signal": "SIGKILL", "at_s": 10.0, "cleared_s": 10.0}
    [result] = stats.recovery_times([kill], samples)
    # The 10.05 s sample predates the service noticing; it is not a recovery.
    assert result["outage_seen"] and result["recovery_s"] == 2.5 and result["service_gpu_recovery_s"] == 2.4
    held = {**kill, "cleared_s": 12.0}  # memory held until 12 s: recovery counts from when it was given back
    assert stats.recovery_times([held], samples)[0]["recovery_s"] == 0.5
    never = {**kill, "at_s": 12.8, "cleared_s": 12.8}
    assert stats.recovery_times([never], samples)[0] == {
        "phase": 8, "kind": "kill", "signal": "SIGKILL", "at_s": 12.8, "cleared_s": 12.8, "outage_seen": False,
        "recovered_at_s": None, "recovery_s": None, "service_gpu_recovery_s": None}


def test_extreme():
    samples = [{"t": 1.0, "ram": 900.0}, {"t": 2.0, "ram": 700.0}, {"t": 3.0, "ram": None}]
    assert stats.extreme(samples, "ram", pick=min) == {"value": 700.0, "at_s": 2.0}
    assert stats.extreme(samples, "ram") == {"value": 900.0, "at_s": 1.0}
    assert stats.extreme([], "ram") is None


# ----- verdict ------------------------------------------------------------------------------------


def check(severity, passed):
    return {"name": "x", "severity": severity, "passed": passed, "detail": ""}


def test_verdict_and_exit_code():
    assert decide_verdict([check("invariant", True), check("expectation", True)]) == ("PASS", 0)
    assert decide_verdict([check("finding", False)]) == ("PASS", 0)
    assert decide_verdict([check("expectation", False)]) == ("FAIL", 3)
    assert decide_verdict([check("expectation", False), check("invariant", False)]) == ("FAIL", 1)
