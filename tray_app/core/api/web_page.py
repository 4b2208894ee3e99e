"""GET /ui: the web page (tray_app/web), the tray's panel for a browser;
GET /admin/logs: the end of a worker's log, for the page's log view.

The files ship in the package and are served as they are: no build step,
and the page loads nothing from outside, which the Content-Security-Policy
below also enforces in the browser.
"""

from __future__ import annotations

import asyncio
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import error_response

if TYPE_CHECKING:
    from ..service import Service

_TYPES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "style.css": "text/css; charset=utf-8"}
_HEADERS = {
    # Only this origin's own files; the page's script never builds HTML
    # from text (textContent), and no inline script may run.
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

LOG_ROLES = ("gpu", "cpu")
DEFAULT_LOG_LINES = 200
MAX_LOG_LINES = 1000
# What is read from the end of a log, whatever `lines` asks: a worker that
# logs one enormous line can't make an answer (or the page) large.
LOG_TAIL_BYTES = 256 * 1024


@lru_cache(maxsize=None)
def _file(name: str) -> bytes:
    return resources.files("tray_app").joinpath("web", name).read_bytes()


async def web_page(request: Request) -> Response:
    name = request.path_params.get("name") or "index.html"
    if name not in _TYPES:
        return error_response(404, f"the web page has no file {name!r}; open /ui", "not_found")
    return Response(_file(name), media_type=_TYPES[name], headers=_HEADERS)


def last_lines(data: bytes, lines: int, *, cut_at_start: bool) -> list[str]:
    """The last `lines` lines of `data`, the end of a file; when `data` was
    cut from a longer file its first line is a fragment and is dropped."""
    text = data.decode("utf-8", "replace").splitlines()
    if cut_at_start and text:
        text = text[1:]
    return text[-lines:] if lines else []


def read_end(path: Path, max_bytes: int = LOG_TAIL_BYTES) -> tuple[bytes, bool]:
    """The last `max_bytes` of a file, and whether that is less than all of it.
    A log not written yet reads as empty."""
    try:
        with open(path, "rb") as file:
            size = file.seek(0, 2)
            start = max(0, size - max_bytes)
            file.seek(start)
            return file.read(max_bytes), start > 0
    except FileNotFoundError:
        return b"", False


def _lines_param(raw: str | None) -> int | None:
    if raw is None:
        return DEFAULT_LOG_LINES
    try:
        lines = int(raw)
    except ValueError:
        return None
    return lines if 1 <= lines <= MAX_LOG_LINES else None


def worker_logs(service: Service) -> Callable[[Request], Awaitable[Response]]:
    """GET /admin/logs?worker=gpu|cpu&lines=N[&model=NAME]: the last lines of
    that worker's log file (the one the tray's log viewer reads), read only
    when asked, so a page that isn't open costs nothing."""

    async def handler(request: Request) -> Response:
        params = request.query_params
        role = params.get("worker", "")
        if role not in LOG_ROLES:
            return error_response(400, f"'worker' must be one of {', '.join(LOG_ROLES)}", "invalid_value",
                                  param="worker")
        lines = _lines_param(params.get("lines"))
        if lines is None:
            return error_response(400, f"'lines' must be a whole number from 1 to {MAX_LOG_LINES}",
                                  "invalid_value", param="lines")
        name = params.get("model")
        model_host = service.model_host_for(name)
        if model_host is None:
            return error_response(404, f"no model named {name!r}", "model_not_found", param="model")
        worker = next((w for w in model_host.workers() if w.role == role), None)
        if worker is None:
            return error_response(404, f"this model has no {role.upper()} worker", "not_found", param="worker")
        data, cut = await asyncio.to_thread(read_end, worker.log_path)
        return JSONResponse({"worker": role, "model": model_host.model.name, "file": worker.log_path.name,
                             "lines": last_lines(data, lines, cut_at_start=cut)})

    return handler
