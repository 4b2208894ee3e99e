"""The drill's check that a resumed stream repeated and lost nothing at the
seam, on answers whose text is made to read back right or wrong (a fake
tokenizer counting words stands in for /tokenize)."""

from __future__ import annotations

import types

import pytest

from tray_app.drill.phases.faults import RESET_TOKENS, _check_seam
from tray_app.drill.records import PhaseResult


def checked(pieces: list[str], finish_reason: str = "length"):
    client = types.SimpleNamespace(count_tokens=lambda text: len(text.split()))
    drill = types.SimpleNamespace(client=client)
    victim = types.SimpleNamespace(saw_done=True, output_tokens=pieces, output_text="".join(pieces),
                                   finish_reason=finish_reason)
    phase = PhaseResult(8, "reset", "reset")
    _check_seam(drill, phase, 1, victim)
    return phase.checks


def words(count: int, start: int = 0) -> list[str]:
    return [f" w{i}" for i in range(start, start + count)]


def test_a_whole_answer_passes():
    [check] = checked(words(RESET_TOKENS))
    assert check.passed and f"{RESET_TOKENS} tokens" in check.detail


def test_text_sent_twice_at_the_seam_fails():
    sent = words(3)
    # The CPU's first event carries the text already sent, then goes on.
    [check] = checked([*sent, "".join(sent) + " w3", *words(RESET_TOKENS - 4, start=4)])
    assert not check.passed


def test_text_lost_at_the_seam_fails():
    # What the GPU had generated but not sent is skipped: ten tokens short.
    [check] = checked(words(RESET_TOKENS - 10))
    assert not check.passed


@pytest.mark.parametrize("finish_reason", ["stop"])
def test_an_answer_that_stopped_early_is_held_to_its_own_event_count(finish_reason):
    [check] = checked(words(20), finish_reason)
    assert check.passed


def test_a_stream_that_did_not_finish_is_left_to_the_other_checks():
    client = types.SimpleNamespace(count_tokens=lambda text: pytest.fail("no text to count"))
    victim = types.SimpleNamespace(saw_done=False, output_tokens=[], output_text="", finish_reason=None)
    phase = PhaseResult(8, "reset", "reset")
    _check_seam(types.SimpleNamespace(client=client), phase, 1, victim)
    assert phase.checks == []
