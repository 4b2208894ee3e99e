"""Usage counting: per name and day, bounded, and kept across a restart."""

from __future__ import annotations

import json
from datetime import date, timedelta

from tray_app.core.access.usage import HISTORY_DAYS, OTHER, SAVE_INTERVAL_S, Outcome, UsageBook, UsageStore
from tests.fakes.clock import FakeClock

DAY = date(2026, 12, 1)


def test_counts_by_name_path_and_outcome():
    book = UsageBook()
    book.record("phone", Outcome("gpu", 10, 5), DAY)
    book.record("phone", Outcome("cpu", 7, 3, degraded=True), DAY)
    book.record("phone", Outcome(refused=True), DAY)
    book.record("laptop", Outcome("peer", 1, 2, degraded=True, cancelled=True), DAY)
    today = book.snapshot(DAY)["by_name"]
    phone = today["phone"]["today"]
    assert (phone["requests"], phone["tokens_in"], phone["tokens_out"]) == (3, 17, 8)
    assert (phone["degraded"], phone["refused"], phone["cancelled"]) == (1, 1, 0)
    assert phone["paths"]["gpu"] == {"requests": 1, "tokens_in": 10, "tokens_out": 5}
    assert phone["paths"]["cpu"] == {"requests": 1, "tokens_in": 7, "tokens_out": 3}
    assert today["laptop"]["today"]["paths"]["peer"]["requests"] == 1
    assert today["laptop"]["today"]["cancelled"] == 1
    assert book.since_start["phone"]["requests"] == 3


def test_today_and_the_last_seven_days_and_older_days_dropped():
    book = UsageBook()
    book.record("phone", Outcome("gpu", 1, 1), DAY - timedelta(days=7))  # the eighth day back: history only
    book.record("phone", Outcome("gpu", 1, 1), DAY - timedelta(days=6))
    book.record("phone", Outcome("gpu", 1, 1), DAY)
    snapshot = book.snapshot(DAY)
    assert snapshot["by_name"]["phone"]["today"]["requests"] == 1
    assert snapshot["by_name"]["phone"]["last_7_days"]["requests"] == 2
    assert len(snapshot["days"]) == 3
    book.record("phone", Outcome("gpu", 1, 1), DAY + timedelta(days=HISTORY_DAYS))
    assert [d["day"] for d in book.snapshot(DAY + timedelta(days=HISTORY_DAYS))["days"]] == [
        (DAY + timedelta(days=HISTORY_DAYS)).isoformat()]


def test_names_are_bounded_with_an_other_bucket():
    book = UsageBook(max_names=4)
    for n in range(10):
        book.record(f"app{n}", Outcome("gpu", 1, 1), DAY)
    names = book.snapshot(DAY)["by_name"]
    assert set(names) == {"app0", "app1", "app2", OTHER}
    assert names[OTHER]["today"]["requests"] == 7
    assert set(book.since_start) == {"app0", "app1", "app2", OTHER}


def test_saved_at_most_every_interval_and_read_back_after_a_restart(tmp_path):
    clock = FakeClock()
    path = tmp_path / "usage.json"
    store = UsageStore(path, clock=clock, today=lambda: DAY)
    assert store.record("phone", Outcome("gpu", 3, 4)) is False  # just started: not due
    clock.advance(SAVE_INTERVAL_S)
    assert store.record("phone", Outcome("cpu", 1, 1, degraded=True)) is True
    store.write(store.take_unsaved())
    assert store.take_unsaved() is None  # nothing new since
    store.record("laptop", Outcome(refused=True))
    store.save()  # at shutdown
    again = UsageStore(path, clock=clock, today=lambda: DAY).snapshot()["by_name"]
    assert again["phone"]["today"]["requests"] == 2 and again["phone"]["today"]["degraded"] == 1
    assert again["laptop"]["today"]["refused"] == 1


def test_an_unreadable_file_starts_a_new_book(tmp_path):
    path = tmp_path / "usage.json"
    path.write_text("{broken")
    assert UsageStore(path, today=lambda: DAY).snapshot()["by_name"] == {}
    path.write_text(json.dumps({"format": 1, "days": {"not-a-day": {}, DAY.isoformat(): {"x": {"requests": "a"}}}}))
    assert UsageStore(path, today=lambda: DAY).snapshot()["by_name"] == {}
