"""The panel's small tables: a bold header row, and the usage table."""

from __future__ import annotations

from typing import Callable

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QGridLayout, QGroupBox, QLabel

from . import theme
from . import viewmodel as vm
from .widgets import ElidedLabel, plain_label, set_text
from . import qtcompat  # noqa: F401 - guards against a PySide6 refcount bug

USAGE_COLUMNS = ("Key or app", "Today", "Last 7 days")


def header_row(grid: QGridLayout, columns: tuple[str, ...],
               align: Callable[[int], Qt.AlignmentFlag] | None = None) -> None:
    """A table's bold header in row 0, and the stretch after its last column."""
    for column, name in enumerate(columns):
        label = QLabel(name)
        bold = label.font()
        bold.setBold(True)
        label.setFont(bold)
        if align is not None:
            label.setAlignment(align(column))
        grid.addWidget(label, 0, column)
    grid.setColumnStretch(len(columns), 1)


class UsageTable(QGroupBox):
    """Who used the service (status["usage"]): a row per key or app, today
    and the last 7 days; hidden until anyone has."""

    def __init__(self) -> None:
        super().__init__("Usage")
        self.grid = QGridLayout(self)
        self.grid.setHorizontalSpacing(14)
        self.grid.setVerticalSpacing(4)
        header_row(self.grid, USAGE_COLUMNS)
        # The name column takes what the others leave, rather than widening the panel.
        self.grid.setColumnStretch(len(USAGE_COLUMNS), 0)
        self.grid.setColumnStretch(0, 1)
        self.cells: list[list[QLabel]] = []
        self.more = plain_label()
        theme.set_muted_text(self.more)
        self.setVisible(False)

    def set_view(self, view: vm.UsageView | None) -> None:
        self.setVisible(view is not None)
        rows = view.rows if view is not None else ()
        while len(self.cells) < len(rows):
            cells = [ElidedLabel() if column == 0 else plain_label() for column in range(len(USAGE_COLUMNS))]
            for column, label in enumerate(cells):
                self.grid.addWidget(label, len(self.cells) + 1, column)
            self.cells.append(cells)
        for index, cells in enumerate(self.cells):
            usage = rows[index] if index < len(rows) else None
            for label in cells:
                label.setVisible(usage is not None)
            if usage is not None:
                cells[0].set_full_text(usage.name)
                set_text(cells[1], usage.today)
                set_text(cells[2], usage.week)
        # Below the last row: the grid keeps the rows it made, hidden or not.
        self.grid.addWidget(self.more, len(self.cells) + 1, 0, 1, len(USAGE_COLUMNS))
        more = view.more if view is not None else 0
        set_text(self.more, f"and {more} more (the web page lists them all)" if more else "")
        self.more.setVisible(bool(more))
