"""The model library: every model the server can serve, by the name a
client asks for.

Three sources, in this order: the default model ([model] path, or the
bundled one), each [[models]] entry in the config, and every .gguf in the
models folder that no entry already names. Each model has its own GPU
profile (context, layers, slots), a CPU fallback (the same file, a smaller
model, or none) and how long its GPU worker stays loaded without a request.

Resolving a name is pure: exact names first, then aliases, Ollama's
":latest" tag, the file name, and "default".

A model reads images when it has a multimodal projector: `mmproj = "path"` in
its [[models]] entry, or an mmproj*.gguf beside its file (llama-server's
router mode uses the same convention). Projector files are not models.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

# A split GGUF's later parts ("model-00002-of-00003.gguf") are loaded through
# the first part; listing them as models of their own would be wrong.
_LATER_SPLIT_PART = re.compile(r"-(\d{5})-of-\d{5}\.gguf$", re.IGNORECASE)
PROJECTOR_PREFIX = "mmproj"
OLLAMA_TAG = ":latest"


@dataclass(frozen=True)
class LibraryModel:
    name: str
    path: Path
    aliases: tuple[str, ...] = ()
    source: str = "folder"            # "default", "config" or "folder"
    gpu_n_ctx: int = 0                # one request's context on the GPU (per slot); 0 = sized from memory
    gpu_layers: int = -1
    slots: int = 4
    cpu_path: Path | None = None      # the CPU fallback's file; None = no CPU fallback
    cpu_n_ctx: int = 0                # 0 = sized from memory (memory/context_size.py)
    idle_unload_s: float = 300.0      # the GPU worker unloads after this long idle; 0 = never
    mmproj: Path | None = None        # the projector that lets it read images; None = text only
    cpu_mmproj: Path | None = None    # the CPU fallback's projector (its model may be another file)

    @property
    def is_default(self) -> bool:
        return self.source == "default"

    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def sees_images(self) -> bool:
        return self.mmproj is not None


class LibraryError(ValueError):
    """Two models claim one name, or an entry names no file."""


class Library:
    def __init__(self, models: Iterable[LibraryModel]) -> None:
        self.models: tuple[LibraryModel, ...] = tuple(models)
        if not self.models:
            raise LibraryError("the library has no model")
        self._by_name: dict[str, LibraryModel] = {}
        for model in self.models:
            for name in model.names():
                other = self._by_name.get(name)
                if other is not None and other is not model:
                    raise LibraryError(f"the name {name!r} is taken by two models: {other.path} and {model.path}; "
                                       "give one of them another name in its [[models]] entry")
                self._by_name[name] = model

    def __iter__(self) -> Iterator[LibraryModel]:
        return iter(self.models)

    def __len__(self) -> int:
        return len(self.models)

    @property
    def default(self) -> LibraryModel:
        return self.models[0]

    def resolve(self, name: str | None) -> LibraryModel | None:
        """The model a request's `model` field means; None when nothing here has that name."""
        if name is None or name == "default":
            return self.default
        if name in self._by_name:
            return self._by_name[name]
        if name.endswith(OLLAMA_TAG) and name[: -len(OLLAMA_TAG)] in self._by_name:
            return self._by_name[name[: -len(OLLAMA_TAG)]]
        return next((m for m in self.models if m.path.name == name), None)


def is_projector(path: Path) -> bool:
    return path.name.lower().startswith(PROJECTOR_PREFIX) and path.suffix.lower() == ".gguf"


def projector_beside(model_path: Path) -> Path | None:
    """The mmproj*.gguf in the model file's folder (the first by name), or
    None. Only a folder that holds this one model pairs it: a projector is
    made for one model, and in a folder of several nothing says for which."""
    folder = model_path.parent
    if not folder.is_dir():
        return None
    files = [path for path in folder.iterdir() if path.suffix.lower() == ".gguf" and path.is_file()]
    projectors = sorted(path for path in files if is_projector(path))
    others = [path for path in files if not is_projector(path) and path.name != model_path.name
              and not _is_later_split_part(path)]
    return projectors[0] if projectors and not others else None


def _is_later_split_part(path: Path) -> bool:
    split = _LATER_SPLIT_PART.search(path.name)
    return split is not None and split.group(1) != "00001"


def gguf_files(folder: Path) -> list[Path]:
    """The loadable .gguf files under a folder, recursively (downloads often
    land in one subfolder per model), the later parts of split files left out."""
    if not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.rglob("*")):
        if path.suffix.lower() != ".gguf" or is_projector(path) or not path.is_file():
            continue
        if _is_later_split_part(path):
            continue
        found.append(path)
    return found


def folder_models(folder: Path, taken: Iterable[Path], template: LibraryModel) -> list[LibraryModel]:
    """A model for each file in the folder that no other entry names, with
    the default profile (`template`) and its own file as the CPU fallback."""
    seen = {p.resolve() for p in taken}
    models = []
    names = set()
    for path in gguf_files(folder):
        if path.resolve() in seen:
            continue
        name = _LATER_SPLIT_PART.sub(".gguf", path.name)[: -len(".gguf")]
        if name in names:  # the same file name in two subfolders: keep the first
            continue
        names.add(name)
        mmproj = projector_beside(path)
        models.append(LibraryModel(name=name, path=path, source="folder", gpu_n_ctx=template.gpu_n_ctx,
                                   gpu_layers=template.gpu_layers, slots=template.slots, cpu_path=path,
                                   cpu_n_ctx=template.cpu_n_ctx, idle_unload_s=template.idle_unload_s,
                                   mmproj=mmproj, cpu_mmproj=mmproj))
    return models


def build_library(config) -> Library:
    """The library a config describes: its default model, its [[models]]
    entries, and the models folder's files (config.Config; typed loosely so
    this module stays importable without the config's dependencies)."""
    gpu, cpu = config.gpu, config.cpu
    default_path = config.model_path()
    default_cpu_path = config.fallback_model_path()
    default_mmproj = projector_beside(default_path)
    default = LibraryModel(
        name=default_path.stem, path=default_path, aliases=("default",), source="default", gpu_n_ctx=gpu.n_ctx,
        gpu_layers=gpu.n_gpu_layers, slots=gpu.max_concurrency, cpu_path=default_cpu_path,
        cpu_n_ctx=cpu.n_ctx, idle_unload_s=gpu.idle_unload_s, mmproj=default_mmproj,
        cpu_mmproj=cpu_projector(default_path, default_mmproj, default_cpu_path))
    models = [default]
    for entry in config.models:
        path = Path(entry.path).expanduser()
        if entry.cpu_fallback == "none":
            cpu_path = None
        elif entry.cpu_fallback == "same":
            cpu_path = path
        else:
            cpu_path = Path(entry.cpu_fallback).expanduser()
        configured = getattr(entry, "mmproj", "")
        mmproj = Path(configured).expanduser() if configured else projector_beside(path)
        models.append(LibraryModel(
            name=entry.name, path=path, aliases=tuple(entry.aliases), source="config",
            gpu_n_ctx=entry.n_ctx or gpu.n_ctx,
            gpu_layers=entry.n_gpu_layers, slots=entry.max_concurrency or gpu.max_concurrency, cpu_path=cpu_path,
            cpu_n_ctx=cpu.n_ctx,
            idle_unload_s=gpu.idle_unload_s if entry.idle_unload_s < 0 else entry.idle_unload_s,
            mmproj=mmproj, cpu_mmproj=cpu_projector(path, mmproj, cpu_path)))
    models += folder_models(config.models_folder(), [m.path for m in models], default)
    return Library(models)


def cpu_projector(model_path: Path, mmproj: Path | None, cpu_path: Path | None) -> Path | None:
    """The CPU fallback's projector: the model's own when the fallback is the
    same file; a smaller fallback model needs its own beside it (a projector
    is made for one model's width)."""
    if cpu_path is None:
        return None
    if cpu_path == model_path:
        return mmproj
    return projector_beside(cpu_path)
