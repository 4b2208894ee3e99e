"""The work ahead on a path (running and queued), as the latency estimate
reads it: what admission's wait estimates and /status's CPU wait are made of."""

from __future__ import annotations

from typing import Mapping

from .backend import Backend
from .jobs import Job, JobState
from .latency import PathLoad, Work, estimate

# The answer length a queued request is expected to run to, when its limit is
# larger: the wait estimate for those behind it.
EXPECTED_ANSWER_TOKENS = 256


def backlog_s(backend: Backend, jobs: Mapping[str, Job]) -> float:
    """Seconds until a slot of this path frees up for a new arrival: the
    work ahead (running and queued) played forward on its slots at the
    speed each number of busy slots gets. 0 while a slot is free."""
    lane = backend.lane
    if lane.busy_slots < lane.concurrency and not lane.waiting_ids:
        return 0.0
    return estimate(path_load(backend, jobs), Work(0, 0)).wait_s


def remaining_work(job: Job) -> list[Work]:
    """What a request still has to do, for the latency estimate: counted at
    its expected length, not its limit (a chat without max_tokens may fill
    its context, but few do); one that has already run long is expected to
    run as long again. A request with n choices is n answers, one per slot."""
    # The job's tokens are all its choices' together.
    done = (job.tokens_out if job.state is JobState.RUNNING else 0) // job.choices
    expected = min(job.max_tokens, max(EXPECTED_ANSWER_TOKENS, 2 * done))
    return [Work(job.prompt_tokens if done == 0 else 0, max(0, expected - done))] * job.choices


def path_load(backend: Backend, jobs: Mapping[str, Job], not_before_s: float = 0.0) -> PathLoad:
    """A path's slots and the work on them and in its queue (remaining_work),
    for the latency estimate."""
    def remaining(job_id: str) -> list[Work]:
        job = jobs.get(job_id)
        return remaining_work(job) if job is not None else []

    lane = backend.lane
    running = tuple(work for job_id in lane.running_ids for work in remaining(job_id))
    queued = tuple(work for job_id in lane.waiting_ids for work in remaining(job_id))
    speeds = backend.busy_speeds.curve(backend.speed.tokens_per_s, backend.speed.prompt_tokens_per_s)
    return PathLoad(lane.concurrency, running, queued, speeds, not_before_s)
