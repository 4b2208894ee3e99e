from __future__ import annotations

import logging
import os
import stat

import pytest

from tray_app.core.base.files import PrivateRotatingFileHandler, make_private_dir


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def permissive_umask():
    """A umask that would leave new files world-readable, as many desktops set."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_private_dir_is_owner_only_when_new_and_when_it_existed(tmp_path, permissive_umask):
    new = make_private_dir(tmp_path / "a" / "logs")
    existing = tmp_path / "old-logs"
    existing.mkdir(mode=0o755)
    make_private_dir(existing)
    assert mode(new) == 0o700 and mode(existing) == 0o700
    # Only the log folder itself: the folders above it are the user's business.
    assert mode(tmp_path / "a") == 0o755


def test_rotating_log_files_are_owner_only(tmp_path, permissive_umask):
    path = tmp_path / "gpu-worker.log"
    path.write_text("left by an older version\n")
    os.chmod(path, 0o644)
    handler = PrivateRotatingFileHandler(path, maxBytes=200, backupCount=2, encoding="utf-8")
    logger = logging.getLogger("test_files.rotation")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        for n in range(20):
            logger.warning("line %d with a prompt in it", n)
    finally:
        logger.removeHandler(handler)
        handler.close()
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["gpu-worker.log", "gpu-worker.log.1", "gpu-worker.log.2"]
    assert {f.name: mode(f) for f in files} == {f.name: 0o600 for f in files}
    assert "line 19" in path.read_text()
