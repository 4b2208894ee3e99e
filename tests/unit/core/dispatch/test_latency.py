"""The latency estimate with plain numbers: speed per busy slot count, how
busy a process was during an answer, and a queue played forward."""

from dataclasses import replace

import pytest

from tray_app.core.dispatch.admission import (
    CpuView, GpuView, LaneState, RequestShape, Route, decide, estimate_cpu_latency_s,
)
from tray_app.core.dispatch.latency import (
    BusySpeeds, FirstToken, FirstTokenFit, PathLoad, SpeedCurve, Work, estimate, mean_busy,
)

# One stream alone writes 100 tokens/s; two together 60 each (120 in all, not 200).
SHARED_CORES = SpeedCurve(single_tokens_per_s=100.0, prompt_tokens_per_s=1e9, measured=((1, 100.0), (2, 60.0)))
ANSWER = Work(prompt_tokens=0, answer_tokens=100)


def test_each_busy_count_keeps_its_own_ewma_and_rounds_the_mean_count():
    speeds = BusySpeeds(alpha=0.3)
    speeds.observe(1.2, 100.0)
    speeds.observe(1.6, 50.0)
    speeds.observe(2.4, 40.0)
    assert speeds.snapshot() == {"1": {"tokens_per_s": 100.0, "samples": 1},
                                 "2": {"tokens_per_s": pytest.approx(0.3 * 40 + 0.7 * 50), "samples": 2}}
    assert speeds.curve(80.0, 900.0).measured == ((1, 100.0), (2, pytest.approx(47.0)))


def test_mean_busy_weighs_each_neighbour_by_its_overlap():
    # 10 s of decoding: one neighbour there for its first 5 s, one still
    # running from 8 s: 2 busy for 5 s, 1 for 3 s, 2 for 2 s.
    assert mean_busy(0.0, 10.0, [(-5.0, 5.0), (8.0, None), (11.0, 12.0)]) == pytest.approx(10 / (5 / 2 + 3 + 2 / 2))
    assert mean_busy(3.0, 3.0, [(0.0, 9.0)]) == 1.0


def test_an_answer_half_alone_and_half_among_four_is_booked_at_the_count_whose_speed_it_had():
    # 120 tokens/s shared by the busy slots: 5 s among four writes 150
    # tokens, 5 s alone 600, so the answer averaged 75 tokens/s, which is
    # one stream's speed with 1.6 slots busy. The plain mean said 2.5 (48
    # tokens/s there), and so made 2 and 3 busy slots look that much faster.
    busy = mean_busy(0.0, 10.0, [(0.0, 5.0)] * 3)
    assert busy == pytest.approx(1.6)
    assert 120 / busy == pytest.approx((150 + 600) / 10)


def test_unmeasured_counts_share_the_nearest_measured_aggregate():
    assert SHARED_CORES.decode_tokens_per_s(2) == 60.0
    assert SHARED_CORES.decode_tokens_per_s(4) == pytest.approx(30.0)    # 120 tok/s over 4 streams
    nothing = SpeedCurve(single_tokens_per_s=100.0, prompt_tokens_per_s=1000.0)
    assert nothing.decode_tokens_per_s(2) == pytest.approx(50.0)


def test_fewer_busy_slots_than_any_measured_get_the_middle_of_the_two_bounds():
    # Only 4 busy measured, 20 tokens/s each (80 in all). Alone, a stream is
    # no slower than 20 and no faster than 80; cores that are shared make it
    # 80, a GPU that batches nearly 20. The geometric middle, 40, is off by
    # 2x at worst; the slow bound (what a path that never ran alone was
    # given, its speeds blended over all counts at most) by 4x.
    only_four = SpeedCurve(single_tokens_per_s=25.0, prompt_tokens_per_s=1000.0, measured=((4, 20.0),))
    assert only_four.decode_tokens_per_s(1) == pytest.approx(40.0)
    assert only_four.decode_tokens_per_s(2) == pytest.approx(20.0 * 2 ** 0.5)


def test_a_count_between_two_measured_ones_draws_the_aggregate_between_them():
    # 2 busy: 60 tokens/s each (120 in all); 4 busy: 40 each (160 in all).
    # 3 busy lies between: 140 in all. Sharing the 2-slot aggregate alone
    # said 40 each, as slow as 4 busy.
    batching = replace(SHARED_CORES, measured=((2, 60.0), (4, 40.0)))
    assert batching.decode_tokens_per_s(3) == pytest.approx(140 / 3)
    assert batching.decode_tokens_per_s(6) == pytest.approx(160 / 6)   # above them all: the highest's aggregate


def test_time_to_first_token_is_a_fixed_part_and_a_part_per_prompt_token():
    # A 38-token prompt's first token after 0.1 s, a 366-token one's after
    # 0.2 s: 0.088 s fixed and 0.3 ms a token. Prompt tokens over the time
    # alone (380 tokens/s from the short ones) priced the long prompt at 0.96 s.
    fit = FirstTokenFit(alpha=0.1)
    for _ in range(10):
        fit.observe(38, 0.1)
        fit.observe(366, 0.2)
    line = fit.fit(prior_prompt_tokens_per_s=380.0)
    assert line is not None
    assert line.seconds(366) == pytest.approx(0.2, rel=0.01)
    assert line.seconds(38) == pytest.approx(0.1, rel=0.01)
    assert line.seconds(0) == 0.0   # a request already past its prompt


def test_time_to_first_token_with_one_prompt_length_takes_its_slope_from_the_prior():
    fit = FirstTokenFit()
    assert fit.fit(1000.0) is None
    fit.observe(100, 0.4)
    fit.observe(100, 0.4)
    line = fit.fit(prior_prompt_tokens_per_s=1000.0)
    assert line == FirstToken(pytest.approx(0.3), pytest.approx(0.001))   # through 0.4 s at 100 tokens
    # Samples whose line would fall with length: the prior's slope again.
    falling = FirstTokenFit()
    falling.observe(10, 1.0)
    falling.observe(1000, 0.5)
    assert falling.fit(1000.0).per_token_s == pytest.approx(0.001)


def test_the_estimate_reads_a_prompt_at_the_measured_time_to_first_token():
    speeds = BusySpeeds()
    for _ in range(5):
        speeds.first_token.observe(38, 0.1)
        speeds.first_token.observe(366, 0.2)
    # The path's prompt speed (prompt tokens over time to first token) says 380 tokens/s.
    curve = replace(speeds.curve(100.0, 380.0), measured=((1, 100.0),))
    result = estimate(PathLoad(slots=1, running=(), queued=(Work(366, 100),), speeds=curve), Work(366, 100))
    assert result.wait_s == pytest.approx(0.2 + 1.0, rel=0.01)
    assert result.latency_s == pytest.approx(2 * (0.2 + 1.0), rel=0.01)


def test_eighth_of_eight_on_two_slots_runs_in_pairs_at_the_shared_speed():
    # 2 running, 5 queued, all 100 tokens: four rounds of two at 60 tok/s.
    load = PathLoad(slots=2, running=(ANSWER, ANSWER), queued=(ANSWER,) * 5, speeds=SHARED_CORES)
    result = estimate(load, ANSWER)
    assert result.wait_s == pytest.approx(3 * 100 / 60, abs=0.001)
    assert result.latency_s == pytest.approx(4 * 100 / 60, abs=0.001)
    # One stream's speed per slot said 7 * 1 s / 2 slots + 1 s = 4.5 s: a third short.


def test_the_speed_changes_as_slots_free_up():
    # One neighbour has 50 tokens left, one 100: ours starts when the first
    # ends (0.83 s), writes 50 beside the other (0.83 s), then 50 alone at 100 tok/s.
    load = PathLoad(slots=2, running=(Work(0, 50), ANSWER), queued=(), speeds=SHARED_CORES)
    result = estimate(load, ANSWER)
    assert result.wait_s == pytest.approx(50 / 60, abs=0.001)
    assert result.latency_s == pytest.approx(50 / 60 + 50 / 60 + 50 / 100, abs=0.001)


def test_a_free_slot_and_the_prompt_and_a_loading_worker():
    curve = replace(SHARED_CORES, prompt_tokens_per_s=1000.0)
    alone = estimate(PathLoad(slots=2, running=(), queued=(), speeds=curve), Work(500, 100))
    assert (alone.wait_s, alone.latency_s) == (0.0, pytest.approx(0.5 + 1.0))
    # Beside a running answer: the prompt first, then the answer at the shared speed.
    beside = estimate(PathLoad(slots=2, running=(Work(0, 1000),), queued=(), speeds=curve), Work(500, 60))
    assert beside.latency_s == pytest.approx(0.5 + 1.0, abs=0.001)
    loading = estimate(PathLoad(slots=2, running=(), queued=(), speeds=curve, not_before_s=4.0), Work(500, 100))
    assert loading.latency_s == pytest.approx(5.5)


LANE = LaneState(context_cap=2048, running=2, concurrency=2, queued=5, queue_limit=16)
BUSY_CPU = CpuView(lane=LANE, can_serve=True, out_reason=None, host_available_mib=16000, ram_floor_mib=1024,
                   request_ram_mib=40, tokens_per_s=100.0, prompt_tokens_per_s=1e9, backlog_s=3.5,
                   load=PathLoad(slots=2, running=(ANSWER, ANSWER), queued=(ANSWER,) * 5, speeds=SHARED_CORES))


def test_the_cpu_estimate_and_the_header_use_the_speed_per_busy_slot():
    request = RequestShape(prompt_tokens=0, max_tokens=100, force_cpu=True, queue_budget_s=60.0)
    assert estimate_cpu_latency_s(request, BUSY_CPU) == pytest.approx(6.67)
    decision = decide(request, None, BUSY_CPU)
    assert decision.route is Route.CPU and decision.estimated_latency_s == pytest.approx(6.67)


def test_a_gpu_request_gets_an_estimate_too():
    lane = LaneState(context_cap=4096, running=1, concurrency=4, queued=0, queue_limit=8)
    gpu = GpuView(lane=lane, out=None, free_vram_mib=2000, reserve_mib=512, request_vram_mib=50,
                  load=PathLoad(slots=4, running=(Work(0, 1000),), queued=(), speeds=SHARED_CORES))
    decision = decide(RequestShape(prompt_tokens=0, max_tokens=120), gpu, BUSY_CPU)
    assert decision.route is Route.GPU and decision.estimated_latency_s == pytest.approx(2.0)


def test_a_running_request_keeps_its_slot_and_the_queue_keeps_the_others_busy():
    # Two slots: one other request running 60 tokens, one queued behind it.
    load = PathLoad(2, running=(Work(0, 60),), queued=(ANSWER,), speeds=SHARED_CORES)
    rest = estimate(load, ANSWER, holds_slot=True)
    # Already running: no wait, and both slots stay busy to its end (the queued
    # one takes the freed slot), so all 100 tokens go at 60/s.
    assert rest.wait_s == 0
    assert rest.latency_s == pytest.approx(100 / 60, abs=1e-3)
    # As a new arrival the same request would wait for a slot behind the queue.
    assert estimate(load, ANSWER).wait_s == pytest.approx(1.0)
