"""The note inside a degraded answer (issue 31, part 5): when it is wanted
and what it says, as pure functions. The answers themselves are tested
with real workers in tests/integration/test_degraded_note.py."""

from __future__ import annotations

import pytest

from tray_app.core.api.degraded_note import note_chunk, note_text, wanted
from tray_app.core.api.openai_request import InvalidRequest
from tray_app.core.config import parse_config_text
from tray_app.core.dispatch.admission import Decision, Reason, Route
from tray_app.core.dispatch.jobs import Job, JobKind, JobRequest


def job(path: str | None, reason: Reason | None, detail: str = "", estimate: float | None = 40.2,
        kind: JobKind = JobKind.CHAT) -> Job:
    done = Job(JobRequest(id="req-1", kind=kind, body={}, stream=True))
    done.path, done.reason, done.reason_detail, done.estimated_latency_s = path, reason, detail, estimate
    return done


@pytest.mark.parametrize("header, configured, expected", [
    (None, False, False), (None, True, True), ("", True, True),
    ("on", False, True), (" ON ", False, True), ("off", True, False),
])
def test_the_header_overrides_the_setting(header, configured, expected):
    assert wanted(header, configured) is expected


def test_an_unknown_header_value_names_the_header():
    with pytest.raises(InvalidRequest) as refused:
        wanted("yes", False)
    assert refused.value.status == 400 and refused.value.param == "X-Degraded-Note"


def test_the_setting_is_off_by_default_and_read_from_the_config():
    assert parse_config_text("").server.degraded_note is False
    assert parse_config_text("[server]\ndegraded_note = true\n").server.degraded_note is True


def test_the_cpu_note_says_the_banners_reason_the_model_and_the_wait():
    note = note_text(job("cpu", Reason.GPU_YIELDED, "a game holds 7 GiB of VRAM"), "Big", "SmolLM2")
    assert note == "GPU given to another app: a game holds 7 GiB of VRAM. The CPU answers with SmolLM2, about 40 s.\n\n"


def test_a_peer_and_a_load_are_named_and_an_unknown_wait_is_said():
    assert note_text(job("peer", Reason.GPU_BUSY, estimate=None), "Big", "SmolLM2") == (
        "GPU busy. Peer unknown answers with Big, the wait is unknown.\n\n")
    loading = job("gpu", Reason.ADMITTED, "waiting for the GPU to load (X-Prefer-Path: gpu): starting", 3.0)
    loading.decision = Decision(Route.GPU_QUEUE, Reason.ADMITTED, loading.reason_detail, waits_for_load=True)
    assert note_text(loading, "Big", "SmolLM2").startswith("GPU model loading: waiting for the GPU to load")
    assert "The GPU answers with Big once it is loaded, about 3 s." in note_text(loading, "Big", "SmolLM2")


@pytest.mark.parametrize("served", [
    job("gpu", Reason.ADMITTED),
    job("cpu", Reason.GPU_BUSY, kind=JobKind.COMPLETION),  # a completion has no reasoning field
])
def test_no_note_for_the_gpu_or_a_completion(served):
    assert note_text(served, "Big", "SmolLM2") is None


def test_the_chunk_carries_the_note_only_as_reasoning_like_the_first_chunk():
    chunk = note_chunk("the note", {"id": "chatcmpl-1", "created": 7, "model": "m", "choices": []})
    assert chunk["id"] == "chatcmpl-1" and chunk["created"] == 7 and chunk["model"] == "m"
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "reasoning_content": "the note"}
