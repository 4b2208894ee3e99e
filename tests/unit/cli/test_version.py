"""`tray-app --version` prints the version pyproject.toml gives (the one place it is kept)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import tray_app

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"
CHANGELOG = PYPROJECT.parent / "CHANGELOG.md"


def test_version_prints_the_pyproject_version_and_the_changelog_has_it():
    version = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["version"]
    printed = subprocess.run([sys.executable, "-m", "tray_app", "--version"], capture_output=True, text=True,
                             timeout=60)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.strip() == f"tray-app {version}" == f"tray-app {tray_app.__version__}"
    assert f"## [{version}]" in CHANGELOG.read_text(encoding="utf-8")
