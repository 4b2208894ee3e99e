"""Predict the GPU and host memory a llama-cpp-python worker will hold.

Pure arithmetic over ``ModelInfo``: no files, no processes.  The model follows
llama.cpp as vendored by llama-cpp-python 0.3.x and is deliberately simple;
each term names the llama.cpp buffer it stands for.

How llama.cpp splits a model (src/llama-model.cpp, ``i_gpu_start``): it counts
n_layer repeating blocks plus one output layer, and ``n_gpu_layers = g``
offloads the *last* g of those n_layer + 1.  So the output layer goes first
(g = 1 offloads only the output), g = n_layer leaves block 0 on the host, and
g >= n_layer + 1 (or -1) offloads everything.  token_embd always stays on the
host.  The KV cache of a block lives where the block lives.

Host numbers are the resident set the worker reaches once requests have
filled its context, not what it shows right after loading: llama.cpp's CPU
buffers and numpy arrays are committed lazily, page by page, as they are
written.  benchmarks/estimate_vs_rss.py checks them against real workers.
GPU numbers are allocations (cudaMalloc commits at once), so reservations
count in full.  They are not calibrated on a GPU here; see the constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from dataclasses import replace

from .gguf_info import ModelInfo, ProjectorInfo

MIB = 1024 * 1024

# Bytes per element: ggml block size / elements per block for each type
# llama.cpp accepts as --cache-type-k/-v.
KV_TYPE_BYTES: dict[str, float] = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
    "iq4_nl": 18 / 32,
}

F32_BYTES = 4
F16_BYTES = 2
KV_CELL_PADDING = 256  # llama_context pads n_ctx up to a multiple of 256

# Activations alive next to the attention scores or the logits, in rows of
# n_embd floats per token.  Fitted to llama.cpp's own "CPU compute buffer size"
# for SmolLM2 across n_ctx 512..16384 and n_ubatch 128/512 (within 5%).
ACTIVATION_ROWS_PER_TOKEN = 6

# What the worker process holds besides llama.cpp's buffers: CPython, numpy,
# uvicorn/FastAPI/pydantic, the ggml shared libraries and their heaps.
# Measured with benchmarks/estimate_vs_rss.py (llama-cpp-python 0.3.36, CPU
# build, Linux x86-64): RSS minus the modelled buffers was 87-93 MiB after a
# full-context request; rounded up.
HOST_RUNTIME_BASELINE_MIB = 96

# Extra host memory a GPU-enabled worker holds: CUDA driver state, pinned
# staging buffers, cuBLAS.  Not measured here (no GPU); an allowance.
HOST_GPU_RUNTIME_EXTRA_MIB = 256

# GPU memory a worker uses beyond its model, KV and compute buffers: the CUDA
# context (~300-500 MiB on consumer cards, driver dependent), cuBLAS handles and
# workspace, and ggml's CUDA memory pool.  Not measured here; an allowance.
GPU_RUNTIME_OVERHEAD_MIB = 512


@dataclass(frozen=True)
class WorkerSettings:
    n_ctx: int  # total context; 0 means the model's n_ctx_train, as in llama.cpp
    n_gpu_layers: int  # -1 = all layers (llama-cpp-python's convention)
    n_batch: int = 512
    n_ubatch: int = 512
    kv_type: str = "f16"
    # llama-server's slots.  n_ctx is the whole KV cache, split evenly among
    # the slots (no unified KV: see runtime.LlamaServerRuntime), so a slot's
    # attention only ever spans n_ctx / n_parallel cells.
    n_parallel: int = 1
    # llama_cpp.server defaults to logits_all=True, which keeps a float32 row of
    # n_vocab logits for every token of the context in RAM: for SmolLM2 at 8k
    # context that is 1.5 GiB.  Launch with --logits_all False unless logprobs
    # are needed, and say so here.
    logits_all: bool = True
    flash_attn: bool = False  # llama_cpp.server's default
    # The multimodal projector (--mmproj) the worker loads, and the cap on one
    # image's tokens it is started with (--image-max-tokens).
    projector: ProjectorInfo | None = None
    image_max_tokens: int = 0
    # The draft model it speculates with (--model-draft): its weights, and a
    # KV cache of its own as large as the served model's context.
    draft: ModelInfo | None = None

    def __post_init__(self) -> None:
        if self.kv_type not in KV_TYPE_BYTES:
            raise ValueError(f"kv_type {self.kv_type!r} is not one of {', '.join(KV_TYPE_BYTES)}")
        if self.n_ctx < 0 or self.n_batch < 1 or self.n_ubatch < 1 or self.n_parallel < 1:
            raise ValueError(f"nonsensical worker settings: {self}")


@dataclass(frozen=True)
class DeviceNeed:
    weights: int
    kv_cache: int
    compute: int  # compute graph, logits buffers, numpy score rows: scratch that grows with use
    runtime_overhead: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute + self.runtime_overhead


NOTHING = DeviceNeed(0, 0, 0, 0)


@dataclass(frozen=True)
class Footprint:
    # Zeros when nothing is offloaded -- true only for a worker that cannot see
    # the GPU.  A CUDA build at n_gpu_layers=0 still creates a CUDA context and
    # runs big batches on the GPU with a full-size compute buffer there
    # (1108 MiB at -ngl 0 in https://github.com/ggml-org/llama.cpp/issues/8117),
    # so start CPU workers with CUDA_VISIBLE_DEVICES="".
    gpu: DeviceNeed
    host: DeviceNeed  # the worker's RSS once its context has been filled
    layers_on_gpu: int  # llama.cpp's count, of n_layer + 1 (the output layer counts as one)


def layers_offloaded(info: ModelInfo, n_gpu_layers: int) -> int:
    """llama.cpp's "offloaded X/Y layers" X, where Y = n_layer + 1 (the output layer)."""
    offloadable = info.n_layer + 1
    if n_gpu_layers < 0:
        return offloadable
    return min(n_gpu_layers, offloadable)


def kv_bytes_per_token(info: ModelInfo, kv_type: str = "f16") -> int:
    """K and V for one token across all layers."""
    return math.ceil(_kv_bytes_per_token_per_layer(info, kv_type) * info.n_layer)


def estimate_worker(info: ModelInfo, settings: WorkerSettings) -> Footprint:
    text = _estimate_text_worker(info, settings)
    if settings.draft is not None:
        # llama-server loads the draft on the served model's devices, with a
        # context of the same size; the process's own runtime is counted once.
        draft = _estimate_text_worker(settings.draft, replace(settings, draft=None, projector=None))
        text = replace(text, gpu=_with_weights_and_cache(text.gpu, draft.gpu),
                       host=_with_weights_and_cache(text.host, draft.host))
    if settings.projector is None:
        return text
    projector = projector_need(settings.projector, settings.image_max_tokens)
    # llama-server puts the projector on the GPU whenever it has one
    # (--mmproj-offload is on by default), whatever n_gpu_layers says; a worker
    # that offloads nothing is taken to have none.
    if text.layers_on_gpu:
        return replace(text, gpu=_plus(text.gpu, projector), host=_plus(text.host, PROJECTOR_HOST_RUNTIME))
    return replace(text, host=_plus(text.host, replace(projector, runtime_overhead=PROJECTOR_HOST_RUNTIME_BYTES)))


def _with_weights_and_cache(need: DeviceNeed, draft: DeviceNeed) -> DeviceNeed:
    return DeviceNeed(need.weights + draft.weights, need.kv_cache + draft.kv_cache, need.compute + draft.compute,
                      need.runtime_overhead)


def _plus(need: DeviceNeed, more: DeviceNeed) -> DeviceNeed:
    return DeviceNeed(need.weights + more.weights, need.kv_cache, need.compute + more.compute,
                      need.runtime_overhead + more.runtime_overhead)


# What loading any projector adds to the worker's RSS besides its weights and
# compute buffer: mtmd's own context (a second CPU backend and threadpool,
# image decoding and preprocessing buffers). Measured with the tiny projector
# (0.78 MiB of weights, a 0.07 MiB compute buffer) on the bundled llama-server:
# RSS +5.4 MiB after loading, +7.1 MiB after its first image; rounded up.
PROJECTOR_HOST_RUNTIME_BYTES = 8 * MIB
PROJECTOR_HOST_RUNTIME = DeviceNeed(0, 0, 0, PROJECTOR_HOST_RUNTIME_BYTES)


# How llama.cpp sizes a projector's memory (tools/mtmd/clip.cpp): its weights,
# loaded whole, plus one compute buffer that the graph allocator reserves at
# load by building the vision graph for a dummy image ("warmup") of side
# hparams.warmup_image_size, and grows if a later image needs more. For a
# fixed-size encoder (LLaVA's mlp, Gemma 3, ...) every image is resized to
# clip.vision.image_size, so that side is the worst case. For a dynamic-
# resolution one (Qwen-VL, Pixtral, ...) the side follows the image, up to
# image_max_pixels = --image-max-tokens x patch area, and warmup_image_size =
# sqrt(image_max_pixels): the cap bounds the buffer. A type known to be fixed-
# size is charged its image_size; any other the larger of that and the cap,
# so the estimate holds for either kind. In the graph
# the allocator reuses memory between layers, so the buffer is one layer's
# peak: the raw image and its im2col patches, a few rows of activations per
# token (residual, norm, Q, K, V, attention output), the FFN's wide rows, and
# the attention scores (n_head x tokens^2; flash attention skips them, but
# whether the backend has it is only known at load). Checked against the
# tiny projector's "compute buffer size" in llama-server's log (0.07 MiB,
# estimated 0.14 MiB): conservative by design.
VISION_ACTIVATION_ROWS_PER_TOKEN = 6
# clip.projector_type values whose images are always resized to image_size
# (one tile at a time, where the type tiles): --image-max-tokens does not apply.
FIXED_SIZE_PROJECTORS = frozenset({"mlp", "mlp_norm", "ldp", "ldpv2", "gemma3", "idefics3", "internvl", "llama4"})


def image_tokens_bound(projector: ProjectorInfo, image_max_tokens: int) -> int:
    """The most tokens one image (one tile) can become with this projector and cap."""
    if projector.projector_type in FIXED_SIZE_PROJECTORS:
        return projector.tokens_per_image
    return max(projector.tokens_per_image, image_max_tokens)


def projector_need(projector: ProjectorInfo, image_max_tokens: int) -> DeviceNeed:
    """What loading the projector adds: its weights and its compute buffer."""
    tokens = image_tokens_bound(projector, image_max_tokens)
    side = math.isqrt(tokens) * max(projector.patch_size, 1)
    patch_values = 3 * projector.patch_size ** 2
    compute = F32_BYTES * (3 * side * side + tokens * patch_values
                           + tokens * (VISION_ACTIVATION_ROWS_PER_TOKEN * projector.width + 2 * projector.n_ff)
                           + max(projector.n_head, 1) * tokens * tokens)
    return DeviceNeed(weights=projector.weights_bytes, kv_cache=0, compute=compute, runtime_overhead=0)


def _estimate_text_worker(info: ModelInfo, settings: WorkerSettings) -> Footprint:
    offloaded = layers_offloaded(info, settings.n_gpu_layers)
    output_on_gpu = offloaded >= 1
    blocks_on_gpu = max(offloaded - 1, 0)  # the output layer is the first one offloaded
    blocks_on_host = info.n_layer - blocks_on_gpu
    kv_cells = _kv_cells(info, settings)
    kv_per_block = math.ceil(_kv_bytes_per_token_per_layer(info, settings.kv_type) * kv_cells)

    logits_rows = _ubatch(info, settings) if settings.logits_all else 1
    host_logits_scratch = (
        # llama.cpp's output buffer holds one row per output token of a batch...
        info.n_vocab * F32_BYTES * (_batch(info, settings) if settings.logits_all else 1)
        # ...and llama-cpp-python copies every row into its numpy `scores`.
        + (info.n_vocab * F32_BYTES * kv_cells if settings.logits_all else 0)
    )

    if not output_on_gpu:
        # Host pages are committed when written, so only the logits rows that
        # are actually produced count, not the n_ubatch rows llama.cpp reserves.
        compute = compute_buffer_bytes(info, settings, logits_rows) + _attention_conversion(info, settings)
        host = DeviceNeed(
            weights=info.weights_bytes,
            kv_cache=kv_per_block * info.n_layer,
            compute=compute + host_logits_scratch,
            runtime_overhead=HOST_RUNTIME_BASELINE_MIB * MIB,
        )
        return Footprint(gpu=NOTHING, host=host, layers_on_gpu=0)

    offloaded_weights = sum(info.layer_bytes[info.n_layer - blocks_on_gpu :])
    gpu = DeviceNeed(
        weights=offloaded_weights + info.output_bytes,
        kv_cache=kv_per_block * blocks_on_gpu,
        # cudaMalloc commits the whole reservation, sized for n_ubatch output rows.
        compute=compute_buffer_bytes(info, settings) + _attention_conversion(info, settings),
        runtime_overhead=GPU_RUNTIME_OVERHEAD_MIB * MIB,
    )
    # Blocks left on the host compute their attention on the host, so the
    # host needs an attention-sized buffer too; otherwise it only stages input.
    host_compute = (
        _attention_stage(info, settings) + _attention_conversion(info, settings)
        if blocks_on_host
        else 2 * _ubatch(info, settings) * info.n_embd * F32_BYTES
    )
    host = DeviceNeed(
        # An untied output matrix on the GPU stays counted here: conservative
        # by one vocab x embd matrix, because ModelInfo does not say if it is tied.
        weights=info.weights_bytes - offloaded_weights,
        kv_cache=kv_per_block * blocks_on_host,
        compute=host_compute + host_logits_scratch,
        runtime_overhead=(HOST_RUNTIME_BASELINE_MIB + HOST_GPU_RUNTIME_EXTRA_MIB) * MIB,
    )
    return Footprint(gpu=gpu, host=host, layers_on_gpu=offloaded)


def request_vram_bytes(info: ModelInfo, settings: WorkerSettings, n_tokens: int) -> int:
    """GPU memory one request of n_tokens may add beyond the worker's loaded footprint.

    llama.cpp preallocates its KV cache and compute buffers, so on a healthy
    llama.cpp worker this is a safety margin rather than a prediction: it
    covers ggml's CUDA pool growing for long prompts (cuBLAS scratch is taken
    on demand and kept), allocator rounding and fragmentation, and runtimes
    that grow the KV cache lazily, where it is exactly the growth.  Sized as
    the request's KV on the offloaded blocks plus its logits on the GPU.
    """
    offloaded = layers_offloaded(info, settings.n_gpu_layers)
    if offloaded == 0 or n_tokens <= 0:
        return 0
    tokens = min(n_tokens, _slot_cells(info, settings))
    blocks_on_gpu = max(offloaded - 1, 0)
    kv = math.ceil(_kv_bytes_per_token_per_layer(info, settings.kv_type) * blocks_on_gpu * tokens)
    logits = info.n_vocab * F32_BYTES * min(tokens, _ubatch(info, settings))
    return kv + logits


def compute_buffer_bytes(info: ModelInfo, settings: WorkerSettings, logits_rows: int | None = None) -> int:
    """llama.cpp's compute buffer: the larger of the attention and the output stage.

    The graph allocator reuses memory between stages, so the buffer is the
    peak of the two, not their sum.  llama.cpp reserves logits for n_ubatch
    rows (the default); pass fewer for the part a host actually touches.
    """
    rows = _ubatch(info, settings) if logits_rows is None else logits_rows
    output_stage = info.n_vocab * rows * F32_BYTES + _activations(info, settings)
    return max(_attention_stage(info, settings), output_stage)


def _kv_bytes_per_token_per_layer(info: ModelInfo, kv_type: str) -> float:
    if kv_type not in KV_TYPE_BYTES:
        raise ValueError(f"kv_type {kv_type!r} is not one of {', '.join(KV_TYPE_BYTES)}")
    return info.n_head_kv * (info.head_dim_k + info.head_dim_v) * KV_TYPE_BYTES[kv_type]


def _kv_cells(info: ModelInfo, settings: WorkerSettings) -> int:
    """Cells in the whole KV cache: every slot's."""
    return _slot_cells(info, settings) * settings.n_parallel


def _slot_cells(info: ModelInfo, settings: WorkerSettings) -> int:
    """Cells one sequence can attend over: one slot's share of the cache."""
    n_ctx = (settings.n_ctx or info.n_ctx_train) // settings.n_parallel
    return -(-n_ctx // KV_CELL_PADDING) * KV_CELL_PADDING


def _batch(info: ModelInfo, settings: WorkerSettings) -> int:
    return min(settings.n_batch, _kv_cells(info, settings))  # llama.cpp caps n_batch at n_ctx


def _ubatch(info: ModelInfo, settings: WorkerSettings) -> int:
    return min(settings.n_ubatch, _batch(info, settings))


def _activations(info: ModelInfo, settings: WorkerSettings) -> int:
    return _ubatch(info, settings) * info.n_embd * F32_BYTES * ACTIVATION_ROWS_PER_TOKEN


def _attention_stage(info: ModelInfo, settings: WorkerSettings) -> int:
    """One block's attention at a full cache: scores per head plus the mask."""
    score_cells = _slot_cells(info, settings) * _ubatch(info, settings)
    if settings.flash_attn:
        # Flash attention never materialises the scores; only the f16 mask remains.
        return score_cells * F16_BYTES + _activations(info, settings)
    return score_cells * (info.n_head + 1) * F32_BYTES + _activations(info, settings)


def _attention_conversion(info: ModelInfo, settings: WorkerSettings) -> int:
    """Softmaxed scores converted to f16 to multiply with the f16 V cache.

    Lives outside the compute buffer (ggml's CPU work buffer, or the CUDA pool).
    """
    if settings.flash_attn or settings.kv_type == "f32":
        return 0
    return _slot_cells(info, settings) * _ubatch(info, settings) * info.n_head * F16_BYTES


# ----- remote devices (llama.cpp RPC): the local GPU's share -------------------------------------
#
# With `--rpc host:port,...` llama.cpp lists the RPC servers' devices first
# and the local GPUs after them (src/llama.cpp: "add RPC servers at the front
# of the list to minimize network transfers"). Without --tensor-split, which
# the runtimes never pass, llama_model_base::load_tensors
# (src/llama-model.cpp) splits the offloaded layers by each device's free
# memory at load: it sums the free bytes into cumulative fractions and gives
# offloaded layer k (of the n_gpu_layers counted as above, output layer last)
# to the first device whose cumulative fraction exceeds k / n_offloaded. The
# local GPU, last in the list, thus gets the *last* layers of the offloaded
# range, output layer included: exactly what offloading that many layers
# with no remote device puts on it, so estimate_worker prices its share.
# A device that reports 0 free and 0 total stands in with the host's RAM.
# A CPU ggml-rpc-server reports the machine's whole RAM as free. In a build
# without a local GPU the RPC devices are the only offload devices: local
# share 0 (but such a build has no GPU path here: telemetry says so).


def local_share(local_free_mib: float | None, remote_free_mib: list[float]) -> float:
    """The fraction of the offloaded layers' weight llama.cpp's default split
    aims at the local GPU, from each device's free memory at load. None or 0
    for local_free_mib: no local GPU (a CPU-only build), share 0."""
    local = max(local_free_mib or 0.0, 0.0)
    total = local + sum(max(free, 0.0) for free in remote_free_mib)
    if total <= 0:
        return 1.0 if not remote_free_mib else 0.0
    return local / total


def local_gpu_layers(offloaded: int, local_free_mib: float | None, remote_free_mib: list[float]) -> int:
    """How many of the `offloaded` layers (layers_offloaded's count) land on
    the local GPU: those k with k / offloaded at or past the remote devices'
    cumulative fraction. llama.cpp does this in float32, so a layer exactly
    on a boundary may fall either side; it is counted local here."""
    if not remote_free_mib:
        return offloaded
    remote_fraction = 1.0 - local_share(local_free_mib, remote_free_mib)
    # llama.cpp compares in float32: a layer exactly on the boundary can go
    # either way. The allowance sends it to the local GPU, so the estimate
    # errs towards charging the local GPU more, never less.
    return sum(1 for k in range(offloaded) if k / offloaded >= remote_fraction - 1e-6)


def with_gpu_layers(settings: WorkerSettings, n_gpu_layers: int) -> WorkerSettings:
    return replace(settings, n_gpu_layers=n_gpu_layers)


def local_footprint(info: ModelInfo, settings: WorkerSettings, local_layers: int) -> Footprint:
    """The GPU worker's footprint when only the last `local_layers` of its
    offloaded layers are on the local GPU and the rest on RPC devices: the
    weights and KV cache of those layers, the compute buffer and the CUDA
    runtime in full. The host part stays what the whole model offloaded
    leaves on the host: the remote layers are in neither."""
    full = estimate_worker(info, settings)
    if local_layers >= full.layers_on_gpu:
        return full
    if local_layers > 0:
        gpu = estimate_worker(info, with_gpu_layers(settings, local_layers)).gpu
    else:
        # No layer here, but the worker still opens the GPU and may run big
        # batches there: keep its runtime and compute buffer, conservatively.
        gpu = DeviceNeed(0, 0, full.gpu.compute, full.gpu.runtime_overhead)
    return Footprint(gpu=gpu, host=full.host, layers_on_gpu=local_layers)
