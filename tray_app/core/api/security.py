"""Who may talk to the port: loopback binding, API keys, Host and Origin checks.

A localhost port is reachable from every browser tab on the machine. Three
browser attacks matter: DNS rebinding (a page on evil.example re-resolves its
name to 127.0.0.1: caught by the Host check), cross-origin reads (CORS: no
wildcard, an allowlist), and cross-origin *writes*, where a plain form POST
needs no preflight (caught by refusing any Origin not on the allowlist).
Pages served from this machine itself (http://localhost:3000, a local web UI)
are on the allowlist by default, as Ollama does: a page can't forge its Origin,
so only a server already running here can claim one of those.
"""

from __future__ import annotations

import hmac
import json
import os
import re
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from ..http_basics import bearer_header, is_loopback
from .connections import CONNECTION_SCOPE_KEY, ClientConnection, ConnectionLedger, client_key, retry_after_header
from .errors import error_body_for_path

API_KEY_ENV = "TRAY_APP_API_KEY"
# Defined in http_basics, below api/ (the peer path and the config use them
# too); the clients of our own port import them from here.
__all__ = ["API_KEY_ENV", "EXPOSED_HEADERS", "MAX_HEADER_BYTES", "PUBLIC_PATHS", "AccessGuard", "AccessPolicy",
           "bearer_header", "bind_problem", "effective_api_key", "host_name", "is_loopback"]
# Routes a monitor may call without the key.
PUBLIC_PATHS = frozenset({"/health"})
# The request line and headers together; the h11 parser enforces the same cap on
# headers still arriving, this catches ones that arrive in a single packet.
MAX_HEADER_BYTES = 16 * 1024
# What `curl -d` says a body is, and what some scripts send.
_CURL_DEFAULT_TYPES = frozenset({"application/x-www-form-urlencoded", "text/plain"})
# Any port, http or https, on this machine's own names; nothing else (no path, no
# user info, no "localhost.evil.example"). `null` (a sandboxed page or a file://
# one) is not among them: any page can send it.
_LOCAL_ORIGIN = re.compile(r"https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]{1,5})?")
EXPOSED_HEADERS = ("X-Request-Id", "X-Served-By", "X-Route-Reason", "X-Fallback-Model", "X-Peer",
                   "X-Estimated-Latency", "X-Queue-Wait", "Retry-After")


def effective_api_key(configured: str) -> str:
    """The one rule for which key is in force, `configured` being [server] api_key.
    The environment wins, so a key need not be written to disk. The server checks
    requests against this and every client of ours sends it, so they can't disagree."""
    return os.environ.get(API_KEY_ENV, "") or configured


def bind_problem(host: str, api_key: str) -> str | None:
    """Why binding `host` is refused, or None."""
    if is_loopback(host) or api_key:
        return None
    return (f"binding {host} exposes the API to other machines, so it needs an API key: "
            f"export {API_KEY_ENV}=<a long random string> (or set [server] api_key in the config), "
            "then send 'Authorization: Bearer <key>'")


def host_name(host_header: str) -> str:
    """The name part of a Host header: 'example.com:8642' -> 'example.com', '[::1]:80' -> '::1'."""
    value = host_header.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


@dataclass(frozen=True)
class AccessPolicy:
    api_key: str
    bound_host: str
    allowed_hosts: frozenset[str]
    cors_origins: frozenset[str]

    @classmethod
    def build(cls, api_key: str, bound_host: str, allowed_hosts: Iterable[str], cors_origins: Iterable[str]):
        return cls(api_key, bound_host.lower(), frozenset(h.lower() for h in allowed_hosts),
                   frozenset(o.rstrip("/") for o in cors_origins))

    def host_allowed(self, host_header: str | None) -> bool:
        if not host_header:
            return False
        name = host_name(host_header)
        # Exact names only: a wildcard would let a rebinding page's name through too.
        if name in self.allowed_hosts or is_loopback(name):
            return True
        # Bound to a LAN address: clients use that address (or a configured name).
        return not is_loopback(self.bound_host) and self.bound_host not in ("0.0.0.0", "::") and name == self.bound_host

    def origin_allowed(self, origin: str) -> bool:
        origin = origin.rstrip("/")
        return origin in self.cors_origins or _LOCAL_ORIGIN.fullmatch(origin.lower()) is not None

    def key_matches(self, authorization: str | None, x_api_key: str | None = None) -> bool:
        """The key as OpenAI's clients send it (Authorization: Bearer) or as
        Anthropic's do (x-api-key)."""
        if not self.api_key:
            return True
        if authorization and authorization.lower().startswith("bearer "):
            offered = authorization[7:].strip()
        elif x_api_key:
            offered = x_api_key.strip()
        else:
            return False
        # Constant time, so the key can't be guessed byte by byte from timings.
        return hmac.compare_digest(offered.encode(), self.api_key.encode())


def _envelope(path: str, status: int, code: str, message: str, extra_headers: list[tuple[bytes, bytes]] = ()):
    """A refusal at the door, in the route's error envelope. It closes the
    connection (uvicorn closes it after a "Connection: close" answer)."""
    body = json.dumps(error_body_for_path(path, status, message, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close"), *extra_headers]
    return status, headers, body


class AccessGuard:
    """ASGI middleware applying an AccessPolicy before any route runs.

    With a ConnectionLedger it also marks a connection authenticated once a
    request on it carries the key, and slows down an address that keeps
    sending wrong keys (connections.py). Every refusal here closes the
    connection: a client that was turned away at the door must not keep
    holding one of the server's connections by retrying on it."""

    def __init__(self, app, policy: AccessPolicy, ledger: ConnectionLedger | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.app = app
        self.policy = policy
        self.ledger = ledger
        self._clock = clock

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        origin = headers.get("origin")
        rejection = self._check(scope, headers, origin)
        if rejection is not None:
            await _send(send, *rejection)
            return
        if origin is not None and scope["method"] == "OPTIONS":
            await _send(send, 204, self._cors_headers(origin, preflight=True), b"")
            return
        if origin is None:
            await self.app(scope, receive, send)
            return

        cors = self._cors_headers(origin, preflight=False)

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _check(self, scope, headers: dict[str, str], origin: str | None):
        header_bytes = sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        if header_bytes > MAX_HEADER_BYTES:
            return _envelope(scope["path"], 431, "headers_too_large",
                             f"the request headers are {header_bytes} bytes; the limit is "
                             f"{MAX_HEADER_BYTES // 1024} KiB")
        if not self.policy.host_allowed(headers.get("host")):
            return _envelope(scope["path"], 403, "host_not_allowed",
                             f"Host {headers.get('host')!r} is not this server's name; requests must address "
                             "localhost or the bound address (this blocks DNS rebinding). Add the name to "
                             "[server] allowed_hosts if you reach the server under another name.")
        if origin is not None and not self.policy.origin_allowed(origin):
            return _envelope(scope["path"], 403, "origin_not_allowed",
                             f"requests from the web origin {origin!r} are not allowed; add it to "
                             "[server] cors_origins to let that page use the API (pages on localhost "
                             "and 127.0.0.1 are allowed by default)")
        if scope["method"] == "OPTIONS":
            return None
        if scope["path"] not in PUBLIC_PATHS:
            refusal = self._check_key(scope, headers)
            if refusal is not None:
                return refusal
        if scope["method"] == "POST":
            content_type = headers.get("content-type", "application/json").split(";")[0].strip().lower()
            # Ollama's own examples post with `curl -d`, which labels the JSON
            # as a form. A browser's cross-site form post carries an Origin
            # and was refused above, so without one it is a local program.
            if origin is None and scope["path"].startswith("/api/") and content_type in _CURL_DEFAULT_TYPES:
                return None
            if content_type != "application/json":
                return _envelope(scope["path"], 415, "unsupported_media_type",
                                 f"send the body as application/json, not {content_type!r}")
        return None

    def _check_key(self, scope, headers: dict[str, str]):
        connection: ClientConnection | None = (scope.get("extensions") or {}).get(CONNECTION_SCOPE_KEY)
        if connection is not None and connection.authenticated:
            # Shown the key before (or none is set): checked again, but never
            # held back by what other connections from its address did.
            if self.policy.key_matches(headers.get("authorization"), headers.get("x-api-key")):
                return None
            return self._wrong_key(scope, headers, connection.address)
        address = connection.address if connection is not None else client_key((scope.get("client") or ("",))[0])
        if self.ledger is not None and self.policy.api_key:
            wait_s = self.ledger.key_wait_s(address, self._clock())
            if wait_s is not None:
                # Refused before the key is compared, right or wrong, so that
                # a guesser learns nothing until the wait is over.
                return _envelope(scope["path"], 429, "too_many_wrong_keys",
                                 f"too many wrong API keys from {address}: wait {retry_after_header(wait_s)} s "
                                 "before sending a key again (each further wrong key doubles the wait)",
                                 [(b"retry-after", retry_after_header(wait_s).encode())])
        if not self.policy.key_matches(headers.get("authorization"), headers.get("x-api-key")):
            return self._wrong_key(scope, headers, address)
        if connection is not None and self.ledger is not None:
            self.ledger.authenticated(connection)
        return None

    def _wrong_key(self, scope, headers: dict[str, str], address: str):
        # Only a key that was offered counts towards the wait: a client that
        # sent none is not guessing, and shouldn't lock out its address.
        if self.ledger is not None and (headers.get("authorization") or headers.get("x-api-key")):
            self.ledger.key_failed(address, self._clock())
        return _envelope(scope["path"], 401, "invalid_api_key",
                         "missing or wrong API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>') "
                         f"with the key set in {API_KEY_ENV} or [server] api_key", [(b"www-authenticate", b"Bearer")])

    def _cors_headers(self, origin: str, preflight: bool) -> list[tuple[bytes, bytes]]:
        headers = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
                   (b"access-control-expose-headers", ", ".join(EXPOSED_HEADERS).encode())]
        if preflight:
            headers += [
                (b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
                (b"access-control-allow-headers",
                 b"Authorization, Content-Type, X-Request-Id, Idempotency-Key, X-Request-Timeout, X-Force-Path, "
                 b"X-Prefer-Path, X-Fallback, X-Client-Name, X-Degraded-Note, x-api-key, anthropic-version, anthropic-beta"),
                (b"access-control-max-age", b"600"),
            ]
        return headers


async def _send(send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
