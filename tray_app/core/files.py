"""Writing files that other programs read: never half-written."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, data: bytes, mode: int = 0o644) -> Path:
    """Write to a temp file beside `path`, fsync, then rename over it, so a
    reader (the session at login, a restarting service) sees the old file or
    the new one, never a torn one. `mode` applies from creation: a secret is
    never readable by others, even for a moment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
