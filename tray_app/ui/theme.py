"""The bridge between Qt's palette and the pure colour rules in colors.py.

Widgets ask here for the current palette (as colors.Palette) and turn the
RGB tuples colors.py chooses back into QColors, palettes and style sheets.
It also builds a dark Fusion palette: what the tests and the dark-theme
screenshots run under.
"""

from __future__ import annotations

from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication, QToolTip, QWidget

from . import colors
from .colors import RGB


def rgb(color: QColor, background: RGB | None = None) -> RGB:
    """A QColor as RGB; a translucent one (Qt's placeholder text is) is
    blended onto `background`, as it would be drawn."""
    own = (color.red(), color.green(), color.blue())
    if background is None or color.alpha() == 255:
        return own
    return colors.mix(background, own, color.alpha() / 255)


def qcolor(color: RGB) -> QColor:
    return QColor(*color)


def css(color: RGB) -> str:
    return colors.to_hex(color)


def current_palette(source: QPalette | None = None) -> colors.Palette:
    """The application's palette (the desktop's, unless the app set one)."""
    palette = source if source is not None else QGuiApplication.palette()
    window = rgb(palette.color(QPalette.ColorRole.Window))
    base = rgb(palette.color(QPalette.ColorRole.Base))
    return colors.Palette(
        window=window,
        window_text=rgb(palette.color(QPalette.ColorRole.WindowText), window),
        base=base,
        text=rgb(palette.color(QPalette.ColorRole.Text), base),
        muted_text=rgb(palette.color(QPalette.ColorRole.PlaceholderText), window),
    )


def set_text_color(widget: QWidget, color: RGB | None) -> None:
    """Text in `color` (None: the palette's own), through the widget's
    palette, so the label's background stays the theme's."""
    # A fresh QPalette resolves only the roles set on it: the rest (and, with
    # no colour, all of it) still comes from the parent and the application.
    palette = QPalette()
    if color is not None:
        for group in (QPalette.ColorGroup.Active, QPalette.ColorGroup.Inactive):
            palette.setColor(group, QPalette.ColorRole.WindowText, qcolor(color))
            palette.setColor(group, QPalette.ColorRole.Text, qcolor(color))
    widget.setPalette(palette)
    widget.setProperty("chosenTextColor", css(color) if color is not None else None)


def set_muted_text(label: QWidget) -> None:
    """Secondary text (a footer, a help line): the palette's placeholder
    colour, made dark or light enough to read; recolor_muted() redoes it."""
    label.setProperty("mutedText", True)
    set_text_color(label, colors.muted(current_palette()))


def recolor_muted(root: QWidget) -> None:
    """set_muted_text() again for every such label under `root`, after the
    palette changed (a colour in a style sheet would keep the old palette's)."""
    color = colors.muted(current_palette())
    for widget in root.findChildren(QWidget):
        if widget.property("mutedText"):
            set_text_color(widget, color)


def dark_fusion_palette() -> QPalette:
    """A dark palette for the Fusion style, like common desktop dark themes."""
    window, base, text = QColor("#2d2f33"), QColor("#1f2124"), QColor("#e8e8e8")
    disabled = QColor("#7c7f84")
    palette = QPalette()
    roles = {
        QPalette.ColorRole.Window: window,
        QPalette.ColorRole.WindowText: text,
        QPalette.ColorRole.Base: base,
        QPalette.ColorRole.AlternateBase: QColor("#2a2c30"),
        QPalette.ColorRole.ToolTipBase: QColor("#3a3d42"),
        QPalette.ColorRole.ToolTipText: text,
        QPalette.ColorRole.PlaceholderText: QColor("#9aa0a6"),
        QPalette.ColorRole.Text: text,
        QPalette.ColorRole.Button: QColor("#3a3d42"),
        QPalette.ColorRole.ButtonText: text,
        QPalette.ColorRole.BrightText: QColor("#ff6b6b"),
        QPalette.ColorRole.Light: QColor("#4a4d53"),
        QPalette.ColorRole.Midlight: QColor("#3f4247"),
        QPalette.ColorRole.Mid: QColor("#26282b"),
        QPalette.ColorRole.Dark: QColor("#1b1c1f"),
        QPalette.ColorRole.Shadow: QColor("#000000"),
        QPalette.ColorRole.Highlight: QColor("#3d7fd6"),
        QPalette.ColorRole.HighlightedText: QColor("#ffffff"),
        QPalette.ColorRole.Link: QColor("#6aa5f0"),
        QPalette.ColorRole.LinkVisited: QColor("#b08ce8"),
    }
    for role, color in roles.items():
        palette.setColor(role, color)
    for role in (QPalette.ColorRole.WindowText, QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText):
        palette.setColor(QPalette.ColorGroup.Disabled, role, disabled)
    return palette


def use_dark_fusion(app: QApplication) -> None:
    app.setStyle("Fusion")
    palette = dark_fusion_palette()
    app.setPalette(palette)
    # Tooltips and the tray's notification balloon keep a palette of their own.
    QToolTip.setPalette(palette)
