"""Home AI server tray app: GPU and CPU llama.cpp workers behind one OpenAI-compatible port."""

from importlib import metadata as _metadata

try:
    # The version lives in pyproject.toml only; an install (editable or not,
    # and the standalone folder, which copies the metadata) carries it.
    __version__ = _metadata.version("tray-app")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "unknown"
