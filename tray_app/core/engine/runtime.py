"""How a llama.cpp server process is launched and probed, in one place.

Everything that depends on *which* server runs lives behind WorkerRuntime:
llama.cpp's own `llama-server` (the default: parallel slots, continuous
batching) or llama-cpp-python's server (one request at a time). The
supervisor and service only use this interface.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from ..base.policies import SPECULATIVE_TYPES
from .gpu_env import HIDDEN_GPU_VALUES


@dataclass(frozen=True)
class LaunchRequest:
    """What the supervisor wants started; the runtime turns it into argv."""

    model_path: Path
    port: int
    n_ctx: int
    n_gpu_layers: int
    n_batch: int
    n_threads: int  # 0 = runtime default
    # For a simulated device: what the worker would allocate, and what is free.
    simulated_vram_need_mib: float | None = None
    simulated_vram_free_mib: float | None = None
    # The secret the worker must demand of every request (see Worker).
    api_key: str | None = None
    # Requests decoded at once; each gets its own n_ctx of KV cache.
    parallel: int = 1
    # llama.cpp RPC servers whose devices take a share of the layers.
    rpc_servers: tuple[str, ...] = ()
    # The multimodal projector (mmproj .gguf) that lets the model read images; None = text only.
    mmproj: Path | None = None
    kv_type: str = "f16"  # the KV cache's element type; see WorkerSpec
    spec_type: str | None = None  # llama-server's --spec-type; None = no speculative decoding
    draft_model: Path | None = None  # the draft model (--model-draft); see WorkerSpec


# The most tokens one image may become in a worker with a projector
# (llama-server's --image-max-tokens). A dynamic-resolution encoder makes as
# many tokens as the image has patches, and its compute buffer grows with the
# square of them; the cap keeps both inside what memory/estimate.py charges
# (projector_need) and what one slot's context can hold next to the text.
IMAGE_MAX_TOKENS = 1024


# The worker wrapper takes the secret from here and removes it from its
# environment, so it is never in argv (visible to every user in ps) and never
# inherited by anything the worker starts.
WORKER_KEY_VARIABLE = "TRAY_APP_WORKER_KEY"
# The supervisor's pid, set by whoever launches the wrapper. Only the parent
# knows it for certain: by the time the child can call os.getppid(), a dead
# parent has already been replaced by init (or a subreaper).
PARENT_PID_ENV = "TRAY_APP_PARENT_PID"


def parent_pid_environment() -> dict[str, str]:
    """What a launcher adds to the worker wrapper's environment, read in the launcher."""
    return {PARENT_PID_ENV: str(os.getpid())}


async def answers_ok(client: httpx.AsyncClient, url: str) -> bool:
    """A readiness probe: True when url answers 200 within 2 s."""
    try:
        response = await client.get(url, timeout=2.0)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def wrapper_argv(python: str, launch: LaunchRequest) -> list[str]:
    """The worker wrapper (worker_main) and its own flags, which every runtime starts through."""
    args = [python, "-m", "tray_app.core.engine.worker_main"]
    if launch.simulated_vram_need_mib is not None and launch.simulated_vram_free_mib is not None:
        args += [
            "--sim-vram-need-mib", f"{launch.simulated_vram_need_mib:.1f}",
            "--sim-vram-free-mib", f"{launch.simulated_vram_free_mib:.1f}",
        ]
    return args


def wrapper_environment(launch: LaunchRequest) -> dict[str, str]:
    """What every runtime's wrapper is started with: our pid, the secret, and for a CPU worker no GPU."""
    env = parent_pid_environment()
    if launch.api_key:
        env[WORKER_KEY_VARIABLE] = launch.api_key
    if launch.n_gpu_layers == 0:
        # A GPU build at -ngl 0 still makes a device context and a GPU compute
        # buffer, and offloads big batches' matrix products to the device;
        # the CPU fallback must not be able to run out of VRAM.
        env.update(HIDDEN_GPU_VALUES)
    return env


class WorkerRuntime(Protocol):
    name: str
    # Requests one process serves at once without one cutting another short.
    max_parallel: int
    # Whether a request may ask for logprobs.
    supports_logprobs: bool
    # Whether the worker can spread a model over llama.cpp RPC servers.
    supports_rpc: bool
    # Whether the worker can load a multimodal projector (--mmproj) and read images.
    supports_images: bool
    # The KV cache types it can be started with, preferred first.
    kv_types: tuple[str, ...]
    # Whether it continues an answer from its text (see failover.continuation_refused).
    continues_prefill: bool
    # The speculative decoding types it can be started with (engine/speculation.py).
    spec_types: tuple[str, ...]

    def describe(self) -> str:
        """Name and version, for /status and the system fingerprint."""
        ...

    def argv(self, launch: LaunchRequest) -> list[str]: ...

    def environment(self, launch: LaunchRequest) -> dict[str, str]:
        """Variables to set on top of ours."""
        ...

    async def probe(self, client: httpx.AsyncClient, base_url: str) -> bool:
        """True once the server can answer completions."""
        ...


class LlamaCppPythonRuntime:
    """llama-cpp-python's OpenAI server, started through our thin wrapper.

    The wrapper (tray_app.core.engine.worker_main) ties the worker's life to ours and
    plays the simulated device's allocator; the rest is the stock server.
    """

    name = "llama-cpp-python"
    # The server holds one lock around the model: it runs one request at a time.
    max_parallel = 1
    # It would have to keep the logits of every context position (about
    # 1.5 GiB at 8k context for a 135M model): launched without them.
    supports_logprobs = False
    # Its server takes --rpc_servers, but 0.3.36's Llama drops the setting
    # (llama.cpp now registers RPC devices another way): every layer stays
    # local, seen in the load log. Admission would then charge the local GPU
    # only a share of a model it holds whole, so it is refused instead.
    supports_rpc = False
    # Its server reads images only through a chat format chosen per model
    # family (--chat_format llava-1-5 with --clip_model_path), which would
    # replace the model's own template: a projector is not passed.
    supports_images = False
    # Its server takes type_k/type_v as ggml enum numbers, not names, and
    # needs flash attention set by hand for a quantized V: kept at f16.
    kv_types = ("f16",)
    # A chat whose last message is the assistant's gets a new assistant turn,
    # not that message continued: a cut answer can't go on from its text.
    continues_prefill = False
    # Its server drafts only with a second model, which the library doesn't pair yet.
    spec_types: tuple[str, ...] = ()

    def __init__(self, python: str = sys.executable) -> None:
        self._python = python

    def argv(self, launch: LaunchRequest) -> list[str]:
        return wrapper_argv(self._python, launch) + [
            "--",
            "--model", str(launch.model_path),
            "--host", "127.0.0.1",
            "--port", str(launch.port),
            "--n_ctx", str(launch.n_ctx),
            "--n_gpu_layers", str(launch.n_gpu_layers),
            "--n_batch", str(launch.n_batch),
            # Without this a new request aborts the stream in progress.
            "--interrupt_requests", "False",
            # The default keeps a float32 vocabulary-sized row of logits per
            # context token: 1.5 GiB for SmolLM2 at 8k. Only logprobs need it.
            "--logits_all", "False",
            *(["--n_threads", str(launch.n_threads)] if launch.n_threads > 0 else []),
        ]

    def environment(self, launch: LaunchRequest) -> dict[str, str]:
        return wrapper_environment(launch)

    def describe(self) -> str:
        return f"llama-cpp-python {_llama_cpp_python_version()}"

    async def probe(self, client: httpx.AsyncClient, base_url: str) -> bool:
        # The server loads the model before it listens, so an answer from
        # /v1/models means the model is in memory.
        return await answers_ok(client, f"{base_url}/v1/models")


@functools.cache
def _llama_cpp_python_version() -> str:
    # Cached: /status names the engine on every read (the tray's every 5 s),
    # and reading a distribution's metadata parses its METADATA file anew.
    try:
        from importlib.metadata import version
        return version("llama_cpp_python")
    except Exception:  # noqa: BLE001 - a version string is cosmetic
        return "unknown"


LLAMA_SERVER_BINARY = "llama-server"


def llama_cpp_prefix() -> Path | None:
    """The site-packages folder the llama-cpp-python wheel was installed into,
    found without importing it. Its wheel, as packaging/install.sh builds it,
    also carries bin/llama-server and lib/ (llama.cpp's own install layout)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


def bundled_llama_server() -> Path | None:
    """The llama-server built from the same llama.cpp as the installed
    llama-cpp-python: in the standalone folder, or in site-packages."""
    frozen = getattr(sys, "_MEIPASS", None)
    candidates = [Path(frozen) / "llama_server" / LLAMA_SERVER_BINARY] if frozen else []
    prefix = llama_cpp_prefix()
    if prefix is not None:
        candidates.append(prefix / "bin" / LLAMA_SERVER_BINARY)
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


RPC_SERVER_BINARY = "ggml-rpc-server" + (".exe" if sys.platform == "win32" else "")


def bundled_rpc_server() -> Path | None:
    """llama.cpp's RPC server, built beside llama-server (GGML_RPC=ON)."""
    server = bundled_llama_server()
    if server is None:
        return None
    candidate = server.parent / RPC_SERVER_BINARY
    return candidate if candidate.is_file() and os.access(candidate, os.X_OK) else None


def library_dirs(binary: Path, *, bundled: bool = True) -> list[Path]:
    """Where llama-server's shared libraries are: beside it and in ../lib
    (the wheel's install layout); for the bundled binary also llama_cpp/lib
    (the libraries llama-cpp-python loads, from the same build). Another
    build must not be handed those: LD_LIBRARY_PATH wins over its RUNPATH."""
    dirs = [binary.parent, binary.parent.parent / "lib"]
    prefix = llama_cpp_prefix()
    if bundled and prefix is not None:
        dirs.append(prefix / "llama_cpp" / "lib")
    frozen = getattr(sys, "_MEIPASS", None)
    if bundled and frozen:
        # The standalone folder: PyInstaller puts the libraries it resolved at its top.
        dirs.append(Path(frozen))
    return [d for d in dirs if d.is_dir()]


class LlamaServerRuntime:
    """llama.cpp's own server, started through the same wrapper, which execs it.

    The wrapper (tray_app.core.engine.worker_main --exec) ties the process to
    ours and plays the simulated allocator before it becomes llama-server, so
    the pid we watch is llama-server's own.
    """

    name = "llama-server"
    # Slots are cheap to declare; what bounds them is memory (the estimate
    # charges every slot's KV cache) and the config's max_concurrency.
    max_parallel = 64
    # It computes the probabilities of the sampled token's candidates only.
    supports_logprobs = True
    supports_rpc = True
    supports_images = True
    # A quantized V cache turns flash attention on by itself ("-fa auto").
    kv_types = ("f16", "q8_0")
    # It continues a chat's last assistant message (its answer begins with
    # that text) and a completion's prompt: a cut answer goes on from its text.
    continues_prefill = True
    spec_types = SPECULATIVE_TYPES
    # It speculates with a draft model too (--model-draft).
    drafts_with_model = True

    def __init__(self, binary: Path, python: str = sys.executable, *, bundled: bool = True) -> None:
        self.binary = binary
        self.bundled = bundled
        self._python = python

    def describe(self) -> str:
        built = f"built with llama-cpp-python {_llama_cpp_python_version()}" if self.bundled else str(self.binary)
        return f"llama-server ({built})"

    def argv(self, launch: LaunchRequest) -> list[str]:
        return wrapper_argv(self._python, launch) + [
            "--exec", str(self.binary), "--",
            "--model", str(launch.model_path),
            "--host", "127.0.0.1",
            "--port", str(launch.port),
            # One KV cache per slot, each n_ctx long, rather than one unified
            # pool: an admitted request's room can't be taken by its
            # neighbours, so what admission checked still holds mid-answer.
            "--parallel", str(launch.parallel),
            "--ctx-size", str(launch.n_ctx * launch.parallel),
            "--no-kv-unified",
            *(["--cache-type-k", launch.kv_type, "--cache-type-v", launch.kv_type]
              if launch.kv_type != "f16" else []),
            *(["--spec-type", launch.spec_type] if launch.spec_type else []),
            # The draft on the served model's devices: all its layers where
            # the served model offloads, none where it doesn't.
            *(["--model-draft", str(launch.draft_model),
               "--spec-draft-ngl", "all" if launch.n_gpu_layers else "0"] if launch.draft_model else []),
            "--n-gpu-layers", str(launch.n_gpu_layers),
            "--batch-size", str(launch.n_batch),
            # We size and place the model ourselves, against the VRAM others use.
            "--fit", "off",
            # Prompt-cache copies in host RAM (default up to 8 GiB) would be
            # memory the RAM estimate does not count.
            "--cache-ram", "0",
            # Tool calls and response_format need the model's own template.
            "--jinja",
            # /slots: which slot is busy, for cancellation checks and /status.
            "--slots",
            "--no-webui",
            # Warnings and errors only: at info level llama-server logs about
            # six lines per request, and reading them costs the service about
            # 1.4 ms of CPU per request. Load failures and OOMs are errors.
            "--log-verbosity", "2",
            *(["--threads", str(launch.n_threads)] if launch.n_threads > 0 else []),
            *(["--rpc", ",".join(launch.rpc_servers)] if launch.rpc_servers else []),
            *(["--mmproj", str(launch.mmproj), "--image-max-tokens", str(IMAGE_MAX_TOKENS)]
              if launch.mmproj is not None else []),
        ]

    def environment(self, launch: LaunchRequest) -> dict[str, str]:
        env = wrapper_environment(launch)
        inherited = os.environ.get("LD_LIBRARY_PATH", "")
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*(str(d) for d in library_dirs(self.binary, bundled=self.bundled)),
                                                  *([inherited] if inherited else [])])
        return env

    async def probe(self, client: httpx.AsyncClient, base_url: str) -> bool:
        # llama-server listens while it loads; /health answers 503 until the
        # model is in memory, then 200.
        return await answers_ok(client, f"{base_url}/health")


@dataclass(frozen=True)
class RuntimeChoice:
    runtime: WorkerRuntime
    # Why the configured runtime is not the one running, or None.
    fallback_reason: str | None = None


# Another llama-server for every service started from this environment
# (the drill's, a check's) when the config names none: e.g. a CUDA build.
LLAMA_SERVER_ENV = "TRAY_APP_LLAMA_SERVER"


def choose_runtime(name: str, llama_server_path: str = "") -> RuntimeChoice:
    """The runtime the config asks for, or llama-cpp-python with the reason
    when llama-server can't be found."""
    if name == "llama-cpp-python":
        return RuntimeChoice(LlamaCppPythonRuntime())
    llama_server_path = llama_server_path or os.environ.get(LLAMA_SERVER_ENV, "")
    if llama_server_path:
        binary = Path(llama_server_path).expanduser()
        if binary.is_file() and os.access(binary, os.X_OK):
            return RuntimeChoice(LlamaServerRuntime(binary, bundled=False))
        reason = f"[engine] llama_server = {str(binary)!r} is not an executable file"
    else:
        found = bundled_llama_server()
        if found is not None:
            return RuntimeChoice(LlamaServerRuntime(found))
        reason = ("llama-server is not installed beside llama-cpp-python; "
                  "run packaging/install.sh again to build it")
    return RuntimeChoice(LlamaCppPythonRuntime(), f"{reason}; serving with llama-cpp-python (one request at a time)")


def rpc_runtime_problem(rpc_servers: tuple[str, ...], choice: RuntimeChoice) -> str | None:
    """Why the GPU worker can't use [gpu] rpc_servers with this runtime, or None."""
    if not rpc_servers or choice.runtime.supports_rpc:
        return None
    why = f" ({choice.fallback_reason})" if choice.fallback_reason else ""
    return ("[gpu] rpc_servers needs the llama-server engine: llama-cpp-python's server ignores the RPC "
            f"servers, and every layer would stay on this machine{why}. Set [engine] runtime = "
            '"llama-server" (packaging/install.sh builds it), or remove rpc_servers')

