"""A request's life inside the service: identity, route, attempts and events.

A Job is created once per accepted request and keeps its id through a
replay, so the client, the logs and /status always talk about one thing.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .admission import Decision, Reason
from .failover_time import Fault


class JobKind(str, enum.Enum):
    CHAT = "chat"
    COMPLETION = "completion"

    @property
    def upstream_path(self) -> str:
        return "/v1/chat/completions" if self is JobKind.CHAT else "/v1/completions"


class JobState(str, enum.Enum):
    ADMITTING = "admitting"
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:20]}"


# JobRequest.forced_tool for tool_choice "required" with several tools: the
# answer is {"name", "arguments"} for one of them (api/openai_request.py),
# turned into that call once whole (upstream's ToolCallShaping).
ANY_TOOL = "*"


@dataclass
class Attempt:
    path: str
    started_at: float
    first_token_at: float | None = None
    ended_at: float | None = None
    tokens: int = 0
    outcome: str = "running"   # "completed", "failed: ...", "canceled"
    # The worker's exit count when this attempt began (see Worker.exit_after).
    worker_exits: int = 0
    # The worker accepted the request (answered with headers): only then can
    # its input be what crashed the worker.
    reached_worker: bool = False
    # The other attempts that were inside the same process at some point
    # while this one was (llama-server decodes its slots together).
    neighbours: list["Attempt"] = field(default_factory=list, repr=False, compare=False)
    # When the last token came (the path's clock), for the between-tokens deadline.
    last_token_at: float = 0.0
    # When llama-server last said how far it has read the prompt (its
    # prompt_progress events, one per batch): a long prompt is progress, not
    # a hang, however long it takes in all.
    last_progress_at: float | None = None
    # The prompt tokens the worker really read (its cache's aside) and how
    # long that took, from its timings: a speed no cache hit inflates.
    prompt_read: int | None = None
    prompt_read_s: float | None = None
    # The tokens the worker says it has made (its timings' predicted_n: in
    # each event when asked for timings_per_token, else in its last). Counts
    # what events can't: the reasoning parser's hidden tags, tokens held
    # back for a stop string or an unfinished UTF-8 character.
    predicted: int | None = None
    # Speculative decoding's drafted and accepted tokens (its timings' draft_n
    # and draft_n_accepted), when the worker drafts.
    drafted: int | None = None
    draft_accepted: int | None = None

    def tokens_made(self) -> int:
        """The tokens this attempt made up to its last event: the worker's
        own count where it gave one, else the events that carried text."""
        return max(self.tokens, self.predicted or 0)

    def wait_limit_s(self, first_deadline: float, between_tokens_s: float, now: float,
                     progress_gap_s: float = 0.0) -> float:
        """How long the upstream may stay silent from `now`. Until the first
        token one deadline (first_deadline, on the same clock) covers the
        wait for the headers and the first event, and each report of the
        prompt's progress gives it `progress_gap_s` more from then; after,
        it runs from the last token, so keep-alive comments (":" lines)
        can't hide a stall."""
        if self.first_token_at is None:
            deadline = first_deadline
            if self.last_progress_at is not None:
                deadline = max(deadline, self.last_progress_at + progress_gap_s)
            return max(0.0, deadline - now)
        return max(0.0, self.last_token_at + between_tokens_s - now)

    def shared_at_crash(self) -> bool:
        """Whether another request was inside the process when it died: then
        the crash can't be pinned on this one's input. One that finished (or
        was canceled) before, or never got in, doesn't count."""
        return any(other.reached_worker and (other.outcome == "running" or other.outcome.startswith("failed"))
                   for other in self.neighbours)


@dataclass(frozen=True)
class JobRequest:
    """What the client asked, fixed when the job is built: nothing changes it,
    a replay included (the replay resends the same request)."""

    id: str
    kind: JobKind
    body: dict[str, Any]
    stream: bool
    # The prompt's tokens and the answer's limit, from the model's own tokenizer
    # (see Job.sized: the one step that fills them in, before admission).
    prompt_tokens: int = 0
    max_tokens: int = 0
    # The function a named tool_choice forces: the answer (constrained to its
    # arguments) goes back as a call of it (see api.openai_request.force_named_tool).
    forced_tool: str | None = None
    # Alternatives per token the client asked for with logprobs; None = no logprobs.
    top_logprobs: int | None = None
    # Images in the request: only a worker with a projector may run it (a
    # replay resends the same body, images and all).
    images: int = 0
    # What decoding them takes in the worker's memory (its host RAM), on top
    # of what the prompt and answer take.
    image_decode_mib: float = 0.0
    # False: the worker reads the prompt afresh, reusing no cached prefix
    # (the request's key asked never to share the prompt cache).
    prompt_cache: bool = True
    # What the service left out of the request (a tool it can't run), for
    # the answer's Warning headers and the access log.
    warnings: tuple[str, ...] = ()
    # Who sent it (X-Client-Name or the User-Agent's product), for the tray.
    client: str | None = None
    # What the client asked of routing: X-Force-Path: cpu, X-Request-Timeout,
    # X-Prefer-Path: gpu (wait for a loading GPU), X-Fallback (None = the config's).
    force_cpu: bool = False
    deadline_s: float | None = None
    prefer_gpu: bool = False
    no_fallback: bool | None = None
    # What the request asks, without how it is delivered: the key a request
    # that crashed a worker is quarantined under.
    fingerprint: str = ""
    # The library model it is for (its name there); "" = the default model.
    model: str = ""
    # It came from a peer (X-Peer-Hop): one hop only, so two servers that are
    # each other's peers can't bounce it.
    from_peer: bool = False
    # The client's Idempotency-Key, handed on to a peer so a retry there
    # finds the first run's result.
    idempotency_key: str | None = None
    # A plain answer cut by a failed path may go on from its text elsewhere
    # (X-Resume, [routing] resume_answers); False keeps the explicit error.
    resume: bool = True


class SentText:
    """What one answer (choice 0) has handed the client so far: its text,
    its reasoning, and whether a tool call began; with each piece, the
    tokens the path had made by then. Kept only for a job that could be
    continued (Job.continuable), one append per token."""

    __slots__ = ("content", "reasoning", "content_made", "reasoning_made", "tool_call")

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.content_made: list[int] = []
        self.reasoning_made: list[int] = []
        self.tool_call = False

    def take(self, event: dict[str, Any], made: int = 0) -> None:
        """Note what `event` handed the client; `made`: the tokens made by then."""
        for choice in event.get("choices") or ():
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if delta.get("content"):
                    self.content.append(delta["content"])
                    self.content_made.append(made)
                if delta.get("reasoning_content"):
                    self.reasoning.append(delta["reasoning_content"])
                    self.reasoning_made.append(made)
                if delta.get("tool_calls"):
                    self.tool_call = True
            elif choice.get("text"):
                self.content.append(choice["text"])
                self.content_made.append(made)

    def clear(self) -> None:
        for pieces in (self.content, self.reasoning, self.content_made, self.reasoning_made):
            pieces.clear()
        self.tool_call = False

    def cut(self, made: int) -> tuple[str, int]:
        """Where an answer cut here goes on from: the trailing pieces of
        only whitespace of the text that ends the prefill (the answer's, or
        the reasoning's when no answer began), which the prefill leaves out,
        and the tokens made before them (`made`: all of them). Those pieces
        stay the client's, but the next path writes them again: the same
        text split into other tokens (two newlines sent as one) would lead
        a model elsewhere than it went."""
        pieces, marks = (self.content, self.content_made) if self.content else (self.reasoning, self.reasoning_made)
        keep = len(pieces)
        while keep > 1 and not pieces[keep - 1].strip():
            keep -= 1
        if keep == len(pieces) or not pieces[keep - 1].strip():
            return "", made
        return "".join(pieces[keep:]), marks[keep - 1]


@dataclass(frozen=True)
class Continuation:
    """Where an answer cut by a failed path goes on from: the text already
    made (sent to the client, for a stream), and what that cost."""

    text: str
    reasoning: str
    tokens: int  # the failed attempt's tokens, to the prefill's end: counted in the usage, not allowed again
    failed_on: str  # "gpu" or "peer"
    cut_at: float  # when the failure was seen (the dispatcher's clock): the seam's time runs from here
    streamed: bool  # the text reached the client (a stream); else it was only collected
    # The whitespace that ends what was made, left out of the prefill (SentText.cut).
    held_back: str = ""

    @property
    def in_reasoning(self) -> bool:
        """It was cut inside a thinking model's reasoning: the rest of the
        reasoning comes next, then the answer."""
        return bool(self.reasoning) and not self.text

    @property
    def prefill_text(self) -> str:
        return self.text if self.in_reasoning else self.text[:len(self.text) - len(self.held_back)]

    @property
    def prefill_reasoning(self) -> str:
        return self.reasoning[:len(self.reasoning) - len(self.held_back)] if self.in_reasoning else self.reasoning


class _FromRequest:
    """One of the request's fields, read on the Job; never written there."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, job: Job | None, owner: type | None = None) -> Any:
        return self if job is None else getattr(job.request, self.name)

    def __set__(self, job: Job, value: Any) -> None:
        raise AttributeError(f"{self.name} is part of the job's request, fixed when the job was built")


class Job:
    """One accepted request: its fixed `request` and its life in the service.
    The life (state, path, attempts, failures, replay) is written by the
    dispatch package as the job moves (the dispatcher, failover and the
    backend it runs on) and by its sink (`commit`), nowhere else."""

    # The request's fields, read-only here (each its own descriptor: it learns its name).
    id = _FromRequest()
    kind = _FromRequest()
    body = _FromRequest()
    stream = _FromRequest()
    prompt_tokens = _FromRequest()
    max_tokens = _FromRequest()
    forced_tool = _FromRequest()
    top_logprobs = _FromRequest()
    images = _FromRequest()
    image_decode_mib = _FromRequest()
    prompt_cache = _FromRequest()
    warnings = _FromRequest()
    client = _FromRequest()
    force_cpu = _FromRequest()
    deadline_s = _FromRequest()
    prefer_gpu = _FromRequest()
    no_fallback = _FromRequest()
    fingerprint = _FromRequest()
    model = _FromRequest()
    from_peer = _FromRequest()
    idempotency_key = _FromRequest()
    resume = _FromRequest()

    def __init__(self, request: JobRequest) -> None:
        self.request = request
        self.created_at = time.monotonic()
        self.created_wall = time.time()
        # When its dispatcher registered it (on arrival), on the dispatcher's
        # injected clock, which its paths share: what is left of its deadline
        # is measured from here (created_at is time.monotonic's).
        self.registered_at: float | None = None
        self.state = JobState.ADMITTING
        self.path: str | None = None
        self.reason: Reason | None = None
        self.reason_detail = ""
        self.estimated_latency_s: float | None = None
        self.queue_wait_s = 0.0
        self.attempts: list[Attempt] = []
        self.first_failure: str | None = None
        self.replayed = False
        # Where the failure that made this job a replay happened: "gpu" or "peer".
        self.replayed_from = "gpu"
        self.canceled = asyncio.Event()
        self.cancel_reason: str | None = None
        # Set once a byte of the answer has been handed to the client: from then
        # on the request can no longer be re-run anywhere.
        self.committed = False
        # This request is the circuit breaker's half-open probe of the GPU.
        self.half_open_probe = False
        # Admission's verdict, once made.
        self.decision: Decision | None = None
        # The peer server it was sent to ([[peers]]), when it was; and
        # whether a peer already failed it (then peers are out for it).
        self.peer: str | None = None
        self.peer_failed = False
        # This job is the half-open probe of its peer's breaker.
        self.peer_probe = False
        # The GPU's fault that made this job a replay: when and how (failover_time).
        self.fault: Fault | None = None
        # Oldest messages left out to fit the context (Ollama's truncation).
        self.truncated_messages = 0
        # What the answer has made so far, for a continuation (None: this job can't be continued).
        self.sent: SentText | None = SentText() if self.resume and self.continuable_kind() else None
        # Set when a failed path's answer goes on elsewhere from what it made.
        self.continuation: Continuation | None = None
        # When the continuation's first new token came (the seam's end), on the dispatcher's clock.
        self.seam_closed_at: float | None = None

    # ----- its life: each step one method, called from the dispatch package -----

    def decided(self, decision: Decision) -> None:
        """Admission's verdict, and the reason /status and the headers give."""
        self.decision = decision
        self.reason, self.reason_detail = decision.reason, decision.detail
        if decision.estimated_latency_s is not None:
            self.estimated_latency_s = decision.estimated_latency_s

    def joined_lane(self, path: str, queued: bool) -> None:
        """It joined a path's lane: with a slot at once, or queued for one."""
        self.path = path
        if queued:
            self.state = JobState.QUEUED

    def refused_by(self, path: str) -> None:
        """A path refused it before it joined the lane: the answer (an error) is that path's."""
        self.path = path

    def got_slot(self, queue_wait_s: float) -> None:
        self.queue_wait_s = queue_wait_s

    def running_on(self, path: str) -> None:
        self.path, self.state = path, JobState.RUNNING

    def to_replay(self, failed_on: str) -> None:
        """A path failed it before any output: its one re-run comes next."""
        self.replayed, self.replayed_from = True, failed_on

    def continue_after(self, failed_on: str, cut_at: float) -> Continuation:
        """A path failed it after making part of a plain answer: the rest is
        made elsewhere, from that part, instead of from nothing."""
        assert self.sent is not None
        held_back, tokens = self.sent.cut(self.attempts[-1].tokens_made() if self.attempts else 0)
        self.continuation = Continuation("".join(self.sent.content), "".join(self.sent.reasoning), tokens,
                                         failed_on, cut_at, self.committed, held_back)
        self.replayed, self.replayed_from = True, failed_on
        return self.continuation

    def back_to_admission(self) -> None:
        """A peer gave it back unanswered: it is decided again here."""
        self.path, self.state = None, JobState.ADMITTING

    def finished(self) -> None:
        self.state = JobState.DONE

    def sized(self, prompt_tokens: int, max_tokens: int) -> None:
        """Fill in the request's size once its prompt is counted: the one
        change a request gets, and only before admission decides on it."""
        if self.state is not JobState.ADMITTING or self.decision is not None:
            raise RuntimeError(f"job {self.id} is sized after its admission")
        self.request = dataclasses.replace(self.request, prompt_tokens=prompt_tokens, max_tokens=max_tokens)

    @property
    def choices(self) -> int:
        """How many answers the request asks for (OpenAI's `n`, checked by the
        API): llama-server runs each in its own slot, so the job holds that
        many slots in its lane and its estimate counts that many answers."""
        n = self.body.get("n")
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1

    def continuable_kind(self) -> bool:
        """Whether a cut answer to this request could go on from its text:
        one plain answer, whose next token depends on nothing but the text
        before it. Not with a tool forced (a call has its own shape), a
        grammar or schema (its state would restart at the seam), logprobs
        (the seam's tokens would have none), several choices, or a prompt
        that is not one string (the text can't be appended to it)."""
        if self.choices != 1 or self.forced_tool is not None or self.top_logprobs is not None:
            return False
        body = self.body
        if body.get("grammar") is not None or body.get("json_schema") is not None:
            return False
        response_format = body.get("response_format")
        if isinstance(response_format, dict) and response_format.get("type", "text") != "text":
            return False
        if self.kind is JobKind.CHAT:
            return body.get("tool_choice") in (None, "auto", "none") or not body.get("tools")
        return isinstance(body.get("prompt"), str)

    def continuable(self) -> bool:
        """continuable_kind, and what was made so far is plain text: an
        answer, or a thinking model's reasoning (with or without the answer
        after it), with no tool call begun."""
        return (self.sent is not None and not self.sent.tool_call
                and bool(self.sent.content or self.sent.reasoning))

    @property
    def no_peer(self) -> bool:
        """Peers are out for this job: it came from one, or one failed it."""
        return self.from_peer or self.peer_failed

    def commit(self) -> None:
        """A byte of the answer reached the client: nothing may re-run it now."""
        self.committed = True

    def note_failure(self, detail: str) -> None:
        """Keep the first failure's detail: the one a client and /status are told."""
        self.first_failure = self.first_failure or detail

    def cancel(self, why: str) -> None:
        if not self.canceled.is_set():
            self.cancel_reason = why
            self.canceled.set()

    @property
    def tokens_out(self) -> int:
        """The answer's tokens so far: the last attempt's, since a replay
        starts the answer over; a continuation's add to those it went on from."""
        last = self.attempts[-1].tokens if self.attempts else 0
        return last + (self.continuation.tokens if self.continuation is not None else 0)

    def age_s(self) -> float:
        return round(time.monotonic() - self.created_at, 3)

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "client": self.client,
            "model": self.model or None,
            "kind": self.kind.value,
            "stream": self.stream,
            "state": self.state.value,
            "path": self.path,
            "peer": self.peer,
            "reason": self.reason.value if self.reason else None,
            "detail": self.reason_detail,
            "age_s": self.age_s(),
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "estimated_latency_s": self.estimated_latency_s,
            "replayed": self.replayed,
            "resumed": self.continuation is not None,
            "first_failure": self.first_failure,
            "attempts": [
                {"path": a.path, "outcome": a.outcome, "tokens": a.tokens} for a in self.attempts
            ],
        }


# OpenAI's error type for each HTTP status that has its own; any other 4xx is
# an invalid_request_error, any 5xx a server_error.
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                429: "rate_limit_error"}


def error_type(status: int) -> str:
    """The OpenAI error `type` for an HTTP status: the one place it is decided,
    for every error the service sends (api.errors builds the envelope with it).
    Here rather than in the api package so JobFailed can use it too."""
    if status >= 500:
        return "server_error"
    return _ERROR_TYPES.get(status, "invalid_request_error")


class JobFailed(Exception):
    """A job ends with an error the client should see, in the OpenAI envelope.
    err_type defaults to the status's type (error_type)."""

    def __init__(self, status: int, code: str, message: str, *, err_type: str | None = None,
                 retry_after_s: float | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.err_type = err_type or error_type(status)
        self.retry_after_s = retry_after_s
        self.param = param


class WorkerFailure(Exception):
    """The worker broke while serving (crash, reset, OOM, hang): replace it,
    and replay the request elsewhere if nothing was sent yet."""

    def __init__(self, message: str, *, process_may_have_died: bool = False, hung: bool = False) -> None:
        super().__init__(message)
        # The connection broke the way it does when the process dies: how it
        # died (its exit signal) decides whether the request itself was the cause.
        self.process_may_have_died = process_may_have_died
        # The worker went silent past its deadline (and is replaced).
        self.hung = hung


class WorkerRequestError(Exception):
    """The worker is fine but failed this one request (an exception inside
    the server for this input): re-running it would fail the same way."""


class DraftTally:
    """Speculative decoding's drafted and accepted tokens on one path over the
    last `window_s`: how often the drafts pay, as the answers go."""

    def __init__(self, window_s: float = 300.0) -> None:
        self.window_s = window_s
        self._answers: collections.deque[tuple[float, int, int]] = collections.deque()  # (when, drafted, accepted)

    def observe(self, now: float, drafted: int, accepted: int) -> None:
        self._answers.append((now, drafted, min(accepted, drafted)))
        self._forget(now)

    def _forget(self, now: float) -> None:
        while self._answers and self._answers[0][0] < now - self.window_s:
            self._answers.popleft()

    def summary(self, now: float) -> dict[str, Any]:
        self._forget(now)
        drafted = sum(d for _, d, _ in self._answers)
        accepted = sum(a for _, _, a in self._answers)
        return {"answers": len(self._answers), "drafted": drafted, "accepted": accepted,
                "acceptance": round(accepted / drafted, 3) if drafted else None, "window_s": self.window_s}


@dataclass
class PathSpeed:
    """Measured speed of one path, smoothed (EWMA) so one odd request can't swing it."""

    tokens_per_s: float
    prompt_tokens_per_s: float
    samples: int = 0
    alpha: float = 0.3

    def observe(self, generated: int, generation_s: float, prompt_tokens: int, ttft_s: float) -> None:
        if generated >= 4 and generation_s > 0:
            rate = generated / generation_s
            self.tokens_per_s = rate if self.samples == 0 else self.alpha * rate + (1 - self.alpha) * self.tokens_per_s
        if prompt_tokens >= 16 and ttft_s > 0:
            rate = prompt_tokens / ttft_s
            self.prompt_tokens_per_s = (
                rate if self.samples == 0 else self.alpha * rate + (1 - self.alpha) * self.prompt_tokens_per_s
            )
        self.samples += 1
