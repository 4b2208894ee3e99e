"""A tiny llama-architecture GGUF with SmolLM2's real tokenizer and random weights.

The GPU check runs on a machine that reaches no package index and takes a
few tens of MiB per transfer, so the bundled 98 MB model cannot travel.  What
travels is the tokenizer (``export``: every ``tokenizer.*`` key of the bundled
model, gzipped JSON, well under 1 MB); the machine then writes a model on the
spot (``write``) from it and a seeded random generator.

The model answers gibberish, but llama.cpp loads and runs it like any llama
model: same tokenizer, same chat template, real CUDA kernels.  Its
``context_length`` is large (1M tokens by default) so llama-server accepts
contexts of 64k..1M tokens and the KV cache, which llama.cpp allocates at load
for the whole context, makes VRAM use real:

    KV bytes per token = 2 (K and V) * n_layer * n_head_kv * (n_embd / n_head) * 2 (f16)

which is 2 KiB for the defaults: 128 MiB at 64k tokens, 2 GiB at 1M.

The output matrix is tied to ``token_embd.weight`` (no ``output.weight``), as
in SmolLM2 itself: llama.cpp's llama loader falls back to the embeddings when
``output.weight`` is absent.

Only numpy, gguf and the standard library are imported: the GPU machine has
numpy, and gguf travels as a wheel.

    python -m benchmarks.gpu_check.tiny_model export --source MODEL.gguf --out tokenizer.json.gz
    python -m benchmarks.gpu_check.tiny_model write --tokenizer tokenizer.json.gz --out tiny.gguf
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

FORMAT = "tiny-model-tokenizer/1"
TINY_MODEL_NAME = "tiny-random-smollm2-tokenizer"
WEIGHT_STD = 0.02
RMS_EPSILON = 1e-5
ROPE_FREQ_BASE = 100_000.0  # SmolLM2's
DTYPES = {"f16": (np.float16, LlamaFileType.MOSTLY_F16), "f32": (np.float32, LlamaFileType.ALL_F32)}


def export_tokenizer(source_gguf: Path, dest_json: Path) -> int:
    """Write every ``tokenizer.*`` key of source_gguf, with its GGUF value
    type, and its ``general.name`` to dest_json (gzipped when the name ends in
    .gz). Returns the size of dest_json in bytes."""
    reader = GGUFReader(source_gguf)
    keys: list[list[Any]] = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value_type = GGUFValueType(field.types[0])
        item_type = GGUFValueType(field.types[-1]).name if value_type is GGUFValueType.ARRAY else None
        if value_type is GGUFValueType.ARRAY and len(field.types) != 2:
            raise ValueError(f"{source_gguf}: {key} is a nested array, which this exporter does not handle")
        keys.append([key, value_type.name, item_type, field.contents()])
    if not any(key == "tokenizer.ggml.tokens" for key, *_ in keys):
        raise ValueError(f"{source_gguf} has no tokenizer.ggml.tokens: not a model with a llama.cpp tokenizer")
    name_field = reader.fields.get("general.name")
    document = {
        "format": FORMAT,
        "source": {"file": Path(source_gguf).name,
                   "general.name": name_field.contents() if name_field is not None else None},
        "keys": keys,
    }
    data = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    dest_json = Path(dest_json)
    dest_json.parent.mkdir(parents=True, exist_ok=True)
    if dest_json.suffix == ".gz":
        # mtime=0 and no file name in the header: the same source gives the same bytes.
        data = gzip.compress(data, compresslevel=9, mtime=0)
    dest_json.write_bytes(data)
    return dest_json.stat().st_size


def load_tokenizer(tokenizer_json: Path) -> dict[str, Any]:
    """The document export_tokenizer wrote."""
    raw = Path(tokenizer_json).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    document = json.loads(raw)
    if document.get("format") != FORMAT:
        raise ValueError(f"{tokenizer_json} is not a {FORMAT} tokenizer export")
    return document


def kv_bytes_per_token(*, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, kv_bytes: int = 2) -> int:
    """K and V of one token across all layers, f16 by default."""
    return 2 * n_layer * n_head_kv * (n_embd // n_head) * kv_bytes


def write_tiny_model(tokenizer_json: Path, dest: Path, *, n_layer: int = 4, n_embd: int = 128, n_head: int = 4,
                     n_head_kv: int = 4, n_ff: int = 256, context_length: int = 1_048_576, seed: int = 0,
                     dtype: str = "f16") -> int:
    """Write a llama-architecture GGUF with the exported tokenizer and random
    weights (normal, std 0.02, from numpy's Generator seeded with seed; norm
    weights are ones). The same arguments give the same bytes. Returns the
    file size in bytes."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if min(n_layer, n_embd, n_head, n_head_kv, n_ff, context_length) < 1:
        raise ValueError("every dimension must be positive")
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError(f"n_embd {n_embd} must divide by n_head {n_head}, and n_head by n_head_kv {n_head_kv}")
    head_dim = n_embd // n_head
    if head_dim % 2:
        raise ValueError(f"the head dimension n_embd / n_head = {head_dim} must be even for RoPE")
    weight_dtype, file_type = DTYPES[dtype]
    tokenizer = load_tokenizer(tokenizer_json)
    keys = tokenizer["keys"]
    tokens = next(value for key, _, _, value in keys if key == "tokenizer.ggml.tokens")
    n_vocab = len(tokens)

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(dest, "llama")
    source_name = tokenizer["source"].get("general.name") or tokenizer["source"].get("file")
    writer.add_name(TINY_MODEL_NAME)
    writer.add_description(f"random weights, not a language model; tokenizer of {source_name}; seed {seed}")
    writer.add_file_type(int(file_type))
    writer.add_context_length(context_length)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_layer_norm_rms_eps(RMS_EPSILON)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(ROPE_FREQ_BASE)
    writer.add_vocab_size(n_vocab)
    for key, type_name, item_type_name, value in keys:
        item_type = GGUFValueType[item_type_name] if item_type_name else None
        writer.add_key_value(key, value, GGUFValueType[type_name], sub_type=item_type)

    rng = np.random.default_rng(seed)

    def random(*numpy_shape: int) -> np.ndarray:
        # numpy shapes are ggml's ne reversed: (rows = outputs, columns = inputs).
        return (rng.standard_normal(numpy_shape, dtype=np.float32) * WEIGHT_STD).astype(weight_dtype)

    def ones() -> np.ndarray:
        return np.ones(n_embd, dtype=np.float32)

    n_embd_kv = n_head_kv * head_dim
    # No output.weight: tied to token_embd, as in SmolLM2.
    writer.add_tensor("token_embd.weight", random(n_vocab, n_embd))
    writer.add_tensor("output_norm.weight", ones())
    for block in range(n_layer):
        prefix = f"blk.{block}."
        writer.add_tensor(prefix + "attn_norm.weight", ones())
        writer.add_tensor(prefix + "attn_q.weight", random(n_embd, n_embd))
        writer.add_tensor(prefix + "attn_k.weight", random(n_embd_kv, n_embd))
        writer.add_tensor(prefix + "attn_v.weight", random(n_embd_kv, n_embd))
        writer.add_tensor(prefix + "attn_output.weight", random(n_embd, n_embd))
        writer.add_tensor(prefix + "ffn_norm.weight", ones())
        writer.add_tensor(prefix + "ffn_gate.weight", random(n_ff, n_embd))
        writer.add_tensor(prefix + "ffn_up.weight", random(n_ff, n_embd))
        writer.add_tensor(prefix + "ffn_down.weight", random(n_embd, n_ff))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest.stat().st_size


def _mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:.2f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check.tiny_model", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="export a GGUF model's tokenizer to gzipped JSON")
    export.add_argument("--source", type=Path, required=True, help="the .gguf model to take the tokenizer from")
    export.add_argument("--out", type=Path, required=True, help="where to write it, e.g. tokenizer.json.gz")
    write = commands.add_parser("write", help="write a tiny random-weight llama GGUF with an exported tokenizer")
    write.add_argument("--tokenizer", type=Path, required=True, help="what export wrote")
    write.add_argument("--out", type=Path, required=True, help="the .gguf to write")
    write.add_argument("--layers", type=int, default=4)
    write.add_argument("--embd", type=int, default=128)
    write.add_argument("--heads", type=int, default=4)
    write.add_argument("--heads-kv", type=int, default=4)
    write.add_argument("--ff", type=int, default=256)
    write.add_argument("--ctx", type=int, default=1_048_576, help="the model's training context (llama.context_length)")
    write.add_argument("--seed", type=int, default=0)
    write.add_argument("--dtype", choices=sorted(DTYPES), default="f16")
    args = parser.parse_args(argv)

    if args.command == "export":
        size = export_tokenizer(args.source, args.out)
        print(f"{args.out}: {_mib(size)} ({size:,} bytes)")
        return 0
    size = write_tiny_model(args.tokenizer, args.out, n_layer=args.layers, n_embd=args.embd, n_head=args.heads,
                            n_head_kv=args.heads_kv, n_ff=args.ff, context_length=args.ctx, seed=args.seed,
                            dtype=args.dtype)
    per_token = kv_bytes_per_token(n_layer=args.layers, n_embd=args.embd, n_head=args.heads, n_head_kv=args.heads_kv)
    print(f"{args.out}: {_mib(size)} ({size:,} bytes); f16 KV cache {per_token:,} bytes/token, "
          f"{_mib(per_token * 65_536)} at 64k tokens, {_mib(per_token * args.ctx)} at {args.ctx:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
