"""PromptCounter on the bundled model's own tokenizer (its vocabulary only)."""

from __future__ import annotations

import llama_cpp
import llama_cpp.llama_cpp
import pytest

from tray_app.core.catalog.tokenizer_child import Tokenizer
from tray_app.core.catalog.tokens import QUICK_COUNT_BYTES, PromptCounter
from tray_app.core.config import bundled_model_path


@pytest.fixture(scope="module")
def counter():
    counter = PromptCounter(bundled_model_path())
    yield counter
    counter.close()


TEXTS = ["", "Hi", "caf\u00e9 \U0001F600 \u2028 quoted \"text\"", "   spaced   out   " * 40,
         "<|im_start|>user\nhi<|im_end|>", "word " * 3000]


@pytest.fixture
def tokenize_calls(monkeypatch):
    """Every call of llama.cpp's tokenizer in this process."""
    calls = []
    real = llama_cpp.llama_cpp.llama_tokenize

    def counting(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(llama_cpp.llama_cpp, "llama_tokenize", counting)
    monkeypatch.setattr(llama_cpp, "llama_tokenize", counting)
    return calls


def test_counts_agree_with_llama_cpp_and_client_text_is_never_tokenized_in_this_process(counter, tokenize_calls):
    """The text clients send is tokenized in the child (tokenizer_process.py):
    a crash in llama.cpp's tokenizer must not take the service with it."""
    reference = llama_cpp.Llama(str(bundled_model_path()), vocab_only=True, verbose=False)
    for text in TEXTS:
        for special in (False, True):
            tokens = reference.tokenize(text.encode(), add_bos=True, special=special)
            assert counter.tokenize(text, add_special=True, parse_special=special) == tokens
        assert counter.count_text(text) == len(reference.tokenize(text.encode(), add_bos=True))
    assert counter.count_chat([{"role": "user", "content": "Write a short poem."}]) > 5
    reference.close()
    tokenize_calls.clear()  # the reference's own calls
    counter.count_text("Hello")
    counter.detokenize(counter.tokenize("Hello", add_special=True, parse_special=True))
    assert tokenize_calls == []


def test_the_child_tokenizes_each_text_once(tokenize_calls):
    # llama-cpp-python's own tokenize sized its first buffer by n_ctx_train,
    # which a vocabulary-only load reads as 0: every count tokenized twice.
    tokenizer = Tokenizer(str(bundled_model_path()))
    for text in TEXTS:
        tokenize_calls.clear()
        tokenizer.tokenize(text.encode(), True, False)
        assert len(tokenize_calls) == 1


def test_a_count_on_the_event_loop_never_waits_for_the_tokenizer(counter):
    prompt = counter.chat_prompt([{"role": "user", "content": "Hi"}])
    assert prompt.quick and not counter.text_prompt("x" * (QUICK_COUNT_BYTES + 1)).quick
    # Another thread is tokenizing: the caller is told to count in a thread, not blocked.
    with counter._lock:
        assert counter.count_if_free(prompt) is None
    expected = counter.count(prompt)
    assert counter.count_if_free(prompt) == expected == counter.count_chat([{"role": "user", "content": "Hi"}])


def test_a_count_on_the_event_loop_never_waits_for_the_child_to_start():
    counter = PromptCounter(bundled_model_path())
    try:
        prompt = counter.text_prompt("Hi")
        assert counter.count_if_free(prompt) is None  # the child is still loading: count in a thread
        expected = counter.count(prompt)  # waits for it
        assert counter.count_if_free(prompt) == expected
    finally:
        counter.close()


def test_a_counter_that_only_compares_models_starts_no_child(counter):
    import psutil

    before = {child.pid for child in psutil.Process().children()}
    reader = PromptCounter(bundled_model_path(), tokenizes=False)
    try:
        assert {child.pid for child in psutil.Process().children()} == before
        # What the model host compares: the template and the vocabulary.
        assert reader.chat_template == counter.chat_template
        assert reader.vocabulary_fingerprint() == counter.vocabulary_fingerprint()
        with pytest.raises(RuntimeError, match="tokenizes=False"):
            reader.count_text("Hi")
    finally:
        reader.close()
