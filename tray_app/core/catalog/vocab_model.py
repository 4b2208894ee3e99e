"""A model file opened for its vocabulary and metadata only, quietly.

llama.cpp makes a context even for a vocabulary-only load, and a vocabulary
has no training length, so each load printed "llama_context: n_ctx_seq (512)
> n_ctx_train (0) -- possible training context overflow" on stderr, past
llama-cpp-python's verbose=False, into the service log: a warning about a
context that is never used. The load's own output goes nowhere; a failure
still raises.
"""

from __future__ import annotations

from pathlib import Path


def vocab_only_model(model_path: str | Path):
    import llama_cpp
    from llama_cpp._utils import suppress_stdout_stderr

    with suppress_stdout_stderr(disable=False):  # its default is to suppress nothing
        return llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)
