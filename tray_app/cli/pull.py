"""`tray-app pull REPO/FILE.gguf`: download a model into the models folder.

The file lands in the models folder ([model] folder, else the platform data
dir's tray-app/models), where the library offers every .gguf as a model named
by its file stem on the next start. Before downloading it says, from the file
size alone, whether the model will fit (see ``download.rough_fit``); that
never stops the download unless --check-only asks it to.

Exit codes: 0 downloaded, or already there with the same hash; 1 the
download failed or was refused (not found, no access, hash mismatch, disk
full, network); 2 the command itself is wrong (the reference, a file that is
not .gguf, a bad config), as in the rest of the CLI; 130 interrupted (the
.part is kept and the same command resumes it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from ..core.config import ConfigError, apply_overrides, load_config
from ..core.catalog.download import (DEFAULT_HUB_URL, DEFAULT_REVISION, HUB_URL_ENV, PART_SUFFIX, TOKEN_ENV,
                             DownloadError, ErrorKind, RemoteFile, download_model, format_bytes, lookup_remote_files,
                             new_client, parse_model_ref, render_progress, rough_fit)
from .models import read_headroom

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

_USAGE_ERRORS = (ErrorKind.USAGE, ErrorKind.NOT_GGUF)

# A terminal redraws its bar often enough to look alive; a log gets a line now and then.
TTY_INTERVAL_S = 0.1
PLAIN_INTERVAL_S = 5.0
BAR_WIDTH = 24


def add_pull_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "pull",
        help="download a .gguf model from Hugging Face (or another hub) into the models folder",
        description="Download a GGUF file from a Hugging Face-style hub into the models folder, verify its "
                    "SHA-256, and say whether it will fit this machine. An interrupted download resumes "
                    "when the same command is run again. The model is named by its file stem; a running "
                    "service is asked to read its models folder again and serves it at once, otherwise it "
                    "is served from the service's next start.",
    )
    parser.add_argument("model", metavar="REPO/FILE.gguf",
                        help="owner/name/file.gguf, owner/name/sub/dir/file.gguf or owner/name:file.gguf")
    parser.add_argument("--revision", default=DEFAULT_REVISION, metavar="REV",
                        help=f"branch, tag or commit (default {DEFAULT_REVISION})")
    parser.add_argument("--hub", metavar="URL",
                        help=f"the hub's base URL (default: ${HUB_URL_ENV}, else {DEFAULT_HUB_URL}); "
                             f"a token in ${TOKEN_ENV} is sent for private or gated models")
    parser.add_argument("--no-verify", action="store_true",
                        help="take a file the hub publishes no SHA-256 for (a published one is always checked)")
    parser.add_argument("--check-only", action="store_true",
                        help="say whether it will fit, and stop before downloading")
    parser.add_argument("--config", metavar="PATH",
                        help="TOML config file (default: the platform config dir's config.toml)")
    parser.add_argument("--url", help="a running service to read free memory from "
                                      "(default http://127.0.0.1:<the configured port>)")
    parser.add_argument("--simulate-gpu-mib", type=int, metavar="N",
                        help="judge the fit against a simulated GPU of N MiB")
    return parser


class ProgressPrinter:
    """progress(done, total) for download_model: a redrawn bar on a terminal,
    a plain line every few seconds otherwise (a log or a pipe)."""

    def __init__(self, stream: TextIO, *, tty: bool, clock=time.monotonic) -> None:
        self.stream, self.tty, self.clock = stream, tty, clock
        self.started = 0.0  # at the first call: the tree lookup and fit check are not download time
        self.resumed_from: int | None = None
        self.last_shown = float("-inf")
        self.drawn = False

    def __call__(self, done: int, total: int | None) -> None:
        now = self.clock()
        if self.resumed_from is None:
            self.resumed_from, self.started = done, now
        finished = total is not None and done >= total
        if now - self.last_shown < (TTY_INTERVAL_S if self.tty else PLAIN_INTERVAL_S) and not finished:
            return
        self.last_shown = now
        line = render_progress(done, total, now - self.started, resumed_from=self.resumed_from,
                               bar_width=BAR_WIDTH if self.tty else 0)
        if self.tty:
            self.stream.write(f"\r{line}\x1b[K")
            self.drawn = True
        else:
            self.stream.write(f"tray-app: {line}\n")
        self.stream.flush()

    def finish(self) -> None:
        """End the bar's line so what follows starts on a fresh one."""
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False


def _fail(message: str, code: int) -> int:
    print(f"tray-app: error: {message}", file=sys.stderr)
    return code


def _exit_code(error: DownloadError) -> int:
    return EXIT_USAGE if error.kind in _USAGE_ERRORS else EXIT_FAILED


def run_pull(args: argparse.Namespace) -> int:
    try:
        ref = parse_model_ref(args.model)
        config = load_config(args.config)
        if args.simulate_gpu_mib is not None:
            config = apply_overrides(config, {"gpu": {"simulate_mib": args.simulate_gpu_mib}})
    except DownloadError as exc:
        return _fail(str(exc), _exit_code(exc))
    except ConfigError as exc:
        return _fail(str(exc), EXIT_USAGE)
    hub = args.hub or os.environ.get(HUB_URL_ENV) or DEFAULT_HUB_URL
    token = os.environ.get(TOKEN_ENV) or None
    dest_dir = config.models_folder()
    printer = ProgressPrinter(sys.stderr, tty=sys.stderr.isatty())
    try:
        with new_client() as client:
            remote, projector = lookup_remote_files(client, hub, ref, revision=args.revision, token=token)
            print(f"tray-app: {ref} at {args.revision}: {_describe_remote(remote)}", file=sys.stderr)
            if projector is not None:
                print(f"tray-app: its vision projector {projector.ref}: {_describe_remote(projector)}",
                      file=sys.stderr)
                # The library pairs a projector with the one model in its folder.
                dest_dir = dest_dir / Path(ref.filename).stem
            _print_fit(remote, config, args)
            if args.check_only:
                return 0
            result = download_model(hub, ref.repo, ref.file, dest_dir, revision=args.revision, token=token,
                                    progress=printer, client=client, verify=not args.no_verify, remote=remote)
            if projector is not None:
                printer.finish()
                download_model(hub, ref.repo, projector.ref.file, dest_dir, revision=args.revision, token=token,
                               progress=ProgressPrinter(sys.stderr, tty=sys.stderr.isatty()), client=client,
                               verify=not args.no_verify, remote=projector)
    except DownloadError as exc:
        printer.finish()
        return _fail(str(exc), _exit_code(exc))
    except KeyboardInterrupt:
        printer.finish()
        part = dest_dir / f"{ref.filename}{PART_SUFFIX}"
        kept = f": {format_bytes(part.stat().st_size)} kept in {part}; run the same command again to resume" \
            if part.exists() else ""
        return _fail(f"interrupted{kept}", EXIT_INTERRUPTED)
    printer.finish()
    name = result.path.stem
    _warn_on_name_clash(config)
    if result.already_present:
        check = "same sha256" if result.verified else "same size; no published hash to compare"
        print(f"{result.path} is already there ({check}); it is the model {name!r}")
        return 0
    rate = result.transferred / result.elapsed_s / (1024 * 1024) if result.elapsed_s > 0 else 0.0
    resumed = f", resumed after {format_bytes(result.resumed_from)}" if result.resumed_from else ""
    verified = "sha256 verified" if result.verified else "NOT verified: the hub publishes no sha256"
    sees = f" with its vision projector {projector.ref.filename} beside it" if projector is not None else ""
    print(f"saved {result.path}{sees} ({format_bytes(result.size)}, {verified}{resumed}; "
          f"{format_bytes(result.transferred)} in {result.elapsed_s:.1f} s, {rate:.1f} MiB/s). "
          f"{_announce(config, args, name)}")
    return 0


def _announce(config: Any, args: argparse.Namespace, name: str) -> str:
    """Tell a running service to read its models folder again, so the new
    model is served now; without one, it is served from the next start."""
    import httpx

    from ..core.api.security import bearer_header, effective_api_key

    url = (args.url or f"http://127.0.0.1:{config.server.port}").rstrip("/")
    try:
        response = httpx.post(f"{url}/admin/library/rescan", headers=bearer_header(
            effective_api_key(config.server.api_key)), timeout=30.0)
    except httpx.HTTPError:
        return f"It is the model {name!r} from the service's next start."
    if response.status_code == 200 and name in response.json().get("added", ()):
        return f"The running service at {url} serves it now as the model {name!r}."
    return f"It is the model {name!r} (the service at {url} did not add it now: HTTP {response.status_code})."


def _describe_remote(remote: RemoteFile) -> str:
    size = format_bytes(remote.size) if remote.size is not None else "size unknown"
    digest = f"sha256 {remote.sha256}" if remote.sha256 else "no published sha256"
    return f"{size}, {digest}"


def _print_fit(remote: RemoteFile, config: Any, args: argparse.Namespace) -> None:
    if remote.size is None:
        print("Fit: unknown (the hub gives no size for this file)")
        return
    url = args.url or f"http://127.0.0.1:{config.server.port}"
    reading = read_headroom(config, url, simulate_requested=args.simulate_gpu_mib is not None)
    _, line = rough_fit(remote.size, reading.headroom)
    print(f"Fit (rough, from the file size; memory from {reading.description}): {line}")


def _warn_on_name_clash(config: Any) -> None:
    """The library refuses two models with one name (a file stem): say so
    now rather than when the service next fails to start."""
    from ..core.catalog.library import LibraryError, build_library

    try:
        build_library(config)
    except LibraryError as exc:
        print(f"tray-app: warning: {exc}", file=sys.stderr)
    except ConfigError:
        pass  # no default model to clash with; `tray-app serve` says why
