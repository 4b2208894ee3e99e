"""GET /ui: the web page (tray_app/web), the tray's panel for a browser.

The files ship in the package and are served as they are: no build step,
and the page loads nothing from outside, which the Content-Security-Policy
below also enforces in the browser.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response

from .errors import error_response

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


@lru_cache(maxsize=None)
def _file(name: str) -> bytes:
    return resources.files("tray_app").joinpath("web", name).read_bytes()


async def web_page(request: Request) -> Response:
    name = request.path_params.get("name") or "index.html"
    if name not in _TYPES:
        return error_response(404, f"the web page has no file {name!r}; open /ui", "not_found")
    return Response(_file(name), media_type=_TYPES[name], headers=_HEADERS)
