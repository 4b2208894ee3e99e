"""A Job's request is fixed when the job is built: its fields read through
to a frozen JobRequest and refuse writes; the one change, its size, comes
before admission and never after."""

from __future__ import annotations

import dataclasses

import pytest

from tests.unit.core.dispatch.test_dispatcher import make_job, make_rig, run_job
from tray_app.core.dispatch.jobs import Job, JobKind, JobRequest


def test_a_jobs_request_fields_read_through_and_refuse_writes():
    job = Job(JobRequest(id="req-1", kind=JobKind.CHAT, body={}, stream=True, force_cpu=True, deadline_s=3.0))
    assert (job.id, job.force_cpu, job.deadline_s, job.prefer_gpu) == ("req-1", True, 3.0, False)
    with pytest.raises(AttributeError, match="force_cpu is part of the job's request"):
        job.force_cpu = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.request.deadline_s = None  # type: ignore[misc]
    assert job.force_cpu is True and job.deadline_s == 3.0


async def test_a_job_is_sized_before_admission_and_never_after():
    job = make_job(prompt=0, max_tokens=0)
    job.sized(12, 34)
    assert (job.prompt_tokens, job.max_tokens) == (12, 34)
    await run_job(make_rig(), job)
    with pytest.raises(RuntimeError, match="sized after its admission"):
        job.sized(1, 1)
    assert (job.prompt_tokens, job.max_tokens) == (12, 34)


def test_peers_are_out_for_a_job_from_a_peer_or_one_a_peer_failed():
    assert not make_job().no_peer
    assert make_job(from_peer=True).no_peer
    failed = make_job()
    failed.peer_failed = True
    assert failed.no_peer
