from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tray_app.core.memory.estimate import (
    MIB,
    WorkerSettings,
    compute_buffer_bytes,
    estimate_worker,
    kv_bytes_per_token,
    layers_offloaded,
    request_vram_bytes,
)
from tray_app.core.memory.gguf_info import ModelInfo




def llama3_8b_shape() -> ModelInfo:
    """Llama-3-8B's published shape; sizes are round stand-ins."""
    return ModelInfo(
        path=Path("llama3-8b.gguf"), file_size=0, architecture="llama", name="shape only", file_type="Q4_K_M",
        parameter_count=8_030_261_248, n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim_k=128,
        head_dim_v=128, n_ctx_train=8192, n_vocab=128_256, layer_bytes=(100 * MIB,) * 32,
        non_layer_bytes=700 * MIB, output_bytes=400 * MIB, chat_template=None, tokenizer_model="gpt2",
    )


# --- KV cache --------------------------------------------------------------


def test_kv_per_token_matches_the_published_llama3_8b_figure() -> None:
    # 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB per token.
    assert kv_bytes_per_token(llama3_8b_shape()) == 128 * 1024


def test_kv_per_token_smollm2(smollm2: ModelInfo) -> None:
    assert kv_bytes_per_token(smollm2) == 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_token(smollm2, "q8_0") == 2 * 30 * 3 * 64 * 34 // 32
    assert kv_bytes_per_token(smollm2, "q4_0") == 2 * 30 * 3 * 64 * 18 // 32


# llama.cpp's own log lines for SmolLM2 (llama-cpp-python 0.3.36), e.g.
# "llama_kv_cache: size = 45.00 MiB ( 2048 cells, 30 layers, 1/1 seqs)".
@pytest.mark.parametrize(("n_ctx", "kv_mib"), [(512, 11.25), (1000, 22.50), (2048, 45.0), (8192, 180.0)])
def test_kv_cache_matches_llama_cpp(smollm2: ModelInfo, n_ctx: int, kv_mib: float) -> None:
    # n_ctx 1000 shows the padding to 256 cells (llama.cpp logged n_ctx = 1024).
    footprint = estimate_worker(smollm2, WorkerSettings(n_ctx=n_ctx, n_gpu_layers=0))
    assert footprint.host.kv_cache == kv_mib * MIB


def test_n_ctx_zero_means_the_training_context(smollm2: ModelInfo) -> None:
    zero = estimate_worker(smollm2, WorkerSettings(n_ctx=0, n_gpu_layers=0))
    explicit = estimate_worker(smollm2, WorkerSettings(n_ctx=8192, n_gpu_layers=0))
    assert zero == explicit


def test_unknown_kv_type_is_rejected() -> None:
    with pytest.raises(ValueError, match="kv_type 'q3_k'"):
        WorkerSettings(n_ctx=2048, n_gpu_layers=0, kv_type="q3_k")


# --- Compute buffer --------------------------------------------------------

# "sched_reserve: CPU compute buffer size = ... MiB" logged by llama.cpp for
# SmolLM2 (llama-cpp-python 0.3.36) at these settings.
LLAMA_CPP_COMPUTE_BUFFER_MIB = [
    # n_ctx, n_ubatch, flash_attn, MiB
    (512, 512, False, 98.25),
    (2048, 512, False, 99.38),
    (8192, 512, False, 166.38),
    (16384, 512, False, 326.38),
    (8192, 128, False, 41.60),
    (2048, 512, True, 102.51),
    (8192, 512, True, 98.25),
]


@pytest.mark.parametrize(("n_ctx", "n_ubatch", "flash_attn", "logged_mib"), LLAMA_CPP_COMPUTE_BUFFER_MIB)
def test_compute_buffer_within_5_percent_of_llama_cpp(
    smollm2: ModelInfo, n_ctx: int, n_ubatch: int, flash_attn: bool, logged_mib: float
) -> None:
    settings = WorkerSettings(n_ctx=n_ctx, n_gpu_layers=0, n_ubatch=n_ubatch, flash_attn=flash_attn)
    assert compute_buffer_bytes(smollm2, settings) / MIB == pytest.approx(logged_mib, rel=0.05)


# --- Host footprint, checked against measured RSS --------------------------

# RSS of `python -m llama_cpp.server` (llama-cpp-python 0.3.36, CPU build) after
# a prompt that filled the context, from benchmarks/estimate_vs_rss.py.
MEASURED_FULL_CONTEXT_RSS_MIB = [
    # n_ctx, logits_all, MiB
    (2048, True, 832.2),
    (8192, True, 2225.7),
    (2048, False, 295.4),
    (8192, False, 594.9),
]


@pytest.mark.parametrize(("n_ctx", "logits_all", "rss_mib"), MEASURED_FULL_CONTEXT_RSS_MIB)
def test_host_estimate_tracks_measured_rss(smollm2: ModelInfo, n_ctx: int, logits_all: bool, rss_mib: float) -> None:
    host = estimate_worker(smollm2, WorkerSettings(n_ctx=n_ctx, n_gpu_layers=0, logits_all=logits_all)).host
    assert host.total / MIB == pytest.approx(rss_mib, rel=0.05)


def test_logits_all_costs_a_vocab_row_per_context_token(smollm2: ModelInfo) -> None:
    lean = estimate_worker(smollm2, WorkerSettings(n_ctx=8192, n_gpu_layers=0, logits_all=False)).host
    full = estimate_worker(smollm2, WorkerSettings(n_ctx=8192, n_gpu_layers=0, logits_all=True)).host
    row = smollm2.n_vocab * 4
    # llama-cpp-python's numpy scores (8192 rows) + llama.cpp's output buffer
    # (512 rows instead of 1); at 8k the attention stage dominates the compute buffer.
    assert full.compute - lean.compute == row * 8192 + row * (512 - 1)
    assert full.weights == lean.weights and full.kv_cache == lean.kv_cache


def test_flash_attention_shrinks_long_context_compute(smollm2: ModelInfo) -> None:
    plain = estimate_worker(smollm2, WorkerSettings(n_ctx=16384, n_gpu_layers=0, logits_all=False))
    flash = estimate_worker(smollm2, WorkerSettings(n_ctx=16384, n_gpu_layers=0, logits_all=False, flash_attn=True))
    assert flash.host.compute < plain.host.compute / 5


def test_cpu_worker_uses_no_gpu(smollm2: ModelInfo) -> None:
    footprint = estimate_worker(smollm2, WorkerSettings(n_ctx=2048, n_gpu_layers=0))
    assert footprint.gpu.total == 0
    assert footprint.layers_on_gpu == 0
    assert footprint.host.weights == smollm2.weights_bytes


# --- Splitting between GPU and host ----------------------------------------


@pytest.mark.parametrize(("n_gpu_layers", "expected"), [(-1, 31), (0, 0), (1, 1), (30, 30), (31, 31), (999, 31)])
def test_layers_offloaded_counts_like_llama_cpp(smollm2: ModelInfo, n_gpu_layers: int, expected: int) -> None:
    assert layers_offloaded(smollm2, n_gpu_layers) == expected


def test_one_gpu_layer_is_the_output_layer(smollm2: ModelInfo) -> None:
    footprint = estimate_worker(smollm2, WorkerSettings(n_ctx=2048, n_gpu_layers=1))
    assert footprint.gpu.weights == smollm2.output_bytes
    assert footprint.gpu.kv_cache == 0
    assert footprint.host.kv_cache == 45 * MIB


def test_n_layer_gpu_layers_leave_block_0_on_the_host(smollm2: ModelInfo) -> None:
    footprint = estimate_worker(smollm2, WorkerSettings(n_ctx=2048, n_gpu_layers=30))
    per_block_kv = 45 * MIB // 30
    assert footprint.gpu.weights == sum(smollm2.layer_bytes[1:]) + smollm2.output_bytes
    assert footprint.gpu.kv_cache == 29 * per_block_kv
    assert footprint.host.kv_cache == per_block_kv
    assert footprint.host.weights == smollm2.weights_bytes - sum(smollm2.layer_bytes[1:])


def test_full_offload_keeps_only_token_embd_side_on_the_host(smollm2: ModelInfo) -> None:
    footprint = estimate_worker(smollm2, WorkerSettings(n_ctx=2048, n_gpu_layers=-1))
    assert footprint.layers_on_gpu == 31
    assert footprint.host.kv_cache == 0
    assert footprint.gpu.kv_cache == 45 * MIB
    assert footprint.host.weights == smollm2.non_layer_bytes
    # The host no longer needs an attention-sized scratch buffer.
    partial = estimate_worker(smollm2, WorkerSettings(n_ctx=2048, n_gpu_layers=30))
    assert footprint.host.compute < partial.host.compute


def test_gpu_compute_is_the_full_reservation(smollm2: ModelInfo) -> None:
    settings = WorkerSettings(n_ctx=2048, n_gpu_layers=-1, logits_all=False)
    gpu = estimate_worker(smollm2, settings).gpu
    # cudaMalloc commits all n_ubatch logits rows even when only one is used.
    assert gpu.compute >= compute_buffer_bytes(smollm2, settings)
    assert gpu.runtime_overhead > 0


def test_more_offload_moves_memory_to_the_gpu(smollm2: ModelInfo) -> None:
    totals = [estimate_worker(smollm2, WorkerSettings(n_ctx=4096, n_gpu_layers=g)) for g in (1, 10, 20, 31)]
    gpu = [f.gpu.weights + f.gpu.kv_cache for f in totals]
    host = [f.host.weights + f.host.kv_cache for f in totals]
    assert gpu == sorted(gpu) and len(set(gpu)) == 4
    assert host == sorted(host, reverse=True) and len(set(host)) == 4


# --- Per-request VRAM ------------------------------------------------------


def test_request_on_a_cpu_worker_needs_no_vram(smollm2: ModelInfo) -> None:
    assert request_vram_bytes(smollm2, WorkerSettings(n_ctx=2048, n_gpu_layers=0), 1000) == 0


def test_request_vram_is_kv_plus_logits(smollm2: ModelInfo) -> None:
    settings = WorkerSettings(n_ctx=2048, n_gpu_layers=-1)
    assert request_vram_bytes(smollm2, settings, 100) == 100 * 23040 + 100 * smollm2.n_vocab * 4


def test_request_logits_are_capped_at_one_ubatch(smollm2: ModelInfo) -> None:
    settings = WorkerSettings(n_ctx=4096, n_gpu_layers=-1, n_ubatch=256)
    assert request_vram_bytes(smollm2, settings, 1000) == 1000 * 23040 + 256 * smollm2.n_vocab * 4


def test_request_cannot_exceed_the_context(smollm2: ModelInfo) -> None:
    settings = WorkerSettings(n_ctx=2048, n_gpu_layers=-1)
    assert request_vram_bytes(smollm2, settings, 10**6) == request_vram_bytes(smollm2, settings, 2048)


def test_request_counts_only_offloaded_blocks(smollm2: ModelInfo) -> None:
    only_output = WorkerSettings(n_ctx=2048, n_gpu_layers=1)
    assert request_vram_bytes(smollm2, only_output, 10) == 10 * smollm2.n_vocab * 4
    half = WorkerSettings(n_ctx=2048, n_gpu_layers=16)  # output + 15 blocks
    assert request_vram_bytes(smollm2, half, 10) == 10 * 15 * 2 * 3 * 64 * 2 + 10 * smollm2.n_vocab * 4


def test_settings_are_frozen() -> None:
    settings = WorkerSettings(n_ctx=2048, n_gpu_layers=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.n_ctx = 1  # type: ignore[misc]


def test_every_slot_has_its_own_kv_cache_and_attention_spans_one_slot(smollm2: ModelInfo) -> None:
    # llama-server -np 4 -c 8192 --no-kv-unified logs "n_slots = 4, n_ctx_slot = 2048": four
    # caches of 2048 cells x 22.5 KiB per token (45 MiB each, as llama.cpp logs for one).
    one = WorkerSettings(n_ctx=2048, n_gpu_layers=0)
    four = WorkerSettings(n_ctx=4 * 2048, n_gpu_layers=0, n_parallel=4)
    assert estimate_worker(smollm2, four).host.kv_cache == 4 * estimate_worker(smollm2, one).host.kv_cache == 180 * MIB
    assert compute_buffer_bytes(smollm2, four) == compute_buffer_bytes(smollm2, one)


# --- a draft model -------------------------------------------------------------


def test_a_draft_model_adds_its_weights_and_a_kv_cache_of_the_same_context(smollm2: ModelInfo) -> None:
    settings = WorkerSettings(n_ctx=4096, n_gpu_layers=-1, n_parallel=2, logits_all=False)
    alone = estimate_worker(llama3_8b_shape(), settings)
    with_draft = estimate_worker(llama3_8b_shape(), dataclasses.replace(settings, draft=smollm2))
    draft_alone = estimate_worker(smollm2, settings)
    assert with_draft.gpu.weights == alone.gpu.weights + draft_alone.gpu.weights
    assert with_draft.gpu.kv_cache == alone.gpu.kv_cache + draft_alone.gpu.kv_cache
    # One process: its CUDA context and runtime are counted once.
    assert with_draft.gpu.runtime_overhead == alone.gpu.runtime_overhead
    assert with_draft.gpu.total > alone.gpu.total + smollm2.weights_bytes
