"""Which draft model the GPU worker takes, or why not: the vocabulary check
on real files (SmolLM2 for itself) and on shapes that differ in one way each."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tray_app.core.config import bundled_model_path
from tray_app.core.engine.draft import DRAFT_SPEC_TYPE, choose_draft, vocabulary_mismatch
from tray_app.core.memory.gguf_info import ModelFileError, read_model_info

SMOLLM2 = read_model_info(bundled_model_path())


def choose(configured: str, *, files: dict[str, Path] | None = None, read=read_model_info, drafts: bool = True):
    files = files if files is not None else {"smol": SMOLLM2.path}
    return choose_draft(configured, SMOLLM2, resolve=files.get, read=read, runtime_drafts=drafts)


def test_no_draft_configured_is_no_draft_and_no_complaint():
    choice = choose("")
    assert choice.info is None and choice.refused is None and choice.path is None


def test_a_model_drafting_for_itself_shares_its_vocabulary():
    # The wiring's test, not the gain's: the test models share no vocabulary.
    choice = choose("smol")
    assert choice.refused is None and choice.path == SMOLLM2.path and SMOLLM2.vocab_digest
    assert DRAFT_SPEC_TYPE == "draft-simple"


def test_another_vocabulary_is_refused_with_what_differs():
    other_strings = dataclasses.replace(SMOLLM2, path=Path("other.gguf"), vocab_digest="0" * 32)
    assert "other token strings" in vocabulary_mismatch(other_strings, SMOLLM2)
    smaller = dataclasses.replace(SMOLLM2, n_vocab=32_000)
    assert "49,152" in vocabulary_mismatch(smaller, SMOLLM2) and "32,000" in vocabulary_mismatch(smaller, SMOLLM2)
    sentencepiece = dataclasses.replace(SMOLLM2, tokenizer_model="llama")
    assert "tokenizers differ (llama and gpt2)" in vocabulary_mismatch(sentencepiece, SMOLLM2)
    choice = choose("other", files={"other": Path("other.gguf")}, read=lambda path: other_strings)
    assert choice.info is None and choice.refused.startswith("other.gguf can't draft for ")


def test_a_name_that_is_nothing_is_refused():
    choice = choose("tiny-llama")
    assert choice.info is None and "no library model or .gguf file named 'tiny-llama'" in choice.refused


def test_an_unreadable_file_is_refused_with_the_readers_words():
    def broken(path: Path):
        raise ModelFileError(f"{path}: not a GGUF file")

    choice = choose("smol", read=broken)
    assert choice.info is None and "not a GGUF file" in choice.refused


def test_an_engine_without_draft_models_says_so():
    choice = choose("smol", drafts=False)
    assert choice.info is None and "can't speculate with a draft model" in choice.refused
