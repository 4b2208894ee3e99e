"""The worker wrapper's tie to its supervisor (no model server is started)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tray_app.core.engine.runtime import PARENT_PID_ENV

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")

# Exits 0 only if _die_with_parent lets the process go on.
SURVIVES = "from tray_app.core.engine.worker_main import _die_with_parent; _die_with_parent()"


def _run_wrapper_check(expected_parent: str) -> int:
    env = {**os.environ, PARENT_PID_ENV: expected_parent}
    return subprocess.run([sys.executable, "-c", SURVIVES], env=env, timeout=60).returncode


def test_worker_exits_when_its_parent_is_not_the_supervisor_that_launched_it():
    # What a worker sees when its supervisor died before prctl: its parent is
    # now init or a subreaper, not the pid the launcher passed.
    not_the_parent = str(os.getpid() + 1_000_000)
    assert _run_wrapper_check(not_the_parent) == 1


def test_worker_runs_on_when_its_parent_is_the_supervisor_that_launched_it():
    assert _run_wrapper_check(str(os.getpid())) == 0
