"""Degraded mode where the person is looking: one short note inside the answer.

A person chatting through a web UI on a phone never sees the tray's banner,
and chat apps don't show the route headers. With the opt-in (the request's
`X-Degraded-Note: on`, or `[server] degraded_note = true`), a chat answer
served by the CPU or a peer, or one that waited for the GPU model to load,
begins with one reasoning delta saying what serves it, why (in the banner's
words, core/base/route_reasons.py) and the estimated wait. It goes in the
reasoning field, which chat apps show as "thinking": never in the content,
so the answer itself, and what a program parses out of it, stay the same.

Pure functions; app.py puts the chunk first in the stream or the answer, and
each protocol's encoder moves it into its own reasoning field.
"""

from __future__ import annotations

from typing import Any

from ..dispatch.admission import Reason
from ..dispatch.jobs import Job, JobKind
from ..base.route_reasons import ROUTE_REASONS, route_reason_text
from .openai_request import InvalidRequest

NOTE_HEADER = "X-Degraded-Note"
_SWITCH = {"on": True, "off": False}


def wanted(header_value: str | None, configured: bool) -> bool:
    """The request's X-Degraded-Note, else [server] degraded_note."""
    value = (header_value or "").strip().lower()
    if not value:
        return configured
    if value not in _SWITCH:
        raise InvalidRequest(400, f"{NOTE_HEADER} must be 'on' or 'off'", "invalid_header", NOTE_HEADER)
    return _SWITCH[value]


def _wait_words(seconds: float | None) -> str:
    if seconds is None:
        return "the wait is unknown"
    return f"about {max(1, round(seconds))} s"


def _sentence(words: str) -> str:
    return words[:1].upper() + words[1:]


def note_text(job: Job, model_id: str, fallback_model_id: str) -> str | None:
    """The note for a job whose route is decided, or None when the GPU serves
    it without a wait (or it is not a chat: a completion has no reasoning field).

    'GPU busy: <the decision's detail>. The CPU answers with SmolLM2, about 40 s.'"""
    if job.kind is not JobKind.CHAT or job.reason is Reason.CPU_ONLY:
        # (No GPU path: the CPU is this machine's path, nothing is degraded.)
        return None
    waited_for_load = job.path == "gpu" and job.decision is not None and job.decision.waits_for_load
    if job.path not in ("cpu", "peer") and not waited_for_load:
        return None
    reason = ROUTE_REASONS["gpu_loading"] if waited_for_load else route_reason_text(
        job.reason.value if job.reason else None)
    why = f"{reason}: {job.reason_detail}" if job.reason_detail else reason
    wait = _wait_words(job.estimated_latency_s)
    if job.path == "cpu":
        serves = f"the CPU answers with {fallback_model_id}, {wait}"
    elif job.path == "peer":
        serves = f"peer {job.peer or 'unknown'} answers with {model_id}, {wait}"
    else:
        serves = f"the GPU answers with {model_id} once it is loaded, {wait}"
    # The blank line keeps a thinking model's own reasoning, which follows, apart.
    return f"{_sentence(why.rstrip('.'))}. {_sentence(serves)}.\n\n"


def note_chunk(note: str, like: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI chat chunk carrying only the note as reasoning, shaped like
    `like` (the answer's first chunk: its id, model and time)."""
    return {
        "id": like.get("id"), "object": "chat.completion.chunk", "created": like.get("created"),
        "model": like.get("model"), "system_fingerprint": like.get("system_fingerprint"),
        "choices": [{"index": 0, "delta": {"role": "assistant", "reasoning_content": note}, "finish_reason": None}],
    }


def seam_note_text(job: Job, fallback_model_id: str) -> str | None:
    """The note at a continued answer's seam: where the GPU stopped and the
    CPU went on (None for a completion: it has no reasoning field)."""
    if job.kind is not JobKind.CHAT or job.continuation is None:
        return None
    return (f"\n\n[The GPU failed {job.continuation.tokens} tokens into this answer; the CPU goes on from there "
            f"with {fallback_model_id}.]\n\n")
