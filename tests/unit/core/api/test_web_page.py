"""GET /admin/logs reads a bounded end of a worker's log (core/api/web_page.py)."""

from __future__ import annotations

from tray_app.core.api.web_page import LOG_TAIL_BYTES, last_lines, read_end


def test_a_long_log_is_read_only_from_its_end_and_its_cut_first_line_dropped(tmp_path):
    log = tmp_path / "gpu-worker.log"
    lines = [f"line {i:07d} " + "x" * 80 for i in range(20_000)]  # about 1.8 MB
    log.write_text("\n".join(lines) + "\n")
    data, cut = read_end(log)
    assert cut and len(data) == LOG_TAIL_BYTES
    tail = last_lines(data, 10_000, cut_at_start=True)
    assert tail == lines[-len(tail):]  # whole lines only: the fragment the cut began with is gone
    assert 0 < len(tail) < 20_000
    assert last_lines(data, 3, cut_at_start=True) == lines[-3:]


def test_a_short_log_is_read_whole_and_a_missing_one_is_empty(tmp_path):
    log = tmp_path / "cpu-worker.log"
    log.write_text("first\nsecond\n")
    data, cut = read_end(log)
    assert not cut and last_lines(data, 5, cut_at_start=cut) == ["first", "second"]
    assert read_end(tmp_path / "not-written-yet.log") == (b"", False)


def test_text_that_is_not_utf8_is_replaced_not_an_error():
    assert last_lines(b"ok\n\xff\xfe bad\n", 5, cut_at_start=False) == ["ok", "\ufffd\ufffd bad"]
