"""Tray and window icons: the PNGs in resources/icons/ when they are there,
otherwise rendered from the SVG text in icon_art (an installed package)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from PySide6.QtCore import QByteArray, Qt
from PySide6.QtGui import QIcon, QImage, QPainter, QPixmap
from PySide6.QtSvg import QSvgRenderer

from . import icon_art, qtcompat  # noqa: F401 - qtcompat guards against a PySide6 refcount bug

_CANDIDATES = (
    Path(__file__).resolve().parent / "icons",
    Path(__file__).resolve().parents[2] / "resources" / "icons",
)


def icons_dir() -> Path | None:
    for candidate in _CANDIDATES:
        if (candidate / "tray-gpu-16.png").is_file():
            return candidate
    return None


def render(kind: str, size: int) -> QImage:
    """The icon for `kind` at size x size pixels, from its SVG source."""
    renderer = QSvgRenderer(QByteArray(icon_art.svg(kind).encode()))
    image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    painter.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform)
    renderer.render(painter)
    painter.end()
    return image


@lru_cache(maxsize=None)
def state_icon(kind: str) -> QIcon:
    icon = QIcon()
    folder = icons_dir()
    for size in icon_art.SIZES:
        file = folder / f"tray-{kind}-{size}.png" if folder else None
        if file is not None and file.is_file():
            icon.addFile(str(file))
        else:
            icon.addPixmap(QPixmap.fromImage(render(kind, size)))
    return icon


def write_files(folder: Path) -> list[Path]:
    """Write tray-<state>.svg and tray-<state>-<size>.png for every state (resources/icons)."""
    from PySide6.QtGui import QGuiApplication

    app = QGuiApplication.instance() or QGuiApplication(["render-icons"])  # noqa: F841 - Qt wants one
    written = []
    folder.mkdir(parents=True, exist_ok=True)
    for kind in icon_art.kinds():
        svg_file = folder / f"tray-{kind}.svg"
        svg_file.write_text(icon_art.svg(kind))
        written.append(svg_file)
        for size in icon_art.SIZES:
            png = folder / f"tray-{kind}-{size}.png"
            if not render(kind, size).save(str(png)):
                raise OSError(f"could not write {png}")
            written.append(png)
    return written
