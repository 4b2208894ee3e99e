"""The CPU module a modular llama.cpp build (GGML_BACKEND_DL) needs before a
vocabulary loads: a fake libllama stands in for ctypes' handle. The real
modular build is exercised by tests/integration/test_cuda_build.py."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from tray_app.core.catalog.vocab_model import load_cpu_backend_module, module_folders


class Function:
    """A ctypes function's shape: callable, with restype and argtypes to set."""

    def __init__(self, body) -> None:
        self.body = body

    def __call__(self, *args):
        return self.body(*args)


def fake_libllama(registered: int):
    loaded: list[bytes] = []
    lib = types.SimpleNamespace(
        ggml_backend_reg_count=Function(lambda: registered + len(loaded)),
        ggml_backend_load=Function(lambda path: (loaded.append(path), 0x1000)[1]))
    return lib, loaded


def test_a_build_with_backends_linked_in_loads_nothing(tmp_path):
    (tmp_path / "libggml-cpu.so").write_text("")
    lib, loaded = fake_libllama(registered=1)
    assert load_cpu_backend_module(lib, [tmp_path]) is None and loaded == []


def test_a_modular_build_gets_the_cpu_module_and_no_other(tmp_path):
    for name in ("libggml-cuda.so", "libggml-vulkan.so", "libggml-cpu.so", "libggml-base.so"):
        (tmp_path / name).write_text("")
    lib, loaded = fake_libllama(registered=0)
    assert load_cpu_backend_module(lib, [tmp_path / "missing", tmp_path]) == str(tmp_path / "libggml-cpu.so")
    assert loaded == [str(tmp_path / "libggml-cpu.so").encode()]
    assert lib.ggml_backend_reg_count() == 1


def test_a_modular_build_without_its_cpu_module_says_how_to_fix_it(tmp_path):
    (tmp_path / "libggml-cuda.so").write_text("")
    lib, _ = fake_libllama(registered=0)
    with pytest.raises(RuntimeError, match=r"no CPU module \(libggml-cpu\*\.so\).*packaging/install\.sh"):
        load_cpu_backend_module(lib, [tmp_path])


def test_a_module_that_fails_to_load_is_not_taken_for_loaded(tmp_path):
    (tmp_path / "libggml-cpu.so").write_text("")
    lib = types.SimpleNamespace(ggml_backend_reg_count=Function(lambda: 0),
                                ggml_backend_load=Function(lambda path: None))
    with pytest.raises(RuntimeError):
        load_cpu_backend_module(lib, [tmp_path])


def test_an_older_libllama_without_the_registry_functions_is_left_alone():
    assert load_cpu_backend_module(types.SimpleNamespace(), [Path("/nowhere")]) is None


def test_the_folders_are_the_overridden_library_path_then_the_packages_own():
    package = types.SimpleNamespace(__file__="/venv/site-packages/llama_cpp/__init__.py")
    assert module_folders(package, {}) == [Path("/venv/site-packages/llama_cpp/lib")]
    assert module_folders(package, {"LLAMA_CPP_LIB_PATH": "/build/bin"}) == [
        Path("/build/bin"), Path("/venv/site-packages/llama_cpp/lib")]
