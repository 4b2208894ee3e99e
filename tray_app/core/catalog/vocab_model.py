"""A model file opened for its vocabulary and metadata only, quietly.

llama.cpp makes a context even for a vocabulary-only load, and a vocabulary
has no training length, so each load printed "llama_context: n_ctx_seq (512)
> n_ctx_train (0) -- possible training context overflow" on stderr, past
llama-cpp-python's verbose=False, into the service log: a warning about a
context that is never used. The load's own output goes nowhere; a failure
still raises.

In a build with ggml's backends as modules (install.sh's CUDA build,
GGML_BACKEND_DL), libllama has no backend at all until one is loaded, and
llama.cpp's own loader looks beside the executable (python, here) and in the
working folder, so a load failed with "no backends are loaded". The
processes that read vocabularies load the CPU module only: they never hold
a GPU, whatever the build.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any


def module_folders(llama_cpp: Any, environ: dict[str, str] | None = None) -> list[Path]:
    """Where llama-cpp-python's libraries, and a modular build's modules, are."""
    environ = os.environ if environ is None else environ
    folders = [Path(environ["LLAMA_CPP_LIB_PATH"])] if environ.get("LLAMA_CPP_LIB_PATH") else []
    folders.append(Path(llama_cpp.__file__).parent / "lib")
    return folders


def load_cpu_backend_module(lib: Any, folders: list[Path]) -> str | None:
    """Loads ggml's CPU module into `lib` (libllama, through ctypes) when the
    build has modules and none is loaded; returns the module's path, or None
    when there was nothing to do (backends linked in, or loaded already)."""
    try:
        count, load = lib.ggml_backend_reg_count, lib.ggml_backend_load
    except AttributeError:
        return None  # an older libllama: its backends are linked in
    count.restype, count.argtypes = ctypes.c_size_t, []
    if count() > 0:
        return None
    load.restype, load.argtypes = ctypes.c_void_p, [ctypes.c_char_p]
    for folder in folders:
        for module in sorted(folder.glob("libggml-cpu*.so")):
            if load(str(module).encode()):
                return str(module)
    raise RuntimeError(f"this llama.cpp loads its backends as modules, and no CPU module (libggml-cpu*.so) "
                       f"loads from {', '.join(map(str, folders))}: reinstall with packaging/install.sh")


def vocab_only_model(model_path: str | Path):
    import llama_cpp
    from llama_cpp._utils import suppress_stdout_stderr

    load_cpu_backend_module(llama_cpp.llama_cpp._lib, module_folders(llama_cpp))
    with suppress_stdout_stderr(disable=False):  # its default is to suppress nothing
        return llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)
