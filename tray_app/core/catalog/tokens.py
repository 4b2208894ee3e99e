"""Counting prompt tokens with the model's own tokenizer and chat template.

Admission needs the prompt's length in the worker's tokens, not characters.
We load only the vocabulary (no weights, ~0.15 s for SmolLM2) and render chat
messages with the GGUF's own Jinja template, the way llama-cpp-python's server
does, so the count matches what the worker will evaluate.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
from pathlib import Path
from typing import Any, Sequence

import llama_cpp
from llama_cpp import llama_chat_format


class PromptCounter:
    def __init__(self, model_path: Path) -> None:
        self._lock = threading.Lock()
        self._llm = llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)
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

    def _token_text(self, token_id: int) -> str:
        if token_id < 0:
            return ""
        return self._llm._model.token_get_text(token_id)

    def count_text(self, text: str) -> int:
        with self._lock:
            return len(self._llm.tokenize(text.encode("utf-8"), add_bos=True, special=False))

    def count_chat(self, messages: Sequence[dict[str, Any]], tools: Any = None) -> int:
        if self._formatter is None:
            # No template in the file: the server falls back to a plain format;
            # counting role and content is close enough for admission.
            text = "\n".join(f"{m.get('role', '')}: {_content_text(m.get('content'))}" for m in messages)
            return self.count_text(text)
        rendered = self._formatter(messages=list(messages), tools=tools)
        with self._lock:
            return len(self._llm.tokenize(rendered.prompt.encode("utf-8"), add_bos=not rendered.added_special, special=True))

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        """The text's tokens as llama-server's /tokenize gives them."""
        with self._lock:
            return self._llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)

    def pieces(self, tokens: Sequence[int]) -> list[bytes]:
        """Each token's bytes, special tokens written out, as llama-server's
        common_token_to_piece gives them. Every id must be below n_vocab:
        llama.cpp reads its token table unchecked, in this process."""
        bad = next((t for t in tokens if not 0 <= t < self.n_vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is not in this vocabulary (0 to {self.n_vocab - 1})")
        with self._lock:
            vocab = self._llm._model.vocab
            buffer = ctypes.create_string_buffer(64)
            out = []
            for token in tokens:
                size = llama_cpp.llama_token_to_piece(vocab, token, buffer, len(buffer), 0, True)
                if size < 0:  # the piece is longer than the buffer: it says how long
                    buffer = ctypes.create_string_buffer(-size)
                    size = llama_cpp.llama_token_to_piece(vocab, token, buffer, len(buffer), 0, True)
                out.append(buffer.raw[:size])
            return out

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

    def close(self) -> None:
        with self._lock:
            self._llm.close()


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""
