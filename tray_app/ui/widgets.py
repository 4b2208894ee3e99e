"""Small custom widgets: the headroom bar, the history chart, the degraded banner."""

from __future__ import annotations

import html
import time
from typing import Callable, Sequence

from PySide6.QtCore import QPointF, QRectF, QSize, Qt, Signal
from PySide6.QtGui import QBrush, QColor, QFont, QFontMetrics, QPainter, QPainterPath, QPen
from PySide6.QtWidgets import (
    QFrame, QGridLayout, QHBoxLayout, QLabel, QPushButton, QSizePolicy, QVBoxLayout, QWidget,
)

from . import colors
from . import theme
from . import viewmodel as vm
from .icons import state_icon
from . import qtcompat  # noqa: F401 - guards against a PySide6 refcount bug

# The status hue (colors.STATUS_HUES) each service state is shown in.
STATE_STATUS = {vm.GPU: "ok", vm.CPU: "info", vm.DEGRADED: "warn", vm.STARTING: "info", vm.DOWN: "error"}


def box_style_sheet(selector: str, box: colors.Box, extra: str = "") -> str:
    """A rounded, tinted frame for `selector`, in the colours of `box`."""
    return (f"{selector} {{ background: {theme.css(box.background)}; color: {theme.css(box.text)};"
            f" border: 1px solid {theme.css(box.border)}; border-radius: 6px; {extra} }}")


def set_tab_order(first: QWidget, following: list[QWidget]) -> None:
    """Put `following`, in order, right after `first` in the Tab chain.

    Widgets made after their window was built (a banner's Cancel rows) join
    the end of the chain, after every button of the window; this moves them
    back next to what they belong to."""
    previous = first
    for widget in following:
        QWidget.setTabOrder(previous, widget)
        previous = widget


def plain_label(text: str = "") -> QLabel:
    """A label that shows its text as written. A QLabel guesses, and draws
    text that looks like HTML as HTML: a model's, a peer's or a client's
    name such as "<b>x</b><img src=...>" would be bold, or fetch an image.
    Every label showing text from the service, a peer or a file is one of these."""
    label = QLabel(text)
    label.setTextFormat(Qt.TextFormat.PlainText)
    return label


def as_written(text: str) -> str:
    """`text` for a place that guesses its format and can't be told (a
    tooltip, a message box): text that could pass for HTML (it has a "<")
    becomes HTML that shows it as written; any other text stays as it is."""
    if "<" not in text:
        return text
    return "<qt>" + html.escape(text, quote=False).replace("\n", "<br>") + "</qt>"


def set_text(label: QLabel, text: str) -> None:
    """setText only when it changes: no relayout every poll."""
    if label.text() != text:
        label.setText(text)


class ElidedLabel(QLabel):
    """One line that elides in the middle to fit its width, with the whole
    text in the tooltip: a long model name keeps its start and its
    quantization suffix, and never widens the window."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setTextFormat(Qt.TextFormat.PlainText)  # a model's name, as written (see plain_label)
        self.full_text = ""
        # Ignored: the layout decides the width, the text does not.
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)

    def set_full_text(self, text: str) -> None:
        if text != self.full_text:
            self.full_text = text
            self.setToolTip(as_written(text))
            self._elide()

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt name
        super().resizeEvent(event)
        self._elide()

    def _elide(self) -> None:
        elided = self.fontMetrics().elidedText(self.full_text, Qt.TextElideMode.ElideMiddle, max(self.width(), 40))
        set_text(self, elided)


class HeadroomBar(QWidget):
    """A horizontal bar in segments (used / reserve / free) with the numbers inside."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._bar: vm.Bar | None = None
        self.setMinimumHeight(26)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def sizeHint(self) -> QSize:
        return QSize(480, 26)

    def set_bar(self, bar: vm.Bar | None) -> None:
        if bar != self._bar:
            self._bar = bar
            self.update()

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt name
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        rect = QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5)
        outline = QPainterPath()
        outline.addRoundedRect(rect, 5, 5)
        shades = colors.bar_colors(theme.current_palette())
        painter.fillPath(outline, theme.qcolor(shades.track))
        bar = self._bar
        if bar is not None and bar.total_mib and bar.segments:
            painter.save()
            painter.setClipPath(outline)
            x = rect.left()
            font = QFont(self.font())
            font.setPointSizeF(max(7.0, font.pointSizeF() * 0.9))
            painter.setFont(font)
            metrics = QFontMetrics(font)
            for index, segment in enumerate(bar.segments):
                width = rect.width() * max(segment.mib, 0.0) / bar.total_mib
                if index == len(bar.segments) - 1:
                    width = rect.right() - x
                if width <= 0:
                    continue
                seg_rect = QRectF(x, rect.top(), width, rect.height())
                fill = shades.segments.get(segment.key, shades.segments["used"])
                painter.fillRect(seg_rect, theme.qcolor(fill))
                if segment.key == "reserve":
                    painter.fillRect(seg_rect, QBrush(QColor(0, 0, 0, 45), Qt.BrushStyle.BDiagPattern))
                text = vm.fmt_mib(segment.figure)
                if metrics.horizontalAdvance(text) + 10 < width:
                    painter.setPen(theme.qcolor(colors.text_on(fill)))
                    painter.drawText(seg_rect, Qt.AlignmentFlag.AlignCenter, text)
                x += width
            painter.restore()
        elif bar is not None:
            painter.setPen(theme.qcolor(colors.muted(theme.current_palette(), shades.track)))
            # Cut at its end, never at both sides of a centred line too wide for the bar.
            caption = painter.fontMetrics().elidedText(bar.caption, Qt.TextElideMode.ElideRight, int(rect.width()) - 12)
            painter.drawText(rect, Qt.AlignmentFlag.AlignCenter, caption)
        painter.setPen(QPen(theme.qcolor(shades.outline), 1))
        painter.drawPath(outline)
        painter.end()


def legend_html(bar: vm.Bar, swatches: dict[str, colors.RGB]) -> str:
    parts = []
    for segment in bar.segments:
        if segment.mib < 0.5 and segment.key == "used" and any(s.key == "worker" for s in bar.segments):
            continue
        color = theme.css(swatches.get(segment.key, swatches["used"]))
        parts.append(f'<span style="color:{color}; font-size:large">&#9632;</span>&nbsp;'
                     f'{html.escape(segment.label)}&nbsp;<b>{html.escape(vm.fmt_mib(segment.figure))}</b>')
    return "&nbsp;&nbsp;&nbsp; ".join(parts)


class BarBlock(QWidget):
    """Title, bar, legend and one caption line for one device."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(3)
        top = QHBoxLayout()
        self.title = plain_label()  # a device's name, as its driver gives it
        font = self.title.font()
        font.setBold(True)
        self.title.setFont(font)
        self.badge = plain_label()
        self.badge.hide()
        top.addWidget(self.title)
        top.addWidget(self.badge)
        top.addStretch(1)
        self.caption = plain_label()
        self.caption.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        top.addWidget(self.caption)
        layout.addLayout(top)
        self.bar = HeadroomBar()
        layout.addWidget(self.bar)
        self.legend = QLabel()
        self.legend.setTextFormat(Qt.TextFormat.RichText)
        layout.addWidget(self.legend)
        self.warning = plain_label()  # a driver's error text, among others
        self.warning.setWordWrap(True)
        self.warning.hide()
        layout.addWidget(self.warning)
        self.apps = plain_label()  # process names come from other programs
        self.apps.setWordWrap(True)
        self.apps.hide()
        layout.addWidget(self.apps)
        self._bar: vm.Bar | None = None
        self.apply_colors()

    def apply_colors(self) -> None:
        """Colours from the current palette (again after it changes)."""
        palette = theme.current_palette()
        badge = colors.tinted_box(palette, "info")
        self.badge.setStyleSheet(box_style_sheet("QLabel", badge, "border-radius: 3px; padding: 0px 5px;"
                                                 " font-size: small;"))
        theme.set_text_color(self.warning, colors.status_color("error", palette.window))
        self._swatches = colors.bar_colors(palette).swatches
        if self._bar is not None:
            set_text(self.legend, legend_html(self._bar, self._swatches))
        self.bar.update()

    def set_bar(self, bar: vm.Bar) -> None:
        self._bar = bar
        set_text(self.title, bar.title)
        badge = bar.note.upper() if bar.note else ""
        set_text(self.badge, badge)
        self.badge.setVisible(bool(badge))
        # Without segments the bar itself says what is wrong; don't say it twice.
        set_text(self.caption, bar.caption if bar.segments else "")
        self.bar.set_bar(bar)
        set_text(self.legend, legend_html(bar, self._swatches))
        self.legend.setVisible(bool(bar.segments))
        set_text(self.warning, bar.warning[:1].upper() + bar.warning[1:])
        self.warning.setVisible(bool(bar.warning))
        set_text(self.apps, bar.apps)
        self.apps.setVisible(bool(bar.apps))


class HistoryChart(QWidget):
    """A line chart of one series over the last few minutes, with a dashed
    line for the reserve (VRAM) or the floor (RAM)."""

    def __init__(self, title: str, status: str, value: Callable[[vm.Sample], float | None],
                 total: Callable[[vm.Sample], float | None], threshold: Callable[[vm.Sample], float | None],
                 threshold_label: str, window_s: float = 300.0, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.title = title
        self.status = status  # the series' hue, a key of colors.STATUS_HUES
        self._value, self._total, self._threshold = value, total, threshold
        self.threshold_label = threshold_label
        self.window_s = window_s
        self.samples: Sequence[vm.Sample] = ()
        self.setMinimumSize(240, 130)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def sizeHint(self) -> QSize:
        return QSize(280, 140)

    def set_samples(self, samples: Sequence[vm.Sample]) -> None:
        self.samples = list(samples)
        self.update()

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt name
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        palette = theme.current_palette()
        base = palette.base
        text_color = theme.qcolor(colors.readable(palette.text, base))
        muted = theme.qcolor(colors.muted(palette, base))
        series = theme.qcolor(colors.status_color(self.status, base, colors.GRAPHIC_CONTRAST))
        metrics = painter.fontMetrics()
        line_h = metrics.height()
        frame = QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5)
        painter.setPen(QPen(theme.qcolor(colors.bar_colors(palette).outline), 1))
        painter.setBrush(theme.qcolor(base))
        painter.drawRoundedRect(frame, 5, 5)
        plot = QRectF(frame.left() + 8, frame.top() + line_h + 8, frame.width() - 16,
                      frame.height() - 2 * line_h - 14)
        latest = self.samples[-1] if self.samples else None
        title_font = QFont(self.font())
        title_font.setBold(True)
        painter.setFont(title_font)
        painter.setPen(text_color)
        painter.drawText(QRectF(frame.left() + 8, frame.top() + 4, frame.width() - 16, line_h),
                         Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, self.title)
        painter.setFont(self.font())
        value_now = self._value(latest) if latest else None
        painter.drawText(QRectF(frame.left() + 8, frame.top() + 4, frame.width() - 16, line_h),
                         Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter,
                         vm.fmt_mib(value_now) if latest else "no data")
        # Axis labels under the plot.
        painter.setPen(muted)
        minutes = round(self.window_s / 60)
        bottom = QRectF(plot.left(), plot.bottom() + 3, plot.width(), line_h)
        painter.drawText(bottom, Qt.AlignmentFlag.AlignLeft, f"{minutes} min ago")
        painter.drawText(bottom, Qt.AlignmentFlag.AlignRight, "now")
        total = max((self._total(s) or 0.0 for s in self.samples), default=0.0)
        if total > 0:
            painter.drawText(bottom, Qt.AlignmentFlag.AlignHCenter, f"scale 0 – {vm.fmt_mib(total)}")
        # Grid: translucent mid-grey, faint on a light base and on a dark one alike.
        painter.setPen(QPen(QColor(128, 128, 128, 50), 1))
        for fraction in (0.25, 0.5, 0.75):
            y = plot.bottom() - plot.height() * fraction
            painter.drawLine(QPointF(plot.left(), y), QPointF(plot.right(), y))
        painter.setPen(QPen(QColor(128, 128, 128, 110), 1))
        painter.drawLine(QPointF(plot.left(), plot.bottom()), QPointF(plot.right(), plot.bottom()))
        if total <= 0 or latest is None:
            painter.end()
            return
        now = time.monotonic() if latest.t <= time.monotonic() + 1 else latest.t
        start = now - self.window_s

        def point(t: float, value: float) -> QPointF:
            x = plot.left() + plot.width() * min(max((t - start) / self.window_s, 0.0), 1.0)
            y = plot.bottom() - plot.height() * min(max(value / total, 0.0), 1.0)
            return QPointF(x, y)

        threshold = self._threshold(latest)
        if threshold:
            y = point(now, threshold).y()
            painter.setPen(QPen(theme.qcolor(colors.status_color("warn", base, colors.GRAPHIC_CONTRAST)), 1,
                                Qt.PenStyle.DashLine))
            painter.drawLine(QPointF(plot.left(), y), QPointF(plot.right(), y))
            painter.setPen(theme.qcolor(colors.status_color("warn", base)))
            label_rect = QRectF(plot.left() + 2, y - line_h - 1, plot.width() - 4, line_h)
            if label_rect.top() < plot.top():
                label_rect.moveTop(y + 1)
            painter.drawText(label_rect, Qt.AlignmentFlag.AlignLeft, f"{self.threshold_label} {vm.fmt_mib(threshold)}")
        # The series, broken where a value is unknown.
        runs: list[list[QPointF]] = [[]]
        for sample in self.samples:
            value = self._value(sample)
            if value is None or sample.t < start:
                if runs[-1]:
                    runs.append([])
                continue
            runs[-1].append(point(sample.t, value))
        fill = QColor(series)
        fill.setAlpha(45)
        for run in runs:
            if not run:
                continue
            if len(run) == 1:
                run = [QPointF(run[0].x() - 1, run[0].y()), run[0]]
            area = QPainterPath(QPointF(run[0].x(), plot.bottom()))
            for p in run:
                area.lineTo(p)
            area.lineTo(QPointF(run[-1].x(), plot.bottom()))
            area.closeSubpath()
            painter.fillPath(area, fill)
            line = QPainterPath(run[0])
            for p in run[1:]:
                line.lineTo(p)
            painter.setPen(QPen(series, 2))
            painter.setBrush(Qt.BrushStyle.NoBrush)
            painter.drawPath(line)
        painter.end()


class DegradedBanner(QFrame):
    """Degraded mode: fallback model, why, limits, latency, and Cancel."""

    cancel_requested = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("degradedBanner")
        self.apply_colors()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 10, 12, 10)
        layout.setSpacing(6)
        top = QHBoxLayout()
        icon = QLabel()
        icon.setPixmap(state_icon(vm.DEGRADED).pixmap(20, 20))
        top.addWidget(icon)
        self.title = plain_label()  # names the peers that serve
        font = self.title.font()
        font.setBold(True)
        font.setPointSizeF(font.pointSizeF() * 1.1)
        self.title.setFont(font)
        top.addWidget(self.title, 1)
        layout.addLayout(top)
        grid = QGridLayout()
        grid.setHorizontalSpacing(10)
        grid.setVerticalSpacing(3)
        grid.setColumnStretch(1, 1)
        self.values: dict[str, QLabel] = {}
        for row, (key, label) in enumerate((("reason", "Why"), ("model", "Fallback model"),
                                           ("limits", "Limits"), ("latency", "Estimated latency"))):
            name = QLabel(label)
            name.setProperty("role", "key")
            name.setAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop)
            value = ElidedLabel() if key == "model" else plain_label()
            value.setWordWrap(key != "model")
            value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            grid.addWidget(name, row, 0)
            grid.addWidget(value, row, 1)
            self.values[key] = value
        layout.addLayout(grid)
        self.warning = plain_label()
        self.warning.setProperty("role", "warn")
        self.warning.setWordWrap(True)
        self.warning.hide()
        layout.addWidget(self.warning)
        self.rows_box = QVBoxLayout()
        self.rows_box.setSpacing(4)
        layout.addLayout(self.rows_box)
        self.more_label = QLabel()
        self.more_label.setProperty("role", "key")
        self.more_label.hide()
        layout.addWidget(self.more_label)
        self.empty_label = QLabel("No requests are waiting for the CPU.")
        self.empty_label.setProperty("role", "key")
        layout.addWidget(self.empty_label)
        self._rows: dict[str, tuple[QWidget, QLabel, QPushButton]] = {}
        self.show_empty_note = True
        self.banner: vm.Banner | None = None
        self._tab_rows: list[str] = []
        self.hide()

    def apply_colors(self) -> None:
        """An amber box in the theme's lightness (again after the palette changes)."""
        box = colors.tinted_box(theme.current_palette(), "warn")
        self.setStyleSheet(
            box_style_sheet("#degradedBanner", box)
            + f"#degradedBanner QLabel {{ color: {theme.css(box.text)}; background: transparent; }}"
            f"#degradedBanner QLabel[role='key'] {{ color: {theme.css(box.key_text)}; }}"
            f"#degradedBanner QLabel[role='warn'] {{ color: {theme.css(box.status_text)}; }}"
        )

    def set_banner(self, banner: vm.Banner | None) -> None:
        self.banner = banner
        if banner is None:
            self.setVisible(False)
            for request_id in list(self._rows):
                self._drop_row(request_id)
            self._tab_rows = []
            return
        set_text(self.title, banner.title)
        set_text(self.values["reason"], banner.reason)
        self.values["model"].set_full_text(banner.model)
        set_text(self.values["limits"], banner.limits)
        set_text(self.values["latency"], banner.latency)
        set_text(self.warning, banner.warning)
        self.warning.setVisible(bool(banner.warning))
        wanted = [r.id for r in banner.requests]
        for request_id in list(self._rows):
            if request_id not in wanted:
                self._drop_row(request_id)
        for position, request in enumerate(banner.requests):
            if request.id not in self._rows:
                self._add_row(request.id)
            row, label, button = self._rows[request.id]
            set_text(label, request.text)
            if self.rows_box.indexOf(row) != position:
                self.rows_box.removeWidget(row)
                self.rows_box.insertWidget(position, row)
        set_text(self.more_label, f"{banner.more} more" + (" request" if banner.more == 1 else " requests")
                 + " on the CPU, not listed")
        self.more_label.setVisible(banner.more > 0)
        self.empty_label.setVisible(self.show_empty_note and not banner.requests)
        if wanted != self._tab_rows:
            self._order_tabs(wanted)
        self.setVisible(True)

    def _order_tabs(self, request_ids: list[str]) -> None:
        """Each row's Cancel right after the banner's text and the rows
        before it, so Tab reaches them before the window's other buttons."""
        chain: list[QWidget] = []
        for request_id in request_ids:
            _, label, button = self._rows[request_id]
            chain += [label, button]
        # The last value label: made with the banner, so it sits in the chain
        # where the banner is; and selectable, which setTabOrder requires.
        set_tab_order(self.values["latency"], chain)
        self._tab_rows = list(request_ids)

    def cancel_button(self, request_id: str) -> QPushButton | None:
        entry = self._rows.get(request_id)
        return entry[2] if entry else None

    def _add_row(self, request_id: str) -> None:
        row = QWidget()
        box = QHBoxLayout(row)
        box.setContentsMargins(0, 0, 0, 0)
        label = plain_label()  # the request's client names itself (X-Client-Name)
        label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        # No Alt+letter: several rows would share it (and Alt+C opens the chat);
        # Tab reaches each row's button right after its text instead.
        button = QPushButton("Cancel")
        button.setToolTip(as_written(f"Cancel request {request_id} (DELETE /v1/requests/{request_id})"))
        button.setObjectName(f"cancel-{request_id}")

        def clicked() -> None:
            button.setEnabled(False)
            button.setText("Canceling…")
            self.cancel_requested.emit(request_id)

        button.clicked.connect(clicked)
        box.addWidget(label, 1)
        box.addWidget(button)
        self.rows_box.addWidget(row)
        self._rows[request_id] = (row, label, button)

    def cancel_failed(self, request_id: str) -> None:
        entry = self._rows.get(request_id)
        if entry:
            entry[2].setEnabled(True)
            entry[2].setText("Cancel")

    def _drop_row(self, request_id: str) -> None:
        row, _, _ = self._rows.pop(request_id)
        self.rows_box.removeWidget(row)
        # Hidden now: deleteLater waits for the event loop, and until then the
        # row would still be drawn, overlapping the rows that moved up.
        row.hide()
        row.deleteLater()


class StateHeader(QWidget):
    """Icon, state title and the reason, at the top of the panel."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.icon = QLabel()
        self.icon.setFixedSize(36, 36)
        layout.addWidget(self.icon, 0, Qt.AlignmentFlag.AlignTop)
        text = QVBoxLayout()
        text.setSpacing(1)
        self.title = plain_label()
        font = self.title.font()
        font.setBold(True)
        font.setPointSizeF(font.pointSizeF() * 1.35)
        self.title.setFont(font)
        self.detail = plain_label()  # the service's reason
        self.detail.setWordWrap(True)
        self.detail.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        text.addWidget(self.title)
        text.addWidget(self.detail)
        layout.addLayout(text, 1)
        self.kind: str | None = None

    def set_state(self, kind: str, detail: str, title: str | None = None) -> None:
        if kind != self.kind:
            self.kind = kind
            self.icon.setPixmap(state_icon(kind).pixmap(36, 36))
            self._color_title()
        set_text(self.title, title or vm.STATE_TITLES[kind])
        set_text(self.detail, detail)

    def apply_colors(self) -> None:
        if self.kind is not None:
            self._color_title()

    def _color_title(self) -> None:
        status = STATE_STATUS[self.kind] if self.kind is not None else "info"
        theme.set_text_color(self.title, colors.status_color(status, theme.current_palette().window))
