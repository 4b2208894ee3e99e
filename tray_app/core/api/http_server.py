"""The HTTP server for the service: uvicorn, with the limits a home server needs.

uvicorn answers a malformed request with plain text and has no deadline for
a client that trickles its headers (slowloris). Both happen before the app
runs, so they are handled here, in a small subclass of its h11 protocol.
"""

from __future__ import annotations

import asyncio
import socket
import sys

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..config import Config
from ..access.keys import KeyStore
from ..service import Service
from .app import create_app
from .connections import CONNECTION_SCOPE_KEY, ConnectionLedger, client_key
from .errors import error_bytes
from .access_log import AccessLog
from .security import MAX_HEADER_BYTES, AccessGuard, AccessPolicy, effective_api_key


class GuardedH11Protocol(H11Protocol):
    """Cuts off clients that take too long to send their headers, answers
    unparseable or oversized requests in the OpenAI error envelope, and
    refuses a connection its client address may not open (connections.py)."""

    header_timeout_s = 10.0
    # Who holds which connections, shared by every connection of one server;
    # build_server sets it. Past its caps a new connection is refused at
    # once, so idle or slow clients can't take every file descriptor, and
    # one client can't take them all from the others.
    ledger: ConnectionLedger

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self.client_connection, refusal = self.ledger.open(client_key(self.client[0] if self.client else None))
        if refusal is not None:
            self._reply_and_close(503, refusal.code, refusal.message)
            return
        # The access guard marks the connection authenticated when a request
        # on it carries the key; it finds the connection in the request's scope.
        app, connection = self.app, self.client_connection

        async def app_knowing_the_connection(scope, receive, send) -> None:
            scope.setdefault("extensions", {})[CONNECTION_SCOPE_KEY] = connection
            await app(scope, receive, send)

        self.app = app_knowing_the_connection
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self.ledger.closed(self.client_connection)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        # Read before the base class starts the next cycle, which resets both sides to IDLE.
        body_unread = self.conn.their_state is h11.SEND_BODY
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if body_unread:
            # Answered before its body was read (a rejection, or a route that
            # takes no body): the rest of the body would have to be read and
            # thrown away before the connection could serve another request.
            # Close it instead, so a client can't hold it open by never
            # finishing a body it declared.
            self.transport.close()
            return
        self._arm_header_timer()

    def send_400_response(self, msg: str) -> None:
        self._reply_and_close(400, "invalid_http_request",
                              f"the request could not be parsed as HTTP/1.1, or its request line and headers are "
                              f"over {MAX_HEADER_BYTES // 1024} KiB")

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0] or self.cycle is None:
            self._reply_and_close(408, "request_timeout",
                                  f"the request headers did not arrive within {self.header_timeout_s:g} s")
        else:
            # An idle keep-alive connection: just close it.
            self.transport.close()

    def _reply_and_close(self, status: int, code: str, message: str) -> None:
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        body = error_bytes(status, message, code)
        try:
            if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers)))
                self.transport.write(self.conn.send(h11.Data(data=body)))
                self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:
            pass
        self.transport.close()


def _declares_body(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"", b"0")):
            return True
    return False


class CloseWhenBodyUnread:
    """Says "Connection: close" on a response sent before the request's body
    was read: GuardedH11Protocol closes such a connection after the response,
    and a client that was not told would send its next request on it and
    meet a reset."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not _declares_body(scope.get("headers") or []):
            await self.app(scope, receive, send)
            return
        body_read = False

        async def tracking_receive():
            nonlocal body_read
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                body_read = True
            return message

        async def closing_send(message) -> None:
            if message["type"] == "http.response.start" and not body_read:
                headers = message.get("headers", [])
                if (b"connection", b"close") not in headers:
                    message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, tracking_receive, closing_send)


class CalmServer(uvicorn.Server):
    """uvicorn's server, waking once a second when idle, not ten times.

    uvicorn's main loop sleeps 0.1 s at a time only to look at should_exit
    (and, once a second, to renew the Date header): on an idle home server
    that tick was the service's most frequent wake-up when idle. Here
    the loop ticks at TICK_S, and setting should_exit, from a signal handler
    or from another thread (the tray stopping the service), wakes it at
    once, so stopping is as quick as before."""

    TICK_S = 1.0
    # The running main loop's wake-up; None before it starts and after it ends.
    _exit_wakeup: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
    _should_exit = False

    @property  # type: ignore[override]
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        wakeup = self._exit_wakeup
        if value and wakeup is not None:
            loop, event = wakeup
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop has closed: nothing left to wake
                pass

    async def main_loop(self) -> None:
        event = asyncio.Event()
        self._exit_wakeup = (asyncio.get_running_loop(), event)
        try:
            counter = 0
            while not await self.on_tick(counter):
                # on_tick renews the Date header when counter % 10 == 0 (its
                # once a second at 10 Hz): every tick here is a second.
                counter = (counter + 10) % 864000
                try:
                    await asyncio.wait_for(event.wait(), self.TICK_S)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._exit_wakeup = None


class ThreadedServer(CalmServer):
    """For a server on a background thread (the tray): only the main thread
    may install signal handlers, and the tray handles quitting itself."""

    def install_signal_handlers(self) -> None:
        pass


class _ListensOnBoundSockets:
    """Serves on sockets bound beforehand: the main port and Ollama's, one
    app on both. Bound in build_server, so a port already taken is an error
    there, with its number, rather than a log line in a thread."""

    bound_sockets: list[socket.socket] | None = None

    async def serve(self, sockets=None) -> None:
        await super().serve(sockets=sockets or self.bound_sockets)  # type: ignore[misc]


def _listen(host: str, port: int, what: str) -> list[socket.socket]:
    """Listening sockets on every address `host` names ("localhost" is both
    127.0.0.1 and ::1), bound and listening now, so a port in use is an
    error here. On Windows SO_REUSEADDR would let us share a port another
    process (a real Ollama) holds: there the port is taken exclusively."""
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys((i[0], i[1], i[2], i[3], i[4]) for i in infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            if sys.platform == "win32":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_EXCLUSIVEADDRUSE, 1)
            else:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(2048)
            sock.set_inheritable(True)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        hint = " (is Ollama itself running? stop it, or set [server] ollama_port = 0)" if what == "ollama_port" else ""
        raise OSError(exc.errno, f"can't listen on {host}:{port} ([server] {what}): {exc.strerror}{hint}") from None
    return sockets


def build_server(config: Config, service: Service | None = None, log_level: str = "info",
                 manage_lifecycle: bool = True,
                 server_class: type[uvicorn.Server] = CalmServer,
                 **uvicorn_options) -> tuple[uvicorn.Server, Service]:
    """The HTTP app behind the access guard, in a uvicorn server with our limits.
    On a background thread pass ThreadedServer (or a subclass) as server_class."""
    service = service or Service(config)
    app = create_app(service, manage_lifecycle=manage_lifecycle)
    policy = AccessPolicy.build(
        api_key=effective_api_key(config.server.api_key), bind_address=config.server.host,
        allowed_hosts=config.server.allowed_hosts, cors_origins=config.server.cors_origins, keys=KeyStore(),
    )
    ledger = ConnectionLedger(config.server.max_connections, key_required=policy.key_required)
    protocol = type("ConfiguredGuardedH11Protocol", (GuardedH11Protocol,),
                    {"header_timeout_s": config.server.header_timeout_s, "ledger": ledger})
    sockets = None
    if config.server.ollama_port:
        sockets = (_listen(config.server.host, config.server.port, "port")
                   + _listen(config.server.host, config.server.ollama_port, "ollama_port"))
        server_class = type(server_class.__name__, (_ListensOnBoundSockets, server_class), {"bound_sockets": sockets})
    server = server_class(uvicorn.Config(
        AccessLog(CloseWhenBodyUnread(AccessGuard(app, policy, ledger))), host=config.server.host, port=config.server.port, http=protocol,
        log_level=log_level.lower(), access_log=False, lifespan="on", timeout_graceful_shutdown=10,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES, timeout_keep_alive=5, **uvicorn_options,
    ))
    return server, service
