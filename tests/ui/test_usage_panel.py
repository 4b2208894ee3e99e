"""The panel's usage table (status["usage"]): per key or app, today and the
last 7 days, busiest first, a few rows and the rest counted."""

from __future__ import annotations

from tests.status_sample import conforming
from tray_app.ui import viewmodel as vm
from tray_app.ui.client import ServiceClient
from tray_app.ui.panel import HeadroomPanel


def counts(requests: int, tokens_in: int = 0, tokens_out: int = 0, degraded: int = 0) -> dict:
    paths = {path: {"requests": 0, "tokens_in": 0, "tokens_out": 0} for path in ("gpu", "cpu", "peer")}
    return {"requests": requests, "tokens_in": tokens_in, "tokens_out": tokens_out, "degraded": degraded,
            "refused": 0, "cancelled": 0, "paths": paths}


def with_usage(by_name: dict[str, tuple[dict, dict]]) -> dict:
    return conforming({"usage": {"today": "2026-12-01", "days": [],
                                 "by_name": {name: {"today": today, "last_7_days": week}
                                             for name, (today, week) in by_name.items()}}})


def test_usage_rows_are_busiest_first_over_the_week_with_tokens_and_degraded() -> None:
    status = with_usage({
        "notes-app": (counts(0), counts(3, 100, 20)),
        "editor": (counts(12, 3000, 456, degraded=2), counts(40, 9000, 3456, degraded=2)),
    })
    view = vm.usage_view(status)
    assert view == vm.UsageView((
        vm.UsageRow("editor", "12 requests · 3,456 tokens · 2 degraded", "40 requests · 12.5k tokens · 2 degraded"),
        vm.UsageRow("notes-app", "none", "3 requests · 120 tokens"),
    ), more=0)


def test_no_usage_or_nothing_counted_yet_shows_no_table() -> None:
    status = conforming({})
    status.pop("usage", None)
    assert vm.usage_view(status) is None
    assert vm.usage_view(with_usage({})) is None


def test_the_panel_lists_a_few_names_and_counts_the_rest(qtbot) -> None:
    client = ServiceClient("http://127.0.0.1:9")  # never started: the test feeds snapshots
    panel = HeadroomPanel(client, vm.History(), floor_mib=1024)
    qtbot.addWidget(panel)
    panel.show()
    names = {f"app-{n}": (counts(n), counts(10 * n, 50 * n, 50 * n)) for n in range(1, vm.MAX_USAGE_ROWS + 3)}
    client.last_status = with_usage(names)
    panel.refresh()
    assert panel.usage_table.isVisible()
    shown = [(cells[0].full_text, cells[1].text(), cells[2].text())
             for cells in panel.usage_table.cells if cells[0].isVisible()]
    busiest = f"app-{vm.MAX_USAGE_ROWS + 2}"  # the most requests this week
    assert len(shown) == vm.MAX_USAGE_ROWS
    assert shown[0] == (busiest, f"{vm.MAX_USAGE_ROWS + 2} requests · 0 tokens", "70 requests · 700 tokens")
    assert panel.usage_table.more.isVisible() and panel.usage_table.more.text().startswith("and 2 more")

    client.last_status = with_usage({"solo": (counts(1, 5, 5), counts(1, 5, 5))})
    panel.refresh()
    assert [cells[1].text() for cells in panel.usage_table.cells if cells[1].isVisible()] == ["1 request · 10 tokens"]
    assert not panel.usage_table.more.isVisible()


def test_counts_stay_short() -> None:
    assert [vm.fmt_count(n) for n in (0, 3456, 12_345, 232_000, 4_500_000)] == ["0", "3,456", "12.3k", "232k", "4.5M"]
