"""`tray-app drill`: the failover drill as a command.

Wiring for tray_app/cli.py: `add_drill_parser(subparsers)` adds the
subcommand and `run_drill(args)` runs it and returns the exit code. Until
then: `python -m tray_app.drill [options]`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EXIT_PASS = 0
EXIT_INVARIANT = 1      # an accepted request lost or duplicated, or a tool call run twice
EXIT_COULD_NOT_RUN = 2  # the service could not be started or reached
EXIT_EXPECTATION = 3    # no request lost or duplicated, but the service did something other than designed
EXIT_INTERRUPTED = 130

DESCRIPTION = """\
The failover drill: starts its own service (a simulated GPU when NVML finds
none, the real GPU otherwise), runs eleven phases of traffic and faults
against it (requests over the GPU profile, streaming, a cancel in the CPU
queue, 8 concurrent clients, agents with a counted tool, shrinking VRAM, an
allocation failure, a GPU worker killed mid-request, a request that crashes
the GPU worker), and writes report.json,
report.md and a latency plot. With --url it checks a running service instead,
without injecting faults.

Exit codes: 0 pass; 1 an accepted request was lost or duplicated, or a tool
call ran twice; 2 the drill could not run; 3 another check failed."""


def add_drill_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "drill", help="run the failover drill (or --profiles) and write a report",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    configure_parser(parser)
    return parser


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--short", action="store_true",
                        help="a few requests per phase (about a minute; what the test suite runs)")
    parser.add_argument("--url", metavar="URL",
                        help="check an already-running service instead of starting one; no faults are injected")
    parser.add_argument("--out", metavar="DIR", default="drill-report",
                        help="where report.json, report.md and latency.png go (default: ./drill-report)")
    parser.add_argument("--phases", metavar="LIST", help="only these phases, e.g. 1,2,8 (default: all eleven)")
    parser.add_argument("--simulated-gpu", action="store_true",
                        help="use the simulated GPU even when a real one is present")
    parser.add_argument("--model", metavar="GGUF", help="model for the drill's own service (default: the bundled one)")
    parser.add_argument("--profiles", action="store_true",
                        help="instead of the drill: compare offload profiles (GPU-resident, split, CPU fallback)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run_drill(args: argparse.Namespace) -> int:
    if args.profiles:
        from .profiles import run_profiles

        return run_profiles(args)
    from .plan import FULL, SHORT
    from .progress import Progress
    from .runner import PHASES, Drill
    from .target import LiveService, OwnService, TargetError, detect_device

    try:
        phases = _parse_phases(args.phases, {phase.number for phase in PHASES})
    except ValueError as exc:
        print(f"tray-app drill: error: {exc}", file=sys.stderr)
        return EXIT_COULD_NOT_RUN
    plan = SHORT if args.short else FULL
    out_dir = Path(args.out)
    started = time.monotonic()
    workdir: Path | None = None
    notes: list[str] = []
    if args.url:
        from ..core.api.security import effective_api_key
        from ..core.config import ConfigError, load_config

        try:
            configured_key = load_config().server.api_key
        except ConfigError as exc:
            print(f"tray-app drill: error: {exc}", file=sys.stderr)
            return EXIT_COULD_NOT_RUN
        target = LiveService(args.url, effective_api_key(configured_key))
        notes.append("live check: requests only; phases 7, 8 and 9 (faults) are skipped and phase 6 takes no VRAM")
    else:
        simulated, device, why = detect_device(args.simulated_gpu)
        workdir = Path(tempfile.mkdtemp(prefix="tray-app-drill-"))
        target = OwnService(workdir, simulated=simulated, device=device, model=args.model)
        notes.append(f"device: {device}; {why}")
        if simulated:
            notes.append("simulated GPU: both workers run on the CPU; VRAM is the simulated device's, and "
                         "'out of memory' is its allocator failing a worker the way llama.cpp's CUDA backend does")
        else:
            notes.append("real GPU: VRAM pressure comes from extra llama.cpp processes holding memory")
    progress = Progress(plan.planned_requests, enabled=not args.no_progress)
    progress.phase(f"starting: {target.description}")
    try:
        status = target.start()
    except TargetError as exc:
        target.stop()
        progress.finish()
        print(f"tray-app drill: error: {exc}", file=sys.stderr)
        return EXIT_COULD_NOT_RUN
    startup_s = time.monotonic() - started
    drill = Drill(target, status, plan, progress=progress, phases=phases)
    try:
        drill.run()
    except TargetError as exc:
        target.stop()
        progress.finish()
        print(f"tray-app drill: error: {exc}", file=sys.stderr)
        return EXIT_COULD_NOT_RUN
    except KeyboardInterrupt:
        target.stop()
        progress.finish()
        if workdir is not None:
            _keep_logs(workdir, out_dir / "logs")
            shutil.rmtree(workdir, ignore_errors=True)
        print(f"\ntray-app drill: interrupted; no report written (service logs: {out_dir / 'logs'})", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        target.stop()
        progress.finish()
    report = assemble_report(drill, target, plan.name, notes, startup_s, time.monotonic() - started)
    if workdir is not None:
        if report["verdict"] != "PASS":
            _keep_logs(workdir, out_dir / "logs")
        shutil.rmtree(workdir, ignore_errors=True)
    from .render import terminal_summary, write_files

    write_files(report, out_dir)
    print(terminal_summary(report, out_dir))
    return int(report["exit_code"])


def assemble_report(drill: Any, target: Any, plan_name: str, notes: list[str], startup_s: float,
                    total_s: float) -> dict[str, Any]:
    from .report import build_report, enrich_records

    monitor = drill.monitor.snapshot()
    records = enrich_records([r.to_dict() for r in drill.records], monitor, drill.clock.wall_t0)
    service = drill.initial_status
    gpu = service.get("gpu") or {}
    run = {
        "plan": plan_name,
        "target": target.description,
        "device": getattr(target, "device", "live service"),
        "url": target.url,
        "simulated": bool(target.simulated),
        "live": not target.can_inject,
        "started_at": dt.datetime.fromtimestamp(drill.started_wall).astimezone().isoformat(timespec="seconds"),
        "duration_s": round(total_s, 1),
        "service_start_s": round(startup_s, 1),
        "phases_s": round(drill.duration_s, 1),
        "service": {
            "model": (service.get("service") or {}).get("model"),
            "gpu_ctx": drill.gpu_cap, "cpu_ctx": drill.cpu_cap,
            "gpu_total_mib": gpu.get("total_mib"), "gpu_reserve_mib": gpu.get("reserve_mib"),
            "workers": [{k: w.get(k) for k in ("role", "n_ctx", "n_gpu_layers", "estimated_vram_mib", "last_load_s")}
                        for w in service.get("workers") or ()],
        },
        "config": getattr(target, "config_text", None),
        "notes": notes,
        "calibration": next((p.data.get("calibration") for p in drill.phases if p.number == 0), None),
    }
    report = build_report(
        records=records, phases=[p.to_dict() for p in drill.phases], monitor=monitor, faults=drill.faults,
        prefix_pairs=drill.prefix_pairs, tool_executions=dict(drill.ledger.executions), run=run)
    return report


def _keep_logs(workdir: Path, into: Path) -> None:
    """The service's and workers' logs next to the report of a failed drill, for whoever reads it.
    Owner-only, like the logs they copy: they hold the drill's prompts and answers."""
    from ..core.base.files import PRIVATE_FILE_MODE, make_private_dir

    make_private_dir(into)
    for source in [workdir / "service.log", workdir / "config.toml", *sorted(workdir.glob("vram-holder-*.log")),
                   *sorted((workdir / "state").rglob("*.log*"))]:
        if source.is_file():
            copy = into / source.name
            shutil.copy2(source, copy)
            os.chmod(copy, PRIVATE_FILE_MODE)


def _parse_phases(text: str | None, known: set[int]) -> set[int] | None:
    if not text:
        return None
    chosen = set()
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) not in known:
            raise ValueError(f"--phases: {part!r} is not a phase number (1-11)")
        chosen.add(int(part))
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tray_app.drill", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    configure_parser(parser)
    return run_drill(parser.parse_args(argv))
