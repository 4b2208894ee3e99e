"""The tiny random-weight model the GPU check writes on the spot: a valid
llama GGUF carrying the bundled model's tokenizer unchanged."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from unittest import mock

import pytest
from gguf import GGUFReader, GGUFValueType

from benchmarks.gpu_check import tiny_model
from tray_app.core.config import bundled_model_path
from tray_app.core.memory.gguf_info import read_model_info

N_LAYER, N_EMBD, N_HEAD, N_HEAD_KV, N_FF = 4, 128, 4, 4, 256
HEAD_DIM = N_EMBD // N_HEAD
# The f16 embeddings alone are 49152 x 128 x 2 bytes = 12 MiB.
MAX_DEFAULT_MODEL_BYTES = 16 << 20
MAX_TOKENIZER_BYTES = 2 << 20


@pytest.fixture(scope="module")
def source(bundled_gguf):
    return bundled_gguf


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, source):
    path = tmp_path_factory.mktemp("tiny") / "tokenizer.json.gz"
    # The export reads the bundled model with gguf-py's reader, which `source`
    # already built (seconds of Python each time): it is lent that one.
    def reader(gguf_path, *args, **kwargs):
        return source if Path(gguf_path) == bundled_model_path() else GGUFReader(gguf_path, *args, **kwargs)

    with mock.patch.object(tiny_model, "GGUFReader", reader):
        size = tiny_model.export_tokenizer(bundled_model_path(), path)
    assert size == path.stat().st_size
    return path


@pytest.fixture(scope="module")
def model(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    size = tiny_model.write_tiny_model(tokenizer, path)
    assert size == path.stat().st_size
    return path


@pytest.fixture(scope="module")
def model_reader(model):
    return GGUFReader(model)


def test_the_exported_tokenizer_is_small_gzipped_json_with_every_tokenizer_key(tokenizer, source):
    assert tokenizer.stat().st_size <= MAX_TOKENIZER_BYTES
    document = json.loads(gzip.decompress(tokenizer.read_bytes()))
    assert document["format"] == tiny_model.FORMAT
    assert document["source"]["general.name"] == source.fields["general.name"].contents()
    exported = [key for key, *_ in document["keys"]]
    assert exported == [key for key in source.fields if key.startswith("tokenizer.")]
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.model",
            "tokenizer.chat_template", "tokenizer.ggml.eos_token_id"} <= set(exported)


def test_the_tiny_model_is_a_small_llama_with_the_requested_dimensions(model, model_reader):
    assert model.stat().st_size < MAX_DEFAULT_MODEL_BYTES
    fields = model_reader.fields
    assert fields["general.architecture"].contents() == "llama"
    assert fields["general.name"].contents() == tiny_model.TINY_MODEL_NAME
    expected = {
        "llama.context_length": 1_048_576,
        "llama.embedding_length": N_EMBD,
        "llama.block_count": N_LAYER,
        "llama.feed_forward_length": N_FF,
        "llama.attention.head_count": N_HEAD,
        "llama.attention.head_count_kv": N_HEAD_KV,
        "llama.rope.dimension_count": HEAD_DIM,
        "llama.vocab_size": 49152,
    }
    assert {key: fields[key].contents() for key in expected} == expected
    assert fields["llama.attention.layer_norm_rms_epsilon"].contents() == pytest.approx(1e-5)


def test_the_tensors_have_llama_cpp_shapes_and_the_output_is_tied(model_reader):
    # GGUFReader reports ggml's ne order: (inputs, outputs).
    shapes = {tensor.name: tuple(int(n) for n in tensor.shape) for tensor in model_reader.tensors}
    types = {tensor.name: tensor.tensor_type.name for tensor in model_reader.tensors}
    n_embd_kv = N_HEAD_KV * HEAD_DIM
    expected = {"token_embd.weight": (N_EMBD, 49152), "output_norm.weight": (N_EMBD,)}
    for block in range(N_LAYER):
        expected |= {
            f"blk.{block}.attn_norm.weight": (N_EMBD,),
            f"blk.{block}.attn_q.weight": (N_EMBD, N_EMBD),
            f"blk.{block}.attn_k.weight": (N_EMBD, n_embd_kv),
            f"blk.{block}.attn_v.weight": (N_EMBD, n_embd_kv),
            f"blk.{block}.attn_output.weight": (N_EMBD, N_EMBD),
            f"blk.{block}.ffn_norm.weight": (N_EMBD,),
            f"blk.{block}.ffn_gate.weight": (N_EMBD, N_FF),
            f"blk.{block}.ffn_up.weight": (N_EMBD, N_FF),
            f"blk.{block}.ffn_down.weight": (N_FF, N_EMBD),
        }
    assert shapes == expected
    assert len(model_reader.tensors) == 2 + 9 * N_LAYER
    assert "output.weight" not in shapes
    assert {name for name, kind in types.items() if kind == "F32"} == {name for name in shapes if "norm" in name}
    assert {kind for name, kind in types.items() if "norm" not in name} == {"F16"}
    norm = next(t for t in model_reader.tensors if t.name == "output_norm.weight")
    assert (norm.data == 1).all()
    embeddings = next(t for t in model_reader.tensors if t.name == "token_embd.weight")
    assert 0.015 < float(embeddings.data.astype("float32").std()) < 0.025


def test_the_tokenizer_keys_come_back_with_their_values_and_types(model_reader, source):
    keys = [key for key in source.fields if key.startswith("tokenizer.")]
    for key in keys:
        original, copied = source.fields[key], model_reader.fields[key]
        assert [GGUFValueType(t) for t in copied.types] == [GGUFValueType(t) for t in original.types], key
        assert copied.contents() == original.contents(), key


def test_the_same_seed_gives_the_same_bytes_and_another_seed_other_weights(tokenizer, model, tmp_path):
    again = tmp_path / "again.gguf"
    tiny_model.write_tiny_model(tokenizer, again)
    assert again.read_bytes() == model.read_bytes()
    other = tmp_path / "other.gguf"
    tiny_model.write_tiny_model(tokenizer, other, seed=1)
    assert other.stat().st_size == model.stat().st_size
    assert other.read_bytes() != model.read_bytes()


def test_bad_dimensions_are_refused_before_anything_is_written(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="n_head"):
        tiny_model.write_tiny_model(tokenizer, tmp_path / "bad.gguf", n_embd=100, n_head=3)
    with pytest.raises(ValueError, match="dtype"):
        tiny_model.write_tiny_model(tokenizer, tmp_path / "bad.gguf", dtype="q4_0")
    assert not (tmp_path / "bad.gguf").exists()


def test_the_kv_formula_matches_the_documented_one():
    assert tiny_model.kv_bytes_per_token(n_layer=4, n_embd=128, n_head=4, n_head_kv=4) == 2048


def test_the_command_line_writes_a_model_with_the_given_dimensions(tokenizer, tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert tiny_model.main(["write", "--tokenizer", str(tokenizer), "--out", str(out), "--layers", "2",
                            "--embd", "64", "--ctx", "65536"]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "MiB" in printed
    info = read_model_info(out)  # the app's own reader, and faster than GGUFReader
    assert (info.n_layer, info.n_embd, info.n_ctx_train, info.n_vocab) == (2, 64, 65536, 49152)
