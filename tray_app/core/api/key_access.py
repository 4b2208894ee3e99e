"""What a request's key may do once past the door, and what it used.

The access guard (security.py) says who a request is (an ApiKey, or None
when the server needs no key) and keeps inference keys off /admin/*. Here,
in the routes: a key's allowed models, its concurrent requests, whose
requests it may cancel, and the usage each request is counted under.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import Counter, OrderedDict
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from starlette.requests import Request

from ..dispatch.admission import Reason
from ..dispatch.jobs import Job, JobFailed
from ..embeddings.path import EmbeddingResult
from ..access.keys import LEGACY_KEY_NAME, TRAY_KEY_NAME, ApiKey, KeyStore
from ..access.usage import Outcome, UsageStore
from .ollama import DEFAULT_TAG
from ..dispatch.upstream import path_names_only
from .requests import ModelNames, client_name
from .security import principal_of

if TYPE_CHECKING:
    from ..model_host import ModelHost
    from ..service import Service

log = logging.getLogger(__name__)

# A key at its concurrency limit is told to come back when the first of its
# requests is expected to end (admission's estimate, from its start); with
# no estimate, or one already overdue, in this long: a second is what
# OpenAI's clients back off by at first anyway.
CONCURRENCY_RETRY_AFTER_S = 1
UNKNOWN_CLIENT = "unknown"
# Request ids remembered with their key after the request ended, so an
# inference key still finds its own among /status's recent decisions and
# events (20 of each): a few hundred is plenty, and bounded.
RECENT_OWNERS = 512
# How often a named key's running requests look for its revocation: one
# stat of the keys file, only while such a request runs.
REVOCATION_CHECK_S = 1.0
# Keys that no file revokes: [server] api_key and the tray's own.
_UNREVOCABLE = frozenset({LEGACY_KEY_NAME, TRAY_KEY_NAME})


class Refusal(Exception):
    """A key's limit said no: the status, the sentence and the code, in
    whichever protocol's envelope the route speaks."""

    def __init__(self, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}

    def as_failure(self) -> JobFailed:
        """The refusal as a JobFailed, for routes that answer failures in their protocol's way."""
        retry_after = self.headers.get("Retry-After")
        return JobFailed(self.status, self.code, self.message,
                         retry_after_s=float(retry_after) if retry_after is not None else None)


def usage_name(principal: ApiKey | None, client: str | None) -> str:
    """Whom a request's usage is counted under: its key, or with no keys its
    app's name (X-Client-Name, else the User-Agent's product)."""
    if principal is not None:
        return principal.name
    return client or UNKNOWN_CLIENT


def model_host_named(service: "Service", model: Any) -> "ModelHost":
    """The model host of a model name that validation has accepted, with
    Ollama's tag or without: the one a key's models are checked against.
    The default model's CPU fallback file, named on its own, is the default
    model's, and so is a name no model has ([model] unknown_name)."""
    model_host = service.model_host_for(model)
    if model_host is None and isinstance(model, str) and model.endswith(DEFAULT_TAG):
        model_host = service.model_host_for(model[: -len(DEFAULT_TAG)])
    return model_host or service.default_model_host


def model_allowed(principal: ApiKey | None, model_host: "ModelHost") -> bool:
    if principal is None or not principal.models:
        return True
    names = {model_host.model_id, model_host.name, *model_host.model.names()}
    return any(name in names for name in principal.models)


def model_refusal(principal: ApiKey | None, model_host: "ModelHost") -> Refusal | None:
    if model_allowed(principal, model_host):
        return None
    assert principal is not None
    # 404 as OpenAI ("does not exist or you do not have access to it"),
    # Anthropic and Ollama answer a model a key can't use: the client's
    # handling of an unusable model name applies.
    return Refusal(404, f"the model {model_host.model_id!r} does not exist, or the key {principal.name!r} may not "
                   f"use it; it may use: {', '.join(principal.models)}", "model_not_found")


def retry_after_s(expected_ends: Iterable[float | None], now: float) -> int:
    """Whole seconds until the soonest of a key's running requests is
    expected to end (each given as a monotonic time, None = unknown); one
    second when none is known or all are overdue."""
    ahead = [end - now for end in expected_ends if end is not None and end > now]
    return max(CONCURRENCY_RETRY_AFTER_S, math.ceil(min(ahead))) if ahead else CONCURRENCY_RETRY_AFTER_S


def expected_end(job: Job) -> float | None:
    """When admission expects `job` to end (job.created_at's clock), if it estimated."""
    return job.created_at + job.estimated_latency_s if job.estimated_latency_s is not None else None


def visible_status(status: dict[str, Any], viewer: str, owns: Callable[[str], bool]) -> dict[str, Any]:
    """/status as an inference key `viewer` sees it: its own requests (ids,
    app names, prompts' sizes) and its own usage; another key's requests
    show only in the counts (queues, models' in_flight), and the events
    keep their kind but not another key's request id. An admin sees all."""
    seen = dict(status)
    seen["requests"] = [entry for entry in status["requests"] if owns(entry["id"])]
    seen["recent_decisions"] = [entry for entry in status["recent_decisions"] if owns(entry["id"])]
    seen["events"] = [event if "id" not in event or owns(event["id"])
                      else {key: value for key, value in event.items() if key != "id"} for event in status["events"]]
    usage = status.get("usage")
    if usage is not None:
        def own(by_name: dict[str, Any]) -> dict[str, Any]:
            return {name: counts for name, counts in by_name.items() if name == viewer}
        seen["usage"] = {**usage, "by_name": own(usage["by_name"]),
                         "days": [{**day, "by_name": own(day["by_name"])} for day in usage["days"]]}
    return seen


# Numbers that say how the machine runs its processes, not how it serves.
_PROCESS_FIELDS = frozenset({"pid", "gpu_pid", "port"})


def layout_hidden(status: dict[str, Any], visible_model: Callable[[str], bool]) -> dict[str, Any]:
    """/status without how the machine is laid out, for an inference key:
    no folders in any path (a model's or a log's file name stays), no
    process ids or loopback ports, no peers' addresses, and only the library
    models the key may use. What it needs to use the service stays: states,
    memory, queues, contexts, reasons."""
    def scrub(value: Any, key: str = "") -> Any:
        if key in _PROCESS_FIELDS:
            return None
        if isinstance(value, str):
            return path_names_only(value)
        if isinstance(value, dict):
            return {k: scrub(v, k) for k, v in value.items() if k != "simulated_device_dir"}
        if isinstance(value, list):
            return [scrub(item) for item in value]
        return value

    seen = scrub(status)
    seen["service"]["pid"] = 0  # always a number in the contract
    seen["ram"]["rss_mib_by_pid"] = {}
    seen["peers"] = []
    seen["models"] = [model for model in seen["models"] if visible_model(model["name"])]
    return seen


def visible_metrics(text: str, viewer: str) -> str:
    """/metrics as an inference key sees it: the usage series of its own
    key only (key names are [A-Za-z0-9._-], so the label needs no escaping)."""
    own = f'key="{viewer}"'
    return "".join(line for line in text.splitlines(keepends=True)
                   if not line.startswith("tray_app_usage_") or own in line)


def outcome_of(job: Job, failure: JobFailed | None) -> Outcome:
    ran = job.path is not None and bool(job.attempts)
    return Outcome(
        path=job.path if ran else None,
        tokens_in=job.prompt_tokens if ran else 0,
        tokens_out=job.tokens_out if ran else 0,
        # The client's own choice of the CPU (X-Force-Path) is not the
        # service falling short; a paused GPU is. Nor is the CPU of a
        # machine with no GPU path.
        degraded=ran and job.path != "gpu" and not job.force_cpu and job.reason is not Reason.CPU_ONLY,
        refused=failure is not None and not ran and not job.canceled.is_set(),
        cancelled=job.canceled.is_set(),
    )


class KeyAccess:
    def __init__(self, service: "Service", usage: UsageStore, keys: KeyStore | None = None) -> None:
        self.service = service
        self.usage = usage
        # request id -> (its job, the identity of the key that owns it); an
        # entry lives while its job is registered with a dispatcher, no longer.
        self._owners: dict[str, tuple[Job, str]] = {}
        # Key identity -> its slots held by work that is no dispatcher's job.
        self._leases: Counter[str] = Counter()
        # Request id -> key identity, the last RECENT_OWNERS requests admitted.
        self._recent_owners: OrderedDict[str, str] = OrderedDict()
        self._saving: asyncio.Future | None = None
        # The named keys, read to end a revoked key's running requests.
        self._keys = keys
        self._revocation_watch: asyncio.Task | None = None

    # ----- limits ---------------------------------------------------------------

    def admit(self, request: Request, job: Job, model_host: "ModelHost") -> None:
        """Raise Refusal if the request's key may not run `job` now; else
        record the key as the job's owner. Called with no await between it
        and the job's registration, so two requests can't both take the last
        of a key's slots."""
        principal = principal_of(request.scope)
        if principal is None:
            return
        self._check(principal, model_host)
        self._prune()
        self._owners[job.id] = (job, principal.identity)
        self._remember(job.id, principal.identity)
        if principal.sha256 and self._keys is not None and self._revocation_watch is None:
            self._revocation_watch = asyncio.get_running_loop().create_task(self._end_revoked())

    @contextmanager
    def holding(self, request: Request, model_host: "ModelHost | None" = None) -> Iterator[None]:
        """A slot of the key's concurrency for work that is no dispatcher's
        job (tokenizing), and the check that the key may use `model_host`'s model
        (None: no model to check). Raises Refusal."""
        holder = self._take(principal_of(request.scope), model_host)
        try:
            yield
        finally:
            self._release(holder)

    def _take(self, principal: ApiKey | None, model_host: "ModelHost | None") -> str | None:
        """Take one of the key's slots (a Refusal if it may not); its name, to release."""
        if principal is None:
            return None
        self._check(principal, model_host)
        self._leases[principal.identity] += 1
        return principal.identity

    def _release(self, holder: str | None) -> None:
        if holder is not None:
            self._leases[holder] -= 1

    def _check(self, principal: ApiKey, model_host: "ModelHost | None") -> None:
        refusal = model_refusal(principal, model_host) if model_host is not None else None
        if refusal is not None:
            raise refusal
        running = self.running(principal.identity)
        if principal.max_concurrency is not None and running >= principal.max_concurrency:
            # On Job.created_at's clock.
            ends = [expected_end(job) for job, owner in self._owners.values()
                    if owner == principal.identity and self._live(job)]
            wait_s = retry_after_s(ends, time.monotonic())
            raise Refusal(429, f"the key {principal.name!r} has {running} requests in flight, its limit "
                          f"(max concurrency {principal.max_concurrency}); retry when one finishes",
                          "key_concurrency_limit", {"Retry-After": str(wait_s)})

    def running(self, identity: str) -> int:
        jobs = sum(1 for job, owner in self._owners.values() if owner == identity and self._live(job))
        return jobs + self._leases[identity]

    @staticmethod
    def keep_alive(principal: ApiKey | None, seconds: float | None) -> float | None:
        """The keep_alive a request may set on its model's residency. An
        inference key's is the server's own idle time (None): a key shares
        the GPU with every other key, so it may load a model it can use, but
        not unload one another key is using, nor pin one past the idle time
        over the admin's Load. An admin key, or no keys, sets it as Ollama does."""
        return seconds if principal is None or principal.is_admin else None

    def names_seen_by(self, principal: ApiKey | None, names: ModelNames) -> ModelNames:
        """The model names as a key sees them: an unknown model's 404 lists
        only the models the key may use, as /v1/models does."""
        if principal is None or not principal.models:
            return names
        served = frozenset(n for n in names.served if model_allowed(principal, model_host_named(self.service, n)))
        return dataclasses.replace(names, served=served)

    def usable_model_host(self, principal: ApiKey | None, model_host: "ModelHost") -> "ModelHost":
        """`model_host`, or a Refusal when `principal` may not use its model."""
        refusal = model_refusal(principal, model_host)
        if refusal is not None:
            raise refusal
        return model_host

    def owns(self, identity: str, request_id: str) -> bool:
        """Whether `request_id` (running, or among the recently ended) was the key `identity`'s."""
        return self._recent_owners.get(request_id) == identity

    def _remember(self, request_id: str, identity: str) -> None:
        self._recent_owners[request_id] = identity
        self._recent_owners.move_to_end(request_id)
        while len(self._recent_owners) > RECENT_OWNERS:
            self._recent_owners.popitem(last=False)

    def owner_of(self, request_id: str) -> str | None:
        entry = self._owners.get(request_id)
        return entry[1] if entry is not None and self._live(entry[0]) else None

    def cancel_refusal(self, request: Request, request_id: str) -> str | None:
        """Why this request's key may not cancel `request_id`, or None. An
        admin key cancels any request; an inference key its own only."""
        principal = principal_of(request.scope)
        if principal is None or principal.is_admin or not self.service.request_in_flight(request_id):
            return None
        if self.owner_of(request_id) == principal.identity:
            return None
        return (f"the request {request_id!r} is not one of the key {principal.name!r}'s; an inference key "
                "cancels only its own requests (an admin key cancels any)")

    async def _end_revoked(self) -> None:
        """While a named key's requests run, look at the keys file each
        REVOCATION_CHECK_S: a key revoked (by the CLI, the tray or the web
        page) ends its running requests, as it refuses its next ones."""
        assert self._keys is not None
        try:
            while True:
                await asyncio.sleep(REVOCATION_CHECK_S)
                self._prune()
                named = {owner for _, owner in self._owners.values() if owner not in _UNREVOCABLE}
                if not named:
                    return
                for owner in named:
                    if self._keys.with_identity(owner) is None:
                        for request_id in [rid for rid, (_, who) in self._owners.items() if who == owner]:
                            self.service.cancel(request_id, "its API key was revoked")
        finally:
            self._revocation_watch = None

    def _live(self, job: Job) -> bool:
        return any(model_host.dispatcher.jobs.get(job.id) is job for model_host in self.service.model_hosts.values())

    def _prune(self) -> None:
        for request_id in [rid for rid, (job, _) in self._owners.items() if not self._live(job)]:
            del self._owners[request_id]

    # ----- usage ----------------------------------------------------------------

    async def run_counted(self, model_host: "ModelHost", job: Job, sink, name: str) -> None:
        """Run the job through its dispatcher, counting what it used under
        `name` however it ends."""
        failure: JobFailed | None = None
        try:
            await model_host.dispatcher.run(job, sink)
        except JobFailed as exc:
            failure = exc
            raise
        finally:
            self.count(name, outcome_of(job, failure))

    @contextmanager
    def embedding(self, request: Request, model_host: "ModelHost") -> Iterator[Callable[[EmbeddingResult], None]]:
        """An embedding request, every protocol's: the key's model and
        concurrency checked (raises JobFailed, the embedding routes' way of
        refusing), then `done(result)` counts it as usage on the CPU path,
        where the embedding worker runs, with its prompt tokens."""
        principal = principal_of(request.scope)
        name = usage_name(principal, client_name(request.headers.get("x-client-name"),
                                                 request.headers.get("user-agent")))
        try:
            holder = self._take(principal, model_host)
        except Refusal as refusal:
            self.count(name, Outcome(refused=True))
            raise refusal.as_failure() from None
        try:
            yield lambda result: self.count(name, Outcome(path="cpu", tokens_in=result.prompt_tokens))
        finally:
            self._release(holder)

    def count(self, name: str, outcome: Outcome) -> None:
        if self.usage.record(name, outcome) and (self._saving is None or self._saving.done()):
            data = self.usage.take_unsaved()
            if data is not None:
                self._saving = asyncio.get_running_loop().run_in_executor(None, self.usage.write, data)

    async def close(self) -> None:
        """Save what the debounce held back: a restart loses no usage."""
        if self._revocation_watch is not None:
            self._revocation_watch.cancel()
        if self._saving is not None:
            await asyncio.shield(self._saving)
        await asyncio.to_thread(self.usage.save)
