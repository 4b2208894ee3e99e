"""What the real-GPU check carries: the trimmed llama.cpp source and the
ballast's behaviour where no GPU library is installed."""

from __future__ import annotations

import io
import os
import tarfile
import zipfile

import pytest

from benchmarks.gpu_check import prepare
from benchmarks.gpu_check.prepare import PREBUILT_NAME, add_prebuilt, kept, trim_sources
from tray_app.drill import ballast


@pytest.mark.parametrize("path", [
    "CMakeLists.txt", "src/llama.cpp", "include/llama.h", "common/arg.cpp", "ggml/src/ggml.c",
    "ggml/src/ggml-cuda/fattn.cu", "ggml/src/ggml-cpu/ops.cpp", "ggml/src/CMakeLists.txt",
    "tools/server/server.cpp", "tools/mtmd/mtmd.cpp", "tools/ui/CMakeLists.txt", "vendor/cpp-httplib/httplib.h",
    "scripts/ui-assets.cmake", "LICENSE",
])
def test_what_the_build_needs_is_kept(path):
    assert kept(path)


@pytest.mark.parametrize("path", [
    "models/ggml-vocab-llama-bpe.gguf", "docs/build.md", "ggml/src/ggml-vulkan/ggml-vulkan.cpp",
    "ggml/src/ggml-metal/ggml-metal.m", "tools/ui/src/app.ts", "tools/server/tests/test_basic.py",
    "scripts/sync-ggml.sh", "convert_hf_to_gguf.py", "README.md", "tests/test-backend-ops.cpp",
])
def test_what_the_build_never_reads_is_dropped(path):
    assert not kept(path)


def _sdist(path, files: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def test_the_sdist_splits_into_the_engine_source_and_the_bindings(tmp_path):
    root = "llama_cpp_python-9.9.9"
    sdist = tmp_path / f"{root}.tar.gz"
    _sdist(sdist, {f"{root}/vendor/llama.cpp/src/llama.cpp": b"x" * 10,
                   f"{root}/vendor/llama.cpp/models/vocab.gguf": b"y" * 1000,
                   f"{root}/llama_cpp/__init__.py": b"z",
                   f"{root}/llama_cpp/lib/libllama.so": b"w" * 100,
                   f"{root}/setup.py": b""})
    out = tmp_path / "carry"
    out.mkdir()
    summary = trim_sources(sdist, out)
    with tarfile.open(out / "llama.cpp.tar.gz") as engine:
        assert engine.getnames() == ["llama.cpp/src/llama.cpp"]
    with tarfile.open(out / "llama_cpp_py.tar.gz") as bindings:
        assert bindings.getnames() == ["llama_cpp/__init__.py"]  # never a prebuilt library for another machine
    assert summary["llama.cpp"]["files"] == 1 and summary["llama_cpp_py"]["files"] == 1


def test_without_torch_or_cupy_the_ballast_refuses_to_start_and_says_why(monkeypatch, capsys):
    monkeypatch.setattr(ballast.importlib.util, "find_spec", lambda name: None)
    assert ballast.library() is None
    assert ballast.main() == 2
    assert capsys.readouterr().out == "error neither torch nor cupy is installed\n"


def _cuda_wheelhouse(cache, architectures: str, module_bytes: int = 100) -> None:
    house = cache / "wheels" / "abc123"
    house.mkdir(parents=True)
    with zipfile.ZipFile(house / "llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl", "w") as wheel:
        wheel.writestr("bin/llama-server", b"s" * 10)
        wheel.writestr("bin/libggml-cuda.so", os.urandom(module_bytes))  # as incompressible as machine code
        wheel.writestr("bin/llama-quantize", b"q")  # a tool the check never runs
        wheel.writestr("llama_cpp/lib/libllama.so", b"l")
        wheel.writestr("llama_cpp/lib/libggml-cuda.so", b"c")  # a second copy, for llama-cpp-python
        wheel.writestr("lib/libllama-server-impl.so", b"i")
        wheel.writestr("lib/libllama.so", b"l")  # the same file again, as a wheel holds a link
        wheel.writestr("llama_cpp/__init__.py", b"")
    (house / "cmake-args").write_text(f"-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES={architectures} -DX=1\n")


def _prepared(tmp_path) -> tuple[dict, object]:
    """add_prebuilt's manifest entries and the carry folder it wrote into."""
    manifest: dict = {}
    carry = tmp_path / "carry"
    carry.mkdir()
    add_prebuilt(carry, manifest, tmp_path / "cache")
    return manifest, carry


def test_the_sm90_cuda_build_is_packed_with_what_the_check_runs(tmp_path):
    _cuda_wheelhouse(tmp_path / "cache", "90-real")
    manifest, carry = _prepared(tmp_path)
    assert manifest["prebuilt"]["architectures"] == "90-real"
    with tarfile.open(carry / PREBUILT_NAME) as archive:
        assert sorted(archive.getnames()) == ["bin/libggml-cuda.so", "bin/llama-server", "lib/libllama-server-impl.so",
                                              "lib/libllama.so", "llama_cpp/lib/libllama.so"]
        copy = archive.getmember("lib/libllama.so")  # the wheel's second copy
        assert copy.issym() and copy.linkname == "../llama_cpp/lib/libllama.so"


def test_a_build_for_another_card_is_not_packed(tmp_path):
    _cuda_wheelhouse(tmp_path / "cache", "89-real")
    manifest, carry = _prepared(tmp_path)
    assert manifest["prebuilt"].startswith("none: no sm_90 CUDA build") and not (carry / PREBUILT_NAME).exists()


def test_a_build_that_would_overfill_the_carry_is_left_out_and_by_how_much(tmp_path, monkeypatch):
    _cuda_wheelhouse(tmp_path / "cache", "90-real", module_bytes=3 * 1024 * 1024)
    monkeypatch.setattr(prepare, "CARRY_LIMIT_MIB", 1.0)
    manifest, carry = _prepared(tmp_path)
    assert manifest["prebuilt"].startswith("left out: ") and " over 1; gpu.sh builds there" in manifest["prebuilt"]
    assert not (carry / PREBUILT_NAME).exists()
