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
import secrets
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable

from ..base.http_basics import bearer_header, is_loopback
from ..access.keys import LEGACY_KEY_NAME, TRAY_KEY_NAME, ApiKey, KeyStore
from .connections import CONNECTION_SCOPE_KEY, ClientConnection, ConnectionLedger, client_key, retry_after_header
from .errors import error_body_for_path

API_KEY_ENV = "TRAY_APP_API_KEY"
# Defined in http_basics, below api/ (the peer path and the config use them
# too); the clients of our own port import them from here.
__all__ = ["API_KEY_ENV", "CSRF_COOKIE", "CSRF_HEADER", "EXPOSED_HEADERS", "MAX_HEADER_BYTES", "PUBLIC_PATHS",
           "PRINCIPAL_SCOPE_KEY", "SESSION_COOKIE", "AccessGuard", "AccessPolicy", "WebSessions", "bearer_header",
           "bind_problem", "effective_api_key", "host_name", "is_loopback", "principal_of", "process_admin_key"]
# Where the guard leaves the key a request was made with (an ApiKey), for the
# routes: its name owns the request's jobs and its usage, its scope and limits
# apply. Absent when the server needs no key: then everyone may do everything.
PRINCIPAL_SCOPE_KEY = "tray_app.principal"
# Routes only an admin key may use (the web page's controls call these too).
ADMIN_PREFIX = "/admin/"
# Routes a monitor may call without the key.
PUBLIC_PATHS = frozenset({"/health"})
# The web page's files (tray_app/web) hold no data, so a browser may fetch them
# before logging in: the page then asks for the key when /status says 401.
WEB_PAGE_PREFIX = "/ui"
WEB_LOGIN_PATH = "/ui/login"
WEB_LOGOUT_PATH = "/ui/logout"
# The page's session: an opaque token in an HttpOnly cookie (never the key,
# which a stolen cookie would then leak), and a CSRF token the page's script
# reads from a second cookie and echoes in a header a cross-site form can't set.
SESSION_COOKIE = "tray_app_session"
CSRF_COOKIE = "tray_app_csrf"
CSRF_HEADER = "x-csrf-token"
SESSION_LIFETIME_S = 12 * 3600
# Logins held at once: per key (a key's ninth login ends its oldest), and
# in all (the key with the most gives way), so one key can't log out others.
MAX_WEB_SESSIONS = 256
MAX_WEB_SESSIONS_PER_KEY = 8
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
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


# The tray's own key: made afresh by each process and never written or shown
# anywhere. The tray runs its service in its own process, so its client
# (ui/client.py) can send this when no [server] api_key is set, and stays an
# admin when named keys close the port to everyone else.
_PROCESS_ADMIN_KEY = "tak_tray_" + secrets.token_urlsafe(32)


def process_admin_key() -> str:
    return _PROCESS_ADMIN_KEY


def principal_of(scope) -> ApiKey | None:
    return (scope.get("extensions") or {}).get(PRINCIPAL_SCOPE_KEY)


def effective_api_key(configured: str) -> str:
    """The one rule for which key is in force, `configured` being [server] api_key.
    The environment wins, so a key need not be written to disk. The server checks
    requests against this and every client of ours sends it, so they can't disagree."""
    return os.environ.get(API_KEY_ENV, "") or configured


def bind_problem(bind_address: str, api_key: str, named_keys: bool = False) -> str | None:
    """Why binding `bind_address` is refused, or None."""
    if is_loopback(bind_address) or api_key or named_keys:
        return None
    return (f"binding {bind_address} exposes the API to other machines, so it needs an API key: "
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
    bind_address: str
    allowed_hosts: frozenset[str]
    cors_origins: frozenset[str]
    # The named keys (keys.py), read again when their file changes.
    keys: KeyStore | None = None

    @classmethod
    def build(cls, api_key: str, bind_address: str, allowed_hosts: Iterable[str], cors_origins: Iterable[str],
              keys: KeyStore | None = None):
        return cls(api_key, bind_address.lower(), frozenset(h.lower() for h in allowed_hosts),
                   frozenset(o.rstrip("/") for o in cors_origins), keys)

    @property
    def key_required(self) -> bool:
        return bool(self.api_key) or (self.keys is not None and self.keys.required())

    def legacy_key(self) -> ApiKey:
        """The old single key: an admin key, so setups from before named keys
        (and the tray, which sends it) keep every right they had."""
        return ApiKey(LEGACY_KEY_NAME, "admin")

    def principal_with_identity(self, identity: str) -> ApiKey | None:
        """A web session's key, looked up again on each request: a revoked
        key's sessions end with it, and a new key that took its name is not it."""
        if identity == LEGACY_KEY_NAME:
            return self.legacy_key() if self.api_key else None
        if identity == TRAY_KEY_NAME:
            return ApiKey(TRAY_KEY_NAME, "admin")
        return self.keys.with_identity(identity) if self.keys is not None and identity else None

    def host_allowed(self, host_header: str | None) -> bool:
        if not host_header:
            return False
        name = host_name(host_header)
        # Exact names only: a wildcard would let a rebinding page's name through too.
        if name in self.allowed_hosts or is_loopback(name):
            return True
        # Bound to a LAN address: clients use that address (or a configured name).
        return not is_loopback(self.bind_address) and self.bind_address not in ("0.0.0.0", "::") and name == self.bind_address

    def origin_allowed(self, origin: str) -> bool:
        origin = origin.rstrip("/")
        return origin in self.cors_origins or _LOCAL_ORIGIN.fullmatch(origin.lower()) is not None

    def key_matches(self, authorization: str | None, x_api_key: str | None = None) -> bool:
        return self.authenticate(authorization, x_api_key)[0]

    def authenticate(self, authorization: str | None, x_api_key: str | None = None) -> tuple[bool, ApiKey | None]:
        """(whether the request may pass, the key it was made with). The key
        as OpenAI's clients send it (Authorization: Bearer) or as Anthropic's
        do (x-api-key). With no key configured anywhere, everyone passes as
        nobody in particular (None)."""
        if not self.key_required:
            return True, None
        if authorization and authorization.lower().startswith("bearer "):
            offered = authorization[7:].strip()
        elif x_api_key:
            offered = x_api_key.strip()
        else:
            return False, None
        # Constant time, so the key can't be guessed byte by byte from timings.
        if self.api_key and hmac.compare_digest(offered.encode(), self.api_key.encode()):
            return True, self.legacy_key()
        if hmac.compare_digest(offered.encode(), _PROCESS_ADMIN_KEY.encode()):
            return True, ApiKey(TRAY_KEY_NAME, "admin")
        named = self.keys.match(offered) if self.keys is not None else None
        return named is not None, named


@dataclass(frozen=True)
class _WebSession:
    csrf_token: str
    expires_at: float
    # The identity (ApiKey.identity) of the key the page logged in with: its
    # scope applies to the page, and a key revoked and added again under the
    # same name is not it.
    key_identity: str = ""


class WebSessions:
    """The web page's logins, kept in memory only: a restart logs the pages
    out, and nothing about them is written to disk."""

    def __init__(self, lifetime_s: float = SESSION_LIFETIME_S, limit: int = MAX_WEB_SESSIONS,
                 per_key: int = MAX_WEB_SESSIONS_PER_KEY) -> None:
        self.lifetime_s = lifetime_s
        self.limit = limit
        self.per_key = per_key
        self._sessions: OrderedDict[str, _WebSession] = OrderedDict()

    def create(self, now: float, key_identity: str = "") -> tuple[str, str]:
        """A new session: (session token, CSRF token). Past the key's own
        limit its oldest session goes; past the table's, the oldest of the
        key holding the most. Repeated logins can't grow the table, and one
        key's logins end only its own sessions until it holds the most."""
        self._expire(now)
        while self._count(key_identity) >= self.per_key:
            self._end_oldest_of(key_identity)
        while len(self._sessions) >= self.limit:
            counts = Counter(s.key_identity for s in self._sessions.values())
            self._end_oldest_of(counts.most_common(1)[0][0])
        token, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        self._sessions[token] = _WebSession(csrf, now + self.lifetime_s, key_identity)
        return token, csrf

    def _count(self, key_identity: str) -> int:
        return sum(1 for s in self._sessions.values() if s.key_identity == key_identity)

    def _end_oldest_of(self, key_identity: str) -> None:
        del self._sessions[next(t for t, s in self._sessions.items() if s.key_identity == key_identity)]

    def csrf_for(self, token: str | None, now: float) -> str | None:
        """The CSRF token of a live session, or None for an unknown or expired one."""
        if not token:
            return None
        session = self._sessions.get(token)
        if session is None:
            return None
        if session.expires_at <= now:
            del self._sessions[token]
            return None
        return session.csrf_token

    def key_identity(self, token: str | None) -> str:
        session = self._sessions.get(token or "")
        return session.key_identity if session is not None else ""

    def end(self, token: str | None) -> None:
        self._sessions.pop(token or "", None)

    def _expire(self, now: float) -> None:
        for token in [t for t, s in self._sessions.items() if s.expires_at <= now]:
            del self._sessions[token]


def cookie_value(cookie_header: str | None, name: str) -> str | None:
    for part in (cookie_header or "").split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key == name:
            return value
    return None


def _is_web_page_file(method: str, path: str) -> bool:
    return method in ("GET", "HEAD") and (path == WEB_PAGE_PREFIX or path.startswith(WEB_PAGE_PREFIX + "/"))


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
                 clock: Callable[[], float] = time.monotonic, sessions: WebSessions | None = None) -> None:
        self.app = app
        self.policy = policy
        self.ledger = ledger
        self._clock = clock
        self.sessions = sessions or WebSessions()

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
        if scope["method"] == "POST" and scope["path"] in (WEB_LOGIN_PATH, WEB_LOGOUT_PATH):
            # Answered here, where the key, the sessions and the wrong-key
            # slowdown live, so no route ever sees the key.
            await _send(send, *await self._web_login(scope, receive, headers))
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
        # The login checks the key itself, as a body field.
        if (scope["path"] not in PUBLIC_PATHS and scope["path"] != WEB_LOGIN_PATH
                and not _is_web_page_file(scope["method"], scope["path"])):
            refusal = self._check_key(scope, headers) or _check_scope(scope)
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
        """None when the request may pass, with its key left in the scope
        (PRINCIPAL_SCOPE_KEY); else the refusal."""
        connection: ClientConnection | None = (scope.get("extensions") or {}).get(CONNECTION_SCOPE_KEY)
        key_required = self.policy.key_required
        if key_required and not (headers.get("authorization") or headers.get("x-api-key")):
            session = cookie_value(headers.get("cookie"), SESSION_COOKIE)
            csrf = self.sessions.csrf_for(session, self._clock())
            if csrf is not None:
                principal = self.policy.principal_with_identity(self.sessions.key_identity(session))
                if principal is None:  # its key was revoked since the login
                    self.sessions.end(session)
                    return self._wrong_key(scope, headers, "")
                _set_principal(scope, principal)
                return self._check_csrf(scope, headers, csrf, connection)
        if connection is not None and connection.authenticated:
            # Shown the key before (or none is set): checked again, but never
            # held back by what other connections from its address did.
            passed, principal = self.policy.authenticate(headers.get("authorization"), headers.get("x-api-key"))
            if passed:
                _set_principal(scope, principal)
                return None
            return self._wrong_key(scope, headers, connection.address)
        address = connection.address if connection is not None else client_key((scope.get("client") or ("",))[0])
        if self.ledger is not None and key_required:
            wait_s = self.ledger.key_wait_s(address, self._clock())
            if wait_s is not None:
                # Refused before the key is compared, right or wrong, so that
                # a guesser learns nothing until the wait is over.
                return _envelope(scope["path"], 429, "too_many_wrong_keys",
                                 f"too many wrong API keys from {address}: wait {retry_after_header(wait_s)} s "
                                 "before sending a key again (each further wrong key doubles the wait)",
                                 [(b"retry-after", retry_after_header(wait_s).encode())])
        passed, principal = self.policy.authenticate(headers.get("authorization"), headers.get("x-api-key"))
        if not passed:
            return self._wrong_key(scope, headers, address)
        _set_principal(scope, principal)
        if connection is not None and self.ledger is not None:
            self.ledger.authenticated(connection)
        return None

    def _check_csrf(self, scope, headers: dict[str, str], csrf: str, connection: ClientConnection | None):
        """A logged-in page: reads pass; a change must echo the CSRF token,
        which a page on another site can neither read nor guess."""
        if scope["method"] not in _SAFE_METHODS:
            offered = headers.get(CSRF_HEADER, "")
            if not hmac.compare_digest(offered.encode(), csrf.encode()):
                return _envelope(scope["path"], 403, "csrf_token_invalid",
                                 f"a change made with the web page's login cookie must carry its "
                                 f"{CSRF_HEADER} header; reload the page")
        if connection is not None and self.ledger is not None:
            self.ledger.authenticated(connection)
        return None

    async def _web_login(self, scope, receive, headers: dict[str, str]):
        """POST /ui/login {"key": ...} sets the session cookies; POST
        /ui/logout (with the CSRF header) ends the session."""
        path = scope["path"]
        if path == WEB_LOGOUT_PATH:
            session = cookie_value(headers.get("cookie"), SESSION_COOKIE)
            csrf = self.sessions.csrf_for(session, self._clock())
            if csrf is not None and hmac.compare_digest(headers.get(CSRF_HEADER, "").encode(), csrf.encode()):
                self.sessions.end(session)
            return 200, [(b"content-type", b"application/json"), *_session_cookies("", "", 0)], b'{"logged_in":false}'
        if not self.policy.key_required:
            return 200, [(b"content-type", b"application/json")], b'{"logged_in":true,"key_required":false}'
        body = await _read_small_body(receive)
        try:
            offered = json.loads(body).get("key")
        except (ValueError, AttributeError):
            offered = None
        if not isinstance(offered, str) or not offered:
            return _envelope(path, 400, "invalid_request", 'send {"key": "<the API key>"} as application/json')
        refusal = self._check_key(scope, {"authorization": f"Bearer {offered}"})
        if refusal is not None:
            return refusal
        principal = principal_of(scope)
        token, csrf = self.sessions.create(self._clock(), principal.identity if principal is not None else "")
        answer = {"logged_in": True, "key_required": True,
                  "scope": principal.scope if principal is not None else "admin"}
        return (200, [(b"content-type", b"application/json"),
                      *_session_cookies(token, csrf, int(self.sessions.lifetime_s))], json.dumps(answer).encode())

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
                 b"X-Prefer-Path, X-Fallback, X-Resume, X-Client-Name, X-Degraded-Note, x-api-key, anthropic-version, anthropic-beta"),
                (b"access-control-max-age", b"600"),
            ]
        return headers


def _set_principal(scope, principal: ApiKey | None) -> None:
    if principal is not None:
        scope.setdefault("extensions", {})[PRINCIPAL_SCOPE_KEY] = principal


def _check_scope(scope):
    """An inference key may not use the admin routes: restarting workers,
    giving the GPU away, loading models are the household's, not an app's."""
    principal = principal_of(scope)
    if principal is None or principal.is_admin or not scope["path"].startswith(ADMIN_PREFIX):
        return None
    return _envelope(scope["path"], 403, "insufficient_scope",
                     f"the key {principal.name!r} has scope {principal.scope!r}; {scope['path']} needs an admin key "
                     "(tray-app keys add NAME --scope admin)")


def _session_cookies(token: str, csrf: str, max_age_s: int) -> list[tuple[bytes, bytes]]:
    """Both cookies, or (max_age 0) their removal. SameSite=Strict: a request
    another site starts carries neither."""
    common = f"Path=/; Max-Age={max_age_s}; SameSite=Strict"
    return [(b"set-cookie", f"{SESSION_COOKIE}={token}; {common}; HttpOnly".encode()),
            (b"set-cookie", f"{CSRF_COOKIE}={csrf}; {common}".encode())]


async def _read_small_body(receive, limit: int = 4096) -> bytes:
    """The login form's body: a key, never more than a few KiB."""
    body = b""
    while len(body) <= limit:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    return body[:limit]


async def _send(send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
