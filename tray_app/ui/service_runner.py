"""Runs the service in-process: uvicorn on its own asyncio loop in a thread.

The UI never calls into the service object: it talks to it over HTTP like
any other client. This class only starts, stops and restarts it, and never
blocks the GUI thread while doing so (stopping takes seconds: the workers get
SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time

from PySide6.QtCore import QObject, Signal

from ..core.config import Config
from . import qtcompat  # noqa: F401 - guards against a PySide6 refcount bug

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5


def base_url_for(config: Config) -> str:
    address = config.server.host  # the bind address
    if address in ("0.0.0.0", "", "::"):
        address = "127.0.0.1"
    if ":" in address and not address.startswith("["):
        address = f"[{address}]"
    return f"http://{address}:{config.server.port}"


def port_problem(address: str, port: int) -> str | None:
    """Why we can't listen on the bind address and port, or None if we can."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {address} is already in use (another tray-app?); pick another port in Settings or with --port"
            return f"can't listen on {address}:{port}: {exc.strerror}"
    return None


class _QuietPolls(logging.Filter):
    """Drops the access-log line of each GET /status (the UI polls it every second)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and len(args) >= 3 and args[1] == "GET"
                    and str(args[2]).split("?")[0] in ("/status", "/health"))


_quiet_polls = _QuietPolls()


class ServiceRunner(QObject):
    """Owns the in-process service. Signals arrive on the GUI thread."""

    started = Signal()          # the HTTP port is open
    stopped = Signal()          # the server and its workers are gone
    failed = Signal(str)        # it could not start (or died); the message says why

    def __init__(self, config: Config, log_level: str = "INFO", parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.config = config
        self.log_level = log_level
        access = logging.getLogger("uvicorn.access")
        if _quiet_polls not in access.filters:
            access.addFilter(_quiet_polls)
        self._thread: threading.Thread | None = None
        self._server = None
        self._lock = threading.Lock()
        self._exit_requested = threading.Event()
        self._cycle: threading.Thread | None = None
        self._closed = False
        self.running = False
        self.starting = False
        self.error: str | None = None

    @property
    def base_url(self) -> str:
        return base_url_for(self.config)

    # ----- start / stop ------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self.starting = True
            self.error = None
            self._exit_requested.clear()
            self._thread = threading.Thread(target=self._run, args=(self.config,), name="tray-app-service", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Ask the server to stop for good; `stopped` follows once it and its workers have."""
        with self._lock:
            self._closed = True
            self._request_exit()

        def wait() -> None:
            self._join_all()
            self.stopped.emit()

        threading.Thread(target=wait, name="tray-app-stop", daemon=True).start()

    def stop_and_wait(self, timeout: float = 60.0) -> bool:
        """Blocking stop, for the very end of the process (after the event loop)."""
        with self._lock:
            self._closed = True
            self._request_exit()
        return self._join_all(timeout)

    def _join_all(self, timeout: float | None = None) -> bool:
        # A restart may be between its old and its new server: wait for both.
        deadline = None if timeout is None else time.monotonic() + timeout
        for attr in ("_cycle", "_thread"):
            thread = getattr(self, attr)
            if thread is not None:
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
                if thread.is_alive():
                    return False
        return True

    def restart(self, config: Config | None = None) -> None:
        """Stop what runs, then start with `config` (or the same one); off the GUI thread."""
        old_thread = self._thread
        self._request_exit()
        if config is not None:
            self.config = config
        self.starting = True

        def cycle() -> None:
            if old_thread is not None:
                old_thread.join()
            with self._lock:
                if self._closed:
                    return  # quit while the old server was stopping
                self.error = None
                self._exit_requested.clear()
                self._thread = threading.Thread(target=self._run, args=(self.config,), name="tray-app-service",
                                                daemon=True)
                self._thread.start()

        self._cycle = threading.Thread(target=cycle, name="tray-app-restart", daemon=True)
        self._cycle.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _request_exit(self) -> None:
        self._exit_requested.set()
        server = self._server
        if server is not None:
            server.should_exit = True

    # ----- the thread --------------------------------------------------------------------

    def _run(self, config: Config) -> None:
        from ..core.api.http_server import ThreadedServer, build_server

        problem = port_problem(config.server.host, config.server.port)
        if problem:
            self._fail(problem)
            return
        runner = self

        class _Server(ThreadedServer):
            async def startup(self, sockets=None) -> None:  # type: ignore[override]
                await super().startup(sockets)
                if self.started:
                    runner.running = True
                    runner.starting = False
                    runner.started.emit()

        try:
            # The same guard, limits and slow-client cutoff as `tray-app serve`.
            server, _ = build_server(config, log_level=self.log_level, server_class=_Server, log_config=None)
            self._server = server
            if self._exit_requested.is_set():
                return  # a stop came in while we were getting ready
            server.run()
        except SystemExit as exc:
            self._fail(f"the service failed to start (exit code {exc.code}); see the log for why")
            return
        except BaseException as exc:  # noqa: BLE001 - reported to the user, not swallowed
            log.exception("the service crashed")
            self._fail(f"the service failed: {exc}")
            return
        finally:
            self._server = None
            self.running = False
        if not getattr(server, "started", False) and not server.should_exit:
            self._fail("the service stopped before it started; see the log for why")

    def _fail(self, message: str) -> None:
        log.error("%s", message)
        self.running = False
        self.starting = False
        self.error = message
        self.failed.emit(message)
