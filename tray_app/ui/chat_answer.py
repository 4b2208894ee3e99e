"""The chat window's answer to the question last asked: starting its stream
(`chat_stream.ChatStream`), following it on the transcript as it is routed,
streams, finishes or fails, Stop and Cancel, and the route line's time left
from each /status poll.

A mixin of `ChatWindow`: an answer writes the window's turns, history,
buttons and state line as it goes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from . import viewmodel as vm
from .chat_stream import ChatStream
from .chat_transcript import Turn

if TYPE_CHECKING:
    from PySide6.QtCore import SignalInstance
    from PySide6.QtWidgets import QWidget

    from .chat_transcript import ChatTranscript
    from .client import ServiceClient
    from .widgets import DegradedBanner

    _WindowBase = QWidget  # the type checker sees the widget this is mixed into
else:
    _WindowBase = object


class Answering(_WindowBase):
    """What ChatWindow does with an answer; see the module's docstring."""

    # The window's parts this reads and writes.
    client: ServiceClient
    stream: ChatStream | None
    history: list[dict[str, Any]]
    transcript: ChatTranscript
    banner: DegradedBanner
    max_tokens: int | None
    temperature: float | None
    answer_finished: SignalInstance

    turns: list[Turn]
    _answer: Turn

    if TYPE_CHECKING:  # the window's
        def messages(self) -> list[dict[str, Any]]: ...
        def chosen_model(self) -> str | None: ...
        def save(self) -> bool: ...
        def _set_state(self, text: str) -> None: ...
        def _update_buttons(self) -> None: ...
        def _update_banner(self, status: dict | None) -> None: ...
        def _render(self, *, keep_selection: bool = True) -> None: ...
        def _schedule_render(self) -> None: ...

    def _ask(self) -> None:
        """Start the answer to the conversation as it stands (ending with a question)."""
        self.transcript.follow = True
        answer = Turn("assistant", pending=True, meta="waiting for the service…")
        self.turns.append(answer)
        self._answer = answer
        stream = ChatStream(self.client, self.messages(), max_tokens=self.max_tokens,
                            temperature=self.temperature, model=self.chosen_model(), parent=self)
        self.stream = stream
        # Bound methods, not lambdas holding the stream: a closure that keeps a
        # deleted QObject's wrapper alive upsets PySide at exit.
        stream.routed.connect(self._on_routed)
        stream.delta.connect(self._on_delta)
        stream.finished.connect(self._on_finished)
        stream.failed.connect(self._on_failed)
        stream.start()
        self._update_banner(self.client.last_status)
        self._update_buttons()
        self._set_state("Sent; waiting for the first token…")
        self._render()

    def stop(self) -> None:
        if self.stream is not None:
            self._set_state("Stopping…")
            self.stream.stop()

    def cancel_request(self, request_id: str) -> None:
        """A banner row's Cancel: exactly the request of that row."""
        if request_id == self.request_id:
            self.stop()
            return

        def done(ok: bool, code: int, data: Any, message: str) -> None:
            if not ok:
                self.banner.cancel_failed(request_id)
                self._set_state(f"Cancel failed: {message}")

        self.client.cancel(request_id, done)

    @property
    def request_id(self) -> str | None:
        return self.stream.request_id if self.stream is not None else None

    def _follow_own_request(self, status: dict) -> None:
        """This window's request as /status shows it: the time left on the
        answer's route line, its place in the queue before it starts."""
        if self.stream is None:
            return
        own = next((r for r in status.get("requests") or () if r.get("id") == self.stream.request_id), None)
        answer = self._answer
        if own is not None and answer.pending and answer.route:
            # The estimate was made at admission; what is left of it changes every poll.
            meta = self._route_line(answer, progress=vm.time_left_text(own))
            if meta != answer.meta:
                answer.meta = meta
                # Each poll: the line is rewritten in place, not the whole transcript redrawn.
                if self.transcript.needs_full_render or not self.transcript.replace_answer_meta(meta):
                    self.transcript.needs_full_render = True
                    self._schedule_render()
        if not self.stream.status_code:
            if own is not None and own.get("state") == "queued":
                lane = str(own.get("path") or "").upper()
                self._set_state(f"Waiting in the {lane} queue, {vm._ordinal(own.get('queue_position') or 1)} in line…")

    def _on_routed(self, route: dict) -> None:
        answer = self._answer
        answer.route = route
        answer.meta = self._route_line(answer)
        self._set_state(f"Generating on the {str(route.get('served_by') or '?').upper()}…")
        self.transcript.needs_full_render = True
        self._schedule_render()

    def _on_delta(self, text: str) -> None:
        self._answer.text += text
        self._schedule_render()

    @staticmethod
    def _route_line(answer: Turn, progress: str = "", took_s: float | None = None, speed: str = "") -> str:
        route = answer.route
        line = vm.route_line(route.get("served_by"), route.get("reason"), route.get("fallback_model"),
                             progress=progress, took_s=took_s, peer=route.get("peer"))
        return f"{line} · {speed}" if speed else line

    def _took(self, answer: Turn) -> float:
        return time.monotonic() - answer.started

    def _on_finished(self, reason: str) -> None:
        stream, answer = self.stream, self._answer
        if stream is None:
            return
        answer.pending = False
        answer.meta = self._route_line(answer, took_s=self._took(answer), speed=stream.speed_text())
        if reason == "length":
            answer.meta += " · stopped at max_tokens"
        self.history.append({"role": "assistant", "content": answer.text})
        self._end(stream, "ok", "Ready")

    def _on_failed(self, message: str, code: str) -> None:
        stream, answer = self.stream, self._answer
        if stream is None:
            return
        route = answer.route
        answer.pending = False
        stopped = code == "request_canceled" or stream.stopping
        if route:
            answer.meta = self._route_line(answer, took_s=self._took(answer), speed=stream.speed_text())
        else:
            answer.meta = ""
        if stopped:
            answer.error = "Stopped."
        else:
            answer.error = message
        if answer.text:
            # Keep what was said: the next turn builds on what the user saw.
            self.history.append({"role": "assistant", "content": answer.text})
        else:
            # Nothing came back: forget the question, so a retry isn't a double.
            if self.history and self.history[-1]["role"] == "user":
                self.history.pop()
        self._end(stream, "stopped" if stopped else "failed", "Stopped" if stopped else "The last request failed")

    def _end(self, stream: ChatStream, outcome: str, state: str) -> None:
        self.stream = None
        for signal in (stream.routed, stream.delta, stream.finished, stream.failed):
            signal.disconnect()
        stream.deleteLater()
        self._set_state(state)
        self.save()
        self._update_buttons()
        self._update_banner(self.client.last_status)
        self._render()
        self.answer_finished.emit(outcome)
