"""The log viewer's logic without Qt: which logs, the tail of a growing file, the filter."""

from __future__ import annotations

import os
from pathlib import Path

from tray_app.ui.logtail import (
    LogSource, LogTail, count_text, filter_lines, label_for_file, log_sources, worker_logs_in,
)

APP_LOG = Path("/logs/tray-app.log")


def one_model_status() -> dict:
    return {
        "service": {"model": "qwen"},
        "workers": [{"role": "gpu", "log": "/logs/gpu-worker.log"}, {"role": "cpu", "log": "/logs/cpu-worker.log"}],
        "models": [{"name": "qwen", "logs": {"gpu": "/logs/gpu-worker.log", "cpu": "/logs/cpu-worker.log"}}],
        "embeddings": {"enabled": True, "log": "/logs/embed-worker.log"},
    }


def test_sources_of_one_model_are_named_by_worker() -> None:
    assert log_sources(one_model_status(), APP_LOG) == [
        LogSource("Tray app", APP_LOG),
        LogSource("GPU worker", Path("/logs/gpu-worker.log")),
        LogSource("CPU worker", Path("/logs/cpu-worker.log")),
        LogSource("Embeddings worker", Path("/logs/embed-worker.log")),
    ]


def test_sources_of_several_models_name_the_model_and_list_each_file_once() -> None:
    status = one_model_status()
    status["models"].append({"name": "llama", "logs": {"gpu": "/logs/gpu-llama-worker.log",
                                                       "cpu": "/logs/cpu-llama-worker.log"}})
    status["embeddings"] = {"enabled": False, "reason": "off"}
    labels = [s.label for s in log_sources(status, APP_LOG)]
    assert labels == ["Tray app", "GPU worker (qwen)", "CPU worker (qwen)", "GPU worker (llama)", "CPU worker (llama)"]


def test_without_a_status_the_folder_has_the_worker_logs() -> None:
    # The service is down: its workers' logs are still there to read.
    files = [Path("/logs/gpu-worker.log"), Path("/logs/cpu-big-model-worker.log")]
    assert [s.label for s in log_sources(None, APP_LOG, files)] == ["Tray app", "CPU worker (big-model)", "GPU worker"]
    # A file /status lists keeps its status label.
    assert [s.label for s in log_sources(one_model_status(), APP_LOG, files)][-1] == "CPU worker (big-model)"
    assert len(log_sources(one_model_status(), APP_LOG, files)) == 5


def test_label_for_file_and_the_folder_scan(tmp_path: Path) -> None:
    assert label_for_file(Path("embed-worker.log")) == "Embeddings worker"
    assert label_for_file(Path("notes.txt")) == "notes.txt"
    for name in ("gpu-worker.log", "gpu-worker.log.1", "tray-app.log", "cpu-x-worker.log"):
        (tmp_path / name).write_text("")
    assert [p.name for p in worker_logs_in(tmp_path)] == ["cpu-x-worker.log", "gpu-worker.log"]
    assert worker_logs_in(tmp_path / "missing") == []


def test_filter_ignores_case_and_counts() -> None:
    lines = ["INFO loaded", "warning: slow", "Error: CUDA out of memory", "info done"]
    assert filter_lines(lines, "info") == ["INFO loaded", "info done"]
    assert filter_lines(lines, "") == lines
    assert filter_lines(lines, "cuda OUT") == ["Error: CUDA out of memory"]
    assert count_text(2, 4, True) == "2 of 4 lines"
    assert count_text(4, 4, False) == "4 lines"
    assert count_text(1, 1, False) == "1 line"
    assert count_text(0, 20_000, True) == "0 of 20,000 lines"


def test_tail_reads_appends_whole_lines_only(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    log.write_bytes(b"one\ntwo\n")
    tail = LogTail(log)
    first = tail.poll()
    assert first.reset and first.new == ["one", "two"]
    assert tail.poll().new == [] and not tail.poll().reset
    with log.open("ab") as f:
        f.write(b"three\r\nfou")
    assert tail.poll().new == ["three"]
    with log.open("ab") as f:
        f.write(b"r\n")
    update = tail.poll()
    assert not update.reset and update.new == ["four"]
    assert list(tail.lines) == ["one", "two", "three", "four"]


def test_tail_reads_only_the_end_of_a_big_file(tmp_path: Path) -> None:
    log = tmp_path / "big.log"
    log.write_bytes(b"".join(b"line %05d\n" % i for i in range(1000)))  # 11 bytes a line
    tail = LogTail(log, tail_bytes=105)
    lines = tail.poll().new
    # The partial line at the cut is dropped.
    assert lines == [f"line {i:05d}" for i in range(991, 1000)] and tail.truncated
    # A burst larger than the tail jumps to the end too.
    with log.open("ab") as f:
        f.write(b"".join(b"more %05d\n" % i for i in range(50)))
    update = tail.poll()
    assert update.reset and update.new[-1] == "more 00049" and len(update.new) == 9


def test_tail_keeps_a_bounded_number_of_lines(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    log.write_text("".join(f"{i}\n" for i in range(100)))
    tail = LogTail(log, max_lines=10)
    tail.poll()
    assert list(tail.lines) == [str(i) for i in range(90, 100)]


def test_tail_rereads_after_truncation_and_rotation(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    log.write_text("old 1\nold 2\nold 3\n")
    tail = LogTail(log)
    tail.poll()
    log.write_text("new\n")  # truncated in place: smaller than what was read
    update = tail.poll()
    assert update.reset and update.new == ["new"] and list(tail.lines) == ["new"]
    # Rotated: renamed away, a new file in its place (even one as long as the read part).
    os.rename(log, tmp_path / "a.log.1")
    log.write_text("rotated\n")
    update = tail.poll()
    assert update.reset and list(tail.lines) == ["rotated"]


def test_tail_of_a_missing_file_says_so_then_reads_it(tmp_path: Path) -> None:
    log = tmp_path / "later.log"
    tail = LogTail(log)
    assert tail.poll().reset and tail.message() == f"No log yet at {log}"
    assert not tail.poll().reset  # nothing changed: nothing to redraw
    log.write_text("here\n")
    update = tail.poll()
    assert update.reset and update.new == ["here"] and tail.message() is None
    log.unlink()
    assert tail.poll().reset and tail.message() == f"No log yet at {log}" and not tail.lines


def test_tail_replaces_undecodable_bytes(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    log.write_bytes(b"ok \xff\xfe bytes\n\xe2\x9c\x93 done\n")
    assert LogTail(log).poll().new == ["ok \ufffd\ufffd bytes", "\u2713 done"]


def test_tail_of_an_unreadable_path_says_why(tmp_path: Path) -> None:
    tail = LogTail(tmp_path)  # a folder, not a file
    assert tail.poll().reset
    assert tail.message().startswith(f"Cannot read {tmp_path}: ")
