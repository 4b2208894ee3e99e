"""One real /status, as the in-process service answered it (a simulated GPU,
both workers ready, a peer that served one request), for tests of the code
that reads /status: start from it and change what the test is about, so the
rest conforms to the contract (tests/unit/test_status_contract.py checks it does)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from tray_app.core.status_contract import Status

_SAMPLE: Status = json.loads((Path(__file__).parent / "status_sample.json").read_text())


def sample_status() -> Status:
    """A fresh copy: a test may change it freely."""
    return copy.deepcopy(_SAMPLE)
