"""Read what the rest of the app needs to know about a .gguf model file.

The header is walked directly instead of through ``gguf.GGUFReader``: the
reader materialises every vocabulary and merge string as numpy views, which
takes ~3 s for SmolLM2's 49k-token vocabulary and several times that for
128k-token models -- too slow for a settings dialog.  We only need counts and
a few scalars, so we skip string arrays and take the authoritative type
tables (quant block sizes, file-type names) from the ``gguf`` package.

Every failure surfaces as a one-line ``ModelFileError`` that names the file
and says what to do; nothing here lets a traceback reach the user.

Files may come from strangers, and a sparse file can claim gigabytes of
header for free, so every count is capped before it is walked and the whole
header is capped in size: parsing a hostile file costs bounded time and memory.
"""

from __future__ import annotations

import array
import hashlib
import math
import mmap
import os
import re
import struct
import sys
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, TypeVar

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, LlamaFileType

GGUF_MAGIC = b"GGUF"
SUPPORTED_GGUF_VERSIONS = (2, 3)  # v1 predates 64-bit counts; llama.cpp refuses it too
DEFAULT_ALIGNMENT = 32  # GGUF spec default when general.alignment is absent
MAX_TENSOR_DIMS = 4  # GGML_MAX_DIMS; more means the header is garbage

# Caps on what a header may claim.  A sparse file makes file-size checks
# worthless (gigabytes of zeros cost nothing on disk), so these bound the work
# and memory a hostile file can demand.  Each is far above any real model.
MAX_TENSOR_COUNT = 262_144  # the largest real models have a few thousand tensors
MAX_METADATA_COUNT = 65_536  # real models have under a hundred key-value pairs
MAX_ARRAY_LENGTH = 1 << 22  # vocabularies and merge lists reach ~500k entries
MAX_STRING_BYTES = 4 << 20  # the longest values, chat templates, are tens of KiB
MAX_ARRAY_NESTING = 4  # llama.cpp rejects arrays of arrays; 1 level is all real files use
# Everything before the tensor data.  Big-vocabulary models need ~10 MiB; the
# cap also bounds the total walk, since every walked item uses header bytes.
MAX_HEADER_BYTES = 64 << 20
# llama.cpp keeps per-layer hyperparameters in arrays of this size and refuses
# a larger block_count (LLAMA_MAX_LAYERS).
LLAMA_MAX_LAYERS = 512
# llama.cpp reads the other hyperparameters as uint32.
MAX_HYPERPARAMETER = 2**32 - 1
# Longest problem description quoted from a file in an error message.
_MAX_DETAIL_CHARS = 300

# Hints appended to errors: the user fixes these by pointing the app elsewhere
# or re-downloading, so the message says exactly that.
_POINT_ELSEWHERE = "point --model or [model] path in the config at a .gguf file"
_REDOWNLOAD = "download the model again"

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}

# Numeric arrays are kept as array.array: memory equals the bytes in the file,
# where a tuple of Python numbers would take up to 36 times that.  "B" stands
# in for bool, which array.array lacks; only truthiness is ever read.
_ARRAY_TYPECODES: dict[GGUFValueType, str] = {**_SCALAR_FORMATS, GGUFValueType.BOOL: "B"}

_Info = TypeVar("_Info")

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.")
_ARCHITECTURE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # llama.cpp's are like "llama", "gpt-oss", "ernie4_5"


class ModelFileError(Exception):
    """One-line, user-facing: names the file and says what to do."""


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    file_size: int
    architecture: str
    name: str
    file_type: str
    parameter_count: int
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_ctx_train: int  # 0 when the file does not say
    n_vocab: int
    layer_bytes: tuple[int, ...]
    non_layer_bytes: int
    output_bytes: int
    chat_template: str | None
    tokenizer_model: str | None
    # A digest of the vocabulary's token strings (tokenizer.ggml.tokens): a
    # draft model must have the target's ("" when the file has none).
    vocab_digest: str = ""
    # The file's mtime when it was read. With file_size, what the API lists
    # without touching the disk again: a file deleted since must not fail a listing.
    modified: float = 0.0

    @property
    def weights_bytes(self) -> int:
        return sum(self.layer_bytes) + self.non_layer_bytes


@dataclass(frozen=True, slots=True)  # up to MAX_TENSOR_COUNT of these: keep them small
class _TensorEntry:
    name: str
    quant_type: GGMLQuantizationType
    n_elements: int
    n_bytes: int
    end_offset: int  # relative to the start of the data section


@dataclass(frozen=True)
class _SkippedArray:
    """Stands in for an array of strings or arrays that we walked past without
    keeping: only its length matters to us."""

    item_type: GGUFValueType
    length: int
    # For an array of strings, a digest of its bytes as stored: two files
    # with the same vocabulary have the same tokenizer.ggml.tokens digest.
    digest: str = ""


class _Truncated(Exception):
    """The header claims more bytes than the file holds."""

    def __init__(self, detail: str = "the header ends early") -> None:
        super().__init__(detail)


class _Corrupt(Exception):
    """The header is self-inconsistent; the message says how."""


class _HeaderCursor:
    def __init__(self, buffer: mmap.mmap, byte_order: str) -> None:
        self._buffer = buffer
        self._byte_order = byte_order
        self._read_length = struct.Struct(byte_order + "Q").unpack_from
        self._limit = min(len(buffer), MAX_HEADER_BYTES)
        self.position = 0

    def _past_limit(self) -> Exception:
        if self._limit < len(self._buffer):
            return _Corrupt(f"the header runs past {MAX_HEADER_BYTES >> 20} MiB, far beyond any real model's")
        return _Truncated()

    def expect_at_least(self, n_bytes: int) -> None:
        # Called with the smallest size a claimed count needs, before walking
        # it, so a count the file cannot hold fails at once.
        if self.position + n_bytes > self._limit:
            raise self._past_limit()

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.expect_at_least(size)
        (value,) = struct.unpack_from(self._byte_order + fmt, self._buffer, self.position)
        self.position += size
        return value

    def count(self, what: str, maximum: int) -> int:
        value = self.unpack("Q")
        if value > maximum:
            raise _Corrupt(f"it claims {value:,} {what}, more than the {maximum:,} allowed")
        return value

    def string(self, what: str = "bytes in a string") -> str:
        length = self.count(what, MAX_STRING_BYTES)
        self.expect_at_least(length)
        raw = self._buffer[self.position : self.position + length]
        self.position += length
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        # Vocabularies hold 10^5 strings: skip by length, never decode.  The
        # loop is the hot path for real models, hence the local names.
        self.expect_at_least(count * 8)
        buffer, limit, read_length, position = self._buffer, self._limit, self._read_length, self.position
        for _ in range(count):
            if position + 8 > limit:
                raise self._past_limit()
            (length,) = read_length(buffer, position)
            if length > MAX_STRING_BYTES:
                raise _Corrupt(f"it claims {length:,} bytes in a string, more than the {MAX_STRING_BYTES:,} allowed")
            position += 8 + length
        self.position = position
        self.expect_at_least(0)

    def value(self, value_type: int) -> Any:
        value_type = _value_type(value_type)
        if value_type is GGUFValueType.STRING:
            return self.string()
        if value_type is GGUFValueType.ARRAY:
            return self._array(depth=1)
        return self.unpack(_SCALAR_FORMATS[value_type])

    def _array(self, depth: int) -> Any:
        if depth > MAX_ARRAY_NESTING:
            raise _Corrupt(f"its metadata arrays nest more than {MAX_ARRAY_NESTING} deep")
        item_type = _value_type(self.unpack("I"))
        length = self.count("array items", MAX_ARRAY_LENGTH)
        if item_type is GGUFValueType.STRING:
            start = self.position
            self.skip_strings(length)
            digest = hashlib.blake2b(self._buffer[start:self.position], digest_size=16).hexdigest()
            return _SkippedArray(item_type, length, digest)
        if item_type is GGUFValueType.ARRAY:
            self.expect_at_least(length * 12)  # each nested array: type u32 + count u64
            for _ in range(length):
                self._array(depth + 1)
            return _SkippedArray(item_type, length)
        total = struct.calcsize(_SCALAR_FORMATS[item_type]) * length
        self.expect_at_least(total)
        values = array.array(_ARRAY_TYPECODES[item_type])
        values.frombytes(self._buffer[self.position : self.position + total])
        if self._byte_order != _NATIVE_BYTE_ORDER:
            values.byteswap()
        self.position += total
        return values


_NATIVE_BYTE_ORDER = "<" if sys.byteorder == "little" else ">"


def _value_type(raw: int) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise _Corrupt(f"unknown metadata value type {raw}") from None


def read_model_info(path: str | os.PathLike[str]) -> ModelInfo:
    """The one place parse failures become ModelFileError: whatever goes wrong
    inside (our own checks or an error nobody foresaw), the caller gets one
    line that names the file."""
    return _read_safely(Path(path), _read_model_info)


def read_projector_info(path: str | os.PathLike[str]) -> "ProjectorInfo":
    """A multimodal projector's (mmproj) sizes, with read_model_info's one-line errors."""
    return _read_safely(Path(path), _read_projector_info)


def read_paired_projector(projector_path: str | os.PathLike[str], model: ModelInfo) -> "ProjectorInfo":
    """The projector paired with `model`, checked to feed embeddings as wide as
    the model's (llama-server refuses the pair at load otherwise)."""
    projector = read_projector_info(projector_path)
    if projector.output_width and projector.output_width != model.n_embd:
        raise ModelFileError(
            f"projector file {projector.path} makes {projector.output_width}-wide embeddings but the model "
            f"{model.path.name} is {model.n_embd} wide: it belongs to another model; use this model's own mmproj")
    return projector


def _read_safely(model_path: Path, read: Callable[[Path], _Info]) -> _Info:
    try:
        return read(model_path)
    except ModelFileError as error:
        raise ModelFileError(_one_line(str(error))) from None
    except FileNotFoundError:
        raise ModelFileError(f"model file {model_path} does not exist: {_POINT_ELSEWHERE}") from None
    except IsADirectoryError:
        raise ModelFileError(f"model file {model_path} is a directory: {_POINT_ELSEWHERE}") from None
    except PermissionError:
        if model_path.is_dir():  # Windows reports opening a directory as EACCES
            raise ModelFileError(f"model file {model_path} is a directory: {_POINT_ELSEWHERE}") from None
        raise ModelFileError(
            f"model file {model_path} cannot be read (permission denied): "
            "give your user read access to it or move it somewhere you own"
        ) from None
    except _Truncated as problem:
        raise ModelFileError(
            f"model file {model_path} is truncated or corrupt ({_detail(problem)}): {_REDOWNLOAD}"
        ) from None
    except _Corrupt as problem:
        raise ModelFileError(f"model file {model_path} is corrupt ({_detail(problem)}): {_REDOWNLOAD}") from None
    except OSError as error:
        reason = error.strerror or str(error)
        raise ModelFileError(
            f"model file {model_path} cannot be read ({_detail(reason)}): {_POINT_ELSEWHERE}"
        ) from None
    except Exception as error:  # noqa: BLE001 - a hostile header must not become a traceback
        # MemoryError and RecursionError are Exceptions too; KeyboardInterrupt is not, and passes.
        raise ModelFileError(
            f"model file {model_path} is corrupt ({type(error).__name__}: {_detail(error)}): {_REDOWNLOAD}"
        ) from None


def _detail(problem: object) -> str:
    return _one_line(str(problem), limit=_MAX_DETAIL_CHARS)


def _one_line(text: str, limit: int | None = None) -> str:
    # Messages quote names and values from the file, which may hold newlines,
    # control characters or megabytes of text; the user gets one short line.
    flat = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    if limit is not None and len(flat) > limit:
        return flat[: limit - 1] + "…"
    return flat


def _read_model_info(model_path: Path) -> ModelInfo:
    file_size, modified, metadata, tensors = _read_header(model_path)
    return replace(_build_info(model_path, file_size, metadata, tensors), modified=modified)


def _read_projector_info(model_path: Path) -> "ProjectorInfo":
    file_size, _, metadata, tensors = _read_header(model_path)
    return _build_projector_info(model_path, file_size, metadata, tensors)


def _read_header(model_path: Path) -> tuple[int, float, dict[str, Any], list[_TensorEntry]]:
    with open(model_path, "rb") as model_file:
        facts = os.fstat(model_file.fileno())
        file_size = facts.st_size
        magic = model_file.read(len(GGUF_MAGIC))
        if magic != GGUF_MAGIC:
            raise ModelFileError(_describe_bad_magic(model_path, magic))
        with mmap.mmap(model_file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            metadata, tensors, data_start = _parse_header(buffer, model_path)
    for tensor in tensors:
        # llama.cpp refuses these too ("data is not within the file bounds").
        if data_start + tensor.end_offset > file_size:
            raise _Truncated(
                f"tensor {tensor.name!r} ends at byte {data_start + tensor.end_offset:,} but the file has {file_size:,}"
            )
    return file_size, facts.st_mtime, metadata, tensors


def _describe_bad_magic(model_path: Path, magic: bytes) -> str:
    if not magic:
        return f"model file {model_path} is empty: {_REDOWNLOAD}"
    return f"model file {model_path} is not a GGUF file (bad magic {magic!r}): download the .gguf build of the model"


def _parse_header(buffer: mmap.mmap, model_path: Path) -> tuple[dict[str, Any], list[_TensorEntry], int]:
    byte_order = "<"
    cursor = _HeaderCursor(buffer, byte_order)
    cursor.position = len(GGUF_MAGIC)
    version = cursor.unpack("I")
    if version & 0xFFFF == 0 and version != 0:
        # A big-endian file read as little-endian puts the version in the high half.
        byte_order = ">"
        cursor = _HeaderCursor(buffer, byte_order)
        cursor.position = len(GGUF_MAGIC)
        version = cursor.unpack("I")
    if version not in SUPPORTED_GGUF_VERSIONS:
        raise ModelFileError(
            f"model file {model_path} uses GGUF version {version}, which is not supported: "
            "download a current .gguf build of the model"
        )
    tensor_count = cursor.count("tensors", MAX_TENSOR_COUNT)
    metadata_count = cursor.count("metadata entries", MAX_METADATA_COUNT)

    cursor.expect_at_least(metadata_count * 12 + tensor_count * 24)  # smallest possible entries
    metadata: dict[str, Any] = {}
    for _ in range(metadata_count):
        key = cursor.string("bytes in a metadata key")
        metadata[key] = cursor.value(cursor.unpack("I"))

    tensors = [_read_tensor_entry(cursor) for _ in range(tensor_count)]
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise _Corrupt(f"general.alignment is {alignment!r}")
    data_start = -(-cursor.position // alignment) * alignment
    return metadata, tensors, data_start


def _read_tensor_entry(cursor: _HeaderCursor) -> _TensorEntry:
    name = cursor.string("bytes in a tensor name")
    n_dims = cursor.unpack("I")
    if n_dims > MAX_TENSOR_DIMS:
        raise _Corrupt(f"tensor {name!r} claims {n_dims} dimensions")
    dims = [cursor.unpack("Q") for _ in range(n_dims)]
    raw_type = cursor.unpack("I")
    offset = cursor.unpack("Q")
    try:
        quant_type = GGMLQuantizationType(raw_type)
    except ValueError:
        raise _Corrupt(
            f"tensor {name!r} has type {raw_type}, unknown to the installed gguf package; "
            "upgrading gguf may also fix this"
        ) from None
    block_size, type_size = GGML_QUANT_SIZES[quant_type]
    n_elements = 1
    for dim in dims:
        n_elements *= dim
    if dims and dims[0] % block_size:
        raise _Corrupt(f"tensor {name!r} row of {dims[0]} is not a multiple of its {block_size}-element blocks")
    n_bytes = n_elements // block_size * type_size
    return _TensorEntry(name, quant_type, n_elements, n_bytes, offset + n_bytes)


def _build_info(model_path: Path, file_size: int, metadata: dict[str, Any], tensors: list[_TensorEntry]) -> ModelInfo:
    def require(key: str) -> Any:
        if key not in metadata:
            raise ModelFileError(
                f"model file {model_path} lacks the metadata key {key}, so it is not a usable llama.cpp model: "
                "download a complete .gguf build of the model"
            )
        return metadata[key]

    def count(key: str, *, default: int = 0, required: bool = False, maximum: int = MAX_HYPERPARAMETER) -> int:
        return _as_count(require(key) if required else metadata.get(key, default), key, maximum)

    architecture = require("general.architecture")
    # It prefixes the keys we look up and appears in messages, so a hostile
    # value must not smuggle dots, newlines or megabytes into either.
    if not isinstance(architecture, str) or not _ARCHITECTURE_NAME.fullmatch(architecture):
        raise _Corrupt(f"general.architecture is {_shorten(architecture)}, not an architecture name")
    prefix = f"{architecture}."
    # block_count sizes layer_bytes and the fit search, so it is the one
    # count that must be small, and a model without blocks is no model.
    n_layer = count(prefix + "block_count", required=True, maximum=LLAMA_MAX_LAYERS)
    if n_layer == 0:
        raise _Corrupt(f"{prefix}block_count is 0")
    n_embd = count(prefix + "embedding_length", required=True)
    # Some architectures store per-layer head counts as arrays; the widest
    # layer bounds the KV cache, so take the maximum to stay conservative.
    n_head = count(prefix + "attention.head_count", default=0)
    n_head_kv = count(prefix + "attention.head_count_kv", default=n_head)
    default_head_dim = n_embd // n_head if n_head else 0
    head_dim_k = count(prefix + "attention.key_length", default=default_head_dim)
    head_dim_v = count(prefix + "attention.value_length", default=head_dim_k)

    tensor_bytes = {tensor.name: tensor.n_bytes for tensor in tensors}
    layer_bytes = [0] * n_layer
    non_layer_bytes = 0
    for tensor in tensors:
        match = _LAYER_TENSOR.match(tensor.name)
        index = int(match.group(1)) if match else -1
        # Blocks past block_count (e.g. next-token-prediction heads) are not
        # offloadable layers in llama.cpp's sense, so they count as non-layer.
        if 0 <= index < n_layer:
            layer_bytes[index] += tensor.n_bytes
        else:
            non_layer_bytes += tensor.n_bytes

    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab_digest = ""
    if isinstance(tokens, _SkippedArray) and tokens.item_type is GGUFValueType.STRING:
        n_vocab, vocab_digest = tokens.length, tokens.digest
    else:
        n_vocab = count(prefix + "vocab_size", default=0)

    chat_template = metadata.get("tokenizer.chat_template")
    tokenizer_model = metadata.get("tokenizer.ggml.model")
    name = metadata.get("general.name")
    return ModelInfo(
        path=model_path,
        file_size=file_size,
        architecture=architecture,
        name=name if isinstance(name, str) and name.strip() else model_path.stem,
        file_type=_file_type_name(metadata.get("general.file_type"), tensors),
        parameter_count=sum(tensor.n_elements for tensor in tensors),
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        n_ctx_train=count(prefix + "context_length", default=0),
        n_vocab=n_vocab,
        layer_bytes=tuple(layer_bytes),
        non_layer_bytes=non_layer_bytes,
        output_bytes=tensor_bytes.get("output.weight", tensor_bytes.get("token_embd.weight", 0)),
        chat_template=chat_template if isinstance(chat_template, str) else None,
        tokenizer_model=tokenizer_model if isinstance(tokenizer_model, str) else None,
        vocab_digest=vocab_digest,
    )


@dataclass(frozen=True)
class ProjectorInfo:
    """What the memory estimate and the library need of a multimodal projector
    (llama.cpp's mmproj file: a vision encoder and the projection to the text
    model's width), read from the keys tools/mtmd/clip.cpp reads."""

    path: Path
    file_size: int
    projector_type: str
    weights_bytes: int
    width: int          # clip.vision.embedding_length
    n_ff: int
    n_head: int
    n_block: int
    image_size: int     # the side an image is resized to (fixed-size encoders) or a nominal one
    patch_size: int
    output_width: int   # clip.vision.projection_dim: the text model's n_embd it feeds

    @property
    def tokens_per_image(self) -> int:
        """Patches of one image_size-square image: what a fixed-size encoder always makes."""
        return (self.image_size // self.patch_size) ** 2 if self.patch_size else 0


def _build_projector_info(model_path: Path, file_size: int, metadata: dict[str, Any],
                          tensors: list[_TensorEntry]) -> ProjectorInfo:
    def count(key: str, default: int | None = None) -> int:
        if key not in metadata and default is None:
            raise ModelFileError(f"projector file {model_path} lacks the metadata key {key}, so it is not a "
                                 "llama.cpp vision projector (mmproj): download the model's mmproj .gguf again")
        return _as_count(metadata.get(key, default), key, MAX_HYPERPARAMETER)

    if not metadata.get("clip.has_vision_encoder"):
        raise ModelFileError(f"projector file {model_path} has no vision encoder (clip.has_vision_encoder), "
                             "so it can't read images: use the model's vision mmproj .gguf")
    projector_type = metadata.get("clip.projector_type", metadata.get("clip.vision.projector_type", ""))
    return ProjectorInfo(
        path=model_path,
        file_size=file_size,
        projector_type=projector_type if isinstance(projector_type, str) else "",
        weights_bytes=sum(tensor.n_bytes for tensor in tensors),
        width=count("clip.vision.embedding_length"),
        n_ff=count("clip.vision.feed_forward_length", 0),
        n_head=count("clip.vision.attention.head_count", 1),
        n_block=count("clip.vision.block_count", 0),
        image_size=count("clip.vision.image_size"),
        patch_size=count("clip.vision.patch_size"),
        output_width=count("clip.vision.projection_dim", 0),
    )


def _as_count(value: Any, key: str, maximum: int) -> int:
    if isinstance(value, array.array):  # per-layer values
        if len(value) > LLAMA_MAX_LAYERS:
            raise _Corrupt(f"{key} has {len(value):,} per-layer values; llama.cpp allows at most {LLAMA_MAX_LAYERS}")
        value = max(value, default=0)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise _Corrupt(f"{key} is {_shorten(value)}, not a count")
    if value > maximum:
        raise _Corrupt(f"{key} is {value:,}, more than the {maximum:,} llama.cpp allows")
    return int(value)


def _shorten(value: Any) -> str:
    # The value may be a megabyte string or a _SkippedArray; repr a bounded part.
    text = repr(value)
    return text if len(text) <= 80 else text[:79] + "…"


def _file_type_name(raw_file_type: Any, tensors: list[_TensorEntry]) -> str:
    if isinstance(raw_file_type, int):
        try:
            # LlamaFileType names read "MOSTLY_Q4_K_M" / "ALL_F32"; users know "Q4_K_M" / "F32".
            return LlamaFileType(raw_file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    # Counting tensors would crown the many tiny F32 norm vectors, so weigh by bytes.
    bytes_per_type: Counter[str] = Counter()
    for tensor in tensors:
        bytes_per_type[tensor.quant_type.name] += tensor.n_bytes
    return bytes_per_type.most_common(1)[0][0] if bytes_per_type else "unknown"
