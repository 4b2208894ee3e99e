"""Embeddings: a worker of their own, with its own lane, loaded on demand.

llama-server started with --embeddings serves embeddings and nothing else,
so the chat workers can't answer them; a third worker on the same model
file does. It has its own lane (slots and a bounded queue), so an embedding
never waits behind a long generation, and it loads on the first request and
unloads when idle (residency.on_demand.OnDemandWorker), so it costs no RAM
until used.

`EmbeddingPath.embed` is protocol-neutral: texts in, vectors out. The
OpenAI route (api.embeddings) and the Ollama ones check their own bodies
and shape their own answers around it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx

from ..dispatch.jobs import JobFailed
from ..dispatch.lanes import Lane
from ..engine.runtime import LaunchRequest, LlamaServerRuntime, WorkerRuntime
from ..engine.handle import WorkerHandle
from ..engine.worker import WorkerState
from ..residency.on_demand import OnDemandWorker

# Tokens a slot holds beyond [embeddings] n_ctx: requests are checked with
# our own count, and the server may add a special token or two (BOS, EOS,
# SEP) that the count leaves out. An input that passed the check must fit.
SPECIAL_TOKEN_MARGIN = 8
# A batch of inputs is one HTTP call to the worker, silent until done: a
# big batch on a slow CPU takes minutes. Past this the worker counts as hung.
WORKER_REPLY_TIMEOUT_S = 900.0
# What a client is told to wait when the lane or the RAM is full.
BUSY_RETRY_AFTER_S = 5.0
NO_RAM_RETRY_AFTER_S = 30.0


@dataclass(frozen=True)
class EmbeddingResult:
    vectors: list[list[float]]  # one per input, in input order
    prompt_tokens: int          # as the worker counted them
    model: str


class EmbeddingRuntime:
    """A llama-server runtime that starts its worker for embeddings: the
    flags go on top of the chat workers' argv, so both are launched the
    same way (wrapper, secret, threads, libraries) from one place."""

    def __init__(self, base: LlamaServerRuntime, pooling: str, ubatch: int) -> None:
        self._base = base
        self._pooling = pooling
        self._ubatch = ubatch
        self.name = base.name
        self.max_parallel = base.max_parallel
        self.supports_logprobs = False

    def describe(self) -> str:
        return self._base.describe()

    def argv(self, launch: LaunchRequest) -> list[str]:
        # --embeddings restricts the server to embeddings. With mean, cls or
        # last pooling llama.cpp embeds an input in one micro-batch, so that
        # must hold the longest input; its default normalisation (L2) is
        # what OpenAI's embeddings are.
        return self._base.argv(launch) + ["--embeddings", "--pooling", self._pooling,
                                          "--ubatch-size", str(self._ubatch)]

    def environment(self, launch: LaunchRequest) -> dict[str, str]:
        return self._base.environment(launch)

    async def probe(self, client: httpx.AsyncClient, base_url: str) -> bool:
        return await self._base.probe(client, base_url)


def embedding_runtime(runtime: WorkerRuntime, pooling: str, ubatch: int) -> WorkerRuntime | str:
    """The runtime for the embedding worker, or why this engine can't have one."""
    if isinstance(runtime, LlamaServerRuntime):
        return EmbeddingRuntime(runtime, pooling, ubatch)
    # llama-cpp-python's server has --embedding but no pooling choice and
    # does not normalise: it would answer token vectors, or unit-less ones.
    return (f"embeddings need the llama-server engine; the {runtime.name} engine's server can't pool and "
            "normalise them ([engine] runtime = \"llama-server\")")


class EmbeddingPath:
    """The embedding worker, its lane and the keeper that loads and unloads it."""

    def __init__(self, worker: WorkerHandle, lane: Lane, http: httpx.AsyncClient, *, model: str, pooling: str,
                 n_ctx: int, dimensions: int, idle_unload_s: float, ready_timeout_s: float,
                 ram_floor_mib: float, load_ram_mib: float, available_ram_mib: Callable[[], float],
                 note: Callable[..., None], changed: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.worker = worker
        self.lane = lane
        self.model = model
        self.pooling = pooling
        self.n_ctx = n_ctx
        self.dimensions = dimensions
        self._http = http
        self._ready_timeout_s = ready_timeout_s
        self._ram_floor_mib = ram_floor_mib
        self.load_ram_mib = load_ram_mib
        self._available_ram_mib = available_ram_mib
        self._note = note
        self._changed = changed
        self._clock = clock
        # Lane keys: a client may reuse an X-Request-Id, the lane needs each once.
        self._seq = itertools.count(1)
        self.loads_on_demand = True  # set by the keeper too; always true here
        self.keeper = OnDemandWorker(self, idle_unload_s, note, clock)
        self.idle_unload_s = idle_unload_s
        self.requests_served = 0
        self.inputs_served = 0
        self.failures = 0
        self.last_used: float | None = None

    # ----- the one operation -----------------------------------------------------------

    async def embed(self, texts: list[str], *, request_id: str, deadline_s: float | None = None) -> EmbeddingResult:
        """Embed texts (already checked: non-empty, each within n_ctx tokens).
        Raises JobFailed when the lane is full, the RAM is short, the worker
        can't load or fails, or the deadline passes. Cancelling the task
        gives its place or slot back at once."""
        self.admit()
        key = f"{request_id}#{next(self._seq)}"
        place = self.lane.join(key)
        self._changed()
        try:
            async with _deadline(deadline_s, request_id):
                if place is not None:
                    await self.lane.wait(key, place)
                await self._ensure_ready()
                result = await self._ask_worker(texts)
        finally:
            self.lane.leave(key)
            self._changed()
        self.requests_served += 1
        self.inputs_served += len(texts)
        self.last_used = time.time()
        return result

    def admit(self) -> None:
        """Refuse at once what can't be served soon: a full queue, or a load
        that would leave the host under the RAM floor. Cheap: the routes ask
        before they tokenize, so a refused request costs no CPU; `embed`
        asks again, as the lane may have filled meanwhile."""
        state = self.lane.state(self.n_ctx)
        if not state.has_free_slot and not state.has_queue_room:
            raise JobFailed(503, "embeddings_busy", f"the embedding queue is full ({state.queued}/"
                            f"{state.queue_limit} waiting, {state.running} running; [embeddings] queue_limit)",
                            retry_after_s=BUSY_RETRY_AFTER_S)
        if self.worker.state in (WorkerState.STOPPED, WorkerState.STOPPING):
            left = self._available_ram_mib() - self.load_ram_mib
            if left < self._ram_floor_mib:
                raise JobFailed(503, "ram_floor", f"loading the embedding worker would leave {left:.0f} MiB of RAM, "
                                f"under the {self._ram_floor_mib:.0f} MiB floor that keeps the host from "
                                "swapping ([cpu] ram_floor_mib)", retry_after_s=NO_RAM_RETRY_AFTER_S)

    async def _ensure_ready(self) -> None:
        worker = self.worker
        # An idle unload under way is waited out by ensure_ready, which then loads again.
        if not await worker.ensure_ready(self._ready_timeout_s):
            raise JobFailed(503, "no_worker", "the embedding worker is not available: "
                            f"{worker.gave_up or worker.unhealthy_reason or 'it did not become ready'}",
                            retry_after_s=NO_RAM_RETRY_AFTER_S)

    async def _ask_worker(self, texts: list[str]) -> EmbeddingResult:
        worker = self.worker
        process = worker.exits
        url = f"{worker.base_url}/v1/embeddings"
        try:
            # Base64 from the worker, whatever the client asked: its JSON is
            # then a few strings, parsed in milliseconds, where floats would
            # be tens of megabytes parsed in one call that holds the GIL
            # (and the event loop with it) to its end.
            response = await self._http.post(url, json={"input": texts, "encoding_format": "base64"},
                                             headers=worker.auth_headers,
                                             timeout=httpx.Timeout(WORKER_REPLY_TIMEOUT_S, connect=5.0))
        except httpx.HTTPError as exc:
            self.failures += 1
            # Broken connection or silence: have its owner replace the process.
            worker.report_failure(f"an embedding request failed: {type(exc).__name__}: {exc}", process=process)
            raise JobFailed(503, "embedding_worker_failed", f"the embedding worker failed: {type(exc).__name__}; "
                            "it is being restarted", retry_after_s=BUSY_RETRY_AFTER_S) from None
        if response.status_code != 200:
            message = _worker_message(response)
            if 400 <= response.status_code < 500:
                raise JobFailed(400, "invalid_input", f"the model server rejected the input: {message}",
                                param="input")
            self.failures += 1
            raise JobFailed(502, "worker_error", f"the embedding worker failed on this request: {message}")
        # Decoded on a thread a vector at a time, so the event loop (every
        # other request, /health) runs between the pieces of a big batch.
        vectors, tokens = await asyncio.to_thread(parse_worker_answer, response.content, len(texts))
        return EmbeddingResult(vectors, tokens, self.model)

    # ----- lifecycle ----------------------------------------------------------------------

    def on_sample(self) -> None:
        self.keeper.on_sample()

    def restart(self, why: str) -> None:
        """Restart a loaded worker; one at rest stays at rest."""
        if self.worker.state is not WorkerState.STOPPED:
            self.worker.restart(why)

    async def close(self) -> None:
        await self.keeper.close()
        await self.worker.close()

    # ----- reads -----------------------------------------------------------------------------

    def status(self, rss_mib: float | None = None) -> dict[str, Any]:
        worker = self.worker
        return {
            "enabled": True,
            "state": worker.state.value,
            "pid": worker.pid,
            "model": self.model,
            "pooling": self.pooling,
            "n_ctx": self.n_ctx,
            "dimensions": self.dimensions,
            "requests_served": self.requests_served,
            "inputs_served": self.inputs_served,
            "failures": self.failures,
            "last_used": self.last_used,
            "idle_unload_s": self.idle_unload_s,
            "queue": self.lane.snapshot(),
            "rss_mib": rss_mib,
            "estimated_ram_mib": round(self.load_ram_mib, 1),
            "last_load_s": worker.last_ready_duration_s,
            "restarts": worker.restarts,
            "unhealthy_reason": worker.unhealthy_reason,
            "gave_up": worker.gave_up,
            "log": str(worker.log_path),
        }


@contextlib.asynccontextmanager
async def _deadline(deadline_s: float | None, request_id: str):
    if deadline_s is None:
        yield
        return
    try:
        async with asyncio.timeout(deadline_s):
            yield
    except TimeoutError:
        raise JobFailed(503, "request_timeout", f"request {request_id} was not answered within its "
                        f"{deadline_s:g} s deadline", retry_after_s=BUSY_RETRY_AFTER_S) from None


def parse_worker_answer(raw: bytes, inputs: int) -> tuple[list[list[float]], int]:
    """The vectors (in input order) and prompt tokens of the worker's answer.
    Raises JobFailed when its shape is not OpenAI's."""
    try:
        body = json.loads(raw)
        rows = sorted(body["data"], key=lambda row: row["index"])
        vectors = [_vector(row["embedding"]) for row in rows]
        tokens = int((body.get("usage") or {}).get("prompt_tokens", 0))
    except (ValueError, KeyError, TypeError, AttributeError, struct.error) as exc:
        raise JobFailed(502, "worker_error", f"the embedding worker answered in an unknown shape: {exc!r}") from None
    if len(vectors) != inputs or any(len(v) != len(vectors[0]) for v in vectors):
        raise JobFailed(502, "worker_error", f"the embedding worker answered {len(vectors)} vectors for "
                        f"{inputs} inputs, or vectors of different sizes")
    return vectors, tokens


def _vector(value: Any) -> list[float]:
    """One vector as the worker sent it: base64 of little-endian float32
    (what we ask for), or a list of numbers (a server that ignored that)."""
    if isinstance(value, str):
        packed = base64.b64decode(value, validate=True)
        if len(packed) % 4:
            raise ValueError(f"a base64 vector of {len(packed)} bytes, not a whole number of float32s")
        return list(struct.unpack(f"<{len(packed) // 4}f", packed))
    return [float(x) for x in value]


def _worker_message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"][:500]
    except ValueError:
        pass
    return f"HTTP {response.status_code}: {response.text[:300]}"
