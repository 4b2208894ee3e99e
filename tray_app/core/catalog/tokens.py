"""Counting prompt tokens with the model's own tokenizer and chat template.

Admission needs the prompt's length in the worker's tokens, not characters.
We load only the vocabulary (no weights, ~0.15 s for SmolLM2) and render chat
messages with the GGUF's own Jinja template, the way llama-cpp-python's server
does, so the count matches what the worker will evaluate.

The file is the user's own, so its vocabulary, metadata and template are read
here; the text and token ids clients send are tokenized in a child process
(tokenizer_process.py), where a crash in llama.cpp ends one request only.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import llama_cpp
from llama_cpp import llama_chat_format

from .tokenizer_process import TokenizerProcess
from .vocab_model import vocab_only_model

# A prompt up to this many bytes is counted on the caller's thread: a round
# trip to the tokenizer's warm child, well under a millisecond; a longer one
# is worth a worker thread, whose hand-off costs more than that for a short
# one (see HttpApp._count_prompt).
QUICK_COUNT_BYTES = 1024


@dataclass(frozen=True)
class Prompt:
    """What the worker will tokenize: the text as bytes, and how."""

    data: bytes
    add_bos: bool
    special: bool

    @property
    def quick(self) -> bool:
        return len(self.data) <= QUICK_COUNT_BYTES


def short_chat(messages: Sequence[dict[str, Any]]) -> bool:
    """Whether rendering these messages is quick enough for the caller's thread."""
    return len(messages) <= 16 and sum(len(_content_text(m.get("content"))) for m in messages) <= QUICK_COUNT_BYTES


class PromptCounter:
    def __init__(self, model_path: Path, *, tokenizes: bool = True) -> None:
        """`tokenizes=False`: the file's template and vocabulary only (to
        compare two models), without starting a tokenizer child."""
        self._lock = threading.Lock()
        self._llm = vocab_only_model(model_path)
        self._child_process = TokenizerProcess(model_path) if tokenizes else None
        metadata = self._llm.metadata
        self.chat_template: str | None = metadata.get("tokenizer.chat_template")
        self.eos_token = self._token_text(self._llm.token_eos())
        self.bos_id = self._llm.token_bos()
        self.bos_token = self._token_text(self.bos_id)
        self.n_vocab = self._llm.n_vocab()
        self._formatter = (
            llama_chat_format.Jinja2ChatFormatter(
                template=self.chat_template, eos_token=self.eos_token, bos_token=self.bos_token,
            )
            if self.chat_template
            else None
        )

    @property
    def _child(self) -> TokenizerProcess:
        if self._child_process is None:
            raise RuntimeError("this PromptCounter was built with tokenizes=False")
        return self._child_process

    def _token_text(self, token_id: int) -> str:
        if token_id < 0:
            return ""
        return self._llm._model.token_get_text(token_id)

    def text_prompt(self, text: str) -> Prompt:
        return Prompt(text.encode("utf-8"), add_bos=True, special=False)

    def chat_prompt(self, messages: Sequence[dict[str, Any]], tools: Any = None) -> Prompt:
        """The messages rendered with the model's chat template, as the worker will see them."""
        if self._formatter is None:
            # No template in the file: the server falls back to a plain format;
            # counting role and content is close enough for admission.
            return self.text_prompt("\n".join(f"{m.get('role', '')}: {_content_text(m.get('content'))}"
                                               for m in messages))
        rendered = self._formatter(messages=list(messages), tools=tools)
        return Prompt(rendered.prompt.encode("utf-8"), add_bos=not rendered.added_special, special=True)

    def count(self, prompt: Prompt) -> int:
        with self._lock:
            return len(self._tokens(prompt))

    def count_if_free(self, prompt: Prompt) -> int | None:
        """The count, or None when another thread is tokenizing now: the
        caller (the event loop) must not wait on this lock, nor on a
        child that is starting or hung: None then too."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            tokens = self._child.tokenize_if_warm(prompt.data, prompt.add_bos, prompt.special)
            return None if tokens is None else len(tokens)
        finally:
            self._lock.release()

    def count_text(self, text: str) -> int:
        return self.count(self.text_prompt(text))

    def count_chat(self, messages: Sequence[dict[str, Any]], tools: Any = None) -> int:
        return self.count(self.chat_prompt(messages, tools))

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        """The text's tokens as llama-server's /tokenize gives them."""
        with self._lock:
            return self._tokens(Prompt(text.encode("utf-8"), add_bos=add_special, special=parse_special))

    def _tokens(self, prompt: Prompt) -> list[int]:
        """Tokenized by the child (the lock held)."""
        return self._child.tokenize(prompt.data, prompt.add_bos, prompt.special)

    def pieces(self, tokens: Sequence[int]) -> list[bytes]:
        """Each token's bytes, special tokens written out, as llama-server's
        common_token_to_piece gives them. Every id must be below n_vocab:
        llama.cpp reads its token table unchecked."""
        bad = next((t for t in tokens if not 0 <= t < self.n_vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is not in this vocabulary (0 to {self.n_vocab - 1})")
        with self._lock:
            return self._child.pieces(tokens)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The tokens' text, as llama-server's /detokenize writes it (bytes
        that are no UTF-8 become U+FFFD)."""
        return b"".join(self.pieces(tokens)).decode("utf-8", "replace")

    def render_chat(self, messages: Sequence[dict[str, Any]], tools: Any = None) -> str:
        """The prompt the model's chat template makes of these messages,
        ready for the answer (the generation prompt added)."""
        if self._formatter is None:
            raise LookupError("the model file has no chat template")
        return self._formatter(messages=list(messages), tools=tools).prompt

    def vocabulary_fingerprint(self) -> str:
        """A digest of every token's text: equal fingerprints mean equal vocabularies."""
        digest = hashlib.sha256()
        with self._lock:
            for token_id in range(self.n_vocab):
                digest.update(self._llm._model.token_get_text(token_id).encode("utf-8", "replace"))
                digest.update(b"\0")
        return digest.hexdigest()[:16]

    def rest(self) -> bool:
        """The tokenizer child ended while nothing uses it (it costs about
        60 MiB; the next count starts it again). False if it was in use or
        not running."""
        if self._child_process is None or not self._lock.acquire(blocking=False):
            return False
        try:
            return self._child_process.rest()
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            if self._child_process is not None:
                self._child_process.close()
            self._llm.close()


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""
