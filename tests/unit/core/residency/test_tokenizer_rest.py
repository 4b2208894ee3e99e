"""A cold library model gives its tokenizer child back (ModelHost.rest_tokenizer_if_cold):
only with no worker loaded and no request anywhere in the service's hands for it, and
never the default model's. The model host is a stand-in with just what the rule reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tray_app.core.engine.worker import WorkerState
from tray_app.core.model_host import ModelHost


class Counter:
    def __init__(self) -> None:
        self.rested = 0

    def rest(self) -> bool:
        self.rested += 1
        return True


def host(*, default: bool = False, states=(WorkerState.STOPPED, WorkerState.STOPPED), jobs=None):
    notes: list[str] = []
    stand_in = SimpleNamespace(
        model=SimpleNamespace(is_default=default), counter=Counter(), dispatcher=SimpleNamespace(jobs=jobs or {}),
        workers=lambda: [SimpleNamespace(state=state) for state in states], note=lambda kind, **data: notes.append(kind))
    return stand_in, notes


def test_a_cold_library_model_rests_its_tokenizer_and_says_so():
    model, notes = host()
    ModelHost.rest_tokenizer_if_cold(model)
    assert model.counter.rested == 1 and notes == ["tokenizer_rested"]


@pytest.mark.parametrize("why_not", [
    {"default": True},                                                  # the default model keeps its own
    {"states": (WorkerState.STOPPED, WorkerState.READY)},               # a worker is loaded
    {"states": (WorkerState.STARTING, WorkerState.STOPPED)},            # or loading
    {"jobs": {"req-1": object()}},                                      # a request is being counted or run
])
def test_a_model_in_use_or_the_default_keeps_its_tokenizer(why_not):
    model, notes = host(**why_not)
    ModelHost.rest_tokenizer_if_cold(model)
    assert model.counter.rested == 0 and notes == []
