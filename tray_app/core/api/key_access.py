"""What a request's key may do once past the door, and what it used.

The access guard (security.py) says who a request is (an ApiKey, or None
when the server needs no key) and keeps inference keys off /admin/*. Here,
in the routes: a key's allowed models, its concurrent requests, whose
requests it may cancel, and the usage each request is counted under.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from starlette.requests import Request

from ..dispatch.jobs import Job, JobFailed
from ..keys import ApiKey
from ..usage import Outcome, UsageStore
from .security import principal_of

if TYPE_CHECKING:
    from ..host import ModelHost
    from ..service import Service

log = logging.getLogger(__name__)

# A key at its concurrency limit is told to come back in this long: its
# requests end at the model's pace, which nobody can promise; a second is
# what OpenAI's clients back off by at first anyway.
CONCURRENCY_RETRY_AFTER_S = 1
UNKNOWN_CLIENT = "unknown"


class Refusal(Exception):
    """A key's limit said no: the status, the sentence and the code, in
    whichever protocol's envelope the route speaks."""

    def __init__(self, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


def usage_name(principal: ApiKey | None, client: str | None) -> str:
    """Whom a request's usage is counted under: its key, or with no keys its
    app's name (X-Client-Name, else the User-Agent's product)."""
    if principal is not None:
        return principal.name
    return client or UNKNOWN_CLIENT


def model_allowed(principal: ApiKey | None, host: "ModelHost") -> bool:
    if principal is None or not principal.models:
        return True
    names = {host.model_id, host.name, *host.model.names()}
    return any(name in names for name in principal.models)


def outcome_of(job: Job, failure: JobFailed | None) -> Outcome:
    ran = job.path is not None and bool(job.attempts)
    return Outcome(
        path=job.path if ran else None,
        tokens_in=job.prompt_tokens if ran else 0,
        tokens_out=job.tokens_out if ran else 0,
        # The client's own choice of the CPU (X-Force-Path) is not the
        # service falling short; a paused GPU is.
        degraded=ran and job.path != "gpu" and not job.force_cpu,
        refused=failure is not None and not ran and not job.canceled.is_set(),
        cancelled=job.canceled.is_set(),
    )


class KeyAccess:
    def __init__(self, service: "Service", usage: UsageStore) -> None:
        self.service = service
        self.usage = usage
        # request id -> (its job, the key name that owns it); an entry lives
        # while its job is registered with a dispatcher, no longer.
        self._owners: dict[str, tuple[Job, str]] = {}
        self._saving: asyncio.Future | None = None

    # ----- limits ---------------------------------------------------------------

    def admit(self, request: Request, job: Job, host: "ModelHost") -> None:
        """Raise Refusal if the request's key may not run `job` now; else
        record the key as the job's owner. Called with no await between it
        and the job's registration, so two requests can't both take the last
        of a key's slots."""
        principal = principal_of(request.scope)
        if principal is None:
            return
        if not model_allowed(principal, host):
            # 404 as OpenAI ("does not exist or you do not have access to
            # it"), Anthropic and Ollama answer a model a key can't use: the
            # client's handling of an unusable model name applies.
            raise Refusal(404, f"the key {principal.name!r} may not use the model {host.model_id!r}; it may use: "
                          f"{', '.join(principal.models)}", "model_not_found")
        running = self.running(principal.name)
        if principal.max_concurrency is not None and running >= principal.max_concurrency:
            raise Refusal(429, f"the key {principal.name!r} has {running} requests in flight, its limit "
                          f"(max concurrency {principal.max_concurrency}); retry when one finishes",
                          "key_concurrency_limit", {"Retry-After": str(CONCURRENCY_RETRY_AFTER_S)})
        self._prune()
        self._owners[job.id] = (job, principal.name)

    def running(self, name: str) -> int:
        return sum(1 for job, owner in self._owners.values() if owner == name and self._live(job))

    def owner_of(self, request_id: str) -> str | None:
        entry = self._owners.get(request_id)
        return entry[1] if entry is not None and self._live(entry[0]) else None

    def cancel_refusal(self, request: Request, request_id: str) -> str | None:
        """Why this request's key may not cancel `request_id`, or None. An
        admin key cancels any request; an inference key its own only."""
        principal = principal_of(request.scope)
        if principal is None or principal.is_admin or not self.service.request_in_flight(request_id):
            return None
        if self.owner_of(request_id) == principal.name:
            return None
        return (f"the request {request_id!r} is not one of the key {principal.name!r}'s; an inference key "
                "cancels only its own requests (an admin key cancels any)")

    def _live(self, job: Job) -> bool:
        return any(host.dispatcher.jobs.get(job.id) is job for host in self.service.hosts.values())

    def _prune(self) -> None:
        for request_id in [rid for rid, (job, _) in self._owners.items() if not self._live(job)]:
            del self._owners[request_id]

    # ----- usage ----------------------------------------------------------------

    async def run_counted(self, host: "ModelHost", job: Job, sink, name: str) -> None:
        """Run the job through its dispatcher, counting what it used under
        `name` however it ends."""
        failure: JobFailed | None = None
        try:
            await host.dispatcher.run(job, sink)
        except JobFailed as exc:
            failure = exc
            raise
        finally:
            self.count(name, outcome_of(job, failure))

    def count(self, name: str, outcome: Outcome) -> None:
        if self.usage.record(name, outcome) and (self._saving is None or self._saving.done()):
            data = self.usage.take_unsaved()
            if data is not None:
                self._saving = asyncio.get_running_loop().run_in_executor(None, self.usage.write, data)

    async def close(self) -> None:
        """Save what the debounce held back: a restart loses no usage."""
        if self._saving is not None:
            await asyncio.shield(self._saving)
        await asyncio.to_thread(self.usage.save)
