from __future__ import annotations

import pytest

from tests.fakes.clock import FakeClock
from tray_app.core.dispatch.breaker import BreakerPolicy, BreakerState, CircuitBreaker


POLICY = BreakerPolicy(failure_threshold=3, window_s=60.0, cooldown_s=30.0)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def breaker(clock: FakeClock) -> CircuitBreaker:
    return CircuitBreaker(POLICY, clock=clock)


def open_breaker(breaker: CircuitBreaker) -> None:
    for attempt in range(POLICY.failure_threshold):
        breaker.record_failure(f"failure {attempt}")
    assert breaker.state is BreakerState.OPEN


def test_starts_closed_and_admits_everything(breaker: CircuitBreaker) -> None:
    assert breaker.state is BreakerState.CLOSED
    assert all(breaker.try_acquire() for _ in range(10))


def test_stays_closed_below_threshold(breaker: CircuitBreaker) -> None:
    breaker.record_failure("a")
    breaker.record_failure("b")
    assert breaker.state is BreakerState.CLOSED
    assert breaker.try_acquire()


def test_opens_at_threshold_and_refuses(breaker: CircuitBreaker) -> None:
    open_breaker(breaker)
    assert not breaker.try_acquire()
    assert breaker.snapshot()["last_failure_reason"] == "failure 2"


def test_failures_outside_window_do_not_count(breaker: CircuitBreaker, clock: FakeClock) -> None:
    breaker.record_failure("old")
    breaker.record_failure("old")
    clock.advance(POLICY.window_s)  # exactly window_s later the old ones have aged out
    breaker.record_failure("new")
    assert breaker.state is BreakerState.CLOSED
    assert breaker.snapshot()["recent_failures"] == 1


def test_failures_inside_window_accumulate(breaker: CircuitBreaker, clock: FakeClock) -> None:
    breaker.record_failure("a")
    clock.advance(POLICY.window_s - 1)
    breaker.record_failure("b")
    breaker.record_failure("c")
    assert breaker.state is BreakerState.OPEN


def test_success_in_closed_does_not_forgive_failures(breaker: CircuitBreaker) -> None:
    breaker.record_failure("a")
    breaker.record_failure("b")
    breaker.record_success()
    breaker.record_failure("c")
    assert breaker.state is BreakerState.OPEN


def test_open_becomes_half_open_after_cooldown(breaker: CircuitBreaker, clock: FakeClock) -> None:
    open_breaker(breaker)
    clock.advance(POLICY.cooldown_s - 0.001)
    assert breaker.state is BreakerState.OPEN
    clock.advance(0.001)
    assert breaker.state is BreakerState.HALF_OPEN


def test_half_open_admits_exactly_one_probe(breaker: CircuitBreaker, clock: FakeClock) -> None:
    open_breaker(breaker)
    clock.advance(POLICY.cooldown_s)
    assert breaker.try_acquire()
    assert not breaker.try_acquire()
    assert not breaker.try_acquire()


def test_probe_success_closes_and_clears(breaker: CircuitBreaker, clock: FakeClock) -> None:
    open_breaker(breaker)
    clock.advance(POLICY.cooldown_s)
    assert breaker.try_acquire()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED
    assert breaker.snapshot()["recent_failures"] == 0
    # Cleared means a single new failure must not reopen it.
    breaker.record_failure("one more")
    assert breaker.state is BreakerState.CLOSED


def test_probe_failure_reopens_with_fresh_cooldown(breaker: CircuitBreaker, clock: FakeClock) -> None:
    open_breaker(breaker)
    clock.advance(POLICY.cooldown_s + 5)
    assert breaker.try_acquire()
    breaker.record_failure("still broken")
    assert breaker.state is BreakerState.OPEN
    assert not breaker.try_acquire()
    clock.advance(POLICY.cooldown_s - 1)
    assert breaker.state is BreakerState.OPEN
    clock.advance(1)
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.try_acquire()  # the new cooldown allows a new probe


def test_released_probe_allows_another(breaker: CircuitBreaker, clock: FakeClock) -> None:
    open_breaker(breaker)
    clock.advance(POLICY.cooldown_s)
    assert breaker.try_acquire()
    breaker.release_probe()
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.try_acquire()
    assert not breaker.try_acquire()


def test_trip_opens_immediately_from_closed(breaker: CircuitBreaker) -> None:
    breaker.trip("worker failed to start: out of memory")
    assert breaker.state is BreakerState.OPEN
    assert not breaker.try_acquire()
    assert breaker.snapshot()["last_failure_reason"] == "worker failed to start: out of memory"


def test_trip_during_half_open_restarts_cooldown(breaker: CircuitBreaker, clock: FakeClock) -> None:
    open_breaker(breaker)
    clock.advance(POLICY.cooldown_s)
    assert breaker.try_acquire()
    breaker.trip("worker died")
    assert breaker.state is BreakerState.OPEN
    # The probe's late verdict belongs to the old episode and must not close it.
    breaker.record_success()
    assert breaker.state is BreakerState.OPEN


def test_failures_while_open_do_not_extend_cooldown(breaker: CircuitBreaker, clock: FakeClock) -> None:
    open_breaker(breaker)
    clock.advance(POLICY.cooldown_s - 1)
    breaker.record_failure("straggler")
    clock.advance(1)
    assert breaker.state is BreakerState.HALF_OPEN


def test_snapshot_while_closed(breaker: CircuitBreaker) -> None:
    breaker.record_failure("timeout")
    assert breaker.snapshot() == {
        "state": "closed",
        "recent_failures": 1,
        "last_failure_reason": "timeout",
        "opened_for_s": None,
        "retry_in_s": None,
    }


def test_snapshot_while_open_counts_down(breaker: CircuitBreaker, clock: FakeClock) -> None:
    open_breaker(breaker)
    clock.advance(10)
    snapshot = breaker.snapshot()
    assert snapshot["state"] == "open"
    assert snapshot["recent_failures"] == 3
    assert snapshot["opened_for_s"] == pytest.approx(10)
    assert snapshot["retry_in_s"] == pytest.approx(POLICY.cooldown_s - 10)


def test_snapshot_while_half_open_has_no_countdown(breaker: CircuitBreaker, clock: FakeClock) -> None:
    open_breaker(breaker)
    clock.advance(POLICY.cooldown_s + 2)
    snapshot = breaker.snapshot()
    assert snapshot["state"] == "half_open"
    assert snapshot["opened_for_s"] == pytest.approx(POLICY.cooldown_s + 2)
    assert snapshot["retry_in_s"] is None


def test_snapshot_forgets_expired_failures(breaker: CircuitBreaker, clock: FakeClock) -> None:
    breaker.record_failure("a")
    clock.advance(POLICY.window_s + 1)
    assert breaker.snapshot()["recent_failures"] == 0


def test_state_values_are_plain_strings() -> None:
    assert BreakerState.HALF_OPEN == "half_open"


@pytest.mark.parametrize(
    "bad_policy",
    [
        {"failure_threshold": 0},
        {"window_s": 0.0},
        {"cooldown_s": -1.0},
    ],
)
def test_policy_rejects_nonsense(bad_policy: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BreakerPolicy(**bad_policy)  # type: ignore[arg-type]
