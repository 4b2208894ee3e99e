"""The UI's only line to the service: HTTP, asynchronously, like any client.

`ServiceClient` polls GET /status about once a second and sends the commands
(pause, resume, restart, cancel). Every call goes through one
QNetworkAccessManager on the GUI thread's event loop, so nothing here ever
waits for the network.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

from PySide6.QtCore import QByteArray, QObject, QTimer, QUrl, Signal
from PySide6.QtNetwork import QNetworkAccessManager, QNetworkProxy, QNetworkReply, QNetworkRequest

from ..core.api.security import bearer_header, effective_api_key, process_admin_key
from ..core.status_contract import Status, validate_status
from .viewmodel import error_message, shape_mismatch_text
from . import qtcompat  # noqa: F401 - guards against a PySide6 refcount bug

log = logging.getLogger(__name__)

STATUS_TIMEOUT_MS = 5000
COMMAND_TIMEOUT_MS = 15000

# (ok, http status or 0, decoded JSON body or None, error text)
Callback = Callable[[bool, int, Any, str], None]


def _is_loopback(url: QUrl) -> bool:
    return url.host() in ("127.0.0.1", "localhost", "::1", "[::1]")


class ServiceClient(QObject):
    """Polls /status and sends commands. Widgets connect to its signals."""

    status_changed = Signal(object)
    unreachable = Signal(str)
    # (what, ok, message) after a command such as "pause" or "cancel abc"
    command_finished = Signal(str, bool, str)

    def __init__(self, base_url: str, *, interval_ms: int = 1000, api_key: str | None = None,
                 parent: QObject | None = None) -> None:
        """`api_key` is the configured one ([server] api_key); TRAY_APP_API_KEY
        overrides it, by the same rule the service applies to requests."""
        super().__init__(parent)
        self.nam = QNetworkAccessManager(self)
        self._base_url = ""
        self.set_base_url(base_url)
        # Without a configured key, the tray's own (an admin key of this
        # process): the service it runs here then serves it even when named
        # keys close the port to everyone else.
        self._api_key = effective_api_key(api_key or "") or process_admin_key()
        self._timer = QTimer(self)
        self._timer.setInterval(interval_ms)
        self._timer.timeout.connect(self.poll_now)
        self._inflight: QNetworkReply | None = None
        self._commands: dict[QNetworkReply, tuple[str, Callback | None]] = {}
        self.last_status: Status | None = None
        self.last_error: str | None = None
        # The last /status broke the contract (another version's service):
        # the panel says so instead of reading it.
        self.shape_mismatch = False

    # ----- setup -------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return self._base_url

    @property
    def api_url(self) -> str:
        return f"{self._base_url}/v1"

    def set_base_url(self, base_url: str) -> None:
        self._base_url = base_url.rstrip("/")
        url = QUrl(self._base_url)
        # A system proxy must not see loopback traffic (and would break it).
        if _is_loopback(url):
            self.nam.setProxy(QNetworkProxy(QNetworkProxy.ProxyType.NoProxy))

    def start(self) -> None:
        self._timer.start()
        self.poll_now()

    def stop(self) -> None:
        self._timer.stop()
        if self._inflight is not None:
            self._inflight.abort()

    def is_polling(self) -> bool:
        return self._timer.isActive()

    @property
    def interval_ms(self) -> int:
        return self._timer.interval()

    def set_interval_ms(self, interval_ms: int) -> None:
        """Poll this often from now on (the tray slows down while nobody looks).
        Unchanged, the timer runs on: setInterval would restart it."""
        if self._timer.interval() != interval_ms:
            self._timer.setInterval(interval_ms)

    def request(self, path: str, timeout_ms: int = COMMAND_TIMEOUT_MS) -> QNetworkRequest:
        request = QNetworkRequest(QUrl(self._base_url + path))
        request.setTransferTimeout(timeout_ms)
        request.setAttribute(QNetworkRequest.Attribute.Http2AllowedAttribute, False)
        for name, value in bearer_header(self._api_key).items():
            request.setRawHeader(name.encode(), value.encode())
        return request

    # ----- polling -----------------------------------------------------------------------

    def poll_now(self) -> None:
        if self._inflight is not None:
            return  # the last poll is still out: don't pile up
        reply = self.nam.get(self.request("/status", STATUS_TIMEOUT_MS))
        self._inflight = reply
        # Bound slots and sender(), not lambdas holding the reply: closures over
        # deleted QObjects upset PySide's reference counting at exit.
        reply.finished.connect(self._on_status)

    def _on_status(self) -> None:
        reply = self._inflight
        self._inflight = None
        if reply is None:
            return
        reply.deleteLater()
        code = reply.attribute(QNetworkRequest.Attribute.HttpStatusCodeAttribute) or 0
        body = bytes(reply.readAll().data()) if reply.isOpen() else b""
        if reply.error() != QNetworkReply.NetworkError.NoError and not code:
            self._set_unreachable(f"no answer at {self._base_url}: {reply.errorString()}")
            return
        if code != 200:
            self._set_unreachable(f"GET /status answered HTTP {code}: {error_message(body, code)[0]}")
            return
        try:
            status = json.loads(body)
        except ValueError:
            self._set_unreachable("GET /status answered something that is not JSON")
            return
        if not isinstance(status, dict):
            self._set_unreachable("GET /status answered something that is not a JSON object")
            return
        # Checked here, at the edge, so every reader past this point may read
        # the contract's always-present keys with [...] and never meets a
        # renamed one as a None or a KeyError in a Qt slot.
        problems = validate_status(status)
        if problems:
            self._set_unreachable(shape_mismatch_text(self._base_url, problems), shape_mismatch=True)
            return
        self.last_status = status
        self.last_error = None
        self.shape_mismatch = False
        self.status_changed.emit(status)

    def _set_unreachable(self, message: str, *, shape_mismatch: bool = False) -> None:
        self.last_status = None
        self.last_error = message
        self.shape_mismatch = shape_mismatch
        self.unreachable.emit(message)

    # ----- commands ----------------------------------------------------------------------

    def send(self, method: str, path: str, body: Any = None, callback: Callback | None = None,
             what: str | None = None) -> QNetworkReply:
        request = self.request(path)
        payload = QByteArray()
        if body is not None:
            request.setHeader(QNetworkRequest.KnownHeaders.ContentTypeHeader, "application/json")
            payload = QByteArray(json.dumps(body).encode())
        reply = self.nam.sendCustomRequest(request, method.encode(), payload)
        self._commands[reply] = (what or f"{method} {path}", callback)
        reply.finished.connect(self._on_command)
        return reply

    def _on_command(self) -> None:
        reply = self.sender()
        entry = self._commands.pop(reply, None)
        if entry is None:
            return
        what, callback = entry
        reply.deleteLater()
        code = int(reply.attribute(QNetworkRequest.Attribute.HttpStatusCodeAttribute) or 0)
        raw = bytes(reply.readAll().data()) if reply.isOpen() else b""
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            data = None
        if not code:
            ok, message = False, f"no answer at {self._base_url}: {reply.errorString()}"
        elif 200 <= code < 300:
            ok, message = True, ""
        else:
            ok, message = False, error_message(data, code)[0]
        if callback is not None:
            callback(ok, code, data, message)
        self.command_finished.emit(what, ok, message)
        if ok:
            self.poll_now()  # show the effect now, not in up to a second

    def set_gpu_paused(self, paused: bool, callback: Callback | None = None) -> QNetworkReply:
        return self.send("POST", "/admin/gpu", {"paused": paused}, callback, "resume the GPU" if not paused else "force CPU")

    def give_gpu_back(self, given: bool, callback: Callback | None = None) -> QNetworkReply:
        return self.send("POST", "/admin/gpu", {"given_back": given}, callback,
                         "give the GPU back" if given else "use the GPU again")

    def set_simulated_pressure(self, mib: float, callback: Callback | None = None) -> QNetworkReply:
        return self.send("POST", "/admin/gpu", {"simulated_pressure_mib": mib}, callback, "set simulated pressure")

    def restart_workers(self, callback: Callback | None = None) -> QNetworkReply:
        return self.send("POST", "/admin/restart", {}, callback, "restart workers")

    def set_model_loaded(self, name: str, loaded: bool, callback: Callback | None = None) -> QNetworkReply:
        path = "/admin/models/" + QUrl.toPercentEncoding(name).data().decode()
        return self.send("POST", path, {"loaded": loaded}, callback, f"{'load' if loaded else 'unload'} {name}")

    def cancel(self, request_id: str, callback: Callback | None = None) -> QNetworkReply:
        return self.send("DELETE", f"/v1/requests/{request_id}", None, callback, f"cancel {request_id}")
