"""The worker owner's mailbox and what an exit means next (engine/restart.py),
without a process."""

from __future__ import annotations

import signal

from tests.fakes.clock import FakeClock
from tray_app.core.engine.exits import ExitKind
from tray_app.core.engine.restart import Command, Commands, ending_report

SIGTERM = -signal.SIGTERM


def test_a_process_we_ended_for_failing_is_an_error_with_the_reason_not_a_clean_stop():
    report = ending_report(SIGTERM, [], None, "did not become ready within 180 s")
    assert report.kind is ExitKind.ERROR and report.evidence == "did not become ready within 180 s"
    report = ending_report(SIGTERM, [], Command.FAILED, "a request failed: connection reset")
    assert report.kind is ExitKind.ERROR and report.evidence == "a request failed: connection reset"


def test_a_stop_or_restart_we_asked_for_is_a_clean_stop():
    for command in (Command.STOP, Command.RESTART):
        assert ending_report(SIGTERM, [], command, "stop requested").kind is ExitKind.CLEAN_STOP


def test_a_process_that_died_on_its_own_is_classified_by_how_it_died():
    assert ending_report(-signal.SIGSEGV, [], None, None).kind is ExitKind.CRASH


def test_before_a_new_process_only_a_stop_survives_in_the_mailbox():
    commands = Commands()
    commands.put(Command.FAILED, "about the process that is gone")
    commands.put(Command.STOP, "stop requested")
    commands.put(Command.RESTART, "moot: a new process starts anyway")
    commands.drop_stale()
    assert commands.take_nowait() == (Command.STOP, "stop requested")
    assert not commands.pending()


async def test_the_backoff_sleep_ends_at_a_stop_or_a_restart_and_says_which():
    clock = FakeClock()
    stopped = Commands()
    stopped.put(Command.STOP, "stop requested")
    assert await stopped.sleep_unless_stopped(600, clock) is True
    restarted = Commands()
    restarted.put(Command.RESTART, "restart requested")
    assert await restarted.sleep_unless_stopped(600, clock) is False
    # A failure report is no reason to end the backoff early: it sleeps on to its end.
    failed = Commands()
    failed.put(Command.FAILED, "moot")
    assert await failed.sleep_unless_stopped(0.01, clock) is False
