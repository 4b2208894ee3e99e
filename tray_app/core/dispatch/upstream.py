"""One attempt at an OpenAI-compatible upstream: a local worker (llama-server,
llama-cpp-python) or a peer server on the LAN.

`stream_attempt` is the one loop both paths run: send the body, wait for
the headers and then each SSE line under the first-token and between-tokens
deadlines (on the injected clock) and the client's cancel, shape every event
as this server's, and count the tokens on the attempt. What differs between
the targets is an `UpstreamRules`: how a refusal, a bad event, a hang or a
broken connection becomes that target's failure, and the caps a peer's
answer gets. The wire format both speak (the request body, each event's
shape, an error answer's text) is here too.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, NoReturn, Protocol

import httpx

from ..base.http_basics import SseLineSplitter, SseLineTooLong, aiter_sse_lines
from ..engine import request_fields
from .jobs import ANY_TOOL, Attempt, Continuation, Job, JobFailed, JobKind, WorkerFailure

# How often a request that waits on an upstream asks whether it can still
# make progress at all (see Worker.liveness_problem).
LIVENESS_INTERVAL_S = 1.0
# The longest SSE line an upstream may send (an event with logprobs is a few KiB).
MAX_SSE_LINE_BYTES = 4 * 1024 * 1024


class Sink(Protocol):
    """Where a job's output goes. `emit` hands an event towards the client."""

    def emit(self, event: dict[str, Any]) -> None: ...

    def reset(self) -> None: ...

    def seam(self, note: dict[str, Any]) -> None:
        """The answer goes on from here on another path (a continuation):
        a stream says so in its protocol's way; a whole answer records it."""
        ...


class UpstreamRules:
    """What differs between upstreams. Each way an attempt can end without
    an answer becomes the target's own failure here; the defaults are a
    target with no liveness check and no caps."""

    # The target's own failure: an attempt that raises it is marked failed with its message.
    failure: type[Exception] = Exception
    # Where a cancel found the job, for the client's 499.
    canceled_where = "while it ran"

    def liveness(self) -> str | None:
        """Why the upstream can't make progress any more, or None (asked every LIVENESS_INTERVAL_S)."""
        return None

    async def refused(self, response: "UpstreamResponse", wait: "Waiter", silent_s: Callable[[], float]) -> NoReturn:
        """The upstream answered an HTTP error status: raise what that means."""
        raise NotImplementedError

    def bad_event(self, message: str) -> NoReturn:
        """The upstream `message` (sent an odd or an error event): raise what that means."""
        raise NotImplementedError

    def hung(self, silent_s: float) -> Exception:
        """The failure for an upstream that sent nothing for `silent_s` seconds."""
        raise NotImplementedError

    def broke(self, exc: Exception, attempt: Attempt) -> Exception | None:
        """The failure for an exception from the connection or the answer,
        or None to let it propagate as it is."""
        return None

    def answer(self, response: "UpstreamResponse") -> Any:
        """The answer as relay_answer reads it (a peer's is capped)."""
        return response

    def sink(self, sink: Sink) -> Sink:
        """The sink as relay_answer writes it (a peer's is capped)."""
        return sink


Waiter = Callable[[Awaitable[Any]], Awaitable[Any]]


class UpstreamResponse(Protocol):
    """What the relay reads of an upstream's answer: httpx.Response has it,
    and so does loopback_http.HopResponse."""

    status_code: int

    def aiter_bytes(self) -> AsyncIterator[bytes]: ...

    async def aread(self) -> bytes: ...

    async def aclose(self) -> None: ...


class Hop(Protocol):
    """How an attempt reaches its upstream: POST a JSON body, the answer streamed."""

    async def post(self, url: str, body: Any, headers: Mapping[str, str]) -> UpstreamResponse: ...


class HttpxHop:
    """The hop through an httpx client: a peer's (the LAN, TLS, a proxy), and
    a test's (an httpx.MockTransport). A worker on loopback takes the lean
    loopback_http.LoopbackHop."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self._http = http

    async def post(self, url: str, body: Any, headers: Mapping[str, str]) -> httpx.Response:
        return await self._http.send(self._http.build_request("POST", url, json=body, headers=headers), stream=True)


async def stream_attempt(hop: Hop, url: str, body: dict[str, Any], headers: dict[str, str], job: Job,
                         attempt: Attempt, sink: Sink, rules: UpstreamRules, *, clock: Callable[[], float],
                         first_token_s: float, between_tokens_s: float, model: str, fingerprint: str) -> bool:
    """POST `body` to `url` and relay the streamed answer into `sink`.
    Returns whether the stream ended with [DONE]; raises JobFailed for a
    cancel and the rules' failures for the rest. The attempt's outcome and
    end time are set on every way out."""
    canceled = asyncio.ensure_future(job.canceled.wait())
    watch = UpstreamWatch(canceled, rules.liveness, clock)
    first_deadline = clock() + first_token_s

    def silent_s() -> float:
        return first_token_s if attempt.first_token_at is None else between_tokens_s

    async def wait(awaitable: Awaitable[Any]) -> Any:
        limit_s = attempt.wait_limit_s(first_deadline, between_tokens_s, clock(), first_token_s)
        result = await watch.wait(awaitable, limit_s)
        if result is _CANCELED:
            attempt.outcome = "canceled"
            raise canceled_error(job, rules.canceled_where)
        return result

    try:
        response = await wait(hop.post(url, body, headers))
        try:
            attempt.reached_worker = True
            if response.status_code >= 400:
                await rules.refused(response, wait, silent_s)
            return await relay_answer(rules.answer(response), job, attempt, rules.sink(sink), wait,
                                      fail=rules.bad_event, model=model, fingerprint=fingerprint, clock=clock)
        finally:
            await response.aclose()
    except rules.failure as failure:
        attempt.outcome = f"failed: {failure}"
        raise
    except asyncio.TimeoutError:
        attempt.outcome = "failed: hang"
        raise rules.hung(silent_s()) from None
    except (JobFailed, asyncio.CancelledError):
        raise
    except Exception as exc:
        failure = rules.broke(exc, attempt)
        if failure is None:
            raise
        attempt.outcome = f"failed: {type(exc).__name__}"
        raise failure from None
    finally:
        watch.close()
        canceled.cancel()
        attempt.ended_at = clock()


# ----- the wire format ------------------------------------------------------------------


async def sse_lines(response: Any) -> AsyncIterator[str]:
    """The lines of an upstream's SSE stream (see http_basics.SseLineSplitter),
    none longer than MAX_SSE_LINE_BYTES: an upstream (a peer, say) that never
    ends its line must not fill our memory."""
    try:
        async for line in aiter_sse_lines(response.aiter_bytes(), MAX_SSE_LINE_BYTES):
            yield line
    except SseLineTooLong as exc:
        raise httpx.RemoteProtocolError(str(exc)) from None


class WireEvent(dict):
    """A shaped event that also carries its OpenAI SSE bytes, made without
    json.dumps by the relay's fast path (PlainDeltas): sinks.sse sends
    `wire` as it is. Every other reader sees an ordinary dict."""

    __slots__ = ("wire",)


class PlainDeltas:
    """The relay's fast path for the event nearly every token is: a plain
    content delta of one choice, as llama-server writes it. Such an event
    is recognised on its raw text, with no full parse and no shaping, and
    its bytes for an OpenAI client are a template learned from the
    attempt's first one, which the slow path (json.loads, shape_event,
    json.dumps) shaped and which the template must reproduce byte for byte
    before it is used. Anything else (a role, a finish, usage, reasoning,
    tool calls, logprobs, another key order, an upstream whose id or model
    changes) doesn't match the template and goes the slow path."""

    HEAD = '{"choices":[{"finish_reason":null,"index":0,"delta":{"content":"'
    # Can't occur inside the content's JSON string: a quote there is escaped.
    MID = '"}}],"created":'

    def __init__(self) -> None:
        # The upstream's text after the created time, and ours in its place.
        self._their_tail: str | None = None
        self._our_tail = b""
        self._rest: dict[str, Any] = {}
        # A template that failed its check once fails again: stop trying,
        # so an odd upstream costs the slow path only, not the learning too.
        self._gave_up = False
        # The worker's count of the tokens made, from the last event shaped (None: it gave none).
        self.predicted: int | None = None

    def learn(self, line: str, shaped: dict[str, Any]) -> None:
        """Learn the template from a line the slow path shaped into
        `shaped`, if this line is a plain delta and the template gives
        exactly the bytes the slow path would send."""
        parts = None if self._gave_up else self._split(line)
        if parts is None or list(shaped)[:2] != ["choices", "created"]:
            return
        _, created, their_tail, _ = parts
        wire = sse_bytes(shaped)
        prefix = f"data: {self.HEAD}".encode()
        tail_at = wire.find(f"{self.MID}{created}".encode(), len(prefix))
        if not wire.startswith(prefix) or tail_at < 0:
            return
        self._their_tail = their_tail
        self._our_tail = wire[tail_at + len(self.MID) + len(created):]
        self._rest = {key: value for key, value in shaped.items() if key not in ("choices", "created")}
        made = self.shape(line)
        if made is None or made.wire != wire or made != shaped:
            self._their_tail = None
            self._gave_up = True

    def shape(self, line: str) -> WireEvent | None:
        """The shaped event for `line` (the text after "data:"), or None
        when it is not a plain delta of the learned form."""
        if self._their_tail is None:
            return None
        parts = self._split(line)
        if parts is None or parts[2] != self._their_tail:
            return None
        text, created, _, self.predicted = parts
        event = WireEvent(choices=[{"finish_reason": None, "index": 0, "delta": {"content": text}}],
                          created=int(created))
        event.update(self._rest)
        event.wire = b"".join((b"data: ", _HEAD_BYTES, _encode_string(text).encode(), _MID_BYTES, created.encode(),
                               self._our_tail))
        return event

    def _split(self, line: str) -> tuple[str, str, str, int | None] | None:
        """(content, created digits, the text after them, predicted_n) of a
        plain delta, else None. The per-token timings llama-server adds last
        (timings_per_token) are not part of the text after: only their count
        of the tokens made is kept (shape_event drops them too)."""
        if not line.startswith(self.HEAD):
            return None
        end = line.find(self.MID, len(self.HEAD))
        if end < 0:
            return None
        try:
            text, after = _scan_string(line, len(self.HEAD))
        except ValueError:
            return None
        if after != end + 1:
            return None
        # As json.dumps writes the number back: no sign, no leading zero, no fraction.
        number = _CREATED.match(line, end + len(self.MID))
        if number is None:
            return None
        tail, predicted = line[number.end(1):], None
        timed = tail.rfind(_TIMINGS_KEY)
        if timed >= 0:
            timings = _TIMINGS.fullmatch(tail, timed)
            # (Twice, json.loads would take the last; the slow path decides.)
            if timings is None or tail.count('"predicted_n"', timed) != 1:
                return None
            tail, predicted = tail[:timed] + "}", int(timings.group(1))
        return text, number.group(1), tail, predicted


_CREATED = re.compile(r"(0|[1-9][0-9]*),")
# llama-server's per-token timings, the event's last member: numbers only, predicted_n among them.
_TIMINGS_KEY = ',"timings":{'
_NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?"  # JSON's grammar
_TIMINGS = re.compile(rf',"timings":\{{(?:"[a-z_]+":{_NUMBER},)*?"predicted_n":(0|[1-9][0-9]*)'
                      rf'(?:,"[a-z_]+":{_NUMBER})*\}}\}}')
_HEAD_BYTES = PlainDeltas.HEAD[:-1].encode()
_MID_BYTES = PlainDeltas.MID[1:].encode()
# The C string scanner and encoder json itself uses: the same escapes json.dumps writes.
_scan_string = json.decoder.scanstring
_encode_string = json.encoder.encode_basestring_ascii


async def relay_answer(response: UpstreamResponse, job: Job, attempt: Attempt, sink: Sink,
                       wait: Callable[[Any], Awaitable[Any]], *, fail: Callable[[str], NoReturn], model: str,
                       fingerprint: str, clock: Callable[[], float]) -> bool:
    """Relay an upstream's streamed answer (a worker's or a peer's) to the
    sink, each event shaped as this server's, counting the tokens on the
    attempt. `wait` awaits each next chunk of bytes under the caller's
    deadlines and cancel (one wait per chunk, however many lines it holds);
    `fail(what)` raises the caller's failure for a bad or error event.
    Returns whether the stream ended with [DONE]."""
    shaping = AttemptShaping()
    # A chat with several choices opens them all, in order, before any output.
    opened = job.kind is not JobKind.CHAT or job.choices == 1
    continuation = job.continuation
    # llama-server's chat answer to an assistant prefill begins with the
    # prefill itself (a completion's doesn't): that much is already the client's.
    seam = ContinuationSeam(continuation, echoes=job.kind is JobKind.CHAT) if continuation else None
    # Only a chat of one choice with nothing to rewrite inside its deltas takes the fast path.
    fast = PlainDeltas() if (job.kind is JobKind.CHAT and job.choices == 1 and job.forced_tool is None
                             and job.top_logprobs is None and seam is None) else None
    sent = job.sent
    splitter = SseLineSplitter(MAX_SSE_LINE_BYTES)
    chunks = response.aiter_bytes()
    while True:
        chunk = await wait(chunks.__anext__())
        try:
            lines = splitter.feed(chunk) if chunk is not None else splitter.finish()
        except SseLineTooLong as exc:
            raise httpx.RemoteProtocolError(str(exc)) from None
        for line in lines:
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                # Usage counts what the worker made, as llama-server's own does:
                # the reasoning's hidden tags and a stop string's tokens too.
                # (With several choices its count is each one's: the events are summed.)
                if job.choices == 1:
                    attempt.tokens = attempt.tokens_made()
                return True
            event = fast.shape(data) if fast is not None else None
            if event is not None:
                carries = bool(event["choices"][0]["delta"]["content"])
                if fast.predicted is not None:
                    attempt.predicted = fast.predicted
            else:
                event = _parsed_event(data, fail)
                if event is None:
                    continue
                if _progress_only(event, attempt, clock):
                    continue  # liveness, not output: a client never sees it, so a replay stays possible
                carries = shape_event(event, job, shaping, model=model, fingerprint=fingerprint)
                if seam is not None:
                    if not seam.join(event, job, attempt):
                        continue  # the echoed prefill, or the role the client already has
                    carries = _carries_token(event)
                    if carries and job.seam_closed_at is None:
                        job.seam_closed_at = clock()
                if fast is not None and opened:
                    fast.learn(data, event)
            if carries:
                attempt.tokens += 1
                attempt.last_token_at = clock()
                if attempt.first_token_at is None:
                    attempt.first_token_at = attempt.last_token_at
            if not opened:
                sink.emit(_opening_event(event, job.choices))
                opened = True
            sink.emit(event)
            if sent is not None:
                sent.take(event, attempt.tokens_made())
        if chunk is None:
            return False


class ContinuationSeam:
    """Where a continued answer's new part joins what the client has. A
    chat answer to a prefill begins with an echo of it in llama-server's
    stream: the reasoning, then the text. What the client already holds is
    dropped, never sent twice (a cut in the answer drops the echoed
    reasoning whole: none comes after it), and so is the role delta. The
    last event carries `resumed`, a field OpenAI's clients ignore, saying
    where the answer was cut and what the new path made."""

    def __init__(self, continuation: Continuation, echoes: bool) -> None:
        # The whitespace the prefill left out comes again, echo or not.
        self._text = _Echo(continuation.text if echoes else continuation.held_back)
        self._reasoning = _Echo(continuation.reasoning if echoes else "")
        self._reasoning_done = not continuation.in_reasoning

    def join(self, event: dict[str, Any], job: Job, attempt: Attempt) -> bool:
        """Rewrite `event` for the joined answer; False when nothing of it is left to send."""
        keep = False
        for choice in event.get("choices") or ():
            delta = choice.get("delta")
            if isinstance(delta, dict):
                delta.pop("role", None)
                if delta.get("reasoning_content"):
                    if self._reasoning_done:
                        del delta["reasoning_content"]
                    else:
                        delta["reasoning_content"] = self._reasoning.strip(delta["reasoning_content"])
                if delta.get("content"):
                    delta["content"] = self._text.strip(delta["content"])
                keep = keep or any(value not in (None, "") for value in delta.values())
            if choice.get("finish_reason"):
                keep = True
                continuation = job.continuation
                assert continuation is not None
                if attempt.predicted is not None:
                    # The engine's own count: the echo's event is not a token of its.
                    attempt.tokens = attempt.predicted
                event["resumed"] = {"from": continuation.failed_on, "on": attempt.path,
                                    "cut_at_tokens": continuation.tokens, "cut_at_chars": len(continuation.text),
                                    "tokens_added": attempt.tokens}
                if continuation.reasoning:
                    event["resumed"]["cut_in"] = "reasoning" if continuation.in_reasoning else "answer"
            if choice.get("text"):
                choice["text"] = self._text.strip(choice["text"])
                keep = keep or bool(choice["text"])
        return keep


class _Echo:
    """One field's echo of the prefill, taken off the front of what comes."""

    def __init__(self, echoed: str) -> None:
        self._left = echoed

    def strip(self, text: str) -> str:
        left = self._left
        if not left:
            return text
        if text.startswith(left):
            self._left = ""
            return text[len(left):]
        if left.startswith(text):
            self._left = left[len(text):]
            return ""
        # The engine's text differs from what was sent (a template that
        # trims the prefill's whitespace): what the two share is the
        # client's; from where they part, the new text is.
        shared = 0
        while shared < min(len(text), len(left)) and text[shared] == left[shared]:
            shared += 1
        self._left = ""
        return text[shared:]


def _progress_only(event: dict[str, Any], attempt: Attempt, clock: Callable[[], float]) -> bool:
    """Note what an event says of the prompt's reading: its progress (the
    deadline to the first token runs from the latest) and, in the last
    event, the worker's timings. True for an event that says nothing else."""
    timings = event.get("timings")
    if isinstance(timings, dict):
        read, read_ms = timings.get("prompt_n"), timings.get("prompt_ms")
        if isinstance(read, int) and isinstance(read_ms, (int, float)) and read_ms > 0:
            attempt.prompt_read, attempt.prompt_read_s = read, read_ms / 1000
        predicted = timings.get("predicted_n")
        if _count(predicted):
            attempt.predicted = predicted
        drafted, accepted = timings.get("draft_n"), timings.get("draft_n_accepted")
        if _count(drafted) and _count(accepted):
            attempt.drafted, attempt.draft_accepted = drafted, accepted
    if "prompt_progress" not in event:
        return False
    attempt.last_progress_at = clock()
    return not _carries_token(event) and not any(c.get("finish_reason") for c in event["choices"])


def _count(value: Any) -> bool:
    """A token count as a worker may report one: a whole number, not negative."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parsed_event(data: str, fail: Callable[[str], NoReturn]) -> dict[str, Any] | None:
    """One event's JSON, checked; None for an event the client doesn't get."""
    try:
        event = json.loads(data)
    except ValueError:
        fail("sent an event that is not JSON")
    if not isinstance(event, dict):
        fail("sent an event that is not a JSON object")
    if "error" in event:
        fail(f"reported an error: {event['error']}")
    choices = event.get("choices")
    if not choices:
        # llama-server's own usage chunk: the sink writes the usage of
        # the whole request (one execution) itself.
        return None
    if not isinstance(choices, list) or not all(
            isinstance(c, dict) and isinstance(c.get("delta", {}), dict) for c in choices):
        fail("sent an event whose choices are not OpenAI's shape")
    return event


def sse_bytes(payload: Any) -> bytes:
    """One SSE event, as every OpenAI stream here writes it (compact JSON);
    a WireEvent's bytes as they are."""
    if type(payload) is WireEvent:
        return payload.wire
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


class AttemptShaping:
    """What shaping one attempt's stream remembers between its events."""

    def __init__(self) -> None:
        # (choice, call) whose name was sent: _drop_repeated_tool_names.
        self.named: set[tuple[int, int]] = set()
        # Each choice's answer so far, under tool_choice "required" with
        # several tools (ANY_TOOL): its call is known once it is whole.
        self.pending: dict[int, str] = {}


def shape_event(event: dict[str, Any], job: Job, shaping: AttemptShaping, *, model: str,
                fingerprint: str) -> bool:
    """Make one streamed event of an upstream server (a worker, or a peer)
    what this server sends: its ids, its model name, OpenAI's shapes.
    Returns whether the event carries output (a token)."""
    # The upstream's per-request timings and usage are its business (the
    # sink writes the usage of the one execution), and the same answer
    # looks the same from any engine or server.
    event.pop("timings", None)
    event.pop("usage", None)
    _trim_logprobs(event, job.top_logprobs)
    _reasoning_as_reasoning_content(event)
    if job.choices > 1:
        # The opening event said each choice's role (see _opening_event).
        _drop_roles(event)
    # Counted before a forced call reshapes it: an answer held back whole
    # (ANY_TOOL) is output as it comes, for the hang deadlines too.
    carries = _carries_token(event)
    if job.forced_tool == ANY_TOOL:
        _as_chosen_tool_call(event, job, shaping.pending)
    elif job.forced_tool is not None:
        _as_forced_tool_call(event, job)
    event["id"] = response_id(job)
    event["model"] = model
    event["system_fingerprint"] = fingerprint
    _drop_repeated_tool_names(event, shaping.named)
    return carries


def worker_body(job: Job) -> dict[str, Any]:
    """What the worker gets: the checked fields it may see (request_fields'
    rule) and the service's own settings."""
    body = request_fields.for_worker(job.kind.value, job.body)
    # Always an explicit limit, the one admission planned with: the worker's
    # own default may be none at all, and it does not know the current API's
    # name max_completion_tokens.
    body["max_tokens"] = job.max_tokens
    continuation = job.continuation
    if continuation is not None:
        # The answer goes on from the text already made: llama-server
        # continues an assistant message that ends the chat (a prefill),
        # and a completion's prompt with that text after it.
        # A thinking model's reasoning goes in the prefill too: cut inside
        # it (no answer text yet), llama-server goes on with the reasoning;
        # after it, with the answer, the reasoning closed as the template writes it.
        if job.kind is JobKind.CHAT:
            prefill = {"role": "assistant", "content": continuation.prefill_text}
            if continuation.reasoning:
                prefill["reasoning_content"] = continuation.prefill_reasoning
            body["messages"] = [*body["messages"], prefill]
        else:
            body["prompt"] = body["prompt"] + continuation.prefill_text
        body["max_tokens"] = max(1, job.max_tokens - continuation.tokens)
    # Always streamed from the worker: that gives cancellation, hang
    # detection, token metering and replay while nothing was sent.
    body["stream"] = True
    # Its prompt_progress events keep a long prompt from reading as a hang.
    body["return_progress"] = True
    if job.sent is not None:
        # Each event then says how many tokens were made so far, hidden ones
        # included: what a cut answer cost, exactly (Attempt.tokens_made).
        body["timings_per_token"] = True
    if not job.prompt_cache:
        body["cache_prompt"] = False
    if job.top_logprobs is not None:
        # See _trim_logprobs: at least one, or llama-server sends none.
        key = "top_logprobs" if job.kind.value == "chat" else "logprobs"
        body[key] = max(1, job.top_logprobs)
    return body


async def upstream_error_message(response: UpstreamResponse) -> str:
    """An upstream's error answer as one client-safe line."""
    return upstream_error_text(await response.aread())


def upstream_error_text(raw: bytes) -> str:
    """An upstream's error body as one client-safe line."""
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = {}
    error = payload.get("error") if isinstance(payload, dict) else None
    message = (error or {}).get("message") if isinstance(error, dict) else None
    message = message or (payload.get("detail") if isinstance(payload, dict) else None) or raw.decode("utf-8", "replace")
    return client_safe(str(message))


_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.\-+@~]+){2,}")


def path_names_only(text: str) -> str:
    """`text` with each file system path cut to its last part: the model's
    file name says which model, its folder says how the machine is laid out."""
    return _PATH.sub(lambda match: re.split(r"[\\/]", match.group(0))[-1], text)


def client_safe(message: str) -> str:
    """A worker's error message as a client may see it: one line, no
    traceback, no file system paths (they tell an attacker the install
    layout), and short."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    kept = [line for line in lines if not line.startswith(("Traceback", "File ", "^", "~"))]
    # A traceback's last line is the exception; otherwise the first few lines
    # (a validation error names the field on the next ones).
    text = kept[-1] if kept and lines[0].startswith("Traceback") else "; ".join(kept[:3])
    return _PATH.sub("<path>", text)[:300] or "no detail"


def _trim_logprobs(event: dict[str, Any], wanted: int | None) -> None:
    """Keep the alternatives the client asked for. llama-server returns 20
    when top_logprobs is absent and none at all for 0, so the worker is asked
    for at least one and the list is cut here (OpenAI's default is 0)."""
    if wanted is None:
        return
    for choice in event.get("choices") or ():
        logprobs = choice.get("logprobs")
        for token in (logprobs.get("content") or ()) if isinstance(logprobs, dict) else ():
            if isinstance(token, dict) and isinstance(token.get("top_logprobs"), list):
                del token["top_logprobs"][wanted:]


def _reasoning_as_reasoning_content(event: dict[str, Any]) -> None:
    """An upstream that streams the reasoning as `reasoning` (a peer with
    [server] reasoning_field = "reasoning", or vLLM) under llama-server's
    name, `reasoning_content`, which every sink reads."""
    for choice in event.get("choices") or ():
        delta = choice.get("delta")
        if isinstance(delta, dict) and isinstance(delta.get("reasoning"), str):
            text = delta.pop("reasoning")
            delta.setdefault("reasoning_content", text)


def _as_forced_tool_call(event: dict[str, Any], job: Job) -> None:
    """The constrained answer to a named tool_choice, as OpenAI streams a
    call: the arguments in fragments, the id and name with each (the first
    one of each choice keeps them: _drop_repeated_tool_names), and
    finish_reason "tool_calls". The id comes from the request id (and the
    choice's index after the first), so a replay names the call the same."""
    for choice in event.get("choices") or ():
        delta = choice.get("delta")
        if delta is None:
            continue
        text = delta.pop("content", None)
        if text:
            index = choice.get("index", 0)
            delta["tool_calls"] = [{"index": 0, "id": f"call_{job.id}" + (f"_{index}" if index else ""),
                                    "type": "function", "function": {"name": job.forced_tool, "arguments": text}}]
        if choice.get("finish_reason") == "stop":
            choice["finish_reason"] = "tool_calls"


def _as_chosen_tool_call(event: dict[str, Any], job: Job, pending: dict[int, str]) -> None:
    """The constrained answer to tool_choice "required" over several tools,
    {"name": N, "arguments": {...}}, as one call of N: held back until the
    choice ends (its name is only known once read), then sent as one delta
    with finish_reason "tool_calls". An answer cut by the limit goes out as
    the text it is, with finish_reason "length"."""
    for choice in event.get("choices") or ():
        delta = choice.get("delta")
        if delta is None:
            continue
        index = choice.get("index", 0)
        text = delta.pop("content", None)
        if text:
            pending[index] = pending.get(index, "") + text
        if choice.get("finish_reason") is None:
            continue
        answer = pending.pop(index, "")
        try:
            call = json.loads(answer)
            name, arguments = call["name"], call["arguments"]
        except (ValueError, TypeError, KeyError):
            if answer:
                delta["content"] = answer
            continue
        delta["tool_calls"] = [{"index": 0, "id": f"call_{job.id}" + (f"_{index}" if index else ""), "type": "function",
                                "function": {"name": name, "arguments": json.dumps(arguments)}}]
        choice["finish_reason"] = "tool_calls"


def _opening_event(first: dict[str, Any], choices: int) -> dict[str, Any]:
    """The chunk that opens every choice of a chat, in index order, as
    OpenAI's stream does: llama-server says the role of choice 0 only, and
    clients (the openai package's stream helper) build their list of
    choices from the order each index first appears."""
    return {**first, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None} for index in range(choices)]}


def _drop_roles(event: dict[str, Any]) -> None:
    for choice in event.get("choices") or ():
        delta = choice.get("delta")
        if isinstance(delta, dict):
            delta.pop("role", None)


def _drop_repeated_tool_names(event: dict[str, Any], named: set[tuple[int, int]]) -> None:
    """OpenAI streams a tool call's name once, in its first delta, and clients
    append the fragments; llama-cpp-python repeats the name in every delta,
    which would read as 'fnfnfn'. Keep only the first."""
    for choice in event.get("choices") or ():
        for call in (choice.get("delta") or {}).get("tool_calls") or ():
            function = call.get("function")
            if not isinstance(function, dict) or not function.get("name"):
                continue
            key = (choice.get("index", 0), call.get("index", 0))
            if key in named:
                function.pop("name")
                call.pop("id", None)
                call.pop("type", None)
            else:
                named.add(key)


def _carries_token(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or ():
        delta = choice.get("delta")
        # A thinking model's reasoning is output too: without it, a model that
        # thinks for a while would look hung before its first answer token.
        if delta is not None and (delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
                                  or delta.get("function_call")):
            return True
        if choice.get("text"):
            return True
    return False


def response_id(job: Job) -> str:
    prefix = "chatcmpl" if job.kind.value == "chat" else "cmpl"
    return f"{prefix}-{job.id}"


def canceled_error(job: Job, where: str) -> JobFailed:
    return JobFailed(499, "request_canceled", f"request {job.id} was canceled {where}: {job.cancel_reason}")


# ----- waiting on an upstream ---------------------------------------------------------------

_CANCELED = object()
_TIMED_OUT = object()


class UpstreamWatch:
    """The deadline, the liveness question and the job's cancel over every
    wait of one attempt, kept by one timer that interrupts the waiting task.

    Each wait (the response, then each chunk of the stream) is a plain await
    in the attempt's own task. A task and an asyncio.wait per chunk cost a
    quarter of the relay's CPU and several loop turns of every request
    on 2 cores; here a chunk costs a float written. The timer fires every
    LIVENESS_INTERVAL_S of silence, or sooner at the deadline, and reads
    the injected clock each time, as the old wait loop did."""

    def __init__(self, canceled: asyncio.Future, liveness: Callable[[], str | None],
                 clock: Callable[[], float]) -> None:
        self._canceled = canceled
        self._liveness = liveness
        self._clock = clock
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task | None = None
        self._deadline = 0.0
        self._silent_since = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        # Why the waiting task was interrupted: _CANCELED, _TIMED_OUT or a liveness problem.
        self._why: object | None = None
        canceled.add_done_callback(self._on_cancel)

    async def wait(self, awaitable: Awaitable[Any], timeout: float) -> Any:
        """The result of `awaitable` (None for an iterator's end), or
        _CANCELED if the job was canceled meanwhile. Raises TimeoutError when
        the upstream gives nothing for `timeout` seconds of the clock, and
        WorkerFailure as soon as liveness names a problem."""
        if self._canceled.done():
            _discard(awaitable)
            return _CANCELED
        now = self._clock()
        if timeout <= 0:
            _discard(awaitable)
            return self._verdict(self._liveness() or _TIMED_OUT)
        self._deadline = now + timeout
        self._silent_since = self._loop.time()
        self._arm(min(LIVENESS_INTERVAL_S, timeout))
        task = self._task = asyncio.current_task()
        assert task is not None
        why = None
        try:
            result = await awaitable
        except StopAsyncIteration:
            result = None
        except BaseException:
            why = self._settle(task)
            if why is None:
                raise
        finally:
            self._task = None
        if why is not None:
            return self._verdict(why)
        self._settle(task)  # an interruption that raced the answer: the answer counts
        return result

    def _settle(self, task: asyncio.Task) -> object | None:
        """This watch's interruption of the last wait, if it made one, its
        cancel taken back; None when a cancel from outside (a shutdown)
        came too, which must go on up."""
        why, self._why = self._why, None
        if why is not None and task.uncancel() > 0:
            return None
        return why

    def close(self) -> None:
        self._canceled.remove_done_callback(self._on_cancel)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _verdict(self, why: object) -> Any:
        if why is _CANCELED:
            return _CANCELED
        if why is _TIMED_OUT:
            raise asyncio.TimeoutError
        raise WorkerFailure(str(why))

    def _arm(self, delay_s: float) -> None:
        """The timer at `delay_s` from now, unless it already fires sooner."""
        at = self._loop.time() + delay_s
        if self._timer is not None:
            if self._timer_at <= at:
                return
            self._timer.cancel()
        self._timer = self._loop.call_at(at, self._tick)
        self._timer_at = at

    def _tick(self) -> None:
        self._timer = None
        if self._task is None:
            return  # between waits: the next wait arms it again
        now = self._clock()
        if now >= self._deadline:
            self._interrupt(_TIMED_OUT)
            return
        # Asked after each LIVENESS_INTERVAL_S of silence (the loop's time,
        # as the old wait loop's slices were), however the clock moves; a
        # timer may fire a hair early.
        if self._loop.time() - self._silent_since >= LIVENESS_INTERVAL_S * 0.999:
            problem = self._liveness()
            if problem is not None:
                self._interrupt(problem)
                return
            self._silent_since = self._loop.time()
        self._arm(min(LIVENESS_INTERVAL_S, self._deadline - now))

    def _on_cancel(self, _: asyncio.Future) -> None:
        if self._task is not None and not self._canceled.cancelled():
            self._interrupt(_CANCELED)

    def _interrupt(self, why: object) -> None:
        if self._task is not None and self._why is None:
            self._why = why
            self._task.cancel()


def _discard(awaitable: Awaitable[Any]) -> None:
    """An awaitable that won't be awaited, closed so it leaves no warning."""
    close = getattr(awaitable, "close", None)
    if close is not None:
        close()
