"""A tiny multimodal projector (an ``mmproj`` GGUF) with random weights, written on the spot.

No small vision model ships as a package this project can install, and a hub
can't be reached from the test machines, so the tests write one: a LLaVA-1.5
style projector (llama.cpp's ``clip.projector_type = "mlp"``), the type whose
graph needs the fewest tensors: a ViT (patch embedding, position embedding,
pre-norm blocks) and two linear layers to the text model's width.  It sees
nothing (the weights are noise), but llama-server loads it with ``--mmproj``,
decodes and preprocesses an image, runs the vision graph and feeds its
embeddings to the text model, so every byte of the image path is real.

The names and keys are those ``tools/mtmd/clip.cpp`` reads (``clip-impl.h``'s
``KEY_*`` and ``TN_*``).  What it needs for ``mlp``:

- keys: ``clip.has_vision_encoder``, ``clip.projector_type``,
  ``clip.vision.{embedding_length, feed_forward_length, block_count,
  projection_dim, attention.head_count, attention.layer_norm_epsilon}``,
  ``clip.vision.{image_size, patch_size, image_mean, image_std}``;
- tensors: ``v.patch_embd.weight`` (a conv kernel, patch x patch x 3 -> width),
  ``v.position_embd.weight``, per block ``v.blk.N.{ln1, attn_q, attn_k, attn_v,
  attn_out, ln2, ffn_up, ffn_down}.{weight, bias}``, and ``mm.0`` / ``mm.2``
  (weight and bias), whose output width must equal the text model's
  ``n_embd`` or llama-server refuses the pair at load.

LLaVA's graph runs ``block_count - 1`` blocks (it takes the second-to-last
layer's output), so two blocks run one.  An image becomes
``(image_size / patch_size) ** 2`` tokens: 16 with the defaults.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

WEIGHT_STD = 0.02
# CLIP's own normalisation; any three numbers would do for random weights.
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]


def image_tokens(*, image_size: int = 64, patch_size: int = 16) -> int:
    """How many tokens one image takes with this projector."""
    return (image_size // patch_size) ** 2


def write_tiny_projector(dest: Path, *, text_width: int, image_size: int = 64, patch_size: int = 16,
                         width: int = 64, n_head: int = 4, n_ff: int = 128, n_block: int = 2,
                         projector_hidden: int = 128, seed: int = 0) -> int:
    """Write an ``mlp`` projector GGUF to dest, with random weights (normal, std
    0.02, seeded; norm weights ones, biases zeros) whose output width is
    text_width. The same arguments give the same bytes. Returns the file size."""
    if image_size % patch_size:
        raise ValueError(f"image_size {image_size} must be a multiple of patch_size {patch_size}")
    if width % n_head:
        raise ValueError(f"width {width} must divide by n_head {n_head}")
    if n_ff == width:
        # clip.cpp swaps ffn_up and ffn_down of legacy llava files when ffn_down's input is the
        # width; a different n_ff keeps the shapes unambiguous.
        raise ValueError("n_ff must differ from width")
    rng = np.random.default_rng(seed)

    def noise(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * WEIGHT_STD).astype(np.float32)

    writer = GGUFWriter(str(dest), "clip")
    writer.add_name("tiny-random-llava-projector")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", image_size)
    writer.add_uint32("clip.vision.patch_size", patch_size)
    writer.add_uint32("clip.vision.embedding_length", width)
    writer.add_uint32("clip.vision.feed_forward_length", n_ff)
    writer.add_uint32("clip.vision.block_count", n_block)
    writer.add_uint32("clip.vision.projection_dim", text_width)
    writer.add_uint32("clip.vision.attention.head_count", n_head)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    writer.add_array("clip.vision.image_mean", IMAGE_MEAN)
    writer.add_array("clip.vision.image_std", IMAGE_STD)

    n_patches = image_tokens(image_size=image_size, patch_size=patch_size)
    # numpy shapes are ggml's ne reversed: a conv kernel is (out, in, kh, kw), a matrix (out, in).
    writer.add_tensor("v.patch_embd.weight", noise(width, 3, patch_size, patch_size))
    writer.add_tensor("v.position_embd.weight", noise(n_patches, width))
    for block in range(n_block):
        prefix = f"v.blk.{block}"
        for norm in ("ln1", "ln2"):
            writer.add_tensor(f"{prefix}.{norm}.weight", np.ones(width, dtype=np.float32))
            writer.add_tensor(f"{prefix}.{norm}.bias", np.zeros(width, dtype=np.float32))
        for attention in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(f"{prefix}.{attention}.weight", noise(width, width))
            writer.add_tensor(f"{prefix}.{attention}.bias", np.zeros(width, dtype=np.float32))
        writer.add_tensor(f"{prefix}.ffn_up.weight", noise(n_ff, width))
        writer.add_tensor(f"{prefix}.ffn_up.bias", np.zeros(n_ff, dtype=np.float32))
        writer.add_tensor(f"{prefix}.ffn_down.weight", noise(width, n_ff))
        writer.add_tensor(f"{prefix}.ffn_down.bias", np.zeros(width, dtype=np.float32))
    writer.add_tensor("mm.0.weight", noise(projector_hidden, width))
    writer.add_tensor("mm.0.bias", np.zeros(projector_hidden, dtype=np.float32))
    writer.add_tensor("mm.2.weight", noise(text_width, projector_hidden))
    writer.add_tensor("mm.2.bias", np.zeros(text_width, dtype=np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dest).stat().st_size


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def tiny_png(width: int = 8, height: int = 8, rgb: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    """A small solid-colour PNG, built with the standard library only."""
    row = b"\x00" + bytes(rgb) * width
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + _png_chunk(b"IDAT", zlib.compress(row * height)) + _png_chunk(b"IEND", b""))


def png_bomb(width: int, height: int) -> bytes:
    """A real PNG of width x height black grey pixels: a few hundred KB that
    decode to width * height bytes (what a decompression bomb is)."""
    packer, row = zlib.compressobj(9), b"\x00" * (width + 1)
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b""))
