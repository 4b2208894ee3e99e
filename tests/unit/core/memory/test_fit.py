from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tray_app.core.memory.estimate import MIB, WorkerSettings, estimate_worker
from tray_app.core.memory.fit import (
    CONTEXT_STEP,
    Headroom,
    Profile,
    Verdict,
    describe_fit,
    fit_model,
    format_mib,
    headroom_from_status,
)
from tray_app.core.memory.gguf_info import ModelInfo

RESERVE = 512
FLOOR = 1024


def llama3_8b_shape(n_ctx_train: int = 8192) -> ModelInfo:
    """Llama-3-8B's published shape; sizes are round stand-ins."""
    return ModelInfo(
        path=Path("llama3-8b.gguf"), file_size=0, architecture="llama", name="shape only", file_type="Q4_K_M",
        parameter_count=8_030_261_248, n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim_k=128,
        head_dim_v=128, n_ctx_train=n_ctx_train, n_vocab=128_256, layer_bytes=(100 * MIB,) * 32,
        non_layer_bytes=700 * MIB, output_bytes=400 * MIB, chat_template=None, tokenizer_model="gpt2",
    )




def need_mib(info: ModelInfo, n_ctx: int, n_gpu_layers: int) -> tuple[float, float]:
    """The estimator asked directly, as the service asks it (logits_all=False)."""
    footprint = estimate_worker(info, WorkerSettings(n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, logits_all=False))
    return footprint.gpu.total / MIB, footprint.host.total / MIB


def headroom(vram_free: float | None, ram_available: float = 64 * 1024) -> Headroom:
    return Headroom(vram_free_mib=vram_free, ram_available_mib=ram_available, vram_reserve_mib=RESERVE,
                    ram_floor_mib=FLOOR, vram_unknown_reason="NVML not found")


# --- unknown VRAM ----------------------------------------------------------------


def test_unknown_vram_never_says_a_gpu_profile_fits():
    fit = fit_model(llama3_8b_shape(), headroom(None), gpu_n_ctx=4096, cpu_n_ctx=2048)
    for profile in (Profile.GPU_RESIDENT, Profile.SPLIT):
        result = fit.profile(profile)
        assert result.verdict is Verdict.UNKNOWN
        assert result.max_n_ctx is None
        assert "NVML not found" in result.reason
        assert describe_fit(result) == "unknown (no GPU reading)"
    # The CPU is still judged: it does not need the GPU reading.
    assert fit.profile(Profile.CPU_ONLY).verdict is Verdict.FITS


# --- a big GPU -------------------------------------------------------------------


def test_everything_fits_on_a_big_gpu_up_to_the_trained_context():
    fit = fit_model(llama3_8b_shape(), headroom(80 * 1024), gpu_n_ctx=4096, cpu_n_ctx=2048)
    resident = fit.profile(Profile.GPU_RESIDENT)
    assert resident.verdict is Verdict.FITS
    assert resident.n_gpu_layers == -1 and resident.layers_on_gpu == resident.layers_total == 33
    assert resident.max_n_ctx == 8192
    assert describe_fit(resident) == "fits at 4096 (max 8192)"
    split = fit.profile(Profile.SPLIT)
    assert split.verdict is Verdict.NOT_NEEDED
    assert describe_fit(split) == "not needed: the whole model fits on the GPU"


# --- the split ---------------------------------------------------------------------


@pytest.mark.parametrize("vram_free", [2000, 2600, 3300, 4000])
def test_split_takes_the_most_layers_that_fit(vram_free):
    info = llama3_8b_shape()
    fit = fit_model(info, headroom(vram_free), gpu_n_ctx=4096, cpu_n_ctx=2048)
    assert fit.profile(Profile.GPU_RESIDENT).verdict is Verdict.DOES_NOT_FIT
    split = fit.profile(Profile.SPLIT)
    assert split.verdict is Verdict.FITS
    room = vram_free - RESERVE
    layers = split.n_gpu_layers
    assert 1 <= layers <= info.n_layer
    assert need_mib(info, 4096, layers)[0] <= room
    # One more layer would not fit: this is the largest split, not just a split.
    assert need_mib(info, 4096, layers + 1)[0] > room
    assert split.layers_on_gpu == layers and split.layers_total == info.n_layer + 1
    assert describe_fit(split).startswith(
        f"fits at 4096 with {layers} of {info.n_layer + 1} layers on the GPU (--gpu-layers {layers})")


def test_more_vram_never_means_fewer_split_layers():
    info = llama3_8b_shape()
    layers = [fit_model(info, headroom(free), gpu_n_ctx=4096, cpu_n_ctx=2048).profile(Profile.SPLIT).n_gpu_layers
              for free in range(1800, 4200, 100)]
    assert layers == sorted(layers)
    assert layers[0] < layers[-1]


def test_nothing_fits_on_a_tiny_gpu():
    info = llama3_8b_shape()
    fit = fit_model(info, headroom(RESERVE + 100), gpu_n_ctx=4096, cpu_n_ctx=2048)
    split = fit.profile(Profile.SPLIT)
    assert split.verdict is Verdict.DOES_NOT_FIT
    assert split.n_gpu_layers == 1  # the smallest split is reported, the closest to fitting
    assert split.max_n_ctx is None  # not even the smallest context fits
    line = describe_fit(fit.profile(Profile.GPU_RESIDENT))
    vram_need = need_mib(info, 4096, -1)[0]
    assert line == (f"does not fit at 4096: needs {format_mib(vram_need)} VRAM, "
                    "100 MiB free above the 512 MiB reserve")


def test_no_vram_above_the_reserve_reads_nothing_free():
    fit = fit_model(llama3_8b_shape(), headroom(RESERVE - 200), gpu_n_ctx=4096, cpu_n_ctx=2048)
    assert "nothing free above the 512 MiB reserve" in describe_fit(fit.profile(Profile.GPU_RESIDENT))


# --- the largest context -------------------------------------------------------------


@pytest.mark.parametrize("vram_free", [5000, 5600, 6400, 7000])
def test_max_context_is_the_largest_step_that_fits(vram_free):
    info = llama3_8b_shape(n_ctx_train=32768)
    resident = fit_model(info, headroom(vram_free), gpu_n_ctx=2048, cpu_n_ctx=2048).profile(Profile.GPU_RESIDENT)
    room = vram_free - RESERVE
    best = resident.max_n_ctx
    assert best is not None and best % CONTEXT_STEP == 0
    assert need_mib(info, best, -1)[0] <= room
    assert best == info.n_ctx_train or need_mib(info, best + CONTEXT_STEP, -1)[0] > room


def test_a_profile_that_misses_at_the_configured_context_suggests_a_smaller_one():
    info = llama3_8b_shape(n_ctx_train=32768)
    room_for_8k = need_mib(info, 8192, -1)[0]
    resident = fit_model(info, headroom(room_for_8k + RESERVE), gpu_n_ctx=16384,
                         cpu_n_ctx=2048).profile(Profile.GPU_RESIDENT)
    assert resident.verdict is Verdict.DOES_NOT_FIT
    assert resident.max_n_ctx == 8192
    assert describe_fit(resident).endswith("; fits at up to 8192")


def test_contexts_are_capped_at_the_trained_context():
    fit = fit_model(llama3_8b_shape(n_ctx_train=4096), headroom(80 * 1024), gpu_n_ctx=16384, cpu_n_ctx=16384)
    for result in fit.profiles:
        assert result.n_ctx == 4096
    assert fit.profile(Profile.GPU_RESIDENT).max_n_ctx == 4096


def test_without_a_trained_context_the_search_stops_at_the_configured_one():
    fit = fit_model(llama3_8b_shape(n_ctx_train=0), headroom(80 * 1024), gpu_n_ctx=4096, cpu_n_ctx=2048)
    assert fit.profile(Profile.GPU_RESIDENT).max_n_ctx == 4096
    assert fit.profile(Profile.CPU_ONLY).max_n_ctx == 2048


# --- host RAM ----------------------------------------------------------------------


def test_cpu_only_is_judged_against_ram_above_the_floor():
    info = llama3_8b_shape()
    ram_need = need_mib(info, 2048, 0)[1]
    just_enough = fit_model(info, headroom(None, ram_available=ram_need + FLOOR), gpu_n_ctx=4096, cpu_n_ctx=2048)
    assert just_enough.profile(Profile.CPU_ONLY).verdict is Verdict.FITS
    short = fit_model(info, headroom(None, ram_available=ram_need + FLOOR - 1), gpu_n_ctx=4096, cpu_n_ctx=2048)
    cpu = short.profile(Profile.CPU_ONLY)
    assert cpu.verdict is Verdict.DOES_NOT_FIT
    assert "RAM" in cpu.reason and "above the 1.0 GiB floor" in cpu.reason and "VRAM" not in cpu.reason
    assert cpu.vram_need_mib == 0


def test_a_gpu_profile_also_needs_its_host_side_to_fit():
    info = llama3_8b_shape()
    ram_need = need_mib(info, 4096, -1)[1]
    fit = fit_model(info, headroom(80 * 1024, ram_available=FLOOR + ram_need / 2), gpu_n_ctx=4096, cpu_n_ctx=2048)
    resident = fit.profile(Profile.GPU_RESIDENT)
    assert resident.verdict is Verdict.DOES_NOT_FIT
    assert "RAM" in resident.reason and "VRAM" not in resident.reason


# --- the real bundled model ------------------------------------------------------------


def test_smollm2_on_a_roomy_simulated_gpu(smollm2):
    fit = fit_model(smollm2, headroom(4096), gpu_n_ctx=4096, cpu_n_ctx=2048)
    assert describe_fit(fit.profile(Profile.GPU_RESIDENT)) == "fits at 4096 (max 8192)"
    assert describe_fit(fit.profile(Profile.CPU_ONLY)) == "fits at 2048 (max 8192)"
    assert fit.profile(Profile.GPU_RESIDENT).layers_total == smollm2.n_layer + 1


def test_to_dict_carries_the_numbers_and_the_summary(smollm2):
    result = fit_model(smollm2, headroom(4096), gpu_n_ctx=4096, cpu_n_ctx=2048).profile(Profile.CPU_ONLY)
    data = result.to_dict()
    assert data["profile"] == "cpu_only" and data["verdict"] == "fits"
    assert data["n_ctx"] == 2048 and data["max_n_ctx"] == 8192 and data["n_gpu_layers"] == 0
    assert data["summary"] == describe_fit(result)
    assert data["ram_need_mib"] == round(need_mib(smollm2, 2048, 0)[1], 1)


# --- headroom from a running service ------------------------------------------------------


def test_headroom_from_status_reads_the_live_numbers():
    status = {"gpu": {"available": True, "free_mib": 3000.0, "reserve_mib": 700, "reason": None},
              "ram": {"available_mib": 12000.0}}
    room = headroom_from_status(status, ram_floor_mib=FLOOR, default_reserve_mib=RESERVE)
    assert (room.vram_free_mib, room.vram_reserve_mib, room.ram_available_mib) == (3000.0, 700.0, 12000.0)
    assert room.vram_room_mib == 2300.0 and room.ram_room_mib == 12000.0 - FLOOR


def test_headroom_from_status_without_a_gpu_is_unknown_not_zero():
    status = {"gpu": {"available": False, "free_mib": None, "reason": "NVML: driver not loaded"},
              "ram": {"available_mib": 12000.0}}
    room = headroom_from_status(status, ram_floor_mib=FLOOR, default_reserve_mib=RESERVE)
    assert room.vram_free_mib is None and room.vram_room_mib is None
    assert room.vram_unknown_reason == "NVML: driver not loaded"
    assert room.vram_reserve_mib == RESERVE


def test_an_unavailable_gpu_with_stale_numbers_is_still_unknown():
    status = {"gpu": {"available": False, "free_mib": 5000.0}, "ram": {"available_mib": 1.0}}
    assert headroom_from_status(status, ram_floor_mib=0, default_reserve_mib=0).vram_free_mib is None


def test_format_mib():
    assert format_mib(612.4) == "612 MiB"
    assert format_mib(1536) == "1.5 GiB"


def test_fit_is_a_frozen_value(smollm2):
    result = fit_model(smollm2, headroom(4096), gpu_n_ctx=4096, cpu_n_ctx=2048)
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.profiles[0].n_ctx = 1  # type: ignore[misc]
