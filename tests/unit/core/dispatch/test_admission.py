"""Admission with plain values: every route reason, and the order they apply in."""

from dataclasses import replace

import pytest

from tray_app.core.dispatch.admission import (
    CpuView, GpuOut, GpuView, LaneState, PeerRole, PeerView, Reason, RequestShape, Route, decide,
    estimate_cpu_latency_s, offer_to_peer,
)

GPU_LANE = LaneState(context_cap=4096, running=0, concurrency=1, queued=0, queue_limit=2)
CPU_LANE = LaneState(context_cap=2048, running=0, concurrency=1, queued=0, queue_limit=4)
GPU = GpuView(lane=GPU_LANE, out=None, free_vram_mib=2000, reserve_mib=512, request_vram_mib=50)
CPU = CpuView(lane=CPU_LANE, can_serve=True, out_reason=None, host_available_mib=16000, ram_floor_mib=1024,
              request_ram_mib=40, tokens_per_s=50.0, prompt_tokens_per_s=500.0, backlog_s=0.0)
SHORT = RequestShape(prompt_tokens=100, max_tokens=100)


def test_fits_on_gpu_is_admitted():
    decision = decide(SHORT, GPU, CPU)
    assert (decision.route, decision.reason) == (Route.GPU, Reason.ADMITTED)


def test_forced_cpu_goes_to_cpu_with_latency_estimate():
    decision = decide(replace(SHORT, force_cpu=True), GPU, CPU)
    assert (decision.route, decision.reason) == (Route.CPU, Reason.FORCED_CPU)
    assert decision.estimated_latency_s == pytest.approx(100 / 50 + 100 / 500)


def test_gpu_out_goes_to_cpu_with_its_reason():
    decision = decide(SHORT, replace(GPU, out=GpuOut(Reason.GPU_UNAVAILABLE, "breaker open")), CPU)
    assert (decision.route, decision.reason) == (Route.CPU, Reason.GPU_UNAVAILABLE)
    assert "breaker open" in decision.detail


def test_over_gpu_context_cap_but_within_cpu_goes_to_cpu():
    gpu = replace(GPU, lane=replace(GPU_LANE, context_cap=1024))
    decision = decide(RequestShape(prompt_tokens=1000, max_tokens=100), gpu, CPU)
    assert decision.reason is Reason.GPU_CONTEXT_CAP and decision.route is Route.CPU


def test_over_every_cap_is_a_client_error():
    decision = decide(RequestShape(prompt_tokens=4000, max_tokens=200), GPU, CPU)
    assert decision.route is Route.REJECT and decision.status == 400
    assert decision.reason is Reason.CONTEXT_LENGTH_EXCEEDED


def test_vram_headroom_counts_the_reserve():
    # 560 free - 512 reserve = 48 < 50 needed
    decision = decide(SHORT, replace(GPU, free_vram_mib=560), CPU)
    assert decision.reason is Reason.GPU_VRAM_HEADROOM and decision.route is Route.CPU
    # 562 free - 512 = 50: just fits
    assert decide(SHORT, replace(GPU, free_vram_mib=562), CPU).route is Route.GPU


def test_unknown_vram_never_admits_to_gpu():
    decision = decide(SHORT, replace(GPU, free_vram_mib=None), CPU)
    assert decision.route is Route.CPU and decision.reason is Reason.GPU_UNAVAILABLE


def test_busy_gpu_queues_then_overflows_to_cpu():
    busy = replace(GPU, lane=replace(GPU_LANE, running=1))
    assert decide(SHORT, busy, CPU).route is Route.GPU_QUEUE
    full = replace(GPU, lane=replace(GPU_LANE, running=1, queued=2))
    decision = decide(SHORT, full, CPU)
    assert (decision.route, decision.reason) == (Route.CPU, Reason.GPU_BUSY)


def test_cpu_queue_full_is_503_with_retry_after():
    cpu = replace(CPU, lane=replace(CPU_LANE, running=1, queued=4), backlog_s=12.2)
    decision = decide(SHORT, replace(GPU, out=GpuOut(Reason.GPU_UNAVAILABLE, "down")), cpu)
    assert decision.route is Route.REJECT and decision.status == 503
    assert decision.reason is Reason.CPU_QUEUE_FULL and decision.retry_after_s == 13


def test_replay_is_never_refused_for_queue_space():
    cpu = replace(CPU, lane=replace(CPU_LANE, running=1, queued=4))
    decision = decide(replace(SHORT, is_replay=True), GPU, cpu)
    assert (decision.route, decision.reason) == (Route.CPU, Reason.GPU_FAILED_REPLAYED)


def test_ram_floor_refuses_cpu():
    cpu = replace(CPU, host_available_mib=1050)
    decision = decide(SHORT, replace(GPU, out=GpuOut(Reason.GPU_UNAVAILABLE, "down")), cpu)
    assert decision.reason is Reason.RAM_FLOOR and decision.status == 503


def test_a_cpu_load_counts_its_ram_and_what_unloading_idle_models_would_free():
    down = replace(GPU, out=GpuOut(Reason.GPU_UNAVAILABLE, "down"))
    # 1500 available, a 600 MiB load and a 1024 floor: short of room...
    cpu = replace(CPU, host_available_mib=1500, load_ram_mib=600)
    refused = decide(SHORT, down, cpu)
    assert refused.reason is Reason.RAM_FLOOR and "loading the CPU model (600 MiB)" in refused.detail
    # ...unless another model's idle CPU worker could be unloaded for it.
    assert decide(SHORT, down, replace(cpu, evictable_ram_mib=400)).route is Route.CPU
    assert decide(SHORT, down, replace(cpu, evictable_ram_mib=100)).reason is Reason.RAM_FLOOR


def test_deadline_shorter_than_cpu_estimate_is_refused_at_once():
    cpu = replace(CPU, backlog_s=3.0)
    decision = decide(replace(SHORT, deadline_s=4.0), replace(GPU, out=GpuOut(Reason.GPU_UNAVAILABLE, "down")), cpu)
    assert decision.reason is Reason.DEADLINE_TOO_SHORT and decision.status == 503
    assert decision.estimated_latency_s == pytest.approx(3.0 + 2.0 + 0.2)
    assert decide(replace(SHORT, deadline_s=6.0), replace(GPU, out=GpuOut(Reason.GPU_UNAVAILABLE, "down")), cpu).route is Route.CPU


def test_deadline_does_not_apply_on_gpu():
    assert decide(replace(SHORT, deadline_s=0.01), GPU, CPU).route is Route.GPU


def test_no_cpu_worker_and_no_gpu_is_503():
    cpu = replace(CPU, can_serve=False, out_reason="bad model")
    decision = decide(SHORT, replace(GPU, out=GpuOut(Reason.GPU_UNAVAILABLE, "down")), cpu)
    assert decision.reason is Reason.NO_WORKER and decision.status == 503


def test_no_gpu_path_is_cpu_only_not_a_gpu_failover():
    decision = decide(SHORT, None, CPU)
    assert decision.route is Route.CPU and decision.reason is Reason.CPU_ONLY
    # Even when the client asks for the CPU: there is no GPU to pause.
    assert decide(replace(SHORT, force_cpu=True), None, CPU).reason is Reason.CPU_ONLY
    # Nor is it a fallback a client can refuse (X-Fallback: never): the CPU serves it.
    never = decide(replace(SHORT, no_fallback=True), None, CPU)
    assert (never.route, never.reason) == (Route.CPU, Reason.CPU_ONLY)
    # A fallback peer (a GPU elsewhere on the LAN) still comes before the local CPU.
    routed, peer = offer_to_peer(decision, SHORT, [PeerView("desk", PeerRole.FALLBACK, 2.0)])
    assert peer == "desk" and routed.route is Route.PEER
    assert offer_to_peer(decision, SHORT, [PeerView("attic", PeerRole.OVERFLOW, 1.0)]) == (decision, None)


def test_cpu_latency_includes_backlog():
    assert estimate_cpu_latency_s(SHORT, replace(CPU, backlog_s=10)) == pytest.approx(12.2)


# ----- queues sized by time ------------------------------------------------------------

BUSY_GPU = replace(GPU, lane=replace(GPU_LANE, running=4, concurrency=4, queued=1, queue_limit=8))
BUSY_CPU = replace(CPU, lane=replace(CPU_LANE, running=2, concurrency=2, queued=3, queue_limit=16))


def test_a_busy_gpu_queues_a_request_whose_wait_fits_its_budget():
    decision = decide(replace(SHORT, queue_budget_s=60), replace(BUSY_GPU, backlog_s=12), CPU)
    assert (decision.route, decision.reason) == (Route.GPU_QUEUE, Reason.ADMITTED)
    assert decision.estimated_latency_s == 12


def test_a_busy_gpu_sends_a_request_whose_wait_is_over_budget_to_the_cpu():
    decision = decide(replace(SHORT, queue_budget_s=10), replace(BUSY_GPU, backlog_s=12), CPU)
    assert (decision.route, decision.reason) == (Route.CPU, Reason.GPU_BUSY)
    assert "queue budget" in decision.detail and "4 GPU slots" in decision.detail


def test_without_a_budget_only_the_count_limits_the_gpu_queue():
    assert decide(SHORT, replace(BUSY_GPU, backlog_s=1e6), CPU).route is Route.GPU_QUEUE
    full = replace(BUSY_GPU, lane=replace(BUSY_GPU.lane, queued=8))
    decision = decide(SHORT, full, CPU)
    assert decision.reason is Reason.GPU_BUSY and "queue is full (8/8)" in decision.detail


def test_a_cpu_wait_over_budget_is_refused_at_once_with_retry_after():
    decision = decide(replace(SHORT, force_cpu=True, queue_budget_s=5), GPU, replace(BUSY_CPU, backlog_s=7.2))
    assert (decision.route, decision.reason, decision.status) == (Route.REJECT, Reason.QUEUE_WAIT_TOO_LONG, 503)
    assert decision.retry_after_s == 8


def test_a_cpu_wait_within_budget_queues():
    decision = decide(replace(SHORT, force_cpu=True, queue_budget_s=10), GPU, replace(BUSY_CPU, backlog_s=7.2))
    assert decision.route is Route.CPU


def test_a_free_cpu_slot_never_counts_the_budget():
    decision = decide(replace(SHORT, force_cpu=True, queue_budget_s=0), GPU, replace(CPU, backlog_s=0))
    assert decision.route is Route.CPU


def test_a_replay_is_never_refused_for_its_wait():
    decision = decide(replace(SHORT, is_replay=True, queue_budget_s=1), GPU, replace(BUSY_CPU, backlog_s=100))
    assert (decision.route, decision.reason) == (Route.CPU, Reason.GPU_FAILED_REPLAYED)
