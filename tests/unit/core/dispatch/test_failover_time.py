"""Failover time with plain values: when each kind of fault happened, and
what /status says of the last replays."""

import pytest

from tray_app.core.dispatch.failover_time import FailoverTimes, Fault, fault_of
from tray_app.core.dispatch.jobs import Attempt


def failed(outcome: str, *, first: float | None = None, last: float = 0.0) -> Attempt:
    return Attempt("gpu", started_at=10.0, first_token_at=first, ended_at=40.0, outcome=outcome,
                   last_token_at=last)


def test_a_crash_and_a_give_back_count_from_when_the_connection_broke():
    assert fault_of(failed("failed: RemoteProtocolError"), gave_back=False) == Fault("crash", 40.0)
    assert fault_of(failed("failed: RemoteProtocolError"), gave_back=True) == Fault("give_back", 40.0)


def test_a_hang_counts_from_when_the_worker_went_quiet_not_from_its_deadline():
    assert fault_of(failed("failed: hang"), gave_back=False) == Fault("hang", 10.0)
    assert fault_of(failed("failed: hang", first=12.0, last=15.0), gave_back=False) == Fault("hang", 15.0)


def test_the_snapshot_has_the_last_value_and_medians_overall_and_per_fault():
    times = FailoverTimes()
    assert times.snapshot() == {"count": 0, "last_s": None, "last_fault": None, "p50_s": None, "by_fault": {},
                                "resumes": 0, "resume_last_s": None}
    for kind, seconds in (("crash", 0.4), ("crash", 0.6), ("hang", 21.0), ("crash", 0.5)):
        times.record(kind, seconds, resumed=seconds == 0.6)
    assert times.snapshot() == {
        "count": 4, "last_s": 0.5, "last_fault": "crash", "p50_s": pytest.approx(0.55),
        "by_fault": {"crash": {"count": 3, "last_s": 0.5, "p50_s": 0.5},
                     "hang": {"count": 1, "last_s": 21.0, "p50_s": 21.0}},
        # One of them went on from the text the GPU had made; its seam was 0.6 s.
        "resumes": 1, "resume_last_s": 0.6,
    }


def test_the_drill_report_gives_failover_time_per_fault():
    from tray_app.drill.report import failover_by_fault

    events = [{"kind": "failover", "fault": "crash", "seconds": 0.5, "id": "a"},
              {"kind": "replay", "id": "a"},
              {"kind": "failover", "fault": "crash", "seconds": 0.3, "id": "b"},
              {"kind": "failover", "fault": "hang", "seconds": 21.0, "id": "c"}]
    assert failover_by_fault(events) == {"crash": {"n": 2, "p50_s": 0.3, "max_s": 0.5},
                                         "hang": {"n": 1, "p50_s": 21.0, "max_s": 21.0}}
