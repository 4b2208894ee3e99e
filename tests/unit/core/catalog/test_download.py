"""The pure parts of `tray-app pull`: model references, the hub's URLs and
tree entries, what a response to a Range request means, the rough fit rule
and the progress line. The network half is in tests/integration/test_pull.py."""

from __future__ import annotations

import io

import pytest

from tests.fakes.clock import FakeClock
from tray_app.cli.pull import EXIT_FAILED, EXIT_USAGE, ProgressPrinter, _exit_code
from tray_app.core.catalog.download import (Action, DownloadError, ErrorKind, ModelRef, RoughFit, decide, error_for_status,
                                    format_duration, make_ref, next_page_url, parse_content_range, parse_model_ref,
                                    plan_offset, range_headers, remote_file_from_tree, render_progress, resolve_url,
                                    rough_fit, space_shortfall, tree_url)
from tray_app.core.memory.fit import Headroom

MIB = 1024 * 1024
SHA = "a" * 64


# ----- model references ------------------------------------------------------------


@pytest.mark.parametrize("text, repo, file", [
    ("bartowski/SmolLM2-GGUF/SmolLM2-Q4.gguf", "bartowski/SmolLM2-GGUF", "SmolLM2-Q4.gguf"),
    ("owner/name/sub/dir/model.gguf", "owner/name", "sub/dir/model.gguf"),
    ("owner/name:model.gguf", "owner/name", "model.gguf"),
    ("owner/name:sub/model.GGUF", "owner/name", "sub/model.GGUF"),
    ("  owner/name/model.gguf ", "owner/name", "model.gguf"),
])
def test_reference_forms(text, repo, file):
    assert parse_model_ref(text) == ModelRef(repo, file)


def test_the_local_name_is_the_last_path_part():
    ref = parse_model_ref("owner/name/sub/dir/model.gguf")
    assert ref.filename == "model.gguf"
    assert str(ref) == "owner/name/sub/dir/model.gguf"


@pytest.mark.parametrize("text", [
    "owner/model.gguf",          # no repo name
    "model.gguf",
    "owner/name:",               # no file
    "owner/name/../x.gguf",      # escapes the repo
    "owner/name/a//x.gguf",
    "own er/name/x.gguf",
    "a/b/c:x.gguf",              # a repo is owner/name, exactly
])
def test_malformed_references_are_usage_errors(text):
    with pytest.raises(DownloadError) as caught:
        parse_model_ref(text)
    assert caught.value.kind is ErrorKind.USAGE
    assert _exit_code(caught.value) == EXIT_USAGE


@pytest.mark.parametrize("text", ["owner/name/model.safetensors", "owner/name:README.md", "owner/name/x.gguf.part"])
def test_only_gguf_files_are_models(text):
    with pytest.raises(DownloadError, match="not a .gguf file") as caught:
        parse_model_ref(text)
    assert caught.value.kind is ErrorKind.NOT_GGUF
    assert _exit_code(caught.value) == EXIT_USAGE


@pytest.mark.parametrize("text", [
    "owner/name:C:evil.gguf",          # on Windows: evil.gguf in drive C's current folder
    "owner/name:sub/C:evil.gguf",
    "owner/name/NUL.gguf",             # a device on Windows, whatever the extension
    "owner/name/com1.Q4.gguf",
    "owner/name/a|b.gguf",
    "owner/name/x\x1b[2J.gguf",
])
def test_a_name_that_is_not_one_plain_file_on_every_os_is_refused(text):
    assert parse_model_ref("owner/name/console-nul.Q4.gguf").filename == "console-nul.Q4.gguf"  # a near miss
    with pytest.raises(DownloadError, match="can't be saved in the models folder") as caught:
        parse_model_ref(text)
    assert caught.value.kind is ErrorKind.USAGE and "\x1b" not in str(caught.value)


def test_hub_urls():
    ref = make_ref("owner/name", "sub dir/model.gguf")
    assert resolve_url("https://hub.example/", ref) == \
        "https://hub.example/owner/name/resolve/main/sub%20dir/model.gguf"
    # A revision's slashes are escaped; the tree listing is of the file's own folder.
    assert resolve_url("http://h", ref, "refs/pr/1") == "http://h/owner/name/resolve/refs%2Fpr%2F1/sub%20dir/model.gguf"
    assert tree_url("http://h", ref, "v1") == "http://h/api/models/owner/name/tree/v1/sub%20dir"
    assert tree_url("http://h", make_ref("owner/name", "m.gguf")) == "http://h/api/models/owner/name/tree/main"


# ----- the tree entry --------------------------------------------------------------


def test_an_lfs_entry_gives_size_and_sha256():
    ref = make_ref("o/n", "sub/m.gguf")
    entries = [
        {"type": "directory", "path": "sub", "oid": "1" * 40, "size": 0},
        {"type": "file", "path": "sub/other.gguf", "size": 5, "lfs": {"oid": "b" * 64, "size": 5}},
        {"type": "file", "path": "sub/m.gguf", "size": 134, "oid": "c" * 40,
         "lfs": {"oid": SHA.upper(), "size": 98362432, "pointerSize": 134}},
    ]
    remote = remote_file_from_tree(entries, ref, "main")
    assert (remote.size, remote.sha256, remote.revision) == (98362432, SHA, "main")


def test_a_plain_entry_has_no_usable_hash():
    # A git blob id is a SHA-1 of header + bytes: not a content SHA-256.
    remote = remote_file_from_tree([{"type": "file", "path": "m.gguf", "size": 10, "oid": "c" * 40}],
                                   make_ref("o/n", "m.gguf"), "main")
    assert (remote.size, remote.sha256) == (10, None)


def test_a_missing_entry_is_not_found():
    with pytest.raises(DownloadError, match="has no file m.gguf at revision v2") as caught:
        remote_file_from_tree([{"type": "file", "path": "x.gguf"}, "junk"], make_ref("o/n", "m.gguf"), "v2")
    assert caught.value.kind is ErrorKind.NOT_FOUND
    with pytest.raises(DownloadError, match="directory"):
        remote_file_from_tree([{"type": "directory", "path": "m.gguf"}], make_ref("o/n", "m.gguf"), "main")


def test_what_the_hub_says_is_never_obeyed_by_a_terminal():
    evil = "\x1b]0;owned\x07\x1b[2J\r\u202e"
    with pytest.raises(DownloadError) as caught:
        remote_file_from_tree([{"type": evil, "path": "m.gguf"}], make_ref("o/n", "m.gguf"), "main")
    text = str(caught.value)
    assert text.isprintable() and "\\x1b]0;owned\\x07\\x1b[2J\\r\\u202e" in text


@pytest.mark.parametrize("link, expected", [
    (None, None),
    ("https://hub.example/api/models/o/n/tree/main?cursor=2", "https://hub.example/api/models/o/n/tree/main?cursor=2"),
    ("/api/models/o/n/tree/main?cursor=2", "https://hub.example/api/models/o/n/tree/main?cursor=2"),
    ("https://HUB.example:443/x", "https://HUB.example:443/x"),
])
def test_the_file_list_continues_on_the_hub(link, expected):
    assert next_page_url("https://hub.example", "https://hub.example/api/models/o/n/tree/main", link) == expected


@pytest.mark.parametrize("link", ["https://evil.example/x", "http://hub.example/x", "https://hub.example:8443/x",
                                  "//evil.example/x"])
def test_a_file_list_continued_elsewhere_is_refused(link):
    with pytest.raises(DownloadError, match="token is never sent off") as caught:
        next_page_url("https://hub.example", "https://hub.example/api/models/o/n/tree/main", link)
    assert caught.value.kind is ErrorKind.SERVER


@pytest.mark.parametrize("status, code, token, kind, words", [
    (404, "", False, ErrorKind.NOT_FOUND, "has no o/n at revision main"),
    (401, "RepoNotFound", False, ErrorKind.NOT_FOUND, "HF_TOKEN"),
    (404, "RevisionNotFound", False, ErrorKind.NOT_FOUND, "no revision main"),
    (404, "EntryNotFound", False, ErrorKind.NOT_FOUND, "no file m.gguf"),
    (401, "", False, ErrorKind.AUTH, "set HF_TOKEN"),
    (403, "GatedRepo", True, ErrorKind.AUTH, "token in HF_TOKEN has no access"),
    (503, "", False, ErrorKind.NETWORK, "HTTP 503"),
    (429, "", False, ErrorKind.NETWORK, "HTTP 429"),
    (418, "", False, ErrorKind.SERVER, "HTTP 418"),
])
def test_statuses_become_one_line_errors(status, code, token, kind, words):
    error = error_for_status(status, make_ref("o/n", "m.gguf"), "main", token_set=token, hub_code=code)
    assert error.kind is kind
    assert words in str(error) and "\n" not in str(error)
    assert _exit_code(error) == EXIT_FAILED


# ----- resuming --------------------------------------------------------------------


def test_range_header_only_when_resuming():
    assert range_headers(0) == {}
    assert range_headers(1234) == {"Range": "bytes=1234-"}


def test_content_range():
    assert parse_content_range("bytes 100-199/1000") == (100, 199, 1000)
    assert parse_content_range("bytes 0-9/*") == (0, 9, None)
    assert parse_content_range("items 0-9/10") is None
    assert parse_content_range(None) is None


@pytest.mark.parametrize("status, offset, content_range, action", [
    (200, 0, None, Action.START_OVER),
    (200, 500, None, Action.START_OVER),          # the server ignored the Range
    (206, 500, "bytes 500-999/1000", Action.APPEND),
    (206, 500, "bytes 0-999/1000", Action.ASK_AGAIN),  # not where we asked
    (206, 500, None, Action.ASK_AGAIN),
    (416, 1000, "bytes */1000", Action.COMPLETE),
    (416, 0, None, None),                         # no range was asked for: an error
    (404, 500, None, None),
    (401, 0, None, None),
])
def test_what_a_response_means(status, offset, content_range, action):
    assert decide(status, offset, content_range) is action


def test_a_part_longer_than_the_file_is_started_over():
    assert plan_offset(500, 1000) == 500
    assert plan_offset(1000, 1000) == 1000  # the server will say 416; then verify
    assert plan_offset(1001, 1000) == 0
    assert plan_offset(7, None) == 7


def test_disk_space_counts_the_part_already_there():
    assert space_shortfall(1000, 0, 2000) == 0
    assert space_shortfall(1000, 600, 400) == 0
    assert space_shortfall(1000, 100, 400) == 500
    assert space_shortfall(None, 0, 0) == 0


# ----- will it fit -----------------------------------------------------------------


def headroom(vram_free: float | None, ram: float) -> Headroom:
    return Headroom(vram_free_mib=vram_free, ram_available_mib=ram, vram_reserve_mib=1024, ram_floor_mib=512,
                    vram_unknown_reason="no NVIDIA GPU")


def test_rough_fit_verdicts():
    size = 4096 * MIB  # + 512 MiB GPU runtime, + 96 MiB host runtime
    fit, line = rough_fit(size, headroom(8192, 16384))
    assert fit is RoughFit.GPU
    assert line.startswith("fits on the GPU: needs ~4.5 GiB of VRAM, 7.0 GiB free above the 1.0 GiB reserve")
    fit, line = rough_fit(size, headroom(5000, 16384))
    assert fit is RoughFit.CPU_ONLY and "fits only on the CPU" in line and "~4.1 GiB of RAM" in line
    fit, line = rough_fit(size, headroom(None, 16384))
    assert fit is RoughFit.CPU_ONLY and "GPU unknown (no NVIDIA GPU)" in line
    fit, line = rough_fit(size, headroom(2048, 4000))
    assert fit is RoughFit.NO_FIT and line.startswith("does not fit")
    assert "KV cache" in line


# ----- progress --------------------------------------------------------------------


def test_progress_line_with_a_known_total():
    line = render_progress(50 * MIB, 100 * MIB, 5.0, bar_width=10)
    assert line == "50.0 MiB / 100.0 MiB   50%  [#####-----]  10.0 MiB/s  ETA 0:05"
    assert render_progress(100 * MIB, 100 * MIB, 10.0).endswith("100%  10.0 MiB/s  ETA 0:00")


def test_progress_speed_counts_only_this_sessions_bytes():
    line = render_progress(60 * MIB, 100 * MIB, 2.0, resumed_from=50 * MIB)
    assert "5.0 MiB/s" in line and "ETA 0:08" in line


def test_progress_without_a_total_or_time():
    assert render_progress(3 * MIB, None, 1.0) == "3.0 MiB  3.0 MiB/s"
    assert render_progress(0, 10 * MIB, 0.0).endswith("0.0 MiB/s  ETA ?")
    assert "GiB" in render_progress(3 * 1024 * MIB, 6 * 1024 * MIB, 1.0)


def test_durations():
    assert format_duration(5) == "0:05"
    assert format_duration(3599) == "59:59"
    assert format_duration(3725) == "1:02:05"


def test_a_terminal_gets_a_redrawn_bar():
    stream, clock = io.StringIO(), FakeClock(0.0)
    printer = ProgressPrinter(stream, tty=True, clock=clock)
    printer(0, 100 * MIB)
    clock.now = 0.05
    printer(10 * MIB, 100 * MIB)  # too soon: skipped
    clock.now = 1.0
    printer(20 * MIB, 100 * MIB)
    clock.now = 1.01
    printer(100 * MIB, 100 * MIB)  # the last one always shows
    printer.finish()
    text = stream.getvalue()
    assert text.count("\r") == 3 and "[" in text and text.endswith("\n")
    assert "10.0 MiB /" not in text


def test_a_log_gets_plain_lines_now_and_then():
    stream, clock = io.StringIO(), FakeClock(0.0)
    printer = ProgressPrinter(stream, tty=False, clock=clock)
    for second in range(12):
        clock.now = float(second)
        printer(second * MIB, 100 * MIB)
    printer.finish()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3  # at 0, 5 and 10 s
    assert all(line.startswith("tray-app: ") and "[" not in line and "\r" not in line for line in lines)
