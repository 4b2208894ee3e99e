"""Prepare what the real-GPU check carries to a machine that reaches no
package index, in at most 60 MiB.

    python -m benchmarks.gpu_check.prepare [--dest .gpu_carry]

It writes into DEST (git-ignored):
- llama.cpp.tar.gz: the llama.cpp that the installed llama-cpp-python
  vendors (so the GPU build is the same engine as here), trimmed to what a
  CUDA (or CPU) build of llama-server and libllama needs: no docs, vocab
  models, tests, web UI sources or other backends' sources;
- llama_cpp_py.tar.gz: llama-cpp-python's Python package (ctypes bindings,
  chat formats, grammar helpers: the router counts tokens with them); it
  loads the GPU build's libllama through LLAMA_CPP_LIB_PATH;
- wheels/: the pure-Python packages the service needs that the machine
  lacks;
- tokenizer.json.gz: the bundled model's tokenizer, from which the check
  writes a tiny model on the spot (the bundled 98 MB model does not fit);
- llama-build-sm90.tar.gz, when install.sh's CUDA build for sm_90 (H100,
  H200) is in the wheel cache (`bash packaging/install.sh --backend cuda
  --cuda-arch 90`) and fits: llama-server, ggml's modules and libllama,
  stripped, so a lent machine spends its minutes on the checks, not on a
  compile. cuBLAS is not carried (over 500 MB): the machine's own PyTorch
  wheels have it. Without one, gpu.sh builds from the source there;
- manifest.json: versions and sizes.

Run `bash benchmarks/gpu_check/gpu.sh` there (see that file).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

from benchmarks.gpu_check import tiny_model

MIB = 1024 * 1024
# install.sh's cache, where its wheelhouses are.
TRAY_APP_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tray-app"
CARRY_LIMIT_MIB = 60.0
# What the service imports that the GPU machine's image lacks (its list is in
# the device tool's KINDS.md: it has anyio, h11, httpx, psutil, jinja2, numpy,
# nvidia-ml-py, prometheus-client, matplotlib, pyyaml and tqdm).
WHEELS = ("starlette", "uvicorn", "platformdirs", "diskcache", "gguf")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")

# Trimmed out of vendor/llama.cpp, as path prefixes. The build with
# LLAMA_BUILD_TESTS/EXAMPLES/UI off never reads them; the other backends are
# only added when their GGML_<NAME> option is on.
DROPPED_PREFIXES = (
    ".github/", ".devops/", "docs/", "models/", "examples/", "tests/", "benches/", "gguf-py/",
    "media/", "conversion/", "grammars/", "requirements/", "skills/", "pocs/", "ci/",
    "tools/ui/src/", "tools/ui/tests/", "tools/ui/static/", "tools/ui/package-lock.json",
    "tools/server/tests/", "tools/server/bench/",
)
KEPT_BACKENDS = {"ggml-cpu", "ggml-cuda", "ggml-rpc"}


def kept(relative: str) -> bool:
    """Whether a path inside vendor/llama.cpp goes into the trimmed source."""
    path = PurePosixPath(relative)
    if any(relative.startswith(prefix) or relative + "/" == prefix for prefix in DROPPED_PREFIXES):
        return False
    if relative.startswith("scripts/"):
        return path.suffix == ".cmake"  # the build runs ui-assets.cmake; the rest are maintainers' tools
    if path.suffix in (".md", ".py") and path.name != "LICENSE":
        return False  # docs and conversion scripts; the C++ build reads neither
    parts = path.parts
    if len(parts) >= 3 and parts[:2] == ("ggml", "src") and parts[2].startswith("ggml-") and "." not in parts[2]:
        return parts[2] in KEPT_BACKENDS
    return True


def llama_version() -> str:
    return importlib.metadata.version("llama_cpp_python")


def fetch_sdist(version: str, cache: Path) -> Path:
    """llama-cpp-python's source release (77 MB), from pip's index or cache."""
    found = sorted(cache.glob(f"llama_cpp_python-{version}.tar.gz"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={version}", "-d", str(cache)], check=True)
    return next(cache.glob(f"llama_cpp_python-{version}.tar.gz"))


def trim_sources(sdist: Path, dest: Path) -> dict[str, object]:
    """Writes llama.cpp.tar.gz and llama_cpp_py.tar.gz from the sdist."""
    root = sdist.name.removesuffix(".tar.gz")
    vendor = f"{root}/vendor/llama.cpp/"
    package = f"{root}/llama_cpp/"
    counts = {"llama.cpp": [0, 0], "llama_cpp_py": [0, 0]}  # files, bytes before compression
    dropped_bytes = 0
    with tarfile.open(sdist) as source, \
            tarfile.open(dest / "llama.cpp.tar.gz", "w:gz", compresslevel=9) as engine, \
            tarfile.open(dest / "llama_cpp_py.tar.gz", "w:gz", compresslevel=9) as bindings:
        for member in source:
            if not member.isfile():
                continue
            if member.name.startswith(vendor):
                relative = member.name[len(vendor):]
                if not kept(relative):
                    dropped_bytes += member.size
                    continue
                target, name, key = engine, f"llama.cpp/{relative}", "llama.cpp"
            elif member.name.startswith(package) and "/lib/" not in member.name:
                target, name, key = bindings, "llama_cpp/" + member.name[len(package):], "llama_cpp_py"
            else:
                continue
            data = source.extractfile(member)
            assert data is not None
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = member.size, member.mode, member.mtime
            target.addfile(info, io.BytesIO(data.read()))
            counts[key][0] += 1
            counts[key][1] += member.size
    return {
        "llama.cpp": {"files": counts["llama.cpp"][0], "source_mib": round(counts["llama.cpp"][1] / MIB, 1),
                      "dropped_mib": round(dropped_bytes / MIB, 1),
                      "archive_mib": round((dest / "llama.cpp.tar.gz").stat().st_size / MIB, 2)},
        "llama_cpp_py": {"files": counts["llama_cpp_py"][0],
                         "archive_mib": round((dest / "llama_cpp_py.tar.gz").stat().st_size / MIB, 2)},
    }


def download_wheels(dest: Path) -> list[str]:
    """The versions installed here, as wheels for the machine's Python 3.12."""
    wheels = dest / "wheels"
    wheels.mkdir(exist_ok=True)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(wheels), *pins],
                   check=True)
    return sorted(path.name for path in wheels.glob("*.whl"))


PREBUILT_NAME = "llama-build-sm90.tar.gz"
# The wheel's files the check runs: llama-server and the modules it loads from
# its own folder, its libraries, and llama-cpp-python's (libllama, ggml) but
# their copy of the CUDA module (the router loads the CPU one only).
PREBUILT_PREFIXES = ("bin/llama-server", "bin/libggml-", "lib/", "llama_cpp/lib/")
PREBUILT_LEFT_OUT = ("llama_cpp/lib/libggml-cuda.so",)


def cuda_wheels(cache: Path) -> list[Path]:
    """install.sh's CUDA builds in its wheel cache (their wheels hold ggml's CUDA module)."""
    found = []
    for wheel in sorted(cache.glob("wheels/*/llama_cpp_python-*.whl")):
        try:
            if any(name.endswith("libggml-cuda.so") for name in zipfile.ZipFile(wheel).namelist()):
                found.append(wheel)
        except (OSError, zipfile.BadZipFile):
            continue
    return found


def built_for(wheel: Path) -> str:
    """The CUDA architectures the wheel was built for, from the CMake flags
    install.sh writes beside it."""
    args = wheel.parent / "cmake-args"
    text = args.read_text(errors="replace") if args.is_file() else ""
    match = re.search(r"-DCMAKE_CUDA_ARCHITECTURES=(\S+)", text)
    return match.group(1) if match else ""


def pack_prebuilt(wheel: Path, dest: Path) -> float:
    """Writes PREBUILT_NAME from the wheel, stripped; returns its MiB."""
    with tempfile.TemporaryDirectory() as scratch, zipfile.ZipFile(wheel) as source:
        members = [m for m in source.infolist()
                   if m.filename.startswith(PREBUILT_PREFIXES) and m.filename not in PREBUILT_LEFT_OUT]
        for member in members:
            path = Path(source.extract(member, scratch))
            path.chmod(0o755)
            # Symbols only a debugger reads: the CUDA module halves.
            subprocess.run(["strip", "--strip-unneeded", str(path)], check=False, capture_output=True)
        # A wheel holds no links: libllama.so, .so.0 and .so.0.5.0 are three
        # copies. The second and later of identical files go in as links.
        first_of: dict[tuple[int, int], str] = {}
        with tarfile.open(dest / PREBUILT_NAME, "w:gz", compresslevel=9) as archive:
            for member in members:
                same = first_of.setdefault((member.CRC, member.file_size), member.filename)
                if same == member.filename:
                    archive.add(Path(scratch) / member.filename, arcname=member.filename)
                    continue
                link = tarfile.TarInfo(member.filename)
                link.type = tarfile.SYMTYPE
                link.linkname = os.path.relpath(same, os.path.dirname(member.filename))
                archive.addfile(link)
    return (dest / PREBUILT_NAME).stat().st_size / MIB


def add_prebuilt(dest: Path, manifest: dict[str, object], cache: Path) -> None:
    """Packs the sm_90 CUDA build when there is one and the carry stays in its
    limit; the manifest says which, or by how much it didn't fit."""
    wheels = [w for w in cuda_wheels(cache) if "90" in built_for(w).replace("-real", "").split(";")]
    if not wheels:
        manifest["prebuilt"] = (f"none: no sm_90 CUDA build in {cache / 'wheels'} "
                                "(bash packaging/install.sh --backend cuda --cuda-arch 90); gpu.sh builds there")
        return
    size = pack_prebuilt(wheels[-1], dest)
    total = folder_mib(dest)
    if total > CARRY_LIMIT_MIB:
        (dest / PREBUILT_NAME).unlink()
        manifest["prebuilt"] = (f"left out: {size:.1f} MiB would make the carry {total:.1f} MiB, "
                                f"{total - CARRY_LIMIT_MIB:.1f} over {CARRY_LIMIT_MIB:g}; gpu.sh builds there")
        return
    manifest["prebuilt"] = {"wheel": str(wheels[-1]), "archive_mib": round(size, 2),
                            "architectures": built_for(wheels[-1])}


def folder_mib(folder: Path) -> float:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()) / MIB


def prepare(dest: Path, sdist: Path | None = None, cache: Path = TRAY_APP_CACHE) -> dict[str, object]:
    from tray_app.core.config import bundled_model_path

    dest.mkdir(parents=True, exist_ok=True)
    version = llama_version()
    sdist = sdist or fetch_sdist(version, Path(tempfile.gettempdir()) / "tray-app-sdist")
    manifest: dict[str, object] = {"llama_cpp_python": version, "sdist_mib": round(sdist.stat().st_size / MIB, 1)}
    manifest.update(trim_sources(sdist, dest))
    manifest["wheels"] = download_wheels(dest)
    tiny_model.export_tokenizer(bundled_model_path(), dest / "tokenizer.json.gz")
    manifest["tokenizer_mib"] = round((dest / "tokenizer.json.gz").stat().st_size / MIB, 2)
    add_prebuilt(dest, manifest, cache)
    manifest["carry_mib"] = round(folder_mib(dest), 2)
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if manifest["carry_mib"] > CARRY_LIMIT_MIB:  # type: ignore[operator]
        raise SystemExit(f"the carry is {manifest['carry_mib']} MiB, over {CARRY_LIMIT_MIB:g} MiB")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=Path(".gpu_carry"), help="where the carry goes (default .gpu_carry)")
    parser.add_argument("--sdist", type=Path, help="llama-cpp-python's sdist, if already downloaded")
    args = parser.parse_args(argv)
    manifest = prepare(args.dest, args.sdist)
    print(json.dumps(manifest, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
