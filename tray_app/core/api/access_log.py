"""The access log: one line per request in the service log, so a user can
see why their app failed (the 4xx it got, and its reason) without a proxy.

    POST /v1/chat/completions 200 0.84s key=phone client=OpenAI/Python served_by=gpu route=admitted id=req-...
    POST /v1/messages 400 0.01s client=claude-cli error="messages.1: each message needs role ..."

Never the prompt or the answer: the method, the path (no query string: it
may carry what a client shouldn't log), the status, the time, who sent it
(the key's name, else the app's name), where it ran and why, what the
service left out or dropped (its Warning and X-Messages-Dropped headers),
and for an error the message of its envelope, cut short. The pages and
polls a tray or a browser makes every second (/health, /status, /metrics,
/ui) are logged only when they fail, or the log would be nothing else.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from .requests import client_name
from .security import principal_of

log = logging.getLogger("tray_app.access")

# GETs a client repeats every second or so: logged when they fail.
_POLLED = ("/health", "/status", "/metrics", "/ui", "/v1/models", "/models", "/api/tags", "/api/ps",
           "/api/version")
# An error body read for its message: the envelopes are small.
_ERROR_BODY_BYTES = 4096
_MESSAGE_CHARS = 240


class AccessLog:
    """ASGI middleware, outermost: it sees every answer, refusals at the door included."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        answer: dict[str, Any] = {"status": None, "headers": {}, "body": bytearray()}

        async def send_noting(message) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
                answer["headers"] = {k.decode("latin-1").lower(): v.decode("latin-1")
                                     for k, v in message.get("headers", ())}
            elif (message["type"] == "http.response.body" and (answer["status"] or 0) >= 400
                  and len(answer["body"]) < _ERROR_BODY_BYTES):
                answer["body"] += message.get("body", b"")[:_ERROR_BODY_BYTES - len(answer["body"])]
            await send(message)

        try:
            await self.app(scope, receive, send_noting)
        finally:
            status = answer["status"]
            if not (scope["method"] == "GET" and scope["path"].startswith(_POLLED) and (status or 0) < 400):
                log.info("%s", access_line(scope, status, answer["headers"], bytes(answer["body"]),
                                           time.monotonic() - started))


def access_line(scope, status: int | None, headers: dict[str, str], error_body: bytes, seconds: float) -> str:
    """One request's line (pure, but for the scope it reads)."""
    request_headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
    parts = [scope["method"], _printable(scope["path"], 200), str(status or "-"), f"{seconds:.2f}s"]
    principal = principal_of(scope)
    if principal is not None:
        parts.append(f"key={principal.name}")
    who = client_name(request_headers.get("x-client-name"), request_headers.get("user-agent"))
    if who:
        parts.append(f"client={who}")
    for header, name in (("x-served-by", "served_by"), ("x-route-reason", "route"), ("x-model", "model"),
                         ("x-messages-dropped", "messages_dropped"), ("x-request-id", "id")):
        if headers.get(header):
            parts.append(f"{name}={_printable(headers[header], 80)}")
    if headers.get("warning"):
        parts.append(f"warning={json.dumps(_printable(headers['warning'], _MESSAGE_CHARS))}")
    # Set by the app once the answer is whole: its headers were sent before a failure cut it.
    resumed = (scope.get("state") or {}).get("resumed")
    if isinstance(resumed, dict):
        parts.append(f"resumed={resumed.get('from')}->{resumed.get('on')} cut_at_tokens={resumed.get('cut_at_tokens')} "
                     f"tokens_added={resumed.get('tokens_added')}")
    if status is None:
        parts.append("error=\"no answer: the connection ended first\"")
    elif status >= 400:
        parts.append(f"error={json.dumps(_printable(error_message(error_body), _MESSAGE_CHARS))}")
    return " ".join(parts)


def error_message(body: bytes) -> str:
    """The message of any of the five protocols' error envelopes."""
    try:
        payload = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", ""))
    if isinstance(error, str):  # Ollama's {"error": "..."}
        return error
    return str(payload)


def _printable(text: str, limit: int) -> str:
    """One line, no control characters (a log line a client can't forge), cut short."""
    cleaned = "".join(c if c.isprintable() else " " for c in text)
    return cleaned if len(cleaned) <= limit else cleaned[:limit - 1] + "…"
