"""The prompt counter's child process: llama.cpp's tokenizer run on client
text and client token ids, away from the service.

The tokenizer is native code fed with whatever a client sends (prompts,
/tokenize bodies, embedding inputs, /detokenize ids); a crash in it inside
the service would take every request and the tray with it. Here a crash, a
runaway allocation or a hang ends this process only, and the parent
(core/catalog/tokenizer_process.py) answers that one request with a 400 and
starts a new child.

Protocol: a JSON header line, then the raw bytes it announces ("bytes"), both
ways; raw bytes because a 4 MiB prompt and its million tokens as JSON text
would cost more to encode and parse than to tokenize. Requests:

    {"tokenize": true, "add_bos": bool, "special": bool, "bytes": N} + N bytes of UTF-8
    {"pieces": true, "bytes": N} + N bytes of token ids (native int32)

Answers: {"bytes": N} + the token ids (native int32), or
{"bytes": N, "lengths": [...]} + the pieces, one after another. The first line
the child writes is {"ready": true}.

    python -m tray_app.core.catalog.tokenizer_child MODEL.gguf
"""

from __future__ import annotations

import array
import ctypes
import json
import sys
from typing import Any, BinaryIO

from ..grammar.child import limit_memory
from .vocab_model import vocab_only_model

# The child's heap, the loaded vocabulary included (about 210 MiB for
# SmolLM2's). llama.cpp holds a prompt many times over while it splits and
# merges it: a 4 MiB prompt (the default [server] max_body_bytes) of one
# repeated character peaked at 540 MiB resident, measured. A larger
# vocabulary needs more at rest, so there is room; past it a runaway
# allocation fails here, not in the machine's other processes.
TOKENIZER_MEMORY_MIB = 2048


class Tokenizer:
    def __init__(self, model_path: str) -> None:
        import llama_cpp

        self._llama_cpp = llama_cpp
        self._llm = vocab_only_model(model_path)
        self._vocab = self._llm._model.vocab
        self._n_vocab = self._llm.n_vocab()

    def tokenize(self, data: bytes, add_bos: bool, special: bool) -> array.array:
        """Tokenized once. llama-cpp-python's own tokenize sizes its first
        buffer by n_ctx_train, which a vocabulary-only load reads as 0, so it
        tokenized every text twice. A token is at least one byte, so the
        text's length plus the few tokens the tokenizer may add (BOS, EOS, a
        leading space) always fits."""
        llama_cpp = self._llama_cpp
        capacity = len(data) + 8
        for _ in range(2):
            buffer = (llama_cpp.llama_token * capacity)()
            n_tokens = llama_cpp.llama_tokenize(self._vocab, data, len(data), buffer, capacity, add_bos, special)
            if n_tokens >= 0:
                tokens = array.array("i")
                tokens.frombytes(memoryview(buffer).cast("B")[:n_tokens * tokens.itemsize])
                return tokens
            capacity = -n_tokens  # too small after all: it says how many
        raise ValueError(f"llama.cpp could not tokenize a text of {len(data)} bytes")

    def pieces(self, tokens: array.array) -> list[bytes]:
        """Each token's bytes, special tokens written out, as llama-server's
        common_token_to_piece gives them. The parent checks the ids too; this
        check stays because llama.cpp reads its token table unchecked."""
        bad = next((t for t in tokens if not 0 <= t < self._n_vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is not in this vocabulary")
        llama_cpp = self._llama_cpp
        buffer = ctypes.create_string_buffer(64)
        out = []
        for token in tokens:
            size = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, True)
            if size < 0:  # the piece is longer than the buffer: it says how long
                buffer = ctypes.create_string_buffer(-size)
                size = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, True)
            out.append(buffer.raw[:size])
        return out

    def answer(self, request: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        if request.get("tokenize"):
            tokens = self.tokenize(payload, bool(request["add_bos"]), bool(request["special"]))
            return {}, tokens.tobytes()
        ids = array.array("i")
        ids.frombytes(payload)
        pieces = self.pieces(ids)
        return {"lengths": [len(piece) for piece in pieces]}, b"".join(pieces)


def serve(tokenizer: Tokenizer, source: BinaryIO, sink: BinaryIO) -> None:
    """Answer requests until the parent closes the pipe (or dies)."""
    sink.write(b'{"ready": true}\n')
    sink.flush()
    while True:
        line = source.readline()
        if not line:
            return
        request = json.loads(line)
        payload = source.read(request["bytes"])
        try:
            header, body = tokenizer.answer(request, payload)
        except MemoryError:
            header, body = {"problem": f"tokenizing it needed more than {TOKENIZER_MEMORY_MIB} MiB"}, b""
        except ValueError as exc:
            header, body = {"problem": str(exc)}, b""
        sink.write(json.dumps({**header, "bytes": len(body)}).encode() + b"\n" + body)
        sink.flush()


def main(model_path: str) -> None:
    tokenizer = Tokenizer(model_path)
    limit_memory(TOKENIZER_MEMORY_MIB)
    serve(tokenizer, sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tray_app.core.catalog.tokenizer_child MODEL.gguf")
    main(sys.argv[1])
