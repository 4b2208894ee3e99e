"""Peer servers: other OpenAI-compatible servers on the LAN ([[peers]]),
usually a second tray-app, that take requests this one can't serve well.

A peer is a path like the GPU and the CPU, with the same rules:
- admission offers it only what the local GPU can't take (see
  admission.offer_to_peer), and only while it is healthy, serves the
  model, has room and its own breaker is closed;
- its answer streams through the same shaping as a worker's, so the client
  sees this server's ids and model name; the headers say a peer served it;
- a peer that fails before any byte reached the client is a failure of
  that path: the request runs once more here, on the CPU; after a byte it
  is a 502 that says nothing was re-run.

A request sent to a peer carries X-Peer-Hop, and a request that arrives
with it is never sent on: two servers that are each other's peers can't
bounce a request between them. The client's X-Request-Id and
Idempotency-Key go with it, so the peer's logs name the same request and
a retry there finds the first result. A "fallback" peer is asked with
X-Fallback: never (a tray-app peer then answers from its GPU or says no at
once): its CPU is no better than this one's.

Whatever answers for a peer's name on the LAN may be hostile, so every read
from it has a deadline and a byte cap: an error answer's body, its model
list, and its streamed answer, which is cut (the peer's failure) once it
runs past the request's max_tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, NoReturn, Protocol
from urllib.parse import urlsplit

import httpx

from ..base.http_basics import bearer_header, is_loopback
from .admission import PeerRole, PeerView
from .breaker import BreakerPolicy, BreakerState, CircuitBreaker
from .backlog import remaining_work
from .jobs import Attempt, Job, PathSpeed
from .latency import PathLoad, SpeedCurve, Work, estimate
from .upstream import (
    MAX_SSE_LINE_BYTES, HttpxHop, Sink, UpstreamRules, Waiter, client_safe, stream_attempt, upstream_error_text,
    worker_body,
)

log = logging.getLogger(__name__)

# How often each peer is asked for its models (its health), and how long it
# may take, its whole answer included: one that drips must not hold the check.
HEALTH_INTERVAL_S = 5.0
HEALTH_TIMEOUT_S = 3.0
# The most of a peer's /v1/models read (a list of hundreds of models is a few
# dozen KiB), and of an error answer's body (only its message is used).
MODELS_MAX_BYTES = 1024 * 1024
ERROR_BODY_MAX_BYTES = 16 * 1024
# A peer's streamed answer is cut, as the peer's failure, past the request's
# max_tokens: a server sends at most one event per token, and a couple
# without one (the role, the finish); the margin is for servers that differ...
ANSWER_EVENT_MARGIN = 16
# ...and past this many bytes per event it may send, beyond one longest SSE
# line (an event with 20 top_logprobs is about 4 KiB).
ANSWER_BYTES_PER_EVENT = 16 * 1024
# The header that marks a request as forwarded by a peer (one hop only).
HOP_HEADER = "X-Peer-Hop"
# Peer answers that mean "not now" (busy, or its GPU can't take it): the
# request stays here, and the peer's breaker counts nothing.
BUSY_STATUSES = (429, 503)
# Transport errors that mean the request never left this machine.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# Wrong or missing key: the peer is misconfigured, not flaky. Its breaker
# opens at once and health checks keep saying why.
AUTH_STATUSES = (401, 403)


class PeerSettings(Protocol):
    """A [[peers]] entry (config.PeerEntry), as this module reads it."""

    name: str
    url: str
    api_key: str
    models: tuple[str, ...]
    role: str
    max_concurrency: int
    first_token_timeout_s: float
    token_timeout_s: float


class PeerFailure(Exception):
    """The peer did not answer this request.

    `counts`: a failure of the peer (its breaker counts it), not a peer that
    is busy or declined. `ran`: the request may have begun there (it broke
    or hung after the peer took it): running it here is a replay, the one
    re-run allowed. A peer that declined with an error status ran nothing.
    """

    def __init__(self, message: str, *, counts: bool = True, ran: bool = True) -> None:
        super().__init__(message)
        self.counts = counts
        self.ran = ran


@dataclass
class PeerHealth:
    # None until the first check; then whether the last check got an answer.
    reachable: bool | None = None
    # Why it takes no requests now (unreachable, wrong key, an error), or None.
    problem: str | None = "not checked yet"
    # The last check's round trip, and a smoothed one.
    latency_ms: float | None = None
    smoothed_ms: float | None = None
    checked_at: float | None = None
    # Since when the peer has been in its current state (healthy or not), wall clock.
    since: float = field(default_factory=time.time)
    # What /v1/models listed at the last check.
    listed: tuple[str, ...] = ()


class Peer:
    def __init__(self, settings: PeerSettings, base_url: str, http: httpx.AsyncClient, breaker: BreakerPolicy,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.name = settings.name
        self.role = PeerRole(settings.role)
        self.base_url = base_url
        self._http = http
        self._hop = HttpxHop(http)
        self._clock = clock
        self.breaker = CircuitBreaker(breaker, clock)
        self.health = PeerHealth()
        # Measured on its answers: the estimate admission compares. Unknown
        # (no estimate) until the first answer of a few tokens.
        self.speed = PathSpeed(tokens_per_s=1.0, prompt_tokens_per_s=1.0)
        # This server's requests running on the peer now (two models' requests
        # may share an id: each has its own dispatcher).
        self._running: set[Job] = set()
        self.served = 0
        self.failures = 0
        self.last_failure: str | None = None

    # ----- what admission sees ---------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def remote_model(self, names: tuple[str, ...]) -> str | None:
        """The name the peer serves this model under (the first of `names`,
        the local model's names, that it has), or None."""
        offered = self.settings.models or self.health.listed
        return next((name for name in names if name in offered), None)

    def unavailable(self, names: tuple[str, ...]) -> str | None:
        """Why this peer can't take a request for this model now, or None."""
        if self.health.problem is not None:
            return self.health.problem
        state = self.breaker.state
        if state is BreakerState.OPEN or (state is BreakerState.HALF_OPEN and self.breaker.probe_in_flight):
            why = ("a probe request is testing it" if state is BreakerState.HALF_OPEN
                   else self.breaker.snapshot()["last_failure_reason"])
            return f"its circuit breaker is {state.value} ({why})"
        if self.remote_model(names) is None:
            return f"it does not serve {names[0]}"
        if self.in_flight >= self.settings.max_concurrency:
            return f"it already has {self.in_flight} requests from here (max_concurrency)"
        return None

    def view(self, prompt_tokens: int, max_tokens: int, expected_tokens: int) -> PeerView:
        return PeerView(self.name, self.role, self.estimate_s(prompt_tokens, min(max_tokens, expected_tokens)),
                        finish_s=self.estimate_s(prompt_tokens, max_tokens))

    def estimate_s(self, prompt_tokens: int, answer_tokens: int) -> float | None:
        """Seconds to an answer of this size: the network round trip plus
        the work ahead of it there, played forward at the measured speeds:
        what this server already has running on the peer (its requests
        share the peer's throughput; a peer's other clients can't be seen
        from here). None until an answer has been measured."""
        if self.speed.samples == 0:
            return None
        rtt = (self.health.smoothed_ms or 0.0) / 1000
        # Only the single-stream speed is measured: streams running together
        # share it (SpeedCurve with no table), they don't multiply it.
        load = PathLoad(self.settings.max_concurrency,
                        tuple(work for job in self._running for work in remaining_work(job)), (),
                        SpeedCurve(self.speed.tokens_per_s, self.speed.prompt_tokens_per_s))
        return round(rtt + estimate(load, Work(prompt_tokens, answer_tokens)).latency_s, 2)

    # ----- health ----------------------------------------------------------------------------

    async def check(self) -> None:
        """Ask the peer for its models: reachable, key accepted, what it
        serves. Never raises: a peer's odd answer is its problem, said in
        /status, and must not stop the checks of the others."""
        started = time.perf_counter()
        problem: str | None = None
        listed = self.health.listed
        reachable = True
        try:
            # httpx's read timeout is per chunk: a body that drips a byte at a
            # time would never trip it. This deadline is for the whole answer.
            status, body = await asyncio.wait_for(self._read_models(), HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            reachable, problem = False, f"its /v1/models did not answer in full within {HEALTH_TIMEOUT_S:g} s"
        except (httpx.TransportError, httpx.TimeoutException) as exc:
            reachable, problem = False, f"unreachable: {type(exc).__name__}: {client_safe(str(exc)) or 'no detail'}"
        except Exception as exc:  # noqa: BLE001 - any odd answer is the peer's problem, shown in /status
            log.warning("peer %s: health check failed: %r", self.name, exc)
            reachable, problem = False, f"its /v1/models could not be read ({type(exc).__name__})"
        else:
            if status in AUTH_STATUSES:
                problem = f"it refused our API key (HTTP {status}): check api_key in [[peers]]"
            elif status >= 400:
                problem = f"its /v1/models answered HTTP {status}"
            elif body is None:
                problem = f"its /v1/models is larger than {MODELS_MAX_BYTES} bytes"
            else:
                listed, problem = _model_ids(body)
        rtt_ms = (time.perf_counter() - started) * 1000
        health = self.health
        if (problem is None) != (health.problem is None):
            health.since = time.time()
        health.reachable, health.problem, health.listed = reachable, problem, listed
        health.checked_at = time.time()
        if reachable:
            health.latency_ms = round(rtt_ms, 1)
            health.smoothed_ms = round(rtt_ms if health.smoothed_ms is None
                                       else 0.3 * rtt_ms + 0.7 * health.smoothed_ms, 1)

    async def _read_models(self) -> tuple[int, bytes | None]:
        """The status of the peer's /v1/models and its body (None when it is
        over MODELS_MAX_BYTES); an error answer's body is not read at all."""
        async with self._http.stream("GET", f"{self.base_url}/v1/models", headers=self._auth_headers(),
                                     timeout=HEALTH_TIMEOUT_S) as response:
            if response.status_code >= 400:
                return response.status_code, b""
            body, complete = await read_at_most(response, MODELS_MAX_BYTES)
            return response.status_code, body if complete else None

    # ----- a request -------------------------------------------------------------------------

    async def run(self, job: Job, sink: Sink, names: tuple[str, ...], model: str, fingerprint: str) -> Attempt:
        """Stream the job through the peer. Raises PeerFailure when the peer
        does not answer it; JobFailed when the client canceled."""
        remote = self.remote_model(names)
        attempt = Attempt("peer", self._clock())
        job.attempts.append(attempt)
        body = worker_body(job)
        # llama-server's own fields: a peer (this service elsewhere) refuses
        # them, and reports no progress or per-token timings of its own.
        body.pop("return_progress", None)
        body.pop("timings_per_token", None)
        body["model"] = remote
        headers = {**self._auth_headers(), HOP_HEADER: "1", "X-Request-Id": job.id}
        if job.idempotency_key:
            headers["Idempotency-Key"] = job.idempotency_key
        if self.role is PeerRole.FALLBACK:
            headers["X-Fallback"] = "never"
        first_wait_s = self.settings.first_token_timeout_s
        if job.deadline_s is not None:
            # The client's X-Request-Timeout, what is left of it: the peer
            # plans with it, and we wait no longer for its first token.
            # (A job no dispatcher registered, run on the peer directly, counts from now.)
            age_s = self._clock() - job.registered_at if job.registered_at is not None else 0.0
            left_s = max(0.1, job.deadline_s - age_s)
            headers["X-Request-Timeout"] = f"{left_s:.3f}"
            first_wait_s = min(first_wait_s, left_s)
        self._running.add(job)
        try:
            done_seen = await stream_attempt(
                self._hop, f"{self.base_url}{job.kind.upstream_path}", body, headers, job, attempt, sink,
                _PeerRules(self, job), clock=self._clock, first_token_s=first_wait_s,
                between_tokens_s=self.settings.token_timeout_s, model=model, fingerprint=fingerprint)
        finally:
            self._running.discard(job)
        if not done_seen:
            attempt.outcome = "failed: truncated"
            raise PeerFailure("its stream ended without [DONE]")
        attempt.outcome = "completed"
        first = attempt.first_token_at or attempt.ended_at
        self.speed.observe(attempt.tokens, attempt.ended_at - first, job.prompt_tokens, first - attempt.started_at)
        self.served += 1
        return attempt

    def record_failure(self, failure: PeerFailure) -> None:
        self.failures += 1
        self.last_failure = str(failure)
        if failure.counts:
            self.breaker.record_failure(str(failure))  # a failed half-open probe opens it again

    def settle_probe(self, succeeded: bool) -> None:
        """The half-open probe request this job held has ended: a success
        closes the breaker; anything else gives the probe back (a failure
        that counts has already opened it again)."""
        if succeeded:
            self.breaker.record_success()
        self.breaker.release_probe()

    def _refused(self, status: int, body: bytes) -> NoReturn:
        message = upstream_error_text(body)
        if status in AUTH_STATUSES:
            reason = f"it refused our API key (HTTP {status}): check api_key in [[peers]]"
            self.breaker.trip(reason)
            if self.health.problem is None:
                self.health.since = time.time()
            self.health.problem = reason
            raise PeerFailure(reason, counts=False, ran=False)
        # A 4xx here is the peer's limit (a smaller context, say), not the
        # client's mistake: this server already accepted the request; it ran
        # nothing. A 5xx other than 503 may come after it began (a tray-app
        # peer's 502 after its worker failed): that one counts as run.
        raise PeerFailure(f"it answered HTTP {status}: {message}", ran=status >= 500 and status != 503,
                          counts=status >= 500 and status not in BUSY_STATUSES)

    def _auth_headers(self) -> dict[str, str]:
        return bearer_header(self.settings.api_key)

    @property
    def key_in_cleartext(self) -> bool:
        """Whether our api_key for it crosses a network unencrypted: plain
        http to a host other than this machine's loopback."""
        url = urlsplit(self.base_url)
        return bool(self.settings.api_key) and url.scheme == "http" and not is_loopback(url.hostname or "")

    # ----- what it says about itself ---------------------------------------------------------

    def status(self) -> dict[str, Any]:
        health = self.health
        return {
            "name": self.name,
            "url": self.base_url,
            "role": self.role.value,
            "models": list(self.settings.models or health.listed),
            "healthy": health.problem is None and self.breaker.state is BreakerState.CLOSED,
            "reachable": health.reachable,
            "problem": health.problem,
            "latency_ms": health.latency_ms,
            "smoothed_latency_ms": health.smoothed_ms,
            "checked_at": health.checked_at,
            "since": health.since,
            "breaker": self.breaker.snapshot(),
            "in_flight": self.in_flight,
            "max_concurrency": self.settings.max_concurrency,
            "served": self.served,
            "failures": self.failures,
            "last_failure": self.last_failure,
            "tokens_per_s": round(self.speed.tokens_per_s, 1) if self.speed.samples else None,
            "key_in_cleartext": self.key_in_cleartext,
            "warning": CLEARTEXT_KEY_WARNING if self.key_in_cleartext else None,
        }


CLEARTEXT_KEY_WARNING = ("its api_key is sent over plain http: anyone on the network between here and "
                         "there can read it and use it; reach the peer over https (a TLS proxy in front of it) "
                         "or only over a network that is yours")


class _PeerRules(UpstreamRules):
    """How an attempt at a peer ends without an answer: a PeerFailure that
    says whether its breaker counts it and whether it may have run there.
    Its answer is capped by the request's max_tokens."""

    failure = PeerFailure

    def __init__(self, peer: Peer, job: Job) -> None:
        self._peer = peer
        self._job = job
        self.canceled_where = f"while peer {peer.name} served it"

    async def refused(self, response: httpx.Response, wait: Waiter, silent_s: Callable[[], float]) -> NoReturn:
        # Its body too under the request's deadline and cancel: a peer that
        # stalls or never ends its error answer must not hold the request
        # (or its in-flight count) forever.
        try:
            error_body, _ = await wait(read_at_most(response, ERROR_BODY_MAX_BYTES))
        except asyncio.TimeoutError:
            raise PeerFailure(f"it answered HTTP {response.status_code} but sent no more of its "
                              f"body for {silent_s():g} s") from None
        self._peer._refused(response.status_code, error_body)

    def bad_event(self, message: str) -> NoReturn:
        raise PeerFailure(f"it {client_safe(message)}")

    def hung(self, silent_s: float) -> Exception:
        return PeerFailure(f"no output for {silent_s:g} s")

    def broke(self, exc: Exception, attempt: Attempt) -> Exception | None:
        if isinstance(exc, (UnicodeEncodeError, httpx.LocalProtocolError)):
            # A request this server could not encode (a header httpx can't
            # send): our failure, not the peer's. It never left; run it here.
            return PeerFailure(f"it was not asked: this request could not be sent ({type(exc).__name__})",
                               counts=False, ran=False)
        if isinstance(exc, (httpx.TransportError, httpx.StreamError)):
            # Refused or timed out at connect: the request never got there.
            return PeerFailure(f"the connection broke: {type(exc).__name__}: {client_safe(str(exc)) or 'no detail'}",
                               ran=not isinstance(exc, NOT_SENT))
        # Whatever a peer sends, the request must not be lost: a body httpx
        # can't decode, an event of an odd shape is the peer's failure, and
        # the request may have begun there.
        log.warning("peer %s: unexpected failure on %s: %r", self._peer.name, self._job.id, exc)
        return PeerFailure(f"its answer could not be read ({type(exc).__name__})")

    def answer(self, response: httpx.Response) -> _CappedAnswer:
        return _CappedAnswer(response, self._job.max_tokens)

    def sink(self, sink: Sink) -> _CappedSink:
        return _CappedSink(sink, self._job.max_tokens)


async def read_at_most(response: httpx.Response, max_bytes: int) -> tuple[bytes, bool]:
    """The first `max_bytes` of a body, and whether that was all of it. It
    stops reading there: a body that never ends costs no more."""
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > max_bytes:
            return bytes(body[:max_bytes]), False
    return bytes(body), True


class _CappedAnswer:
    """A peer's streamed answer as relay_answer reads it (through
    aiter_bytes), cut as the peer's failure past the bytes the request's
    max_tokens allows: a stream that never ends must not fill the sinks or
    the idempotency recording."""

    def __init__(self, response: httpx.Response, max_tokens: int) -> None:
        self._response = response
        self._max_tokens = max_tokens
        self.max_bytes = MAX_SSE_LINE_BYTES + (max_tokens + ANSWER_EVENT_MARGIN) * ANSWER_BYTES_PER_EVENT
        self.read = 0

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.aiter_bytes():
            self.read += len(chunk)
            if self.read > self.max_bytes:
                raise PeerFailure(f"it sent more than {self.max_bytes} bytes for max_tokens {self._max_tokens}: "
                                  "its answer was cut")
            yield chunk


class _CappedSink:
    """The request's sink, which refuses (as the peer's failure) the event
    that runs past max_tokens and its margin, with a token or without: a
    peer that never stops is cut there."""

    def __init__(self, sink: Sink, max_tokens: int) -> None:
        self._sink = sink
        self._max_tokens = max_tokens
        self._max_events = max_tokens + ANSWER_EVENT_MARGIN
        self._events = 0

    def emit(self, event: dict[str, Any]) -> None:
        self._events += 1
        if self._events > self._max_events:
            raise PeerFailure(f"it sent more than {self._max_events} events for max_tokens {self._max_tokens}: "
                              "its answer was cut")
        self._sink.emit(event)

    def reset(self) -> None:
        self._sink.reset()

    def seam(self, note: dict[str, Any]) -> None:
        self._sink.seam(note)


def _model_ids(body: bytes) -> tuple[tuple[str, ...], str | None]:
    """The model ids of an OpenAI /v1/models answer, or why it isn't one."""
    try:
        data = json.loads(body).get("data")
    except (ValueError, AttributeError, RecursionError):  # RecursionError: JSON nested too deep
        data = None
    if not isinstance(data, list):
        return (), "its /v1/models is not an OpenAI model list"
    return tuple(str(m["id"]) for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)), None


class Peers:
    """The configured peers and their health checks (one task, off the request path)."""

    def __init__(self, peers: list[Peer], interval_s: float = HEALTH_INTERVAL_S) -> None:
        self.peers = peers
        self._by_name = {peer.name: peer for peer in peers}
        self._interval_s = interval_s
        self._tasks: list[asyncio.Task] = []

    def get(self, name: str | None) -> Peer | None:
        return self._by_name.get(name) if name else None

    def offering(self, names: tuple[str, ...]) -> list[Peer]:
        """The peers that could take a request for this model now, in config order."""
        return [peer for peer in self.peers if peer.unavailable(names) is None]

    def start(self) -> None:
        # One loop per peer: a slow peer's check never delays another's.
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._check_forever(peer), name=f"peer-health-{peer.name}")
                           for peer in self.peers]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def _check_forever(self, peer: Peer) -> None:
        while True:
            try:
                await peer.check()
            except Exception:  # noqa: BLE001 - check() never raises; this guard keeps the peer watched if it did
                log.exception("peer %s: health check raised", peer.name)
            await asyncio.sleep(self._interval_s)

    def status(self) -> list[dict[str, Any]]:
        return [peer.status() for peer in self.peers]


def job_may_use_peers(job: Job) -> bool:
    """Whether a peer may serve this job at all: not one that came from a
    peer or that a peer already failed, not one the client sent to the CPU,
    and not one constrained by a grammar: structured output and a named
    tool_choice become llama.cpp's `grammar` here, which another kind of
    server would ignore (an unconstrained answer) or refuse. The dispatcher also
    keeps a request that may not leave the GPU (X-Fallback: never) here.
    Nor one whose id or idempotency key can't travel as a header (the door
    refuses those; if one got past it, it is no failure of the peer's)."""
    if not all(_sendable_header(value) for value in (job.id, job.idempotency_key or "")):
        return False
    return not (job.no_peer or job.force_cpu or job.forced_tool is not None or "grammar" in job.body)


def _sendable_header(value: str) -> bool:
    """Whether httpx can send this as a header value: printable ASCII."""
    return value.isascii() and value.isprintable()
