"""PromptCounter on the bundled model's own tokenizer (its vocabulary only)."""

from __future__ import annotations

import llama_cpp
import llama_cpp.llama_cpp
import pytest

from tray_app.core.catalog.tokens import QUICK_COUNT_BYTES, PromptCounter
from tray_app.core.config import bundled_model_path


@pytest.fixture(scope="module")
def counter():
    counter = PromptCounter(bundled_model_path())
    yield counter
    counter.close()


TEXTS = ["", "Hi", "caf\u00e9 \U0001F600 \u2028 quoted \"text\"", "   spaced   out   " * 40,
         "<|im_start|>user\nhi<|im_end|>", "word " * 3000]


def test_a_count_tokenizes_once_and_agrees_with_llama_cpp(counter, monkeypatch):
    # llama-cpp-python's own tokenize sized its first buffer by n_ctx_train,
    # which a vocabulary-only load reads as 0: every count tokenized twice.
    calls = []
    real = llama_cpp.llama_cpp.llama_tokenize

    def counting(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(llama_cpp.llama_cpp, "llama_tokenize", counting)
    monkeypatch.setattr(llama_cpp, "llama_tokenize", counting)
    for text in TEXTS:
        for special in (False, True):
            tokens = counter._llm.tokenize(text.encode(), add_bos=True, special=special)
            assert counter.tokenize(text, add_special=True, parse_special=special) == tokens
        expected = len(counter._llm.tokenize(text.encode(), add_bos=True))
        calls.clear()
        assert counter.count_text(text) == expected
        assert len(calls) == 1
    calls.clear()
    assert counter.count_chat([{"role": "user", "content": "Write a short poem."}]) > 5
    assert len(calls) == 1


def test_a_count_on_the_event_loop_never_waits_for_the_tokenizer(counter):
    prompt = counter.chat_prompt([{"role": "user", "content": "Hi"}])
    assert prompt.quick and not counter.text_prompt("x" * (QUICK_COUNT_BYTES + 1)).quick
    # Another thread is tokenizing: the caller is told to count in a thread, not blocked.
    with counter._lock:
        assert counter.count_if_free(prompt) is None
    assert counter.count_if_free(prompt) == counter.count(prompt) == counter.count_chat([{"role": "user",
                                                                                         "content": "Hi"}])
