"""`tray-app models`: the GGUF files the app knows of, and which profiles fit.

Lists the configured model (or the bundled one), the fallback model, every
.gguf in the models folder and any paths given on the command line.  For
each it prints what the file's metadata says (name, parameters, quant type,
trained context, size) and, from ``fit``, whether it runs GPU resident, as a
split, or on the CPU with the memory this machine has free right now.

The headroom comes from a running service's /status when one answers (so it
is what fits next to the workers already running), otherwise from NVML and
psutil directly, or from a simulated device.  A file that is not a usable
GGUF is one line in the listing, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.config import DEFAULT_PORT, Config, ConfigError, apply_overrides, load_config, models_dir
from ..core.engine.runtime import choose_runtime
from ..core.memory.fit import Headroom, ModelFit, Profile, describe_fit, fit_model, format_mib, headroom_from_status
from ..core.memory.context_size import FLOOR_CONTEXT_TOKENS
from ..core.memory.gguf_info import ModelFileError, ModelInfo, read_model_info

# A service on loopback answers /status in milliseconds; waiting longer only
# delays the listing when nothing is there.
STATUS_TIMEOUT_S = 2.0

# Exit codes: 0 listed at least one usable model; 1 no usable model at all;
# 2 the command itself could not run (bad config), like the rest of the CLI.
EXIT_NO_VALID_MODEL = 1
EXIT_USAGE = 2


@dataclass(frozen=True)
class ModelCandidate:
    path: Path
    source: str  # "configured", "fallback", "models folder" or "argument"


@dataclass(frozen=True)
class ListedModel:
    candidate: ModelCandidate
    fit: ModelFit | None  # None when the file could not be read
    error: str | None = None


@dataclass(frozen=True)
class HeadroomReading:
    headroom: Headroom
    kind: str  # "service", "simulated" or "direct"
    description: str  # where the numbers came from, for a person
    gpu_total_mib: float | None = None
    simulated: bool = False


def add_models_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "models",
        help="list GGUF models and which profiles (GPU, split, CPU) fit this machine",
        description="List the configured model, the fallback model, the .gguf files in the models folder "
                    f"({models_dir()}) and any PATHS given, with their metadata and which profiles fit the "
                    "memory free now.",
    )
    parser.add_argument("paths", nargs="*", metavar="PATH", help="more .gguf files, or folders to search for them")
    parser.add_argument("--config", metavar="PATH",
                        help="TOML config file (default: the platform config dir's config.toml)")
    parser.add_argument("--url", help="a running service to read live headroom from "
                                      f"(default http://127.0.0.1:<the configured port, {DEFAULT_PORT}>)")
    parser.add_argument("--simulate-gpu-mib", type=int, metavar="N",
                        help="judge against a simulated GPU of N MiB instead of the real one or a running service")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    return parser


def run_models(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        if args.simulate_gpu_mib is not None:
            config = apply_overrides(config, {"gpu": {"simulate_mib": args.simulate_gpu_mib}})
    except ConfigError as exc:
        print(f"tray-app: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    url = args.url or f"http://127.0.0.1:{config.server.port}"
    reading = read_headroom(config, url, simulate_requested=args.simulate_gpu_mib is not None)
    candidates, folder_problems = find_models(config, [Path(p).expanduser() for p in args.paths])
    listed = [list_model(candidate, config, reading.headroom) for candidate in candidates]
    if args.json:
        print(json.dumps(listing_to_dict(listed, reading, folder_problems), indent=2))
    else:
        print(render_listing(listed, reading, folder_problems))
    return 0 if any(entry.fit is not None for entry in listed) else EXIT_NO_VALID_MODEL


# ----- finding files ------------------------------------------------------------------


def find_models(config: Config, extra_paths: list[Path]) -> tuple[list[ModelCandidate], list[str]]:
    """Candidates in listing order, each file once; plus lines about folders that held nothing."""
    candidates: list[ModelCandidate] = []
    problems: list[str] = []
    seen: set[Path] = set()

    def add(path: Path, source: str) -> None:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            candidates.append(ModelCandidate(path, source))

    try:
        add(config.model_path(), "configured")
    except ConfigError as exc:  # the bundled model's package is missing
        problems.append(f"configured model: {exc}")
    if config.model.fallback_path:
        add(config.fallback_model_path(), "fallback")
    folder = models_dir()
    for path in _gguf_files(folder):
        add(path, "models folder")
    for path in extra_paths:
        if path.is_dir():
            found = _gguf_files(path)
            if not found:
                problems.append(f"{path}: no .gguf files in this folder")
            for file in found:
                add(file, "argument")
        else:
            # Nonexistent or not-a-GGUF paths are listed so the reader's message explains them.
            add(path, "argument")
    return candidates, problems


def _gguf_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    # Recursive: downloads often land in one subfolder per model.
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() == ".gguf" and p.is_file())


def list_model(candidate: ModelCandidate, config: Config, headroom: Headroom) -> ListedModel:
    try:
        info = read_model_info(candidate.path)
    except ModelFileError as exc:
        return ListedModel(candidate, None, str(exc))
    # Slots as the service would start them: llama-cpp-python runs one.
    most = choose_runtime(config.engine.runtime, config.engine.llama_server).runtime.max_parallel
    # A context sized from memory (0) is judged at its floor; "max" says how far it can go.
    fit = fit_model(info, headroom, gpu_n_ctx=config.gpu.n_ctx or FLOOR_CONTEXT_TOKENS,
                    cpu_n_ctx=config.cpu.n_ctx or FLOOR_CONTEXT_TOKENS,
                    n_batch=config.worker.n_batch, gpu_slots=min(config.gpu.max_concurrency, most),
                    cpu_slots=min(config.cpu.max_concurrency, most))
    return ListedModel(candidate, fit)


# ----- reading headroom ---------------------------------------------------------------


def read_headroom(config: Config, url: str, *, simulate_requested: bool) -> HeadroomReading:
    """A running service's view first, unless a simulated device was asked for on the command line."""
    if not simulate_requested:
        status, why_not = _fetch_status(url, config)
        if status is not None:
            headroom = headroom_from_status(status, ram_floor_mib=config.cpu.ram_floor_mib,
                                            default_reserve_mib=config.gpu.reserve_mib)
            gpu = status.get("gpu") or {}
            total = gpu.get("total_mib")
            return HeadroomReading(
                headroom, "service",
                f"the running service at {url} (its workers' own memory counts as used)",
                gpu_total_mib=float(total) if isinstance(total, (int, float)) else None,
                simulated=bool(gpu.get("simulated")),
            )
    else:
        why_not = "a simulated GPU was asked for"
    return _read_directly(config, why_not)


def _fetch_status(url: str, config: Config) -> tuple[dict[str, Any] | None, str]:
    import httpx

    from ..core.api.security import bearer_header, effective_api_key

    headers = bearer_header(effective_api_key(config.server.api_key))
    try:
        response = httpx.get(f"{url.rstrip('/')}/status", headers=headers, timeout=STATUS_TIMEOUT_S)
    except httpx.HTTPError:
        return None, f"no service answered at {url}"
    if response.status_code != 200:
        return None, f"the service at {url} answered /status with HTTP {response.status_code}"
    try:
        status = response.json()
    except ValueError:
        return None, f"{url} answered /status with something other than JSON"
    if not isinstance(status, dict) or "gpu" not in status or "ram" not in status:
        return None, f"{url} is not a tray-app service (its /status has no gpu/ram)"
    return status, ""


def _read_directly(config: Config, why_not_service: str) -> HeadroomReading:
    from ..core.memory.gpu_readers import detect_gpu_reader
    from ..core.memory.telemetry import SimulatedGpu, read_host

    host = read_host()
    if config.gpu.simulate_mib > 0:
        reader: Any = SimulatedGpu(config.gpu.simulate_mib)
        kind, origin = "simulated", f"a simulated GPU of {config.gpu.simulate_mib} MiB and psutil"
    else:
        reader = detect_gpu_reader(config.engine.llama_server)
        kind, origin = "direct", "the GPU's driver (NVML, amdgpu, fdinfo or llama.cpp) and psutil"
    try:
        gpu = reader.read()
    finally:
        reader.close()
    headroom = Headroom(
        vram_free_mib=gpu.free_mib,
        ram_available_mib=host.available_mib,
        vram_reserve_mib=config.gpu.reserve_mib,
        ram_floor_mib=config.cpu.ram_floor_mib,
        vram_unknown_reason=gpu.reason or "the GPU reading has no device",
    )
    return HeadroomReading(headroom, kind, f"{origin} ({why_not_service})",
                           gpu_total_mib=gpu.total_mib, simulated=gpu.simulated)


# ----- rendering ----------------------------------------------------------------------


def format_parameters(count: int) -> str:
    """134_515_008 -> '135M', 8_030_261_248 -> '8.0B'."""
    if count >= 10**12:
        return f"{count / 10**12:.1f}T"
    if count >= 10**9:
        return f"{count / 10**9:.1f}B"
    if count >= 10**6:
        return f"{count / 10**6:.0f}M"
    return f"{count / 10**3:.0f}K"


def _headroom_lines(reading: HeadroomReading) -> list[str]:
    headroom = reading.headroom
    if headroom.vram_free_mib is None:
        gpu = f"unknown ({headroom.vram_unknown_reason})"
    else:
        total = f" of {format_mib(reading.gpu_total_mib)}" if reading.gpu_total_mib is not None else ""
        kind = "simulated, " if reading.simulated else ""
        gpu = (f"{format_mib(headroom.vram_free_mib)} free{total} ({kind}"
               f"{format_mib(headroom.vram_reserve_mib)} kept in reserve)")
    return [
        f"Headroom from {reading.description}:",
        f"  GPU: {gpu}",
        (f"  RAM: {format_mib(headroom.ram_available_mib)} available "
         f"({format_mib(headroom.ram_floor_mib)} kept free as the RAM floor)"),
    ]


_COLUMNS = ("NAME", "PARAMS", "QUANT", "TRAINED CTX", "SIZE", "SOURCE", "FILE")


def _row(info: ModelInfo, source: str) -> tuple[str, ...]:
    trained = str(info.n_ctx_train) if info.n_ctx_train > 0 else "unknown"
    return (info.name, format_parameters(info.parameter_count), info.file_type, trained,
            format_mib(info.file_size / (1024 * 1024)), source, str(info.path))


def render_listing(listed: list[ListedModel], reading: HeadroomReading, problems: list[str]) -> str:
    lines = _headroom_lines(reading)
    folder = models_dir()
    lines.append(f"Models folder: {folder}{'' if folder.is_dir() else ' (does not exist yet)'}")
    lines.append("")
    rows = [_row(entry.fit.info, entry.candidate.source) for entry in listed if entry.fit is not None]
    widths = [max(len(cells[i]) for cells in [_COLUMNS, *rows]) for i in range(len(_COLUMNS))]

    def table_line(cells: tuple[str, ...]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()

    if rows:
        lines.append(table_line(_COLUMNS))
    label_width = max(len(profile.label) for profile in Profile)
    for entry in listed:
        if entry.fit is None:
            lines.append(f"{entry.candidate.path.name}: skipped: {entry.error}")
            continue
        lines.append(table_line(_row(entry.fit.info, entry.candidate.source)))
        for fit in entry.fit.profiles:
            lines.append(f"    {fit.profile.label.ljust(label_width)}  {describe_fit(fit)}")
    lines.extend(problems)
    if not rows:
        lines.append("No usable model found: put .gguf files in the models folder, "
                     "or set [model] path in the config.")
    return "\n".join(lines)


def listing_to_dict(listed: list[ListedModel], reading: HeadroomReading, problems: list[str]) -> dict[str, Any]:
    headroom = reading.headroom
    models: list[dict[str, Any]] = []
    for entry in listed:
        base = {"path": str(entry.candidate.path), "source": entry.candidate.source}
        if entry.fit is None:
            models.append({**base, "ok": False, "error": entry.error})
            continue
        info = entry.fit.info
        models.append({
            **base,
            "ok": True,
            "name": info.name,
            "architecture": info.architecture,
            "parameters": info.parameter_count,
            "parameters_text": format_parameters(info.parameter_count),
            "quant": info.file_type,
            "n_ctx_train": info.n_ctx_train or None,
            "n_layer": info.n_layer,
            "file_size": info.file_size,
            "profiles": [fit.to_dict() for fit in entry.fit.profiles],
        })
    return {
        "headroom": {
            "source": reading.kind,
            "description": reading.description,
            "gpu_simulated": reading.simulated,
            "gpu_total_mib": reading.gpu_total_mib,
            "vram_free_mib": headroom.vram_free_mib,
            "vram_reserve_mib": headroom.vram_reserve_mib,
            "vram_unknown_reason": None if headroom.vram_free_mib is not None else headroom.vram_unknown_reason,
            "ram_available_mib": round(headroom.ram_available_mib, 1),
            "ram_floor_mib": headroom.ram_floor_mib,
        },
        "models_dir": str(models_dir()),
        "models": models,
        "problems": problems,
    }
