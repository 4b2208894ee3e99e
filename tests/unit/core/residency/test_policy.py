"""Residency with plain values: when the GPU worker gives its memory back and
takes it again, with hysteresis, idle unload and the user's commands."""

from __future__ import annotations

import pytest

from tests.fakes.clock import FakeClock
from tray_app.core.residency.policy import (
    FLAP_WINDOW_S, MAX_SETTLE_FACTOR, RELOAD_MARGIN_MIB, YIELD_CONFIRM_S, Action, DeviceView, HoldKind, Residency,
    SharingPolicy,
)

TOTAL, NEED, RESERVE = 24576.0, 6000.0, 1024.0
# Other apps' use at which the loaded worker could just keep the reserve.
THRESHOLD = TOTAL - NEED - RESERVE


def view(others: float | None, app: str | None = "steam") -> DeviceView:
    return DeviceView(TOTAL if others is not None else None, others, NEED, RESERVE, top_app=app,
                      top_app_mib=others)


def make(*, loads_on_demand: bool = False, **policy) -> tuple[Residency, FakeClock]:
    clock = FakeClock()
    return Residency(SharingPolicy(**{"reload_settle_s": 30.0, "idle_unload_s": 300.0, **policy}), clock,
                     loads_on_demand=loads_on_demand), clock


def observe(residency: Residency, clock: FakeClock, others: float | None, *, after: float = 1.0,
            loaded: bool = True, idle_for_s: float | None = None) -> Action:
    clock.now += after
    return residency.observe(view(others), loaded=loaded, idle_for_s=idle_for_s)


def test_a_game_that_crowds_the_worker_makes_it_yield_after_confirmation():
    residency, clock = make()
    assert observe(residency, clock, 2000) is Action.NONE
    assert observe(residency, clock, THRESHOLD + 1, after=0.5) is Action.NONE  # one reading is not enough
    assert observe(residency, clock, THRESHOLD + 1, after=YIELD_CONFIRM_S) is Action.YIELD
    hold = residency.hold
    assert hold is not None and hold.kind is HoldKind.YIELDED and hold.app == "steam"
    assert hold.describe() == f"GPU given to steam ({(THRESHOLD + 1) / 1024:.1f} GiB)"


def test_exactly_at_the_threshold_the_worker_keeps_the_reserve_and_stays():
    residency, clock = make()
    for _ in range(5):
        assert observe(residency, clock, THRESHOLD) is Action.NONE
    assert residency.hold is None


def test_a_short_spike_does_not_yield():
    residency, clock = make()
    observe(residency, clock, THRESHOLD + 500, after=0.5)
    observe(residency, clock, 1000, after=0.5)
    assert observe(residency, clock, THRESHOLD + 500, after=0.5) is Action.NONE
    assert residency.hold is None


def test_unknown_readings_never_yield_or_reload():
    residency, clock = make()
    for _ in range(5):
        assert observe(residency, clock, None) is Action.NONE
    assert residency.hold is None


def test_no_yield_when_the_policy_is_off():
    residency, clock = make(yield_to_other_apps=False)
    for _ in range(5):
        assert observe(residency, clock, TOTAL) is Action.NONE
    assert residency.hold is None


def yielded() -> tuple[Residency, FakeClock]:
    residency, clock = make()
    observe(residency, clock, THRESHOLD + 1)
    assert observe(residency, clock, THRESHOLD + 1) is Action.YIELD
    return residency, clock


def test_reload_waits_for_the_settle_time_with_the_margin():
    residency, clock = yielded()
    # Free again, but inside the margin: the settle clock does not run.
    for _ in range(60):
        assert observe(residency, clock, THRESHOLD - RELOAD_MARGIN_MIB + 1, loaded=False) is Action.NONE
    assert residency.reload_in_s() is None
    assert observe(residency, clock, 0, loaded=False) is Action.NONE
    assert residency.reload_in_s() == pytest.approx(30.0)
    assert observe(residency, clock, 0, after=29.0, loaded=False) is Action.NONE
    assert observe(residency, clock, 0, after=1.0, loaded=False) is Action.LOAD
    assert residency.hold is None


def test_the_settle_clock_restarts_when_the_game_comes_back():
    residency, clock = yielded()
    observe(residency, clock, 0, loaded=False)
    observe(residency, clock, 0, after=20.0, loaded=False)
    observe(residency, clock, THRESHOLD + 1, loaded=False)
    assert observe(residency, clock, 0, loaded=False) is Action.NONE
    assert observe(residency, clock, 0, after=29.0, loaded=False) is Action.NONE
    assert observe(residency, clock, 0, after=1.0, loaded=False) is Action.LOAD


def test_a_flapping_game_doubles_the_settle_time_up_to_a_cap():
    residency, clock = make()
    settles = []
    for _ in range(7):
        observe(residency, clock, THRESHOLD + 1)
        assert observe(residency, clock, THRESHOLD + 1) is Action.YIELD
        settles.append(residency.settle_s())
        observe(residency, clock, 0, loaded=False)
        clock.now += residency.settle_s()
        assert observe(residency, clock, 0, after=0.0, loaded=False) is Action.LOAD
    assert settles[:4] == [30.0, 60.0, 120.0, 240.0]
    assert max(settles) == 30.0 * MAX_SETTLE_FACTOR
    # A quiet spell longer than the window forgets the episode.
    clock.now += FLAP_WINDOW_S + 1
    assert residency.settle_s() == 30.0


def test_the_name_follows_whoever_holds_the_memory_now():
    residency, clock = yielded()
    clock.now += 1
    residency.observe(view(THRESHOLD + 3000, app="blender"), loaded=False, idle_for_s=None)
    assert residency.hold.app == "blender"


def test_idle_unload_after_the_idle_time_and_load_on_the_next_request():
    residency, clock = make(idle_unload_s=300.0)
    assert observe(residency, clock, 0, idle_for_s=299.0) is Action.NONE
    assert observe(residency, clock, 0, idle_for_s=None) is Action.NONE  # a request is running
    assert observe(residency, clock, 0, idle_for_s=300.0) is Action.UNLOAD
    assert residency.hold.kind is HoldKind.IDLE
    assert residency.hold.describe() == "GPU unloaded (idle)"
    assert observe(residency, clock, 0, loaded=False, idle_for_s=1000.0) is Action.NONE
    assert residency.request_arrived() is Action.LOAD
    assert residency.hold is None
    assert residency.request_arrived() is Action.NONE


def test_idle_unload_zero_means_never():
    residency, clock = make(idle_unload_s=0.0)
    assert observe(residency, clock, 0, idle_for_s=10**9) is Action.NONE


def test_a_game_arriving_while_idle_unloaded_goes_back_to_idle_not_to_a_reload():
    residency, clock = make()
    observe(residency, clock, 0, idle_for_s=300.0)
    assert residency.hold.kind is HoldKind.IDLE
    observe(residency, clock, THRESHOLD + 1, loaded=False)
    assert observe(residency, clock, THRESHOLD + 1, loaded=False) is Action.NONE  # nothing loaded to unload
    assert residency.hold.kind is HoldKind.YIELDED
    assert residency.request_arrived() is Action.NONE  # the game still holds the memory
    observe(residency, clock, 0, loaded=False)
    assert observe(residency, clock, 0, after=30.0, loaded=False) is Action.NONE
    assert residency.hold.kind is HoldKind.IDLE


def test_the_user_gives_the_gpu_back_and_takes_it_again():
    residency, clock = make()
    assert residency.give_back() is Action.YIELD
    assert residency.give_back() is Action.NONE
    assert residency.hold.kind is HoldKind.USER
    for _ in range(100):  # free memory does not bring it back: the user does
        assert observe(residency, clock, 0, loaded=False) is Action.NONE
    assert residency.take_again() is Action.LOAD
    assert residency.hold is None
    assert residency.take_again() is Action.NONE


def test_taking_it_again_while_a_game_holds_the_memory_yields_again_on_the_next_readings():
    residency, clock = yielded()
    assert residency.take_again() is Action.LOAD
    observe(residency, clock, THRESHOLD + 1)
    assert observe(residency, clock, THRESHOLD + 1) is Action.YIELD


def test_on_a_small_card_the_margin_shrinks_so_an_empty_device_takes_it_back():
    clock = FakeClock()
    residency = Residency(SharingPolicy(reload_settle_s=3.0), clock)
    small = dict(total_mib=2048.0, need_mib=1200.0, reserve_mib=512.0)  # 336 MiB of room above the reserve

    def see(others: float) -> Action:
        clock.now += 1.0
        return residency.observe(DeviceView(others_mib=others, **small), loaded=False, idle_for_s=None)

    see(400.0)
    assert see(400.0) is Action.YIELD
    # 168 MiB (half the room) must be free above the reserve: 200 MiB held elsewhere leaves 136...
    for _ in range(10):
        assert see(200.0) is Action.NONE
    # ...an empty device is not.
    see(0.0)
    see(0.0)
    see(0.0)
    assert see(0.0) is Action.LOAD


def test_a_game_that_returns_soon_after_every_reload_is_waited_out_longer_each_time_never_less():
    residency, clock = make()
    waits, announced = [], []
    for _ in range(30):
        observe(residency, clock, THRESHOLD + 1, after=5.0)
        assert observe(residency, clock, THRESHOLD + 1) is Action.YIELD
        announced.append(residency.settle_s())
        observe(residency, clock, 0, after=5.0, loaded=False)
        freed_at = clock.now
        while observe(residency, clock, 0, loaded=False) is not Action.LOAD:
            pass
        waits.append(clock.now - freed_at)
    # What /status announced is what happened, and it never shrinks mid-episode.
    assert all(wait == pytest.approx(settle, abs=1.0) for wait, settle in zip(waits, announced))
    assert announced == sorted(announced) and announced[-1] == 30.0 * MAX_SETTLE_FACTOR


# ----- the transitions that other parts used to make by assigning its fields -------------------


def test_a_model_that_loads_on_demand_starts_unloaded_and_its_first_request_loads_it():
    residency, clock = make(loads_on_demand=True)
    assert residency.hold is not None and residency.hold.kind is HoldKind.IDLE
    assert residency.hold.since == clock.now
    assert residency.request_arrived() is Action.LOAD
    assert residency.hold is None


def test_evicted_for_another_model_names_it_and_the_next_request_loads_again():
    residency, clock = make()
    assert residency.evicted(for_model="gemma") is Action.UNLOAD
    assert residency.hold.kind is HoldKind.IDLE and residency.hold.app == "gemma"
    assert residency.hold.describe() == "GPU unloaded for gemma"
    # Free memory alone does not bring it back: it waits for a request.
    assert observe(residency, clock, 0, loaded=False, idle_for_s=1000.0) is Action.NONE
    assert residency.request_arrived() is Action.LOAD
    assert residency.hold is None


def test_unloaded_by_the_user_reads_as_idle():
    residency, _ = make()
    residency.evicted()
    assert residency.hold.describe() == "GPU unloaded (idle)"


def test_a_refused_load_leaves_it_unloaded_and_the_next_request_tries_again():
    residency, clock = make(loads_on_demand=True)
    assert residency.request_arrived() is Action.LOAD
    clock.now += 5
    assert residency.load_refused() is Action.NONE
    assert residency.hold.kind is HoldKind.IDLE and residency.hold.since == clock.now
    assert residency.request_arrived() is Action.LOAD


def test_keep_alive_replaces_the_idle_time_until_a_request_says_otherwise():
    residency, clock = make(idle_unload_s=300.0)
    residency.set_keep_alive(10.0)
    assert residency.keep_alive_s == 10.0 and residency.idle_limit_s() == 10.0
    assert observe(residency, clock, 0, idle_for_s=10.0) is Action.UNLOAD
    residency.request_arrived()
    residency.set_keep_alive(-1)  # never
    assert residency.idle_limit_s() is None
    assert observe(residency, clock, 0, idle_for_s=10**9) is Action.NONE
    residency.set_keep_alive(None)  # the policy's again
    assert residency.idle_limit_s() == 300.0


def test_switching_yielding_off_brings_a_yielded_worker_back_at_once():
    residency, clock = yielded()
    assert residency.set_yield_to_other_apps(False) is Action.LOAD
    assert residency.hold is None and residency.policy.yield_to_other_apps is False
    # And it does not yield again, however crowded.
    for _ in range(5):
        assert observe(residency, clock, TOTAL) is Action.NONE


def test_switching_yielding_off_leaves_a_model_that_loads_on_demand_unloaded_until_its_next_request():
    residency, clock = make(loads_on_demand=True)
    residency.request_arrived()
    observe(residency, clock, THRESHOLD + 1)
    assert observe(residency, clock, THRESHOLD + 1) is Action.YIELD
    assert residency.set_yield_to_other_apps(False) is Action.NONE
    assert residency.hold.kind is HoldKind.IDLE
    assert residency.request_arrived() is Action.LOAD


def test_switching_yielding_on_or_off_changes_nothing_else_when_not_yielded():
    residency, _ = make()
    assert residency.set_yield_to_other_apps(False) is Action.NONE
    assert residency.set_yield_to_other_apps(True) is Action.NONE
    assert residency.hold is None and residency.policy.yield_to_other_apps is True
    residency.give_back()
    assert residency.set_yield_to_other_apps(False) is Action.NONE
    assert residency.hold.kind is HoldKind.USER  # only the user takes it back


@pytest.mark.parametrize("field", ["hold", "policy", "keep_alive_s"])
def test_its_state_is_read_only_outside(field):
    residency, _ = make()
    with pytest.raises(AttributeError):
        setattr(residency, field, None)
