"""The chat's route line, its SSE parser and the error text of a failed answer."""

from __future__ import annotations

import json
from typing import Any, Mapping

from ...core.base.http_basics import SseLineSplitter
# In core: the note inside a degraded answer says the same words as the banner.
from ...core.base.route_reasons import route_reason_text
from .formatting import fmt_seconds


def route_line(served_by: str | None, reason: str | None, fallback_model: str | None = None, *,
               progress: str = "", took_s: float | None = None, peer: str | None = None) -> str:
    """'served by GPU · admitted', 'served by CPU · GPU busy · Small · about 3.2 s left'
    or 'served by peer desk · sent to a peer'.

    `progress` is the live part (time left or overdue, from the latest poll);
    the estimate in the response headers is fixed at admission, so it is not used.
    """
    if served_by == "peer":
        parts = [f"served by peer {peer or 'unknown'}"]
    else:
        parts = [f"served by {(served_by or 'unknown').upper()}"]
    if reason:
        parts.append(route_reason_text(reason))
    if served_by == "cpu" and fallback_model:
        parts.append(fallback_model)
    if progress:
        parts.append(progress)
    if took_s is not None:
        parts.append(f"took {fmt_seconds(took_s)}")
    return " · ".join(parts)


DONE = "[DONE]"


class SseParser:
    """Incremental `text/event-stream` parser: feed bytes, get events.

    Each event is the decoded JSON of its `data:` lines, or DONE.
    """

    def __init__(self) -> None:
        self._lines = SseLineSplitter()
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[Any]:
        events: list[Any] = []
        for line in self._lines.feed(chunk):
            if not line:
                event = self._dispatch()
                if event is not None:
                    events.append(event)
            elif line.startswith(":"):
                continue
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)
        return events

    def close(self) -> list[Any]:
        """Whatever is left when the stream ends without a blank line."""
        return self.feed(b"\n\n")

    def _dispatch(self) -> Any:
        if not self._data:
            return None
        payload = "\n".join(self._data)
        self._data = []
        if payload.strip() == DONE:
            return DONE
        try:
            return json.loads(payload)
        except ValueError:
            return {"error": {"message": f"unreadable event from the service: {payload[:200]}", "code": "bad_event"}}


def delta_text(event: Mapping[str, Any]) -> str:
    out = []
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content"):
            out.append(delta["content"])
        elif choice.get("text"):
            out.append(choice["text"])
    return "".join(out)


def error_message(body: Any, status_code: int | None = None) -> tuple[str, str]:
    """(message, code) from an OpenAI-style error body, or a fallback."""
    if isinstance(body, (bytes, bytearray)):
        try:
            body = json.loads(body.decode("utf-8", errors="replace") or "null")
        except ValueError:
            body = None
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        error = body["error"]
        return str(error.get("message") or "unknown error"), str(error.get("code") or "")
    return (f"HTTP {status_code}" if status_code else "no answer from the service"), ""
