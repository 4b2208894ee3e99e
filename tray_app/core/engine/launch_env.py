"""What a worker process is started with: what it runs (its spec, and the
launch request the runtime turns into argv), its environment, and whether its
OpenMP threads should give up their cores early. Pure.

The model's host decides whether its workers share the cores
(`workers_share_cores`, from facts about its paths, into WorkerSpec); the
worker applies it to the environment of each launch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from .gpu_env import user_environment
from .runtime import LaunchRequest

# What a worker inherits from our environment: what it needs to find its
# libraries, its locale and its device, and to size its threads. Nothing else:
# llama-cpp-python's server reads unprefixed settings (HOST, PORT, API_KEY,
# CONFIG_FILE, ...) from the environment, so a stray variable in the user's
# shell could put a worker on the LAN or stop it from starting.
_INHERITED_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR",
    "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "SYSTEMROOT",
})
_INHERITED_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "HIP_", "ROCR_", "GGML_", "VK_", "OMP_", "OPENBLAS_", "MKL_",
                       "GOMP_", "KMP_")

# llama.cpp's OpenMP threads spin after each parallel region before they
# sleep (libgomp's default spin count is 300,000). Two llama.cpp processes
# busy on the same cores then mostly spin against each other: the CPU worker
# answering while the GPU worker loads (after an idle unload, a give-back or
# a crash). Measured on 2 cores, a CPU answer during a (simulated) GPU load
# took 6.3 s at the default and 0.7 s at 5,000. Alone on its cores a worker
# loses to the low count (one stream decoded 104-116 tok/s against 116-125 at
# the default), so only a worker that shares its cores gets it.
# OMP_WAIT_POLICY=passive (no spinning) cost 60 % of the speed.
OPENMP_SPIN_SHARED = {"GOMP_SPINCOUNT": "5000"}
# Either of these in the user's environment is their choice, and wins.
_USER_OPENMP_WAITING = frozenset({"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"})


def workers_share_cores(*, gpu_worker: bool, simulated: bool, layers_offloaded: int, layers_total: int) -> bool:
    """Whether a model's GPU and CPU workers share the host's cores, each with
    another busy llama.cpp process: only when there is a GPU worker and its
    own decode runs on the CPU. On a simulated device all of it does (it is a
    CPU llama-server); with a split model, the layers left on the host do. A
    CPU worker alone, or beside a fully offloaded real GPU worker, has its
    cores to itself."""
    return gpu_worker and (simulated or layers_offloaded < layers_total)


def threads_when_sharing(cores: int) -> int:
    """llama.cpp's threads for each of two workers that compute on the same
    `cores` at once: half each. At its default every worker takes all of
    them, and two such workers decoding together oversubscribe the cores:
    each barrier of a decode step then waits for a thread the other process
    has descheduled. Measured on 2 cores, two llama-server processes writing
    100 tokens at once took 11.5 s at 2 threads each (0.7 s alone, each
    burning a whole core) and 0.8 s at 1 thread each, which alone takes
    0.84 s: decode is bound by memory bandwidth, not by threads."""
    return max(1, cores // 2)


def worker_threads(configured: int, shares: bool, cores: int) -> int:
    """A worker's --threads: the user's ([cpu] n_threads) when set; else half
    the cores when the model's two workers share them; else 0, llama.cpp's
    default (all the cores)."""
    if configured or not shares:
        return configured
    return threads_when_sharing(cores)


def workers_oversubscribe(shares: bool, threads: int, cores: int) -> bool:
    """Whether a model's two workers, both computing on the host's cores,
    have more threads together than there are cores (each has `threads`,
    worker_threads' answer; 0 is llama.cpp's default, every core). Then the
    CPU path is no extra capacity: while both decode, each step's barrier
    waits for threads the other process has descheduled. A burst of 64
    short requests on 2 cores at 2 threads each took 1.5 to 2.4 times as
    long as llama-server alone when the overflow ran on the CPU worker, and
    1.06 to 1.16 times when it waited for the GPU worker's slots. On one
    core even the default split (a thread each) oversubscribes it."""
    return shares and 2 * (threads or cores) > cores


def openmp_waiting(user: Mapping[str, str], shares: bool) -> dict[str, str]:
    """The OpenMP spin setting a worker gets: the low count when it shares
    its cores, llama.cpp's default (nothing set) otherwise or when the user
    chose their own."""
    if not shares or _USER_OPENMP_WAITING & user.keys():
        return {}
    return dict(OPENMP_SPIN_SHARED)


def worker_environment(parent: Mapping[str, str], extra: Mapping[str, str],
                       shares: bool = False) -> dict[str, str]:
    """The environment a worker starts with: an allowlist of the user's, plus
    the runtime's own, plus the low spin count when it shares its cores.

    The user's, not ours: the service hides the GPUs from itself (gpu_env),
    and the GPU worker is the one process that must see them."""
    kept = {name: value for name, value in user_environment(parent).items()
            if name in _INHERITED_NAMES or name.startswith(_INHERITED_PREFIXES)}
    return {**openmp_waiting(kept, shares), **kept, **extra}


@dataclass(frozen=True)
class LaunchExtras:
    simulated_vram_need_mib: float | None = None
    simulated_vram_free_mib: float | None = None


@dataclass(frozen=True)
class WorkerSpec:
    role: str  # "gpu" or "cpu"
    model_path: Path
    model_name: str
    n_ctx: int
    n_gpu_layers: int
    n_batch: int = 512
    n_threads: int = 0
    # Slots: requests the process decodes at once, each with its own n_ctx.
    parallel: int = 1
    rpc_servers: tuple[str, ...] = ()
    # Whether another busy llama.cpp process computes on the same cores
    # (launch_env.workers_share_cores): then its OpenMP threads spin briefly.
    shares_cores: bool = False
    # The multimodal projector (mmproj .gguf) the worker loads; None = text only.
    mmproj: Path | None = None
    # The KV cache's element type (--cache-type-k/-v): "f16", or "q8_0"
    # where that is what lets a larger context fit (memory/context_size.py).
    kv_type: str = "f16"
    # llama-server's --spec-type (engine/speculation.py); None = no speculative decoding.
    spec_type: str | None = None
    # The draft model it speculates with (--model-draft, engine/draft.py); None = none.
    draft_model: Path | None = None


def launch_request(spec: WorkerSpec, port: int, extras: LaunchExtras, api_key: str) -> LaunchRequest:
    """What the runtime is asked to start, for one launch of the worker `spec` describes."""
    return LaunchRequest(
        model_path=spec.model_path, port=port, n_ctx=spec.n_ctx, n_gpu_layers=spec.n_gpu_layers,
        n_batch=spec.n_batch, n_threads=spec.n_threads,
        simulated_vram_need_mib=extras.simulated_vram_need_mib, simulated_vram_free_mib=extras.simulated_vram_free_mib,
        api_key=api_key, parallel=spec.parallel, rpc_servers=spec.rpc_servers, mmproj=spec.mmproj,
        kv_type=spec.kv_type, spec_type=spec.spec_type, draft_model=spec.draft_model,
    )
