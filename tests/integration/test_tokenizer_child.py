"""Client text is tokenized in a child process of the service
(core/catalog/tokenizer_process.py), not in the service: the real service, its
real child, killed and stopped from here as the OOM killer or a crash in
llama.cpp would, and the requests around it."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.harness import RunningService, running, wait_gone
from tests.integration.test_llamacpp_routes import worker_call

pytestmark = pytest.mark.integration

TEXTS = ["Hello world", "caf\u00e9 \U0001F600 na\u00efve \u4f60\u597d \u2028 \"quoted\"",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "   spaced   out   " * 20]


def tokenizer_children(service: RunningService) -> list[psutil.Process]:
    return [child for child in psutil.Process(service.process.pid).children()
            if "tray_app.core.catalog.tokenizer_child" in child.cmdline()]


def warm_child(service: RunningService) -> psutil.Process:
    """The service's tokenizer child, after it has answered a request."""
    assert service.http.post("/tokenize", json={"content": "warm"}).status_code == 200
    [child] = tokenizer_children(service)
    return child


def wait_until_dead(child: psutil.Process) -> None:
    """Dead: a zombie (the service reaps it when it next asks) or reaped."""
    while child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.01)


def test_a_killed_tokenizer_child_costs_no_request_anything(fresh, service):
    child = warm_child(fresh)
    os.kill(child.pid, signal.SIGKILL)
    wait_until_dead(child)
    # A short prompt is counted on the event loop: the dead child is noticed and a fresh one counts it.
    answer = fresh.http.post("/v1/completions", json={"prompt": TEXTS[1], "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    [replacement] = tokenizer_children(fresh)
    assert replacement.pid != child.pid
    os.kill(replacement.pid, signal.SIGKILL)
    wait_until_dead(replacement)
    # /tokenize runs on a worker thread: the same there, and the new
    # child's tokens are the worker's own, special tokens and all.
    for text in TEXTS:
        for add_special in (False, True):
            for parse_special in (False, True):
                body = {"content": text, "add_special": add_special, "parse_special": parse_special}
                ours = fresh.http.post("/tokenize", json=body)
                assert ours.status_code == 200, ours.text
                assert ours.json() == worker_call(service, "/tokenize", body), body
    assert len(tokenizer_children(fresh)) == 1


def test_a_hung_tokenizer_child_is_a_400_in_the_envelope_and_the_service_goes_on(fresh):
    # A short prompt on the event loop: the loop stops waiting for the hung
    # child at once, a fresh child on a worker thread counts it.
    child = warm_child(fresh)
    os.kill(child.pid, signal.SIGSTOP)
    answer = fresh.http.post("/v1/completions", json={"prompt": "One, two,", "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    assert child.pid not in [c.pid for c in tokenizer_children(fresh)]
    # A long one goes to a worker thread at once: the hung child is the
    # input's fault there, after the time limit (BASE_TIMEOUT_S, 10 s).
    child = warm_child(fresh)
    os.kill(child.pid, signal.SIGSTOP)
    answer = fresh.http.post("/v1/completions", json={"prompt": "word " * 400, "max_tokens": 1})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "prompt_not_tokenizable" and "took longer than" in error["message"], error
    assert fresh.http.post("/v1/completions", json={"prompt": "word " * 400, "max_tokens": 1}).status_code == 200


def test_the_child_ends_with_the_service_even_when_the_service_is_killed(tmp_path):
    with running(tmp_path / "stopped") as stopped:
        child = warm_child(stopped)
    assert wait_gone([child.pid]) == []
    with running(tmp_path / "killed") as killed:
        child = warm_child(killed)
        killed.process.kill()
        assert wait_gone([child.pid]) == []
