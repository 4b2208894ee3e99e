"""One real /status, as the in-process service answered it (a simulated GPU,
both workers ready, a peer that served one request), for tests of the code
that reads /status: start from it and change what the test is about, so the
rest conforms to the contract (tests/unit/core/test_status_contract.py checks it does).
`conforming()` completes a test's own trimmed status the same way."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from tray_app.core.status_contract import Status, validate_status

_SAMPLE: Status = json.loads((Path(__file__).parent / "status_sample.json").read_text())


def sample_status() -> Status:
    """A fresh copy: a test may change it freely."""
    return copy.deepcopy(_SAMPLE)


# A whole item of each list (and of each part that may be null), for the items a test writes in part.
_WHOLE: dict[str, Any] = {
    "workers": {worker["role"]: worker for worker in _SAMPLE["workers"]},
    "workers.last_exit": {"kind": "crash", "returncode": None, "signal": None, "evidence": None, "description": ""},
    "gpu.devices": _SAMPLE["gpu"]["devices"][0],
    "gpu.devices.processes": {"pid": 0, "used_mib": None, "name": None},
    "gpu.residency": _SAMPLE["gpu"]["residency"],
    "requests": {"id": "req-1", "client": None, "model": None, "kind": "chat", "stream": False, "state": "running",
                 "path": "gpu", "peer": None, "reason": "admitted", "detail": None, "age_s": 0.0,
                 "prompt_tokens": 8, "max_tokens": 16, "estimated_latency_s": None, "replayed": False,
                 "resumed": False,
                 "first_failure": None, "attempts": [], "queue_position": None},
    "requests.attempts": {"path": "gpu", "outcome": None, "tokens": 0},
    "recent_decisions": _SAMPLE["recent_decisions"][0],
    "events": {"t": 0.0, "kind": "note"},
    "models": _SAMPLE["models"][0],
    "peers": _SAMPLE["peers"][0],
}


def conforming(partial: dict[str, Any]) -> Status:
    """A test's own trimmed status laid over the sample: each key it leaves
    out comes from the sample, each list item it writes in part (a worker, a
    request, a device) is completed from a whole one of its kind. Raises if
    the result still breaks the contract."""
    status = _over(sample_status(), partial, "")
    problems = validate_status(status)
    assert not problems, f"the test's status does not conform: {problems}"
    return status


def _over(base: Any, partial: Any, path: str) -> Any:
    if isinstance(partial, dict):
        if not isinstance(base, dict):
            base = copy.deepcopy(_WHOLE.get(path, {}))
        for key, value in partial.items():
            base[key] = _over(base.get(key), value, f"{path}.{key}" if path else key)
        return base
    if isinstance(partial, list):
        return [_over(_whole_item(path, item), item, path) for item in partial]
    return copy.deepcopy(partial)


def _whole_item(path: str, item: Any) -> Any:
    whole = _WHOLE.get(path)
    if path == "workers" and isinstance(item, dict):
        whole = whole.get(item.get("role"), whole["cpu"])
    return copy.deepcopy(whole)
