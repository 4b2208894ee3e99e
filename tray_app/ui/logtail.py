"""What the log viewer shows, as plain functions and values: no Qt in here.

Which logs there are (the tray app's own, and each worker's from the latest
/status, plus worker logs left in the folder when the service is down), the
end of a growing file read a poll at a time (rotation and truncation read
it again), and the filter. tray_app/ui/logs.py puts them in a window.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

TAIL_BYTES = 1 << 20   # what is read of a file on opening it, or after a jump
MAX_LINES = 20_000     # lines kept in memory (and shown) per log
WORKER_LOG_SUFFIX = "-worker.log"
ROLE_LABELS = {"gpu": "GPU worker", "cpu": "CPU worker", "embed": "Embeddings worker"}


@dataclass(frozen=True)
class LogSource:
    label: str
    path: Path


def role_label(role: str, model: str | None = None) -> str:
    label = ROLE_LABELS.get(role, f"{role} worker")
    return f"{label} ({model})" if model else label


def label_for_file(path: Path) -> str:
    """A worker log's label from its name alone ("cpu-qwen-worker.log":
    "CPU worker (qwen)"), for a log /status doesn't list."""
    name = path.name
    if not name.endswith(WORKER_LOG_SUFFIX):
        return name
    role, _, model = name[: -len(WORKER_LOG_SUFFIX)].partition("-")
    return role_label(role, model or None)


def log_sources(status: Mapping[str, Any] | None, app_log: Path,
                folder_files: Iterable[Path] = ()) -> list[LogSource]:
    """The tray app's log, then the default model's workers, the other
    models' workers, the embeddings worker, then any other worker log in
    the folder (`folder_files`). Labelled with the model's name when there
    are several models; each file once."""
    status = status or {}
    models = [m for m in status.get("models") or () if isinstance(m, Mapping)]
    several = len(models) > 1
    default_model = (status.get("service") or {}).get("model")
    found: list[LogSource] = [LogSource("Tray app", Path(app_log))]

    def add(label: str, path: Any) -> None:
        if path and all(Path(path) != s.path for s in found):
            found.append(LogSource(label, Path(path)))

    for worker in status.get("workers") or ():
        add(role_label(str(worker.get("role")), default_model if several else None), worker.get("log"))
    for model in models:
        for role, path in (model.get("logs") or {}).items():
            add(role_label(role, model.get("name") if several else None), path)
    embeddings = status.get("embeddings") or {}
    if embeddings.get("enabled"):
        add(role_label("embed"), embeddings.get("log"))
    for path in sorted(folder_files):
        add(label_for_file(path), path)
    return found


def worker_logs_in(folder: Path) -> list[Path]:
    """The worker logs (not their rotated copies) in `folder`; none if it can't be read."""
    try:
        return sorted(p for p in folder.iterdir() if p.name.endswith(WORKER_LOG_SUFFIX) and p.is_file())
    except OSError:
        return []


def filter_lines(lines: Iterable[str], text: str) -> list[str]:
    """The lines that contain `text`, ignoring case; all of them for no text."""
    needle = text.casefold()
    if not needle:
        return list(lines)
    return [line for line in lines if needle in line.casefold()]


def count_text(shown: int, kept: int, filtered: bool) -> str:
    if filtered:
        return f"{shown:,} of {kept:,} lines"
    return f"{kept:,} line" + ("" if kept == 1 else "s")


@dataclass
class TailUpdate:
    reset: bool           # the lines were read again from scratch: show `lines` instead of adding them
    new: list[str]        # the lines added since the last poll (all of them after a reset)


class LogTail:
    """The end of one log file, read a poll at a time.

    The first poll reads at most the last `tail_bytes`; each next one reads
    what was appended. A file that shrank or was replaced (rotated) is read
    again from its end; so is one that grew by more than `tail_bytes` at once.
    Only whole lines count: a line still being written waits for its newline.
    Bytes that are not UTF-8 show as U+FFFD. At most `max_lines` are kept.
    """

    def __init__(self, path: Path, *, tail_bytes: int = TAIL_BYTES, max_lines: int = MAX_LINES) -> None:
        self.path = Path(path)
        self.tail_bytes = tail_bytes
        self.lines: deque[str] = deque(maxlen=max_lines)
        self.missing = False
        self.error: str | None = None
        self.truncated = False   # the lines start partway through the file
        self._identity: tuple[int, int] | None = None
        self._offset = 0
        self._pending = b""

    def message(self) -> str | None:
        """What to say instead of lines: no file yet, or it can't be read."""
        if self.missing:
            return f"No log yet at {self.path}"
        if self.error:
            return f"Cannot read {self.path}: {self.error}"
        return None

    def poll(self) -> TailUpdate:
        try:
            with open(self.path, "rb") as handle:
                stat = os.fstat(handle.fileno())
                identity = (stat.st_dev, stat.st_ino)
                reset = (identity != self._identity or stat.st_size < self._offset
                         or stat.st_size - self._offset > self.tail_bytes)
                if reset:
                    start = max(0, stat.st_size - self.tail_bytes)
                    self._identity, self._offset, self._pending = identity, start, b""
                    self.lines.clear()
                    self.truncated = start > 0
                handle.seek(self._offset)
                data = handle.read(stat.st_size - self._offset)
        except FileNotFoundError:
            return self._gone(missing=True)
        except OSError as exc:
            return self._gone(error=exc.strerror or str(exc))
        self.missing, self.error = False, None
        if reset and self.truncated:
            # Reading started mid-line: the part before the first newline is not a line.
            cut = data.find(b"\n")
            skip = cut + 1 if cut >= 0 else len(data)
            self._offset += skip
            data = data[skip:]
        self._offset += len(data)
        chunks = (self._pending + data).split(b"\n")
        self._pending = chunks.pop()
        new = [c.rstrip(b"\r").decode("utf-8", errors="replace") for c in chunks]
        self.lines.extend(new)
        return TailUpdate(reset, list(self.lines) if reset else new)

    def _gone(self, *, missing: bool = False, error: str | None = None) -> TailUpdate:
        changed = (missing, error) != (self.missing, self.error) or bool(self.lines)
        self.missing, self.error = missing, error
        self._identity, self._offset, self._pending = None, 0, b""
        self.lines.clear()
        return TailUpdate(changed, [])
