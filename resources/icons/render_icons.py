"""Writes the tray icons: tray-<state>.svg and tray-<state>-<size>.png.

    .venv/bin/python resources/icons/render_icons.py

The SVG source lives in tray_app/ui/icon_art.py (so an installed app can
render the icons without these files); tray_app.ui.icons renders it with Qt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from tray_app.ui.icons import write_files  # noqa: E402


def main() -> int:
    written = write_files(HERE)
    print(f"wrote {len(written)} files to {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
