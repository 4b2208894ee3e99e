"""One request path, several API dialects.

Every chat or completion runs as an OpenAI-shaped job: one validation,
one admission, one replay rule, whatever the client speaks. A `Protocol`
is the edge around that: it turns its own request body into an OpenAI one
(raising InvalidRequest with its own field names), turns the aggregated
OpenAI answer back into its own shape, encodes the stream in its own
framing, and writes errors in its own envelope. Ollama's and Anthropic's
live in ollama.py and anthropic.py; OpenAI's is the identity here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response

from ..dispatch.jobs import Job, JobFailed, JobKind
from . import reasoning
from .errors import error_response, failure_body
from .sinks import sse, usage_chunk, wants_usage


@dataclass
class Translated:
    """A request in OpenAI's shape, plus what OpenAI's shape has no field for."""

    kind: JobKind
    body: dict[str, Any]
    # Ollama's num_ctx: prompt and answer together stay within it.
    context_cap: int | None = None
    # Ollama's keep_alive, in seconds: how long the model stays loaded after
    # this request; negative = until told otherwise, 0 = unload when done.
    keep_alive_s: float | None = None
    # Nothing to generate: Ollama's empty prompt, which only loads the model.
    load_only: bool = False
    # Without a limit the answer may fill the context, as a chat's may (the
    # smallest context the prompt fits in, so a replay runs with the same
    # limit), not a legacy completion's 16 tokens: llama.cpp's n_predict -1.
    fills_context: bool = False
    # Ollama's chat: a history longer than the context loses its oldest
    # messages (never the system ones, nor the last), as Ollama does, rather
    # than being refused. Apps written for Ollama rely on it.
    truncates_history: bool = False
    # What the service left out of the request and the client should know
    # (a tool it can't run): sent back as Warning headers.
    warnings: tuple[str, ...] = ()


class StreamEncoder:
    """Frames one job's OpenAI chunks for the client. Each method returns
    the bytes to send now (possibly none)."""

    def event(self, chunk: dict[str, Any]) -> bytes:
        raise NotImplementedError

    def done(self, job: Job, last_chunk: dict[str, Any]) -> bytes:
        raise NotImplementedError

    def failed(self, failure: JobFailed) -> bytes:
        raise NotImplementedError

    def seam(self, note: dict[str, Any]) -> bytes:
        """The answer goes on from here on another path. An SSE stream says so
        in a comment (a line starting with ':'), which every SSE client skips:
        the seam is told, and no client's parser meets anything new."""
        return seam_comment(note)


def seam_comment(note: dict[str, Any]) -> bytes:
    return (f": resumed on the {note.get('on', 'cpu').upper()} after the {note.get('from', 'gpu').upper()} failed "
            f"({note.get('cut_at_tokens', 0)} tokens in); the answer goes on from the text already sent\n\n").encode()


class Protocol:
    name = "openai"
    stream_media_type = "text/event-stream"
    # OpenAI chat's field for a thinking model's reasoning ([server] reasoning_field).
    reasoning_field = "reasoning_content"

    async def prepare(self, body: dict[str, Any]) -> None:
        """Work on the body that needs the model or a thread, before the
        (pure) translation: llama.cpp's token prompts become text here."""

    def translate(self, body: dict[str, Any], kind: JobKind) -> Translated:
        """The protocol's body as an OpenAI chat or completion body."""
        return Translated(kind, body)

    def answer(self, response: dict[str, Any], job: Job) -> dict[str, Any]:
        """The aggregated OpenAI response in the protocol's shape."""
        for choice in response.get("choices") or ():
            reasoning.in_field(choice.get("message") or {}, self.reasoning_field)
        return response

    def encoder(self, job: Job) -> StreamEncoder:
        return _OpenAIStream(self.reasoning_field)

    def load_answer(self, translated: Translated) -> Response:
        raise NotImplementedError("only Ollama's routes have load-only requests")

    def error(self, status: int, message: str, code: str, param: str | None = None,
              headers: dict[str, str] | None = None) -> Response:
        return error_response(status, message, code, param, headers)

    def error_payload(self, failure: JobFailed) -> dict[str, Any]:
        return failure_body(failure)

    def failed(self, failure: JobFailed, headers: dict[str, str]) -> Response:
        """A job that failed before its answer began, with Retry-After when
        the failure says when to come back."""
        extra = dict(headers)
        if failure.retry_after_s is not None:
            extra["Retry-After"] = str(int(math.ceil(failure.retry_after_s)))
        return JSONResponse(self.error_payload(failure), status_code=failure.status, headers=extra)


class _OpenAIStream(StreamEncoder):
    def __init__(self, reasoning_field: str) -> None:
        self._usage = False
        self._reasoning_field = reasoning_field

    def event(self, chunk: dict[str, Any]) -> bytes:
        for choice in chunk.get("choices") or ():
            reasoning.in_field(choice.get("delta") or {}, self._reasoning_field)
        return sse(chunk)

    def done(self, job: Job, last_chunk: dict[str, Any]) -> bytes:
        tail = sse(usage_chunk(job, last_chunk)) if wants_usage(job.body) else b""
        return tail + b"data: [DONE]\n\n"

    def failed(self, failure: JobFailed) -> bytes:
        return sse(failure_body(failure))


OPENAI = Protocol()


def answer_timings_ns(job: Job) -> dict[str, int]:
    """Ollama-style durations of a job's last attempt, in nanoseconds."""
    attempt = job.attempts[-1] if job.attempts else None
    if attempt is None or attempt.ended_at is None:
        return {"prompt_eval_duration": 0, "eval_duration": 0}
    first = attempt.first_token_at or attempt.ended_at
    return {"prompt_eval_duration": int((first - attempt.started_at) * 1e9),
            "eval_duration": int((attempt.ended_at - first) * 1e9)}
