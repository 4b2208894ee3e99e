"""The automatic context: the largest the memory budget holds, priced by the
real estimator on a real model's shape, with q8_0 only where it lets more fit."""

from __future__ import annotations

from tray_app.core.memory.context_size import (
    AGENT_CONTEXT_TOKENS,
    AUTO,
    FLOOR_CONTEXT_TOKENS,
    choose_context,
    largest_fitting,
)
from tray_app.core.memory.estimate import KV_CELL_PADDING, MIB, WorkerSettings, estimate_worker

from .test_fit import llama3_8b_shape

SLOTS = 4


def gpu_need(info, slots=SLOTS):
    def need(n_ctx: int, kv_type: str) -> float:
        settings = WorkerSettings(n_ctx=n_ctx * slots, n_gpu_layers=-1, n_parallel=slots, logits_all=False,
                                  kv_type=kv_type)
        return estimate_worker(info, settings).gpu.total / MIB
    return need


def test_a_configured_context_is_served_as_set():
    choice = choose_context(configured=3000, trained=131072, room_mib=1.0, need_mib=gpu_need(llama3_8b_shape()))
    assert (choice.n_ctx, choice.kv_type, choice.automatic) == (3000, "f16", False)


def test_a_roomy_card_gets_the_agent_ceiling_or_the_trained_context_whichever_is_smaller():
    info = llama3_8b_shape(n_ctx_train=131072)
    choice = choose_context(configured=AUTO, trained=131072, room_mib=1e9, need_mib=gpu_need(info))
    assert (choice.n_ctx, choice.kv_type, choice.automatic) == (AGENT_CONTEXT_TOKENS, "f16", True)
    assert "agents" in choice.why
    short = llama3_8b_shape(n_ctx_train=8192)
    assert choose_context(configured=AUTO, trained=8192, room_mib=1e9, need_mib=gpu_need(short)).n_ctx == 8192


def test_a_12_gib_card_gets_the_largest_context_that_fits_its_budget_and_no_more():
    info = llama3_8b_shape(n_ctx_train=131072)
    need = gpu_need(info)
    room = 12 * 1024 - 1024.0  # a 12 GiB card less a 1 GiB reserve
    choice = choose_context(configured=AUTO, trained=131072, room_mib=room, need_mib=need, kv_types=("f16",))
    assert FLOOR_CONTEXT_TOKENS < choice.n_ctx < AGENT_CONTEXT_TOKENS
    assert choice.n_ctx % KV_CELL_PADDING == 0
    # The largest: one more cell step would be over the budget.
    assert need(choice.n_ctx, "f16") <= room < need(choice.n_ctx + KV_CELL_PADDING, "f16")
    assert "memory budget" in choice.why


def test_q8_0_is_chosen_only_where_it_lets_a_larger_context_fit():
    info = llama3_8b_shape(n_ctx_train=131072)
    need = gpu_need(info)
    room = 12 * 1024 - 1024.0
    f16 = choose_context(configured=AUTO, trained=131072, room_mib=room, need_mib=need, kv_types=("f16",))
    both = choose_context(configured=AUTO, trained=131072, room_mib=room, need_mib=need)
    assert both.kv_type == "q8_0" and both.n_ctx > f16.n_ctx
    assert "q8_0" in both.why
    # Where f16 already reaches the ceiling, the cache stays f16.
    small = llama3_8b_shape(n_ctx_train=8192)
    roomy = choose_context(configured=AUTO, trained=8192, room_mib=room, need_mib=gpu_need(small))
    assert (roomy.n_ctx, roomy.kv_type) == (8192, "f16")


def test_no_room_for_the_floor_serves_the_floor_and_says_so():
    info = llama3_8b_shape(n_ctx_train=131072)
    choice = choose_context(configured=AUTO, trained=131072, room_mib=100.0, need_mib=gpu_need(info))
    assert (choice.n_ctx, choice.kv_type) == (FLOOR_CONTEXT_TOKENS, "f16")
    assert "no room" in choice.why


def test_an_unknown_budget_or_training_length_serves_the_floor():
    info = llama3_8b_shape()
    assert choose_context(configured=AUTO, trained=8192, room_mib=None, need_mib=gpu_need(info)).n_ctx == 4096
    unknown = choose_context(configured=AUTO, trained=0, room_mib=1e9, need_mib=gpu_need(info))
    assert unknown.n_ctx == FLOOR_CONTEXT_TOKENS and "no trained context" in unknown.why
    # A model trained for less than the floor is never given more than it knows.
    tiny = choose_context(configured=AUTO, trained=2048, room_mib=1e9, need_mib=gpu_need(info))
    assert tiny.n_ctx == 2048


def test_largest_fitting_is_the_boundary_of_a_monotone_need():
    assert largest_fitting(10_000, 5_000.0, lambda n: float(n)) == 4864  # 19 x 256
    assert largest_fitting(10_000, 100.0, lambda n: float(n)) is None
    assert largest_fitting(100, 100.0, lambda n: float(n)) == 100  # below one cell step: the ceiling itself
