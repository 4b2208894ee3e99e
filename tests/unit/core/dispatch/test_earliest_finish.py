"""Earliest expected finish decides (issue 32, part 3): with every GPU slot
busy, a request waits for one, runs on the CPU, or goes to a peer by which is
expected to finish it first, from each path's measured speed per busy slot
count and the work ahead of it. The count of requests waiting doesn't decide;
the queue limit is only a memory guard. Plain numbers, no processes."""

from dataclasses import replace

from tray_app.core.config import CpuConfig, GpuConfig
from tray_app.core.dispatch.admission import (
    CpuView, GpuView, LaneState, PeerRole, PeerView, Reason, RequestShape, Route, decide, offer_to_peer,
)
from tray_app.core.dispatch.latency import PathLoad, SpeedCurve, Work

# A GPU at 50 tokens/s per stream whatever the busy count (4 slots: 200
# tokens/s in all) and a CPU ten times slower (5 tokens/s), prompts read fast
# enough not to matter. A queued request of 100 tokens takes the GPU 2 s.
GPU_SPEED = SpeedCurve(50.0, 1e9, tuple((busy, 50.0) for busy in range(1, 5)))
CPU_SPEED = SpeedCurve(5.0, 1e9)
ANSWER = Work(0, 100)
REQUEST = RequestShape(prompt_tokens=10, max_tokens=100)
# The memory guard, at its new default: far above any queue in these tests.
QUEUE_LIMIT = 256


def busy_gpu(queued: int) -> GpuView:
    """Four GPU slots running a 100-token answer each, `queued` more waiting."""
    load = PathLoad(4, (ANSWER,) * 4, (ANSWER,) * queued, GPU_SPEED)
    lane = LaneState(context_cap=4096, running=4, concurrency=4, queued=queued, queue_limit=QUEUE_LIMIT)
    return GpuView(lane=lane, out=None, free_vram_mib=8000, reserve_mib=1024, request_vram_mib=50,
                   backlog_s=0.0, load=load)


def idle_cpu(**changes) -> CpuView:
    lane = LaneState(context_cap=2048, running=0, concurrency=2, queued=0, queue_limit=QUEUE_LIMIT)
    view = CpuView(lane=lane, can_serve=True, out_reason=None, host_available_mib=16000, ram_floor_mib=1024,
                   request_ram_mib=40, tokens_per_s=5.0, prompt_tokens_per_s=1e9, backlog_s=0.0,
                   load=PathLoad(2, (), (), CPU_SPEED))
    return replace(view, **changes)


def test_a_short_gpu_queue_is_waited_for_rather_than_a_cpu_ten_times_slower():
    # 8 ahead on 4 slots at 2 s each: about 2 s for the running ones, 4 s for
    # the queue, 2 s for its own = 8 s; the idle CPU takes 100 / 5 = 20 s.
    decision = decide(REQUEST, busy_gpu(queued=8), idle_cpu())
    assert (decision.route, decision.reason) == (Route.GPU_QUEUE, Reason.ADMITTED)
    assert decision.estimated_latency_s == 8.0
    assert "the CPU in 20.0 s" in decision.detail


def test_a_long_gpu_queue_sends_the_request_to_the_idle_cpu():
    # 40 ahead: 2 + 20 + 2 = 24 s waiting for the GPU, 20 s on the CPU. The
    # old rule waited (the queue had room); the count of 40 is not what decides.
    decision = decide(REQUEST, busy_gpu(queued=40), idle_cpu())
    assert (decision.route, decision.reason) == (Route.CPU, Reason.GPU_BUSY)
    assert decision.estimated_latency_s == 20.0
    assert "CPU is expected to finish first (about 20.0 s against 24.0 s" in decision.detail


def test_a_cpu_worker_that_would_slow_the_gpu_is_not_where_overflow_goes():
    # The same 40-deep queue that an idle CPU would take, but the two workers'
    # threads oversubscribe the same cores: the request waits for a GPU slot.
    decision = decide(REQUEST, busy_gpu(queued=40), idle_cpu(slows_gpu=True))
    assert (decision.route, decision.reason) == (Route.GPU_QUEUE, Reason.ADMITTED)
    assert decision.estimated_latency_s == 24.0 and "share the same cores" in decision.detail
    # Only earliest finish defers to it: a wait over the client's budget still runs on the CPU.
    over_budget = decide(replace(REQUEST, queue_budget_s=5.0), replace(busy_gpu(queued=40), backlog_s=22.0),
                         idle_cpu(slows_gpu=True))
    assert (over_budget.route, over_budget.reason) == (Route.CPU, Reason.GPU_BUSY)


def test_the_cpus_own_backlog_and_refusals_count_against_it():
    gpu = busy_gpu(queued=40)
    assert decide(REQUEST, gpu, idle_cpu()).route is Route.CPU
    # The same 40-deep GPU queue, but the CPU has two 100-token answers
    # running and two waiting: 20 + 20 + 20 = 60 s there, so the GPU's 24 s wins.
    busy = LaneState(context_cap=2048, running=2, concurrency=2, queued=2, queue_limit=QUEUE_LIMIT)
    cpu = idle_cpu(lane=busy, backlog_s=40.0, load=PathLoad(2, (ANSWER,) * 2, (ANSWER,) * 2, CPU_SPEED))
    decision = decide(REQUEST, gpu, cpu)
    assert decision.route is Route.GPU_QUEUE and decision.estimated_latency_s == 24.0
    # Faster or not, a CPU that is down, may not be used, or has no RAM to
    # spare is no choice: the request waits for the GPU rather than a 503.
    assert decide(REQUEST, gpu, idle_cpu(can_serve=False)).route is Route.GPU_QUEUE
    assert decide(replace(REQUEST, no_fallback=True), gpu, idle_cpu()).route is Route.GPU_QUEUE
    assert decide(REQUEST, gpu, idle_cpu(host_available_mib=1000)).route is Route.GPU_QUEUE
    # n=3 needs three slots at once: the CPU has two.
    three = idle_cpu(lane=replace(idle_cpu().lane, slots_wanted=3))
    assert decide(REQUEST, replace(gpu, lane=replace(gpu.lane, slots_wanted=3)), three).route is Route.GPU_QUEUE


def test_a_peer_measured_to_finish_sooner_than_the_gpu_wait_takes_the_request():
    decision = decide(REQUEST, busy_gpu(queued=8), idle_cpu())
    fast = PeerView("desk", PeerRole.FALLBACK, estimated_latency_s=3.0)
    slow = PeerView("desk", PeerRole.FALLBACK, estimated_latency_s=9.0)
    routed, peer = offer_to_peer(decision, REQUEST, [fast])
    assert (routed.route, peer) == (Route.PEER, "desk")
    assert "peer desk is expected to finish first (about 3.0 s against 8.0 s" in routed.detail
    # Slower than waiting, or unmeasured, or only an overflow peer: wait.
    for other in (slow, replace(fast, estimated_latency_s=None), replace(fast, role=PeerRole.OVERFLOW)):
        assert offer_to_peer(decision, REQUEST, [other]) == (decision, None)
    # Compared at the same length as the local estimates (all of max_tokens),
    # not the shorter expected answer the client is told.
    assert offer_to_peer(decision, REQUEST, [replace(fast, finish_s=9.0)]) == (decision, None)


def test_a_peer_slower_than_the_cpu_chosen_over_the_gpu_leaves_it_on_the_cpu():
    decision = decide(REQUEST, busy_gpu(queued=40), idle_cpu())
    assert decision.route is Route.CPU
    slower = PeerView("desk", PeerRole.FALLBACK, estimated_latency_s=30.0)
    assert offer_to_peer(decision, REQUEST, [slower]) == (decision, None)
    faster = replace(slower, estimated_latency_s=5.0)
    assert offer_to_peer(decision, REQUEST, [faster])[0].route is Route.PEER


def test_the_queue_limit_is_a_memory_guard_at_ollamas_scale_and_the_time_budget_still_refuses():
    # Hundreds by default (8 GPU and 16 CPU places shed a burst of 64).
    assert GpuConfig().queue_limit == CpuConfig().queue_limit == QUEUE_LIMIT
    # Full to the guard: the CPU, however short the GPU wait would be.
    full = busy_gpu(queued=8)
    full = replace(full, lane=replace(full.lane, queued=QUEUE_LIMIT))
    assert decide(REQUEST, full, idle_cpu()).reason is Reason.GPU_BUSY
    # A GPU wait over the budget never waits, even with the CPU unable to
    # answer in time either: a refusal now, not a client left hanging.
    over = replace(busy_gpu(queued=8), backlog_s=30.0)
    slow_cpu = idle_cpu(lane=LaneState(context_cap=2048, running=2, concurrency=2, queued=2,
                                       queue_limit=QUEUE_LIMIT), backlog_s=40.0)
    decision = decide(replace(REQUEST, queue_budget_s=10.0), over, slow_cpu)
    assert decision.route is Route.REJECT and decision.reason is Reason.QUEUE_WAIT_TOO_LONG
