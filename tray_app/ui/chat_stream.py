"""One streaming chat completion against the service's OpenAI-compatible
port, with QNetworkAccessManager (readyRead -> SSE lines), so the GUI never
waits. It sends its own X-Request-Id, so Stop can cancel exactly its own
request with DELETE /v1/requests/{id}; and it measures the answer's speed.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from PySide6.QtCore import QByteArray, QObject, QTimer, Signal
from PySide6.QtNetwork import QNetworkReply, QNetworkRequest

from . import viewmodel as vm
from .client import ServiceClient

STOP_GRACE_MS = 3000


class ChatStream(QObject):
    """One streaming chat completion. Emits what arrives, never blocks."""

    routed = Signal(object)      # the response headers that matter (served by, reason, ...)
    delta = Signal(str)          # text as it arrives
    finished = Signal(str)       # finish reason ("stop", "length", ...) or "" if none was sent
    failed = Signal(str, str)    # (message, code)

    def __init__(self, client: ServiceClient, messages: list[dict[str, Any]], *, request_id: str | None = None,
                 max_tokens: int | None = None, temperature: float | None = None,
                 client_name: str = "tray-app chat", model: str | None = None,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.client = client
        self.model = model  # None: the service's default model
        self.temperature = temperature
        self.client_name = client_name
        self.request_id = request_id or f"chat-{uuid.uuid4().hex[:16]}"
        self.messages = messages
        self.max_tokens = max_tokens
        self.reply: QNetworkReply | None = None
        self.parser = vm.SseParser()
        self.status_code = 0
        self.headers: dict[str, str] = {}
        self.text: list[str] = []
        self.finish_reason = ""
        self.done = False
        self.stopping = False
        self._body = b""
        # For the answer's speed: the server's token count when it sends one
        # (stream_options.include_usage), else the chunks that carried text.
        self.completion_tokens: int | None = None
        self.chunks = 0
        self.first_token_at: float | None = None
        self.ended_at: float | None = None

    def start(self) -> None:
        request = self.client.request("/v1/chat/completions", timeout_ms=0)
        request.setHeader(QNetworkRequest.KnownHeaders.ContentTypeHeader, "application/json")
        request.setRawHeader(b"Accept", b"text/event-stream")
        request.setRawHeader(b"X-Request-Id", self.request_id.encode())
        request.setRawHeader(b"X-Client-Name", self.client_name.encode())
        body: dict[str, Any] = {"messages": self.messages, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        if self.max_tokens:
            body["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            body["temperature"] = self.temperature
        reply = self.client.nam.post(request, QByteArray(json.dumps(body).encode()))
        self.reply = reply
        reply.metaDataChanged.connect(self._on_headers)
        reply.readyRead.connect(self._on_ready_read)
        reply.finished.connect(self._on_finished)

    def stop(self) -> None:
        """Cancel through the service; abort the connection if that fails."""
        if self.done or self.stopping:
            return
        self.stopping = True

        def cancelled(ok: bool, code: int, data: Any, message: str) -> None:
            if not ok:  # not known to the service (yet, or any more): drop the connection
                self.abort()

        self.client.cancel(self.request_id, cancelled)
        QTimer.singleShot(STOP_GRACE_MS, self, self.abort)

    def abort(self) -> None:
        if not self.done and self.reply is not None:
            self.reply.abort()

    def _on_headers(self) -> None:
        reply = self.reply
        if reply is None or self.status_code:
            return
        self.status_code = int(reply.attribute(QNetworkRequest.Attribute.HttpStatusCodeAttribute) or 0)
        if not self.status_code:
            return
        self.headers = {bytes(k.data()).decode("latin-1").lower(): bytes(v.data()).decode("latin-1")
                        for k, v in reply.rawHeaderPairs()}
        if self.status_code == 200:
            self.routed.emit(self.route())

    def route(self) -> dict[str, str | None]:
        h = self.headers
        return {"served_by": h.get("x-served-by"), "reason": h.get("x-route-reason"),
                "fallback_model": h.get("x-fallback-model"), "estimated_latency": h.get("x-estimated-latency"),
                "request_id": h.get("x-request-id"), "peer": h.get("x-peer")}

    def _on_ready_read(self) -> None:
        reply = self.reply
        if reply is None:
            return
        if not self.status_code:
            self._on_headers()
        data = bytes(reply.readAll().data()) if reply.isOpen() else b""
        if self.status_code != 200:
            self._body += data
            return
        for event in self.parser.feed(data):
            self._handle(event)

    def _handle(self, event: Any) -> None:
        if self.done:
            return
        if event == vm.DONE:
            self._finish(self.finish_reason)
            return
        if isinstance(event, dict) and "error" in event:
            message, code = vm.error_message(event)
            self._fail(message, code)
            return
        if isinstance(event, dict):
            text = vm.delta_text(event)
            for choice in event.get("choices") or ():
                if choice.get("finish_reason"):
                    self.finish_reason = choice["finish_reason"]
            usage = event.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                self.completion_tokens = usage["completion_tokens"]
            if text:
                if self.first_token_at is None:
                    self.first_token_at = time.monotonic()
                self.chunks += 1
                self.text.append(text)
                self.delta.emit(text)

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.chunks

    def speed_text(self) -> str:
        """'42 tok/s', or "" before two tokens came."""
        return speed_text(self.tokens, self.first_token_at, self.ended_at or time.monotonic())

    def _on_finished(self) -> None:
        reply = self.reply
        if reply is None:
            return
        self._on_ready_read()
        if self.status_code == 200:
            for event in self.parser.close():
                self._handle(event)
        if self.done:
            return  # handled (and the reply released) by the event that ended it
        self.reply = None
        reply.deleteLater()
        if self.status_code and self.status_code != 200:
            message, code = vm.error_message(self._body, self.status_code)
            self._fail(message, code)
        elif reply.error() == QNetworkReply.NetworkError.OperationCanceledError:
            self._fail("stopped", "request_canceled")
        elif reply.error() != QNetworkReply.NetworkError.NoError:
            self._fail(f"the connection to the service failed: {reply.errorString()}", "network_error")
        else:
            self._fail("the answer ended without [DONE]; it may be incomplete", "incomplete")

    def _finish(self, reason: str) -> None:
        self.done = True
        self.ended_at = time.monotonic()
        self._release_reply()
        self.finished.emit(reason)

    def _fail(self, message: str, code: str) -> None:
        self.done = True
        self.ended_at = time.monotonic()
        self._release_reply()
        self.failed.emit(message, code)

    def _release_reply(self) -> None:
        """The reply outlives this object if the stream ended before the
        connection did: let it delete itself when it is through."""
        reply = self.reply
        if reply is None:
            return
        self.reply = None
        if reply.isFinished():
            reply.deleteLater()
        else:
            reply.finished.connect(reply.deleteLater)


def tokens_per_second(tokens: int, first: float | None, end: float) -> float | None:
    """Decoding speed: the tokens after the first over the time since it came
    (the wait for the first token is the queue and the prompt, not decoding)."""
    if first is None or tokens < 2 or end <= first:
        return None
    return (tokens - 1) / (end - first)


def speed_text(tokens: int, first: float | None, end: float) -> str:
    rate = tokens_per_second(tokens, first, end)
    if rate is None:
        return ""
    # Whole numbers from 10 up; one decimal below, where it still tells apart.
    return f"{rate:.0f} tok/s" if rate >= 9.95 else f"{rate:.1f} tok/s"
