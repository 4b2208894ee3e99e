"""Saved chat conversations: one private JSON file each; bad files are skipped, not fatal."""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
import time

import pytest

from tray_app.ui import conversations as cv


def sample(**kwargs) -> cv.Conversation:
    return cv.Conversation(
        system_prompt="Answer briefly.",
        turns=[{"role": "user", "text": "What is a lighthouse?", "meta": "", "error": ""},
               {"role": "assistant", "text": "A tower with a **light**.", "meta": "served by GPU · 40 tok/s",
                "error": ""}],
        messages=[{"role": "user", "content": "What is a lighthouse?"},
                  {"role": "assistant", "content": "A tower with a **light**."}],
        **kwargs)


def test_save_and_load_round_trip_privately(tmp_path) -> None:
    store = cv.ConversationStore(tmp_path / "conversations")
    conversation = sample()
    path = store.save(conversation)
    assert path == tmp_path / "conversations" / f"{conversation.id}.json"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # it holds what the user typed
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    loaded = store.load(conversation.id)
    assert loaded == conversation
    data = json.loads(path.read_text())
    assert data["format"] == cv.FORMAT and data["title"] == "What is a lighthouse?"


def test_list_is_newest_first_and_titles_are_short(tmp_path) -> None:
    store = cv.ConversationStore(tmp_path)
    older, newer = sample(), sample()
    newer.turns[0]["text"] = "x" * 200 + "\nsecond line"
    store.save(older)
    time.sleep(0.01)
    store.save(newer)
    listed = store.list()
    assert [s.id for s in listed] == [newer.id, older.id]
    assert len(listed[0].title) == cv.TITLE_CHARS and listed[0].title.endswith("…")
    assert cv.title_for([]) == "New conversation"


def test_corrupt_and_foreign_files_are_skipped_with_a_log_line(tmp_path, caplog) -> None:
    store = cv.ConversationStore(tmp_path)
    good = sample()
    store.save(good)
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "foreign.json").write_text(json.dumps({"hello": "world"}))
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    bad_turn = good.to_json() | {"turns": [{"role": "wizard", "text": "x"}]}
    (tmp_path / "badturn.json").write_text(json.dumps(bad_turn))
    future = good.to_json() | {"version": 99}
    (tmp_path / "future.json").write_text(json.dumps(future))
    (tmp_path / "not an id!.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("ignored")
    with caplog.at_level(logging.WARNING, logger=cv.__name__):
        listed = store.list()
    assert [s.id for s in listed] == [good.id]
    skipped = {r.args[0] for r in caplog.records}
    assert {"broken", "foreign", "list", "binary", "badturn", "future"} <= skipped
    assert store.load("broken") is None and store.load("missing") is None


def test_a_missing_folder_lists_nothing(tmp_path) -> None:
    assert cv.ConversationStore(tmp_path / "never-made").list() == []


def test_ids_cannot_reach_outside_the_folder(tmp_path) -> None:
    store = cv.ConversationStore(tmp_path / "c")
    (tmp_path / "secret.json").write_text("{}")
    with pytest.raises(ValueError):
        store.path("../secret")
    assert store.load("../secret") is None
    assert store.delete("../secret") is False and (tmp_path / "secret.json").exists()


def test_delete(tmp_path) -> None:
    store = cv.ConversationStore(tmp_path)
    conversation = sample()
    store.save(conversation)
    assert store.delete(conversation.id) and store.list() == []
    assert store.delete(conversation.id) is False


@pytest.mark.skipif(sys.platform != "linux", reason="XDG_DATA_HOME is where platformdirs looks on Linux")
def test_the_default_folder_is_the_apps_data_folder(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert cv.default_dir() == tmp_path / "tray-app" / "conversations"
