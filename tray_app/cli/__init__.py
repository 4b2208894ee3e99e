"""Command line: `tray-app` (tray, the default), `tray-app serve` (headless), `tray-app status`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, Sequence

from .. import __version__
from ..core.config import DEFAULT_PORT, Config, ConfigError, apply_overrides, lan_api_key_problem, load_config
from ..core.engine.gpu_env import hide_gpus_from_this_process
from ..core.access.keys import KeyProblem
from ..core.memory.gguf_info import ModelFileError
from ..drill.command import add_drill_parser, run_drill
from .keys import add_keys_parser, run_keys
from .launch import add_launch_parser, run_launch
from .models import add_models_parser, run_models
from .pull import add_pull_parser, run_pull
from .rpc_worker import add_rpc_worker_parser, run_rpc_worker
from .usage import add_usage_parser, run_usage


def _add_service_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="PATH", help="TOML config file (default: the platform config dir's config.toml)")
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help=f"port for the OpenAI-compatible API (default {DEFAULT_PORT})")
    parser.add_argument("--model", metavar="GGUF", help="model file for both paths (default: bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--fallback-model", metavar="GGUF", help="a smaller model for the CPU path")
    parser.add_argument("--simulate-gpu-mib", type=int, metavar="N",
                        help="run the GPU path on a simulated device of N MiB (for machines without a GPU)")
    parser.add_argument("--gpu-layers", type=int, metavar="N", help="layers to offload to the GPU (-1 = all)")
    parser.add_argument("--gpu-ctx", type=int, metavar="N", help="context size (and cap) of the GPU worker")
    parser.add_argument("--cpu-ctx", type=int, metavar="N", help="context size (and cap) of the CPU worker")
    parser.add_argument("--no-gpu", action="store_true", help="serve from the CPU worker only")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tray-app",
        description="Home AI server: a GPU and a CPU llama.cpp worker behind one OpenAI-compatible localhost "
                    "port, with admission control and safe CPU failover.",
    )
    parser.add_argument("--version", action="version", version=f"tray-app {__version__}")
    sub = parser.add_subparsers(dest="command")
    tray = sub.add_parser("tray", help="start the service with a system tray icon (the default)")
    _add_service_options(tray)
    serve = sub.add_parser("serve", help="run the service headless (no display needed)")
    _add_service_options(serve)
    status = sub.add_parser("status", help="print a running service's status")
    status.add_argument("--url", default=f"http://127.0.0.1:{DEFAULT_PORT}", help="the service's base URL")
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    status.add_argument("--config", metavar="PATH",
                        help="TOML config file whose [server] api_key to send (default: the platform config "
                             "dir's config.toml); TRAY_APP_API_KEY takes precedence, as on the server")
    add_models_parser(sub)
    add_keys_parser(sub)
    add_launch_parser(sub)
    add_usage_parser(sub)
    add_pull_parser(sub)
    add_drill_parser(sub)
    add_rpc_worker_parser(sub)
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    config = load_config(args.config)
    overrides: dict[str, dict[str, Any]] = {}

    def put(section: str, key: str, value: Any) -> None:
        if value is not None:
            overrides.setdefault(section, {})[key] = value

    put("server", "host", args.host)
    put("server", "port", args.port)
    put("model", "path", args.model)
    put("model", "fallback_path", args.fallback_model)
    put("gpu", "simulate_mib", args.simulate_gpu_mib)
    put("gpu", "n_gpu_layers", args.gpu_layers)
    put("gpu", "n_ctx", args.gpu_ctx)
    put("cpu", "n_ctx", args.cpu_ctx)
    if args.no_gpu:
        put("gpu", "enabled", False)
    return apply_overrides(config, overrides) if overrides else config


def _fail(message: str) -> int:
    print(f"tray-app: error: {message}", file=sys.stderr)
    return 2


def serve(config: Config, log_level: str = "INFO") -> int:
    from ..core.api.http_server import build_server

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per worker probe would drown the log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    server, service = build_server(config, log_level=log_level)
    gpu = service.dispatcher.gpu_missing_reason or (
        f"simulated {config.gpu.simulate_mib} MiB" if service.simulated else "NVIDIA GPU")
    print(f"tray-app: serving {service.model_id} on http://{config.server.host}:{config.server.port}/v1 "
          f"(GPU path: {gpu})", file=sys.stderr, flush=True)
    if config.server.ollama_port:
        print(f"tray-app: Ollama's API also on http://{config.server.host}:{config.server.ollama_port}",
              file=sys.stderr, flush=True)
    server.run()
    return 1 if getattr(server, "startup_failed", False) else 0


def print_status(url: str, as_json: bool, api_key: str = "") -> int:
    import httpx

    from ..core.api.security import API_KEY_ENV, bearer_header

    try:
        response = httpx.get(f"{url.rstrip('/')}/status", headers=bearer_header(api_key), timeout=5.0)
    except httpx.HTTPError as exc:
        return _fail(f"no service answers at {url} ({type(exc).__name__}); start one with `tray-app serve`")
    if response.status_code == 401:
        return _fail(f"the service at {url} refused the API key (HTTP 401): set {API_KEY_ENV} or [server] api_key "
                     "to the key the service was started with")
    if response.status_code != 200:
        return _fail(f"the service at {url} answered /status with HTTP {response.status_code}: "
                     f"{_error_message(response)}")
    try:
        data = response.json()
    except ValueError:
        return _fail(f"{url} answered /status with something other than JSON; is it a tray-app service?")
    if as_json:
        print(json.dumps(data, indent=2))
        return 0
    from .status_text import render_status, status_mismatch

    mismatch = status_mismatch(url, data)
    if mismatch:
        return _fail(mismatch)
    print(render_status(data))
    return 0


def _error_message(response: Any) -> str:
    """The message of the service's error envelope, or the start of whatever came instead."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    raw = list(argv if argv is not None else sys.argv[1:])
    subcommands = {"tray", "serve", "status", "models", "keys", "launch", "usage", "pull", "drill", "rpc-worker"}
    # Options without a subcommand belong to the default one: `tray-app --port 9000`.
    if raw and raw[0] not in subcommands and raw[0] not in ("-h", "--help", "--version"):
        raw = ["tray", *raw]
    # `tray-app launch codex -- exec ...`: what follows -- is the agent CLI's, unparsed.
    passthrough: list[str] = []
    if raw[:1] == ["launch"] and "--" in raw:
        raw, passthrough = raw[:raw.index("--")], raw[raw.index("--") + 1:]
    args = parser.parse_args(raw)
    if raw[:1] == ["launch"]:
        args.args = passthrough
    command = args.command or "tray"
    if args.command is None:
        args = parser.parse_args(["tray"])
    if command in ("tray", "serve"):
        # The service: its tokenizer's llama.cpp must not open a GPU. First,
        # before anything loads llama.cpp; the GPU worker gets the user's values.
        hide_gpus_from_this_process()
    if command in ("status", "usage", "keys", "launch"):
        from ..core.api.security import effective_api_key

        try:
            configured_key = load_config(getattr(args, "config", None)).server.api_key
        except ConfigError as exc:
            return _fail(str(exc))
        if command == "usage":
            return run_usage(args, effective_api_key(configured_key))
        if command == "keys":
            return run_keys(args, legacy_key_set=bool(effective_api_key(configured_key)))
        if command == "launch":
            return run_launch(args, effective_api_key(configured_key))
        return print_status(args.url, args.json, effective_api_key(configured_key))
    if command == "models":
        return run_models(args)
    if command == "pull":
        return run_pull(args)
    if command == "drill":
        return run_drill(args)
    if command == "rpc-worker":
        return run_rpc_worker(args)
    try:
        config = config_from_args(args)
        # Fail fast, with one line, before anything is started.
        from ..core.memory.gguf_info import read_model_info

        read_model_info(config.model_path())
        if config.model.fallback_path:
            read_model_info(config.fallback_model_path())
        from ..core.api.security import bind_problem, effective_api_key
        from ..core.access.keys import KeyStore

        api_key = effective_api_key(config.server.api_key)
        named_keys = KeyStore().required()
        problem = (bind_problem(config.server.host, api_key, named_keys)
                   or lan_api_key_problem(config.server.host, api_key))
        if problem:
            raise ConfigError(problem)
        from ..core.engine.runtime import choose_runtime, rpc_runtime_problem

        problem = rpc_runtime_problem(config.gpu.rpc_servers,
                                      choose_runtime(config.engine.runtime, config.engine.llama_server))
        if problem:
            raise ConfigError(problem)
    except (ConfigError, ModelFileError, KeyProblem) as exc:
        return _fail(str(exc))
    if command == "serve":
        return serve(config, args.log_level)
    try:
        from ..ui.app import run_tray
    except ImportError as exc:
        return _fail(f"the tray needs PySide6 and a display ({exc}); use `tray-app serve` on a headless machine")
    return run_tray(config, args.log_level)


if __name__ == "__main__":
    sys.exit(main())
