"""The tokenizer's child process (core/catalog/tokenizer_process.py): the
real child on the bundled model's vocabulary, and stand-in children (the real
child's code, made to crash, hang or run out of memory on a marker input), so
that what a crash does to a request is shown with a real dead process."""

from __future__ import annotations

import os
import signal
import stat
import sys
import time
from pathlib import Path

import llama_cpp
import psutil
import pytest

from tray_app.core.catalog.tokenizer_process import PromptNotTokenizable, TokenizerProcess, TokenizerUnavailable
from tray_app.core.config import bundled_model_path

MODEL = bundled_model_path()


def stand_in_child(tmp_path: Path, on_marker: str) -> str:
    """A 'python' for the child's argv that runs the real child, except that
    a text containing MARKER makes it do `on_marker` (Python code)."""
    code = tmp_path / "child.py"
    code.write_text(
        "import os, sys, time\n"
        "from tray_app.core.catalog import tokenizer_child\n"
        "class MarkedTokenizer(tokenizer_child.Tokenizer):\n"
        "    def tokenize(self, data, add_bos, special):\n"
        "        if b'MARKER' in data:\n"
        f"            {on_marker}\n"
        "        return super().tokenize(data, add_bos, special)\n"
        "tokenizer_child.Tokenizer = MarkedTokenizer\n"
        "tokenizer_child.main(sys.argv[-1])\n")
    script = tmp_path / "child.sh"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} {code} \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def wait_dead(pid: int) -> None:
    """Until the killed child is a zombie: dead, not yet reaped (its parent
    finds out at the next request)."""
    process = psutil.Process(pid)
    while process.status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.01)


@pytest.fixture(scope="module")
def reference():
    llm = llama_cpp.Llama(str(MODEL), vocab_only=True, verbose=False)
    yield llm
    llm.close()


def test_the_child_tokenizes_and_writes_pieces_as_llama_cpp_does(reference):
    child = TokenizerProcess(MODEL)
    try:
        for text in ["", "Hi", "caf\u00e9 \U0001F600 \u2028 quoted \"text\"", "<|im_start|>user\nhi<|im_end|>",
                     "word " * 3000]:
            for add_bos in (False, True):
                for special in (False, True):
                    expected = reference.tokenize(text.encode(), add_bos=add_bos, special=special)
                    assert child.tokenize(text.encode(), add_bos, special) == expected
        tokens = reference.tokenize("Hello <|im_start|> ça va? 🙂".encode(), add_bos=True, special=True)
        pieces = child.pieces(tokens)
        assert pieces == [reference.detokenize([token], special=True) for token in tokens]
        assert b"".join(pieces) == "Hello <|im_start|> ça va? 🙂".encode()
        assert child.pieces([]) == [] and child.children_started == 1
    finally:
        child.close()


def test_an_input_that_crashes_the_child_is_a_400_and_the_next_one_is_served(tmp_path):
    child = TokenizerProcess(MODEL, python=stand_in_child(tmp_path, "os.abort()"))
    try:
        assert child.tokenize(b"one two", False, False) == child.tokenize(b"one two", False, False)
        assert child.children_started == 1
        with pytest.raises(PromptNotTokenizable) as refused:
            child.tokenize(b"a MARKER b", False, False)
        assert refused.value.status == 400 and refused.value.code == "prompt_not_tokenizable"
        assert "failed on it" in refused.value.message
        # The child was warm, so the input was tried once more on a fresh one before it was blamed.
        assert child.children_started == 2
        assert len(child.tokenize(b"one two", False, False)) == 2
        assert child.children_started == 3
    finally:
        child.close()


def test_a_crash_on_a_fresh_child_is_blamed_at_once(tmp_path):
    child = TokenizerProcess(MODEL, python=stand_in_child(tmp_path, "os.abort()"))
    try:
        with pytest.raises(PromptNotTokenizable):
            child.tokenize(b"MARKER", False, False)
        assert child.children_started == 1
    finally:
        child.close()


def test_a_child_that_hangs_is_killed_at_the_deadline(tmp_path):
    # The stand-in never answers, so the outcome is the same at any deadline: a short one keeps the test quick.
    child = TokenizerProcess(MODEL, python=stand_in_child(tmp_path, "time.sleep(600)"), base_timeout_s=0.25)
    try:
        child.tokenize(b"warm up", False, False)
        hung_pid = child.pid
        with pytest.raises(PromptNotTokenizable) as refused:
            child.tokenize(b"MARKER", False, False)
        assert "took longer than" in refused.value.message
        assert not psutil.pid_exists(hung_pid)  # killed and reaped
        assert child.tokenize(b"warm up", False, False) and child.children_started == 2
    finally:
        child.close()


def test_running_out_of_memory_in_the_child_is_a_400(tmp_path):
    child = TokenizerProcess(MODEL, python=stand_in_child(tmp_path, "raise MemoryError()"))
    try:
        with pytest.raises(PromptNotTokenizable) as refused:
            child.tokenize(b"MARKER", False, False)
        assert "MiB" in refused.value.message
        assert child.tokenize(b"fine", False, False) and child.children_started == 1
    finally:
        child.close()


def test_a_child_killed_between_requests_costs_no_request_anything():
    child = TokenizerProcess(MODEL)
    try:
        expected = child.tokenize(b"Hello world", True, False)
        pid = child.pid
        os.kill(pid, signal.SIGKILL)
        wait_dead(pid)
        assert child.tokenize(b"Hello world", True, False) == expected
        assert child.children_started == 2 and child.pid != pid
    finally:
        child.close()


def test_a_child_that_cannot_start_is_a_503(tmp_path):
    broken = tmp_path / "broken.sh"
    broken.write_text("#!/bin/sh\nexit 3\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    child = TokenizerProcess(MODEL, python=str(broken))
    with pytest.raises(TokenizerUnavailable) as refused:
        child.tokenize(b"Hello", False, False)
    assert refused.value.status == 503 and refused.value.code == "tokenizer_unavailable"
    child.close()


def test_close_ends_the_child_and_refuses_later_requests():
    child = TokenizerProcess(MODEL)
    child.tokenize(b"Hello", False, False)
    pid = child.pid
    child.close()
    assert not psutil.pid_exists(pid)
    with pytest.raises(TokenizerUnavailable):
        child.tokenize(b"Hello", False, False)


def test_a_rested_child_gives_its_process_back_and_the_next_request_starts_one():
    child = TokenizerProcess(MODEL)
    try:
        expected = child.tokenize(b"Hello world", True, False)
        pid = child.pid
        assert child.rest() and not psutil.pid_exists(pid) and not child.warm
        assert not child.rest()  # nothing left to end
        # Not warm: the event loop's quick path says so instead of starting a child itself.
        assert child.tokenize_if_warm(b"Hello world", True, False) is None
        assert child.tokenize(b"Hello world", True, False) == expected
        assert child.children_started == 2 and child.pid != pid and child.warm
    finally:
        child.close()


def test_closing_a_child_that_has_not_said_ready_leaves_no_process():
    child = TokenizerProcess(MODEL)
    pid = child.pid
    child.close()
    assert not psutil.pid_exists(pid)


@pytest.mark.parametrize("on_marker", ["time.sleep(600)", "os.abort()"])
def test_the_event_loops_quick_path_never_waits_for_a_hung_or_dying_child(tmp_path, on_marker):
    child = TokenizerProcess(MODEL, python=stand_in_child(tmp_path, on_marker))
    try:
        assert child.tokenize_if_warm(b"Hi", False, False) is None  # not started yet: don't wait for it
        expected = child.tokenize(b"Hi", False, False)
        assert child.tokenize_if_warm(b"Hi", False, False) == expected
        failed_pid = child.pid
        # Hung past QUICK_TIMEOUT_S, or dead: None, and the child is replaced.
        assert child.tokenize_if_warm(b"MARKER", False, False) is None
        assert not psutil.pid_exists(failed_pid) and not child.warm
        assert child.tokenize(b"Hi", False, False) == expected and child.children_started == 2
    finally:
        child.close()
