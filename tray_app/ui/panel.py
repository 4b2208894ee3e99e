"""The headroom panel: state, degraded banner, VRAM/RAM bars, workers, history."""

from __future__ import annotations

from typing import Any, Iterable

from PySide6.QtCore import QEvent, QSize, Qt, Signal
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QFrame, QGridLayout, QGroupBox, QHBoxLayout, QLabel, QLayout, QScrollArea, QSizePolicy, QToolButton, QVBoxLayout,
    QWidget,
)

from . import colors
from ..core.status_contract import Status
from . import theme
from . import viewmodel as vm
from .client import ServiceClient
from .icons import state_icon
from .tables import UsageTable, header_row
from .widgets import (
    BarBlock, DegradedBanner, ElidedLabel, HistoryChart, StateHeader, box_style_sheet, plain_label, as_written, set_text,
)
from . import qtcompat  # noqa: F401 - guards against a PySide6 refcount bug

WORKER_COLUMNS = ("Worker", "State", "PID", "RSS", "Est. VRAM", "Est. RAM", "Context", "Drafts", "Restarts")
MODEL_COLUMNS = ("Model", "Where", "Memory", "In flight")
MODEL_PLACE_STATE = {"on the GPU": "ready", "on the CPU": "ready", "loading": "starting"}
# The status hue of a worker's state; any state not listed is trouble.
WORKER_STATE_STATUS = {"ready": "ok", "starting": "info", "stopping": "info"}


class HeadroomPanel(QWidget):
    """Reads the client's snapshots; sends Cancel through the client."""

    closed = Signal()  # only when close_quits (no system tray)

    def __init__(self, client: ServiceClient, history: vm.History, *, floor_mib: float | None = None,
                 actions: Iterable[QAction] = (), parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.client = client
        self.history = history
        self.floor_mib = floor_mib
        self.close_quits = False
        self.setWindowTitle("tray-app: headroom")
        self.setWindowIcon(state_icon(vm.GPU))
        self.setMinimumWidth(720)

        # The content scrolls when it is taller than the screen (a 768-pixel
        # laptop in degraded mode), instead of running off its bottom edge.
        self.body = QWidget()
        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.scroll.setWidget(self.body)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(self.scroll)
        root = QVBoxLayout(self.body)
        # Never squeeze the content to fit the viewport (wrapped labels would
        # overlap and buttons get clipped): it keeps its natural height and scrolls.
        root.setSizeConstraint(QLayout.SizeConstraint.SetMinimumSize)
        root.setContentsMargins(14, 12, 14, 12)
        root.setSpacing(10)

        self.no_tray_note = plain_label()
        self.no_tray_note.setObjectName("noTrayNote")
        self.no_tray_note.setWordWrap(True)
        self.no_tray_note.hide()
        root.addWidget(self.no_tray_note)

        self.header = StateHeader()
        root.addWidget(self.header)

        self.banner = DegradedBanner()
        self.banner.cancel_requested.connect(self._cancel)
        root.addWidget(self.banner)

        memory = QGroupBox("Memory headroom")
        self.memory_box = QVBoxLayout(memory)
        self.memory_box.setSpacing(12)
        self.vram_blocks: list[BarBlock] = []
        self.ram_block = BarBlock()
        self.memory_box.addWidget(self.ram_block)
        root.addWidget(memory)

        workers = QGroupBox("Workers")
        self.workers_grid = QGridLayout(workers)
        self.workers_grid.setHorizontalSpacing(14)
        self.workers_grid.setVerticalSpacing(4)
        header_row(self.workers_grid, WORKER_COLUMNS, self._align)
        self.worker_cells: dict[int, list[QLabel]] = {}
        root.addWidget(workers)
        # Failover time, once a replay has answered: how long a GPU fault cost the person waiting.
        self.failover_line = plain_label()
        theme.set_muted_text(self.failover_line)
        self.failover_line.hide()
        root.addWidget(self.failover_line)

        self.usage_table = UsageTable()
        root.addWidget(self.usage_table)

        # The library's models, once there is more than one: which is loaded where, and its memory.
        self.models_box = QGroupBox("Models")
        self.models_grid = QGridLayout(self.models_box)
        self.models_grid.setHorizontalSpacing(14)
        self.models_grid.setVerticalSpacing(4)
        header_row(self.models_grid, MODEL_COLUMNS)
        # The name column takes what the others leave, rather than widening the panel.
        self.models_grid.setColumnStretch(len(MODEL_COLUMNS), 0)
        self.models_grid.setColumnStretch(0, 1)
        self.model_cells: list[list[QLabel]] = []
        self.models_box.setVisible(False)
        root.addWidget(self.models_box)

        charts = QGroupBox("Last 5 minutes")
        charts_box = QHBoxLayout(charts)
        self.vram_chart = HistoryChart(
            "Free VRAM", "info", lambda s: s.vram_free_mib, lambda s: s.vram_total_mib,
            lambda s: s.vram_reserve_mib, "reserve", history.window_s)
        self.ram_chart = HistoryChart(
            "Available RAM", "ok", lambda s: s.ram_available_mib, lambda s: s.ram_total_mib,
            lambda s: self._floor(), "floor", history.window_s)
        charts_box.addWidget(self.vram_chart)
        charts_box.addWidget(self.ram_chart)
        root.addWidget(charts)

        self.buttons = QHBoxLayout()
        self.buttons.setSpacing(6)
        self.buttons.addStretch(1)
        for action in actions:
            self.add_action_button(action)
        root.addLayout(self.buttons)
        self.footer = plain_label()  # the model's name
        theme.set_muted_text(self.footer)
        self.footer.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        root.addWidget(self.footer)
        root.addStretch(1)

        client.status_changed.connect(self._on_status)
        client.unreachable.connect(self._on_unreachable)
        self._last_status: Status | None = None
        self._last_error: str | None = None
        # An error in the footer outlasts the polls that would overwrite it.
        self.footer_note = vm.TimedNote()
        self.service_starting = False
        # Esc puts the panel away like its close button; not in the no-tray
        # window, where closing quits the app and its service.
        self.escape = QShortcut(QKeySequence(Qt.Key.Key_Escape), self)
        self.escape.activated.connect(self._on_escape)
        self.apply_colors()
        self.refresh()

    # ----- public ------------------------------------------------------------------------

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt name
        """The content's size, as tall as the screen allows (a scroll area
        alone would ask for a small fixed size)."""
        hint = self.body.sizeHint()
        width = hint.width() + self.scroll.verticalScrollBar().sizeHint().width()
        screen = self.screen()
        if screen is None:
            return QSize(width, hint.height())
        # Leave room for the title bar and a panel or taskbar.
        room = screen.availableGeometry().height() - 60
        return QSize(width, min(hint.height(), room))

    def add_action_button(self, action: QAction) -> QToolButton:
        button = QToolButton()
        button.setDefaultAction(action)
        button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextOnly)
        button.setSizePolicy(QSizePolicy.Policy.Minimum, QSizePolicy.Policy.Fixed)
        button.setMinimumHeight(28)
        self.buttons.insertWidget(self.buttons.count() - 1, button)
        return button

    def apply_colors(self) -> None:
        """Colours from the current palette; again when the desktop's changes."""
        palette = theme.current_palette()
        self.no_tray_note.setStyleSheet(box_style_sheet("#noTrayNote", colors.tinted_box(palette, "info"),
                                                        "padding: 8px;"))
        self.header.apply_colors()
        self.banner.apply_colors()
        for block in (*self.vram_blocks, self.ram_block):
            block.apply_colors()
        theme.recolor_muted(self)
        for cells in self.worker_cells.values():
            self._color_state(cells[1], cells[1].property("workerState") or "", force=True)

    def set_no_tray_reason(self, text: str | None) -> None:
        self.no_tray_note.setText(text or "")
        self.no_tray_note.setVisible(bool(text))

    def refresh(self) -> None:
        status = self.client.last_status
        if status is not None:
            self._render(status)
        else:
            self._render_unreachable(self.client.last_error or "waiting for the service")

    # ----- events ------------------------------------------------------------------------

    def changeEvent(self, event: QEvent) -> None:  # noqa: N802 - Qt name
        super().changeEvent(event)
        # Only the application's palette reaches the window itself: its
        # children's own colours (set here) don't come back as this event.
        if event.type() == QEvent.Type.PaletteChange and hasattr(self, "escape"):  # not while still being built
            self.apply_colors()

    def _on_escape(self) -> None:
        if not self.close_quits:
            self.close()

    def showEvent(self, event) -> None:  # noqa: N802 - Qt name
        super().showEvent(event)
        self.refresh()

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt name
        if self.close_quits:
            event.accept()
            self.closed.emit()
            return
        event.ignore()
        self.hide()

    def _on_status(self, status: Status) -> None:
        if self.isVisible():
            self._render(status)

    def _on_unreachable(self, message: str) -> None:
        if self.isVisible():
            self._render_unreachable(message)

    def _cancel(self, request_id: str) -> None:
        def done(ok: bool, code: int, data: Any, message: str) -> None:
            if not ok:
                self.banner.cancel_failed(request_id)
                self.footer_note.show(f"Cancel failed: {message}")
                set_text(self.footer, self.footer_note.text())

        self.client.cancel(request_id, done)

    # ----- rendering ---------------------------------------------------------------------

    def _floor(self) -> float | None:
        return vm.ram_floor_mib(self._last_status, self.floor_mib)

    def _render_unreachable(self, message: str) -> None:
        self._last_status = None
        kind = vm.STARTING if self.service_starting else vm.DOWN
        self.header.set_state(kind, message, vm.SHAPE_MISMATCH_TITLE if self.client.shape_mismatch else None)
        self.banner.set_banner(None)
        set_text(self.footer, self.footer_note.text() or self.client.base_url)

    def _render(self, status: Status) -> None:
        self._last_status = status
        kind = vm.icon_kind(status)
        self.header.set_state(kind, vm.state_detail(status), vm.state_title(status))
        self.banner.set_banner(vm.degraded_banner(status))
        bars = vm.vram_bars(status)
        while len(self.vram_blocks) < len(bars):
            block = BarBlock()
            self.memory_box.insertWidget(len(self.vram_blocks), block)
            self.vram_blocks.append(block)
        while len(self.vram_blocks) > len(bars):
            block = self.vram_blocks.pop()
            self.memory_box.removeWidget(block)
            block.hide()
            block.setParent(None)
            block.deleteLater()
        for block, bar in zip(self.vram_blocks, bars):
            block.set_bar(bar)
        self.ram_block.set_bar(vm.ram_bar(status, self.floor_mib))
        self._render_workers(vm.worker_rows(status))
        failover = vm.failover_text(status)
        self.failover_line.setVisible(failover is not None)
        set_text(self.failover_line, failover or "")
        self.usage_table.set_view(vm.usage_view(status))
        self._render_models(vm.model_views(status))
        samples = list(self.history.samples)
        # No GPU, no VRAM to chart: the chart would only say "no data".
        self.vram_chart.setVisible(bool(bars))
        self.vram_chart.set_samples(samples)
        self.ram_chart.set_samples(samples)
        set_text(self.footer, self.footer_note.text() or f"{status['service']['model']} · {self.client.api_url}")

    def _render_models(self, views: list[vm.ModelView]) -> None:
        self.models_box.setVisible(len(views) > 1)
        while len(self.model_cells) < len(views):
            row = len(self.model_cells) + 1
            cells = []
            for column in range(len(MODEL_COLUMNS)):
                # The name shortens in the middle to the room it has (the panel keeps its width).
                label = ElidedLabel() if column == 0 else plain_label()
                self.models_grid.addWidget(label, row, column)
                cells.append(label)
            self.model_cells.append(cells)
        for index, cells in enumerate(self.model_cells):
            view = views[index] if index < len(views) else None
            for label in cells:
                label.setVisible(view is not None)
            if view is None:
                continue
            cells[0].set_full_text(view.name + (" (default)" if view.is_default else ""))
            for label, value in zip(cells[1:], (view.where, view.memory, str(view.busy) if view.busy else "-")):
                set_text(label, value)
            for label in cells:
                label.setToolTip(as_written(view.tooltip))
            # Loaded reads as healthy, loading and unloaded as information (nothing is wrong).
            self._color_state(cells[1], MODEL_PLACE_STATE.get(view.where, "stopping"))

    @staticmethod
    def _align(column: int) -> Qt.AlignmentFlag:
        if column >= 2:
            return Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
        return Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter

    def _render_workers(self, rows: list[vm.WorkerRow]) -> None:
        for index in range(max(len(rows), len(self.worker_cells))):
            row = rows[index] if index < len(rows) else None
            cells = self.worker_cells.get(index)
            if cells is None:
                if row is None:
                    continue
                cells = []
                for column in range(len(WORKER_COLUMNS)):
                    label = plain_label()
                    label.setAlignment(self._align(column))
                    self.workers_grid.addWidget(label, 1 + 2 * index, column)
                    cells.append(label)
                exit_label = plain_label()  # the worker's own last words
                exit_label.setWordWrap(True)
                theme.set_muted_text(exit_label)
                self.workers_grid.addWidget(exit_label, 2 + 2 * index, 1, 1, len(WORKER_COLUMNS) - 1)
                cells.append(exit_label)
                self.worker_cells[index] = cells
            if row is None:
                for label in cells:
                    label.hide()
                continue
            values = (row.role, row.state, row.pid, row.rss, row.vram, row.ram, row.ctx, row.drafts, row.restarts)
            for label, value in zip(cells, values):
                set_text(label, value)
                label.show()
            self._color_state(cells[1], row.state)
            set_text(cells[-1], f"last exit: {row.last_exit}" if row.last_exit else "")
            cells[-1].setVisible(bool(row.last_exit))

    @staticmethod
    def _color_state(label: QLabel, state: str, *, force: bool = False) -> None:
        if label.property("workerState") == state and not force:
            return
        label.setProperty("workerState", state)
        status = WORKER_STATE_STATUS.get(state, "error")
        theme.set_text_color(label, colors.status_color(status, theme.current_palette().window))
