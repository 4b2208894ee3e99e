"""Which draft model the GPU worker speculates with ([gpu] draft_model), or
why the one named isn't used. Pure: the caller resolves names and reads files.

A draft model proposes tokens that the served model checks in one batch, so
the two must share a vocabulary, token for token: a draft from another family
would propose ids that mean other text. llama.cpp checks it at load and
refuses to start the server; here the check comes first, so a mismatch is
said in /status and the worker starts without the draft rather than not at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..memory.gguf_info import ModelFileError, ModelInfo

# llama-server's --spec-type for a draft model.
DRAFT_SPEC_TYPE = "draft-simple"


@dataclass(frozen=True)
class DraftChoice:
    configured: str  # as [gpu] draft_model names it; "" for none
    info: ModelInfo | None = None  # the draft to load; None for none
    refused: str | None = None  # why the configured draft isn't used

    @property
    def path(self) -> Path | None:
        return self.info.path if self.info is not None else None


def choose_draft(configured: str, target: ModelInfo, resolve: Callable[[str], Path | None],
                 read: Callable[[Path], ModelInfo], runtime_drafts: bool) -> DraftChoice:
    """The draft for `target`: `configured` is a library model's name or a
    .gguf path; `resolve` finds its file (None when there is none)."""
    if not configured:
        return DraftChoice("")
    if not runtime_drafts:
        return DraftChoice(configured, refused="this engine can't speculate with a draft model (llama-server can)")
    path = resolve(configured)
    if path is None:
        return DraftChoice(configured, refused=f"there is no library model or .gguf file named {configured!r}")
    try:
        info = read(path)
    except ModelFileError as error:
        return DraftChoice(configured, refused=str(error))
    problem = vocabulary_mismatch(info, target)
    if problem:
        return DraftChoice(configured, refused=f"{info.path.name} can't draft for {target.path.name}: {problem}")
    return DraftChoice(configured, info=info)


def vocabulary_mismatch(draft: ModelInfo, target: ModelInfo) -> str | None:
    """Why `draft`'s vocabulary is not `target`'s; None when they are the same."""
    if draft.tokenizer_model != target.tokenizer_model:
        return (f"their tokenizers differ ({draft.tokenizer_model or 'unknown'} and "
                f"{target.tokenizer_model or 'unknown'})")
    if draft.n_vocab != target.n_vocab:
        return f"their vocabularies differ ({draft.n_vocab:,} and {target.n_vocab:,} tokens)"
    if not draft.vocab_digest or draft.vocab_digest != target.vocab_digest:
        return f"their vocabularies differ (the same {draft.n_vocab:,} tokens count, other token strings)"
    return None
