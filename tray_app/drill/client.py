"""The drill's HTTP client: sends one OpenAI request and writes down what came back.

It is deliberately an ordinary client. It uses no internals of the service,
only the documented request and response headers, so what it sees is what
any application sees.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from ..core.api.security import bearer_header
from ..core.base.http_basics import sse_lines
from ..core.status_contract import Status, validate_status
from .records import RequestRecord

# Seconds without a byte before the client gives up on a request. Generous:
# the CPU path of a loaded 2-core machine is slow, and giving up early would
# turn slowness into "lost".
READ_TIMEOUT_S = 180.0


class DrillClock:
    """Drill-relative time; `wall_t0` places the service's wall-clock events on it."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.wall_t0 = time.time()

    def now(self) -> float:
        return time.monotonic() - self.t0


class DrillClient:
    def __init__(self, base_url: str, clock: DrillClock, on_done: Callable[[RequestRecord], None] | None = None,
                 api_key: str = ""):
        self.base_url = base_url.rstrip("/")
        self.clock = clock
        self._on_done = on_done
        self.http = httpx.Client(
            base_url=self.base_url,
            headers=bearer_header(api_key),
            timeout=httpx.Timeout(connect=10.0, read=READ_TIMEOUT_S, write=30.0, pool=120.0),
            limits=httpx.Limits(max_connections=32, max_keepalive_connections=16),
        )
        self._lock = threading.Lock()

    def close(self) -> None:
        self.http.close()

    # ----- plain calls -------------------------------------------------------------

    def status(self, timeout: float = 10.0) -> Status:
        """/status, checked against the contract here at the edge, so the
        phases read its always-present keys with [...]; an error body or
        another version's shape raises StatusUnreadable naming the mismatch."""
        response = self.http.get("/status", timeout=timeout)
        data = response.json()
        problem = status_problem(data)
        if problem:
            raise StatusUnreadable(f"/status answered {response.status_code}, {problem}")
        return data

    def count_tokens(self, text: str) -> int:
        """How many tokens the default model's tokenizer makes of `text` (/tokenize)."""
        response = self.http.post("/tokenize", json={"content": text}, timeout=30.0)
        response.raise_for_status()
        return len(response.json()["tokens"])

    def admin_gpu(self, body: dict[str, Any]) -> dict[str, Any]:
        response = self.http.post("/admin/gpu", json=body, timeout=10.0)
        response.raise_for_status()
        return response.json()

    def admin_model(self, name: str, loaded: bool) -> httpx.Response:
        """Load or unload a library model (POST /admin/models/{name}); the caller reads the answer."""
        return self.http.post(f"/admin/models/{name}", json={"loaded": loaded}, timeout=60.0)

    def cancel(self, request_id: str) -> httpx.Response:
        return self.http.delete(f"/v1/requests/{request_id}", timeout=10.0)

    def wait_status(self, predicate: Callable[[Status], bool], timeout: float, interval: float = 0.05,
                    what: str = "condition") -> Status:
        """The first /status that satisfies `predicate`. A /status that can't
        be read counts as not yet (a restarting service), and the timeout says
        why the last one couldn't."""
        deadline = time.monotonic() + timeout
        unreadable = ""
        while time.monotonic() < deadline:
            try:
                last = self.status()
            except (httpx.HTTPError, ValueError, StatusUnreadable) as exc:
                unreadable = f"; the last /status: {type(exc).__name__}: {exc}"
            else:
                unreadable = ""
                if predicate(last):
                    return last
            time.sleep(interval)
        raise DrillTimeout(f"timed out after {timeout:g} s waiting for {what}{unreadable}")

    # ----- completions ----------------------------------------------------------------

    def send(self, record: RequestRecord, body: dict[str, Any],
             on_token: Callable[[int], None] | None = None) -> RequestRecord:
        """Send `body` as `record` describes and fill in the record. Never raises
        for what the service does: every outcome is data."""
        body = {**body, "stream": record.stream, "max_tokens": record.max_tokens}
        headers = {"X-Request-Id": record.id}
        if record.idempotency_key:
            headers["Idempotency-Key"] = record.idempotency_key
        if record.forced_cpu:
            headers["X-Force-Path"] = "cpu"
        path = "/v1/chat/completions" if record.kind == "chat" else "/v1/completions"
        record.started_s = self.clock.now()
        try:
            if record.stream:
                self._stream(record, path, body, headers, on_token)
            else:
                self._plain(record, path, body, headers)
        except httpx.HTTPError as exc:
            record.transport_error = f"{type(exc).__name__}: {exc}"
        except ValueError as exc:  # a body that isn't the JSON it claims to be
            record.transport_error = f"unreadable response: {exc}"
        record.ended_s = self.clock.now()
        record.latency_s = round(record.ended_s - record.started_s, 4)
        if self._on_done is not None:
            self._on_done(record)
        return record

    def _plain(self, record: RequestRecord, path: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        response = self.http.post(path, json=body, headers=headers)
        self._take_headers(record, response)
        payload = response.json()
        if response.status_code != 200:
            self._take_error(record, payload)
            return
        choices = payload.get("choices") or []
        if not choices:
            return
        choice = choices[0]
        record.finish_reason = choice.get("finish_reason")
        usage = payload.get("usage") or {}
        record.completion_tokens = usage.get("completion_tokens")
        record.prompt_tokens = usage.get("prompt_tokens")
        if record.kind == "chat":
            message = choice.get("message") or {}
            record.output_text = message.get("content") or ""
            record.tool_calls = [
                {"id": call.get("id"), "name": (call.get("function") or {}).get("name") or "",
                 "arguments": (call.get("function") or {}).get("arguments") or ""}
                for call in message.get("tool_calls") or ()
            ]
        else:
            record.output_text = choice.get("text") or ""
        record.tool_calls_signature = _signature(record.tool_calls)
        record.body_ok = True

    def _stream(self, record: RequestRecord, path: str, body: dict[str, Any], headers: dict[str, str],
                on_token: Callable[[int], None] | None) -> None:
        tokens: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        record.output_tokens = tokens
        with self.http.stream("POST", path, json=body, headers=headers) as response:
            self._take_headers(record, response)
            if response.status_code != 200:
                response.read()
                self._take_error(record, response.json())
                return
            for line in sse_lines(response.iter_bytes()):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if record.saw_done or record.saw_error_event:
                    record.notes.append(f"an SSE event arrived after the stream ended: {data[:120]}")
                    continue
                if data == "[DONE]":
                    record.saw_done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    record.saw_error_event = True
                    self._take_error(record, event)
                    continue
                for choice in event.get("choices") or ():
                    record.finish_reason = choice.get("finish_reason") or record.finish_reason
                piece = _token_of(event, record.kind, calls)
                if piece is None:
                    continue
                if record.ttft_s is None:
                    record.ttft_s = round(self.clock.now() - record.started_s, 4)
                tokens.append(piece)
                if on_token is not None:
                    on_token(len(tokens))
        record.output_text = "".join(tokens) if not calls else ""
        record.tool_calls = [calls[i] for i in sorted(calls)]
        record.tool_calls_signature = _signature(record.tool_calls)
        record.completion_tokens = len(tokens)

    @staticmethod
    def _take_headers(record: RequestRecord, response: httpx.Response) -> None:
        h = response.headers
        record.status = response.status_code
        record.response_request_id = h.get("x-request-id")
        record.served_by = h.get("x-served-by")
        record.route_reason = h.get("x-route-reason")
        record.fallback_model = h.get("x-fallback-model")
        record.estimated_latency = h.get("x-estimated-latency")
        record.retry_after = h.get("retry-after")
        record.idempotent_replay = h.get("x-idempotent-replay") == "true"
        wait = h.get("x-queue-wait")
        record.queue_wait_s = float(wait) if wait else None

    @staticmethod
    def _take_error(record: RequestRecord, payload: Any) -> None:
        error = payload.get("error") if isinstance(payload, dict) else None
        if isinstance(error, dict):
            record.error_code = error.get("code")
            record.error_message = error.get("message")


class DrillTimeout(Exception):
    """The service did not reach a state the drill waited for."""


class StatusUnreadable(Exception):
    """/status answered, but not in the shape this drill reads (an error
    body, another version's service)."""


def status_problem(data: object) -> str | None:
    """Why `data` is not a /status this drill reads, in one sentence; None when it conforms."""
    problems = validate_status(data)
    return f"not a /status this drill reads: {problems[0]}" if problems else None


def _token_of(event: dict[str, Any], kind: str, calls: dict[int, dict[str, Any]]) -> str | None:
    """The piece of answer one SSE event carries, or None. Tool-call deltas are
    accumulated the way the OpenAI streaming format defines them: every string
    field is a fragment to append."""
    for choice in event.get("choices") or ():
        if kind == "completion":
            return choice.get("text") or None
        delta = choice.get("delta") or {}
        tool_calls = delta.get("tool_calls")
        if tool_calls:
            pieces = []
            for call in tool_calls:
                slot = calls.setdefault(call.get("index", 0), {"id": None, "name": "", "arguments": ""})
                slot["id"] = slot["id"] or call.get("id")
                function = call.get("function") or {}
                slot["name"] += function.get("name") or ""
                slot["arguments"] += function.get("arguments") or ""
                pieces.append(function.get("arguments") or "")
            return "".join(pieces)
        if delta.get("content"):
            return delta["content"]
    return None


def _signature(calls: list[dict[str, Any]]) -> str | None:
    if not calls:
        return None
    return json.dumps([[c.get("id"), c.get("name"), c.get("arguments")] for c in calls], sort_keys=True)
