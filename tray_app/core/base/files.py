"""Writing files: never half-written, and private where they may hold what users typed."""

from __future__ import annotations

import logging.handlers
import os
from pathlib import Path

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


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


def make_private_dir(path: Path) -> Path:
    """Create `path` (and its parents) readable by its owner only. An existing
    directory is narrowed too: one an older version made world-readable
    would otherwise stay that way. Logs go here: they hold prompts and answers."""
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    # mkdir's mode passes through the umask and skips an existing directory.
    os.chmod(path, PRIVATE_DIR_MODE)
    return path


class PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """A RotatingFileHandler whose files, rotated ones included, are owner-only."""

    def _open(self):
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE_FILE_MODE)
        # The mode only applies when the file is created; narrow an older one too.
        os.chmod(self.baseFilename, PRIVATE_FILE_MODE)
        # _builtin_open, as the base class does: plain open() may be gone at interpreter shutdown.
        return self._builtin_open(fd, "a", encoding=self.encoding, errors=self.errors)
