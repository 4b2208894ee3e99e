"""A worker's output into its tail and its file: whole lines, the lines that
arrive together in one write (issue 32), and the odd stream (a line with no
end, a last line with no newline)."""

from __future__ import annotations

import asyncio
import re

from tray_app.core.engine.worker_log import MAX_LINE_BYTES, WorkerLog

STAMPED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (.*)$")


def captured(tmp_path, pieces: list[bytes]) -> tuple[WorkerLog, list[str], int]:
    """Feed `pieces` as the process's output (each one read at once);
    returns the log, the lines on_line saw and how many records were written."""
    log = WorkerLog(tmp_path, "cpu")
    records = 0
    emit = log._handler.emit

    def counting_emit(record) -> None:
        nonlocal records
        records += 1
        emit(record)

    log._handler.emit = counting_emit  # type: ignore[method-assign]
    seen: list[str] = []

    async def run() -> None:
        stream = asyncio.StreamReader()
        task = asyncio.create_task(log.capture(stream, seen.append))
        for piece in pieces:
            stream.feed_data(piece)
            await asyncio.sleep(0.01)  # each piece is read before the next arrives
        stream.feed_eof()
        await asyncio.wait_for(task, 5)

    asyncio.run(run())
    log.close()
    return log, seen, records


def file_lines(tmp_path) -> list[str]:
    lines = (tmp_path / "cpu-worker.log").read_text().splitlines()
    assert all(STAMPED.match(line) for line in lines), lines
    return [STAMPED.match(line).group(1) for line in lines]  # type: ignore[union-attr]


def test_lines_that_arrive_together_are_one_write_and_split_lines_are_joined(tmp_path):
    log, seen, records = captured(tmp_path, [b"slot launch\nn_past was set to 30\nhalf of a ", b"line\n", b"last"])
    expected = ["slot launch", "n_past was set to 30", "half of a line", "last"]
    assert seen == expected
    assert log.tail() == expected and log.lines == 4
    assert file_lines(tmp_path) == expected
    # One record per read that completed lines: 3, not one per line (4).
    assert records == 3


def test_a_line_with_no_end_in_sight_is_kept_in_pieces_not_a_crash(tmp_path):
    # asyncio's readline raised on a line over its 64 KiB limit and ended the capture.
    endless = b"x" * (MAX_LINE_BYTES + 10)
    _, seen, _ = captured(tmp_path, [endless, b"\nafter\n"])
    assert seen[-1] == "after"
    assert "".join(seen[:-1]) == "x" * (MAX_LINE_BYTES + 10)


def test_notes_are_stamped_and_stay_out_of_the_tail(tmp_path):
    log = WorkerLog(tmp_path, "cpu")
    log.note("started %s with %d threads", "llama-server", 2)
    log.note("plain 100% text")
    log.close()
    assert file_lines(tmp_path) == ["started llama-server with 2 threads", "plain 100% text"]
    assert log.tail() == []
