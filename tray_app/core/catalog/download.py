"""Download a GGUF model from a Hugging Face-style hub into the models folder.

The hub's layout is Hugging Face's own: a file's bytes at
``{hub}/{repo}/resolve/{revision}/{file}`` and, for the SHA-256 that LFS
publishes, the directory listing at ``{hub}/api/models/{repo}/tree/{revision}``.

What a download promises:

- Nothing half-written ever carries the final name. Bytes go to
  ``<dest>.part``; only a file whose SHA-256 matches the published one (and
  that starts with the GGUF magic) is renamed onto ``<dest>``, atomically.
  The library treats every ``.gguf`` in the folder as a model, so a torn file
  under that name would be offered to clients.
- An interrupted download resumes: a later call sends ``Range: bytes=N-`` for
  the N bytes already in the part. A 206 appends, a 200 (the server ignored
  the range) starts over, a 416 means the part is already whole.
- The hash is computed while the bytes are written (the part already on disk
  is hashed first on resume), so a 10 GB model is not read twice.

What a hostile hub (or whoever answers for it) can't do:

- fill the disk: a download needs an announced size, the free space is
  checked against it before the first byte, and it stops at that size;
- steer the token: it goes only to the hub's own scheme, host and port (a
  file list continued elsewhere is refused; httpx drops it on a redirect);
- write outside the models folder: the local name is one plain file name on
  every OS (no drive, no separator), and the .part is never opened through a
  symbolic link or a second hard link planted there;
- drive the terminal: every error message has its control characters shown
  escaped, since it may quote what the hub said.

The pure parts (parsing a model reference, reading the tree entry, deciding
what a response to a Range request means, the rough fit rule, the progress
line) are separate functions; ``download_model`` is the I/O around them, and
is what the tray can call from a thread (``progress`` and ``cancel``).
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO
from urllib.parse import quote, urljoin, urlsplit

import httpx

from ..memory.estimate import GPU_RUNTIME_OVERHEAD_MIB, HOST_RUNTIME_BASELINE_MIB, MIB
from ..memory.fit import Headroom, format_mib
from ..memory.gguf_info import GGUF_MAGIC

DEFAULT_HUB_URL = "https://huggingface.co"
HUB_URL_ENV = "TRAY_APP_HUB_URL"
TOKEN_ENV = "HF_TOKEN"
DEFAULT_REVISION = "main"
PART_SUFFIX = ".part"

# Reading a file already on disk (to hash it): large blocks, few syscalls.
HASH_BLOCK_BYTES = 8 * 1024 * 1024
# A hub that accepts the connection but stops sending for this long is
# treated as a dropped connection (and retried with a Range request).
CONNECT_TIMEOUT_S = 15.0
READ_TIMEOUT_S = 60.0
# The tree API pages its listing; a model repo has a handful of pages at most.
MAX_TREE_PAGES = 50

_REPO_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# What Windows refuses in a file name, or reads as a drive ("C:evil.gguf" is
# the file evil.gguf in drive C's current folder: outside the models folder).
_NOT_IN_A_FILE_NAME = set('<>:"/\\|?*')
# Windows opens these devices whatever the extension ("NUL.gguf" is NUL).
_WINDOWS_DEVICES = {"CON", "PRN", "AUX", "NUL", *(f"COM{n}" for n in range(1, 10)),
                    *(f"LPT{n}" for n in range(1, 10))}


class ErrorKind(StrEnum):
    USAGE = "usage"                  # the model reference itself is malformed
    NOT_GGUF = "not_gguf"            # only .gguf files are models here
    NOT_FOUND = "not_found"          # no such repo, revision or file
    AUTH = "auth"                    # private or gated: needs HF_TOKEN
    NO_HASH = "no_hash"              # the hub publishes no SHA-256 for the file
    HASH_MISMATCH = "hash_mismatch"  # the bytes are not what the hub published
    EXISTS = "exists"                # the destination holds a different file
    NETWORK = "network"              # connection failed or dropped (the part is kept)
    DISK_FULL = "disk_full"          # no room (the part is kept)
    SERVER = "server"                # the hub answered something unusable
    CANCELLED = "cancelled"          # the caller's cancel event (the part is kept)
    LOCAL = "local"                  # the models folder cannot be written (permissions, ...)


def printable(text: str) -> str:
    """Text for a terminal or a label: control characters (escape sequences,
    newlines, bidi overrides) shown as escapes rather than obeyed."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


class DownloadError(Exception):
    """One line for a person, and a kind for code to branch on. The message
    may quote the hub (an entry's type, a transport error naming a redirect
    target), so it is made printable here, once, for every caller."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(printable(message))
        self.kind = kind


class DownloadCancelled(DownloadError):
    def __init__(self, message: str) -> None:
        super().__init__(ErrorKind.CANCELLED, message)


# ----- what to download (pure) ---------------------------------------------------------


@dataclass(frozen=True)
class ModelRef:
    repo: str  # "owner/name"
    file: str  # the path inside the repo, "sub/dir/model.gguf"

    @property
    def filename(self) -> str:
        """The name it gets in the models folder (its stem is the model's name there)."""
        return PurePosixPath(self.file).name

    def __str__(self) -> str:
        return f"{self.repo}/{self.file}"


def local_name_problem(name: str) -> str | None:
    """Why `name` can't be a file in the models folder on every OS, or None.
    It must name one plain file there: no drive, separator or device name."""
    if set(name) & _NOT_IN_A_FILE_NAME or not name.isprintable():
        return "holds a character a file name can't have on Windows (<>:\"/\\|?* or a control character)"
    if name.split(".")[0].rstrip(" ").upper() in _WINDOWS_DEVICES:
        return "is a device name on Windows"
    return None


def make_ref(repo: str, file: str) -> ModelRef:
    """Check a repo and file path; DownloadError(USAGE or NOT_GGUF) says what is wrong."""
    owner_name = repo.strip().strip("/").split("/")
    if len(owner_name) != 2 or not all(_REPO_PART.match(part) for part in owner_name):
        raise DownloadError(ErrorKind.USAGE, f"{repo!r} is not a repository name: expected owner/name")
    parts = file.strip().strip("/").split("/")
    # No "." or ".." segments: the path goes into a URL, and its last part names a local file.
    if not file.strip() or any(part in ("", ".", "..") or "\\" in part for part in parts):
        raise DownloadError(ErrorKind.USAGE, f"{file!r} is not a file path inside the repository")
    path = "/".join(parts)
    if not path.lower().endswith(".gguf"):
        raise DownloadError(ErrorKind.NOT_GGUF,
                            f"{path} is not a .gguf file: only GGUF files are models here")
    problem = local_name_problem(parts[-1])
    if problem:
        raise DownloadError(ErrorKind.USAGE, f"{parts[-1]!r} can't be saved in the models folder: it {problem}")
    return ModelRef("/".join(owner_name), path)


def parse_model_ref(text: str) -> ModelRef:
    """'owner/name/file.gguf', 'owner/name/sub/dir/file.gguf' or 'owner/name:file.gguf'."""
    text = text.strip()
    if ":" in text:
        repo, _, file = text.partition(":")
    else:
        parts = text.strip("/").split("/")
        if len(parts) < 3:
            raise DownloadError(ErrorKind.USAGE, f"{text!r} names no file: expected owner/name/FILE.gguf "
                                                 "or owner/name:FILE.gguf")
        repo, file = "/".join(parts[:2]), "/".join(parts[2:])
    return make_ref(repo, file)


def resolve_url(hub: str, ref: ModelRef, revision: str = DEFAULT_REVISION) -> str:
    # A revision may hold slashes ("refs/pr/1"); the hub wants them escaped.
    return f"{hub.rstrip('/')}/{ref.repo}/resolve/{quote(revision, safe='')}/{quote(ref.file)}"


def tree_url(hub: str, ref: ModelRef, revision: str = DEFAULT_REVISION) -> str:
    """The listing of the file's own directory: the hub's tree API is not
    recursive, so a file in a subfolder is only listed under that folder."""
    url = f"{hub.rstrip('/')}/api/models/{ref.repo}/tree/{quote(revision, safe='')}"
    folder = str(PurePosixPath(ref.file).parent)
    return url if folder == "." else f"{url}/{quote(folder)}"


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) with the scheme's default port filled in."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(scheme)


def next_page_url(hub: str, page_url: str, link: str | None) -> str | None:
    """Where the file list continues (a Link header's "next", maybe
    relative), or None at its end. A list continued on another scheme, host
    or port is refused: the token goes with each page, and only to the hub."""
    if not link:
        return None
    url = urljoin(page_url, link)
    if origin(url) != origin(hub):
        raise DownloadError(ErrorKind.SERVER, f"{hub}'s file list continues on another host ({url}); it is not "
                                              f"followed, so that the token is never sent off {hub}")
    return url


@dataclass(frozen=True)
class RemoteFile:
    ref: ModelRef
    revision: str
    size: int | None  # bytes; None when the hub did not say
    sha256: str | None  # lowercase hex; None when the hub publishes none (not an LFS file)


def remote_file_from_tree(entries: Iterable[Any], ref: ModelRef, revision: str) -> RemoteFile:
    """The tree entry for ref.file; DownloadError(NOT_FOUND) when the listing lacks it.

    Only an LFS pointer's oid is a SHA-256 of the content; a plain entry's
    oid is a git blob id (SHA-1 of a header plus the bytes), useless here.
    """
    for entry in entries:
        if not isinstance(entry, Mapping) or entry.get("path") != ref.file:
            continue
        if entry.get("type", "file") != "file":
            raise DownloadError(ErrorKind.NOT_FOUND, f"{ref.file} in {ref.repo} is a {entry.get('type')}, not a file")
        lfs = entry.get("lfs") if isinstance(entry.get("lfs"), Mapping) else {}
        oid = str(lfs.get("oid") or lfs.get("sha256") or "").lower().removeprefix("sha256:")
        size = lfs.get("size", entry.get("size"))
        return RemoteFile(ref, revision, size if isinstance(size, int) and size >= 0 else None,
                          oid if _SHA256.match(oid) else None)
    raise DownloadError(ErrorKind.NOT_FOUND, f"{ref.repo} has no file {ref.file} at revision {revision}")


def error_for_status(status: int, ref: ModelRef, revision: str, *, token_set: bool, hub_code: str = "",
                     what: str = "") -> DownloadError:
    """The one-line error for an HTTP status the hub answered with.

    Hugging Face answers 401 for a repo that does not exist as well as for a
    private one (so as not to reveal which), and names the case in X-Error-Code.
    """
    where = what or f"{ref.repo} at revision {revision}"
    private = "" if token_set else f"; if it is private, set {TOKEN_ENV}"
    if hub_code == "RepoNotFound":
        return DownloadError(ErrorKind.NOT_FOUND, f"the hub has no repository {ref.repo} (HTTP {status}{private})")
    if hub_code == "RevisionNotFound":
        return DownloadError(ErrorKind.NOT_FOUND, f"{ref.repo} has no revision {revision} (HTTP {status})")
    if hub_code == "EntryNotFound":
        return DownloadError(ErrorKind.NOT_FOUND, f"{ref.repo} has no file {ref.file} at revision {revision} "
                                                  f"(HTTP {status})")
    if status in (401, 403) or hub_code == "GatedRepo":
        if token_set:
            advice = (f"the token in {TOKEN_ENV} has no access: accept the model's terms on its page, "
                      "or use a token that can read it")
        else:
            advice = f"it is private or gated: set {TOKEN_ENV} to a Hugging Face access token"
        return DownloadError(ErrorKind.AUTH, f"the hub refused {where} (HTTP {status}): {advice}")
    if status == 404:
        return DownloadError(ErrorKind.NOT_FOUND, f"the hub has no {where} (HTTP 404{private})")
    # Rate limits and a hub's bad moments pass; the download retries them like a dropped connection.
    if status == 429 or status in (500, 502, 503, 504):
        return DownloadError(ErrorKind.NETWORK, f"the hub answered {where} with HTTP {status}; try again later")
    return DownloadError(ErrorKind.SERVER, f"the hub answered {where} with HTTP {status}")


# ----- resuming (pure) -----------------------------------------------------------------


class Action(StrEnum):
    APPEND = "append"            # 206 from the offset asked for: the body continues the part
    START_OVER = "start_over"    # 200: the body is the whole file; truncate the part
    COMPLETE = "complete"        # 416 on a resume: nothing left to send; verify the part
    ASK_AGAIN = "ask_again"      # 206 from some other offset: drop the part, ask for everything


def range_headers(offset: int) -> dict[str, str]:
    return {"Range": f"bytes={offset}-"} if offset > 0 else {}


def parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """'bytes 100-199/1000' -> (100, 199, 1000); the total may be '*' (None)."""
    match = re.fullmatch(r"\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*", value or "")
    if match is None:
        return None
    total = match.group(3)
    return int(match.group(1)), int(match.group(2)), None if total == "*" else int(total)


def decide(status: int, offset: int, content_range: str | None) -> Action | None:
    """What a response to a request sent with range_headers(offset) means; None = an error status."""
    if status == 200:
        return Action.START_OVER
    if status == 206:
        parsed = parse_content_range(content_range)
        return Action.APPEND if parsed is not None and parsed[0] == offset else Action.ASK_AGAIN
    if status == 416 and offset > 0:
        return Action.COMPLETE
    return None


def plan_offset(part_size: int, remote_size: int | None) -> int:
    """Where to resume from: a part longer than the file is not a prefix of it."""
    if remote_size is not None and part_size > remote_size:
        return 0
    return part_size


def space_shortfall(remote_size: int | None, part_size: int, free_bytes: int) -> int:
    """Bytes missing on the disk for the rest of the file; 0 when it fits or the size is unknown."""
    if remote_size is None:
        return 0
    return max(0, remote_size - part_size - free_bytes)


# ----- will it fit (pure) --------------------------------------------------------------


class RoughFit(StrEnum):
    GPU = "gpu"
    CPU_ONLY = "cpu_only"
    NO_FIT = "no_fit"


def rough_fit(file_size: int, headroom: Headroom) -> tuple[RoughFit, str]:
    """Before the file is here its metadata is unknown, so this is the
    estimator's rule without the context: the weights are the file, plus the
    runtime overhead it charges every worker (CUDA context on the GPU, the
    process itself on the host). The KV cache of the context comes on top."""
    weights = file_size / MIB
    gpu_need = weights + GPU_RUNTIME_OVERHEAD_MIB
    ram_need = weights + HOST_RUNTIME_BASELINE_MIB
    vram_room = headroom.vram_room_mib
    if vram_room is None:
        gpu_text = f"GPU unknown ({headroom.vram_unknown_reason})"
    else:
        gpu_text = (f"needs ~{format_mib(gpu_need)} of VRAM, {format_mib(max(vram_room, 0))} free above the "
                    f"{format_mib(headroom.vram_reserve_mib)} reserve")
    ram_text = (f"~{format_mib(ram_need)} of RAM, {format_mib(max(headroom.ram_room_mib, 0))} available above the "
                f"{format_mib(headroom.ram_floor_mib)} floor")
    tail = "before the context's KV cache"
    if vram_room is not None and gpu_need <= vram_room:
        return RoughFit.GPU, f"fits on the GPU: {gpu_text} ({tail})"
    if ram_need <= headroom.ram_room_mib:
        return RoughFit.CPU_ONLY, f"fits only on the CPU: {gpu_text}; {ram_text} ({tail})"
    return RoughFit.NO_FIT, f"does not fit: {gpu_text}; {ram_text} ({tail})"


# ----- progress (pure) -----------------------------------------------------------------


def format_bytes(n: float) -> str:
    """Progress needs a decimal that format_mib drops: '93.8 MiB', '4.21 GiB'."""
    if n >= 1024 * MIB:
        return f"{n / (1024 * MIB):.2f} GiB"
    return f"{n / MIB:.1f} MiB"


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def render_progress(done: int, total: int | None, elapsed: float, *, resumed_from: int = 0,
                    bar_width: int = 0) -> str:
    """One progress line: bytes, percent, an optional bar, speed and ETA.

    Speed counts only this session's bytes (done - resumed_from): a resumed
    part arrived earlier and would inflate it.
    """
    rate = (done - resumed_from) / elapsed if elapsed > 0 else 0.0
    speed = f"{rate / MIB:.1f} MiB/s"
    if not total:
        return f"{format_bytes(done)}  {speed}"
    fraction = min(max(done / total, 0.0), 1.0)
    bar = ""
    if bar_width > 0:
        filled = int(fraction * bar_width)
        bar = f"  [{'#' * filled}{'-' * (bar_width - filled)}]"
    eta = format_duration((total - done) / rate) if rate > 0 and done < total else ("0:00" if done >= total else "?")
    return f"{format_bytes(done)} / {format_bytes(total)}  {fraction * 100:3.0f}%{bar}  {speed}  ETA {eta}"


# ----- downloading (I/O) ---------------------------------------------------------------


@dataclass(frozen=True)
class DownloadResult:
    path: Path
    size: int
    sha256: str
    verified: bool          # the hash matched one the hub published
    already_present: bool   # the file was there already; nothing was downloaded
    resumed_from: int = 0   # bytes already in the .part when this call began
    transferred: int = 0    # bytes received over the network by this call
    elapsed_s: float = 0.0
    restarts: int = 0       # times the server ignored a Range request (or the part was unusable)


def new_client(timeout_s: float = READ_TIMEOUT_S) -> httpx.Client:
    # The hub's resolve URL redirects to a CDN; httpx drops the Authorization
    # header on a redirect to another host, as it should.
    return httpx.Client(follow_redirects=True,
                        timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S))


def lookup_remote_file(client: httpx.Client, hub: str, ref: ModelRef, *, revision: str = DEFAULT_REVISION,
                       token: str | None = None) -> RemoteFile:
    """The file's size and published SHA-256, from the hub's tree API."""
    return remote_file_from_tree(list_folder(client, hub, ref, revision=revision, token=token), ref, revision)


def lookup_remote_files(client: httpx.Client, hub: str, ref: ModelRef, *, revision: str = DEFAULT_REVISION,
                        token: str | None = None) -> tuple[RemoteFile, RemoteFile | None]:
    """The file, and the vision projector beside it in the repository (None
    when there is none), from one listing of the file's folder."""
    entries = list_folder(client, hub, ref, revision=revision, token=token)
    return remote_file_from_tree(entries, ref, revision), projector_in_tree(entries, ref, revision)


def projector_in_tree(entries: Iterable[Any], ref: ModelRef, revision: str) -> RemoteFile | None:
    """The mmproj*.gguf in the model's folder of a listing: the f16 one when
    there are several (the usual full-precision upload), else the first by
    name; None when there is none."""
    folder = PurePosixPath(ref.file).parent
    names = sorted(str(entry["path"]) for entry in entries
                   if isinstance(entry, Mapping) and isinstance(entry.get("path"), str)
                   and entry.get("type", "file") == "file" and PurePosixPath(entry["path"]).parent == folder
                   and PurePosixPath(entry["path"]).name.lower().startswith("mmproj")
                   and entry["path"].lower().endswith(".gguf"))
    if not names:
        return None
    chosen = next((name for name in names if "f16" in PurePosixPath(name).name.lower()), names[0])
    return remote_file_from_tree(entries, make_ref(ref.repo, chosen), revision)


def list_folder(client: httpx.Client, hub: str, ref: ModelRef, *, revision: str = DEFAULT_REVISION,
                token: str | None = None) -> list[Any]:
    """The hub's tree API listing of the folder that holds ref.file, every page."""
    url: str | None = tree_url(hub, ref, revision)
    entries: list[Any] = []
    for _ in range(MAX_TREE_PAGES):
        if url is None:
            break
        try:
            response = client.get(url, headers=auth_headers(token), follow_redirects=True)
        except httpx.HTTPError as exc:
            raise _network_error(exc, hub) from exc
        if response.status_code != 200:
            raise error_for_status(response.status_code, ref, revision, token_set=bool(token),
                                   hub_code=response.headers.get("x-error-code", ""))
        try:
            page = response.json()
        except ValueError:
            raise DownloadError(ErrorKind.SERVER, f"{hub} answered the tree API with something other than JSON; "
                                                  "is it a Hugging Face-style hub?") from None
        if not isinstance(page, list):
            raise DownloadError(ErrorKind.SERVER, f"{hub}'s tree API answered with no file list")
        entries.extend(page)
        # Large folders come in pages, linked as the GitHub API does.
        url = next_page_url(hub, str(response.url), response.links.get("next", {}).get("url"))
    return entries


def sha256_of(path: Path, cancel: threading.Event | None = None) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        _hash_into(digest, handle, path, cancel)
    return digest.hexdigest()


def _hash_into(digest: Any, handle: BinaryIO, path: Path, cancel: threading.Event | None) -> None:
    while block := handle.read(HASH_BLOCK_BYTES):
        if cancel is not None and cancel.is_set():
            raise DownloadCancelled(f"cancelled while checking {path.name}")
        digest.update(block)


def _network_error(exc: Exception, hub: str, kept: str = "") -> DownloadError:
    detail = str(exc) or type(exc).__name__
    return DownloadError(ErrorKind.NETWORK, f"network error talking to {hub}: {detail}{kept}")


# Opening the .part never follows a link (O_NOFOLLOW), and never blocks on
# a FIFO (O_NONBLOCK, no effect on a plain file); O_BINARY matters on Windows.
_PART_OPEN_FLAGS = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)


def _open_part(path: Path, flags: int, mode: str) -> BinaryIO:
    """The .part file, opened only if it is a plain file of its own. Anyone
    who can write in the models folder could plant a symbolic link (or a
    hard link) there under the .part's name, and the download would write
    into, truncate or hash the file it points to."""
    if path.is_symlink():  # Windows has no O_NOFOLLOW; elsewhere the flag closes the race
        raise _not_a_plain_part(path)
    try:
        fd = os.open(path, flags | _PART_OPEN_FLAGS, 0o644)
    except OSError as exc:
        if path.is_symlink():  # ELOOP, or EMLINK on the BSDs
            raise _not_a_plain_part(path) from exc
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(fd)
        raise _not_a_plain_part(path)
    return os.fdopen(fd, mode)


def _part_size(path: Path) -> int:
    """Bytes in the .part, 0 when there is none; a link or a device there is refused."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return 0
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        raise _not_a_plain_part(path)
    return info.st_size


def _not_a_plain_part(path: Path) -> DownloadError:
    return DownloadError(ErrorKind.LOCAL, f"{path} is not a plain file of its own (a link, or a device), so "
                                          "the download will not write through it; remove it and run again")


def _check_space(file: Path, total: int, part_size: int, ref: ModelRef) -> None:
    """Refuse, before the first byte, a file that would not fit in `file`'s folder."""
    shortfall = space_shortfall(total, part_size, shutil.disk_usage(file.parent).free)
    if shortfall:
        raise DownloadError(ErrorKind.DISK_FULL, f"not enough space in {file.parent}: "
                                                 f"{format_bytes(shortfall)} more is needed for {ref.filename}")


def _disk_full(dest: Path, done: int, total: int | None) -> DownloadError:
    of = f" of {format_bytes(total)}" if total else ""
    return DownloadError(ErrorKind.DISK_FULL, f"the disk holding {dest.parent} is full after {format_bytes(done)}"
                                              f"{of}; free some space and run again to resume")


@dataclass
class _Part:
    """The .part file and the hash of what it holds so far: carried across
    retries within one call so a resume after a dropped connection does not
    re-read what was just written."""

    path: Path
    size: int = 0
    digest: Any = field(default_factory=hashlib.sha256)
    received: int = 0  # bytes written by this call, across retries
    restarts: int = 0  # times bytes already here were thrown away

    def reset(self) -> None:
        if self.size:
            self.restarts += 1
        _open_part(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "wb").close()
        self.size = 0
        self.digest = hashlib.sha256()

    def kept(self, verb: str) -> str:
        return f"{verb}: {format_bytes(self.size)} kept in {self.path}; run again to resume"


def download_model(url_base: str, repo: str, file: str, dest_dir: str | os.PathLike[str], *,
                   revision: str = DEFAULT_REVISION, token: str | None = None,
                   progress: Callable[[int, int | None], None] | None = None,
                   cancel: threading.Event | None = None, client: httpx.Client | None = None,
                   verify: bool = True, remote: RemoteFile | None = None, retries: int = 3,
                   retry_delay_s: float = 1.0) -> DownloadResult:
    """Download repo/file at revision from the hub at url_base into dest_dir.

    progress(done, total) is called from this thread after each chunk (done
    counts bytes already in a resumed part; total is None when unknown).
    Setting cancel stops at the next chunk with DownloadCancelled and keeps the
    .part for a later call to resume. A dropped connection (or a 429/5xx) is
    retried up to `retries` times, each resuming with a Range request.
    verify=False accepts a file the hub publishes no SHA-256 for; a published
    one is always checked. `remote` skips the tree lookup when the caller has
    done it already. Every failure is a DownloadError with a one-line message.
    """
    ref = make_ref(repo, file)
    http = client if client is not None else new_client()
    try:
        if remote is None:
            remote = lookup_remote_file(http, url_base, ref, revision=revision, token=token)
        if remote.sha256 is None and verify:
            raise DownloadError(ErrorKind.NO_HASH,
                                f"the hub publishes no SHA-256 for {ref} (not an LFS file), so the download "
                                "could not be verified; pass --no-verify to take it anyway")
        dest_dir = Path(dest_dir)
        dest_dir.mkdir(parents=True, exist_ok=True)
        dest = dest_dir / ref.filename
        if dest.exists():
            return _already_there(dest, remote, cancel)
        return _download(http, url_base, ref, remote, dest, token=token, progress=progress, cancel=cancel,
                         retries=retries, retry_delay_s=retry_delay_s)
    except OSError as exc:
        # ENOSPC is turned into DISK_FULL where it happens; this is the rest (a read-only or foreign folder).
        raise DownloadError(ErrorKind.LOCAL, f"cannot write the model into {dest_dir}: "
                                             f"{exc.strerror or exc}") from exc
    finally:
        if client is None:
            http.close()


def _already_there(dest: Path, remote: RemoteFile, cancel: threading.Event | None) -> DownloadResult:
    size = dest.stat().st_size
    if remote.sha256 is None:
        # Nothing to compare with but the size (--no-verify was given).
        if remote.size is not None and size != remote.size:
            raise DownloadError(ErrorKind.EXISTS, f"{dest} already exists and is not this file "
                                                  f"({size} bytes, the hub's is {remote.size}); move it away first")
        return DownloadResult(dest, size, sha256_of(dest, cancel), verified=False, already_present=True)
    actual = sha256_of(dest, cancel)
    if actual != remote.sha256:
        raise DownloadError(ErrorKind.EXISTS, f"{dest} already exists with other content (sha256 {actual}, the hub "
                                              f"publishes {remote.sha256}); move it away to download this one")
    return DownloadResult(dest, size, actual, verified=True, already_present=True)


def _download(http: httpx.Client, hub: str, ref: ModelRef, remote: RemoteFile, dest: Path, *, token: str | None,
              progress: Callable[[int, int | None], None] | None, cancel: threading.Event | None, retries: int,
              retry_delay_s: float) -> DownloadResult:
    started = time.monotonic()
    part = _Part(dest.with_name(dest.name + PART_SUFFIX))
    on_disk = _part_size(part.path)
    if plan_offset(on_disk, remote.size) != on_disk:
        part.size = on_disk
        part.reset()
    elif on_disk:
        with _open_part(part.path, os.O_RDONLY, "rb") as handle:
            _hash_into(part.digest, handle, part.path, cancel)
        part.size = on_disk
    resumed_from = part.size
    if remote.size is not None:  # else the answer's own length is checked before its first byte
        _check_space(dest, remote.size, part.size, ref)
    url = resolve_url(hub, ref, remote.revision)
    failures = 0
    while True:
        if cancel is not None and cancel.is_set():
            raise DownloadCancelled(part.kept("cancelled"))
        try:
            action = _fetch_into(http, url, ref, remote, part, token=token, progress=progress, cancel=cancel)
        except DownloadError as exc:
            if exc.kind is not ErrorKind.NETWORK or failures >= retries:
                raise
        except httpx.TransportError as exc:
            if failures >= retries:
                raise _network_error(exc, hub, f"; {part.kept('kept')}") from exc
        else:
            if action is Action.ASK_AGAIN:
                if part.size == 0:
                    raise DownloadError(ErrorKind.SERVER, f"the hub answered a request for all of {ref} with a "
                                                          "part of it")
                part.reset()
                continue
            if remote.size is None or part.size >= remote.size:
                break
            # The body ended short without an error from the transport.
            if failures >= retries:
                raise DownloadError(ErrorKind.NETWORK, f"the hub sent {part.size} of {remote.size} bytes; "
                                                       f"{part.kept('kept')}")
        failures += 1
        # Back off before resuming; a cancel interrupts the wait.
        if cancel is not None and cancel.wait(retry_delay_s * failures):
            raise DownloadCancelled(part.kept("cancelled"))
        if cancel is None:
            time.sleep(retry_delay_s * failures)
    return _finish(part, dest, remote, resumed_from=resumed_from, elapsed=time.monotonic() - started)


def _fetch_into(http: httpx.Client, url: str, ref: ModelRef, remote: RemoteFile, part: _Part, *,
                token: str | None, progress: Callable[[int, int | None], None] | None,
                cancel: threading.Event | None) -> Action:
    """One GET (with Range when resuming), its body appended to the part;
    returns what the answer meant. The transport's errors propagate (retryable)."""
    # Identity encoding: byte offsets must be offsets into the file itself.
    headers = {**auth_headers(token), **range_headers(part.size), "Accept-Encoding": "identity"}
    with http.stream("GET", url, headers=headers, follow_redirects=True) as response:
        action = decide(response.status_code, part.size, response.headers.get("content-range"))
        if action is None:
            raise error_for_status(response.status_code, ref, remote.revision, token_set=bool(token),
                                   hub_code=response.headers.get("x-error-code", ""),
                                   what=f"{ref} at revision {remote.revision}")
        if action in (Action.COMPLETE, Action.ASK_AGAIN):
            return action
        if action is Action.START_OVER and part.size:
            part.reset()  # the server ignored the Range: this body is the whole file
        total = remote.size if remote.size is not None else _response_total(response, part.size)
        if total is None:
            raise DownloadError(ErrorKind.SERVER, f"the hub did not say how large {ref} is (no size in its file "
                                                  "list, no Content-Length): a download of unknown size could fill "
                                                  "the disk, so it was not started")
        if remote.size is None:
            _check_space(part.path, total, part.size, ref)
        if progress is not None:
            progress(part.size, total)
        try:
            with _open_part(part.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, "ab") as handle:
                # Chunks as the socket gives them (no re-chunking buffer): when the
                # connection drops, every byte that arrived is already in the part.
                for chunk in response.iter_raw():
                    if cancel is not None and cancel.is_set():
                        raise DownloadCancelled(part.kept("cancelled"))
                    if part.size + len(chunk) > total:  # stop at the announced size
                        raise DownloadError(ErrorKind.SERVER, f"the hub sent more than the {total} bytes of {ref}")
                    handle.write(chunk)
                    part.digest.update(chunk)
                    part.size += len(chunk)
                    part.received += len(chunk)
                    if progress is not None:
                        progress(part.size, total)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                # The part keeps what reached the disk; the next call hashes it afresh.
                raise _disk_full(part.path, part.size, total) from exc
            raise
        return action


def _response_total(response: httpx.Response, offset: int) -> int | None:
    parsed = parse_content_range(response.headers.get("content-range"))
    if parsed is not None:
        return parsed[2]
    length = response.headers.get("content-length")
    return offset + int(length) if length and length.isdigit() else None


def _finish(part: _Part, dest: Path, remote: RemoteFile, *, resumed_from: int, elapsed: float) -> DownloadResult:
    actual = part.digest.hexdigest()
    if remote.sha256 is not None and actual != remote.sha256:
        part.path.unlink(missing_ok=True)
        raise DownloadError(ErrorKind.HASH_MISMATCH, f"{dest.name} is corrupt: its sha256 is {actual}, the hub "
                                                     f"publishes {remote.sha256}; the partial file was deleted")
    with _open_part(part.path, os.O_RDWR, "rb+") as handle:
        if handle.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            part.path.unlink(missing_ok=True)
            raise DownloadError(ErrorKind.NOT_GGUF, f"what the hub sent for {dest.name} is not a GGUF file; "
                                                    "it was deleted")
        # On disk before the rename, so a crash cannot leave the final name over missing bytes.
        os.fsync(handle.fileno())
    os.replace(part.path, dest)
    return DownloadResult(dest, part.size, actual, verified=remote.sha256 is not None, already_present=False,
                          resumed_from=resumed_from, transferred=part.received, elapsed_s=elapsed,
                          restarts=part.restarts)
