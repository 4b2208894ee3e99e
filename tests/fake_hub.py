"""A local HTTP server laid out like the Hugging Face hub (the tree API and
resolve URLs, with Range), serving files from memory, for the download
tests. Shared by the pull tests and the tray's download dialog test."""

from __future__ import annotations

import contextlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator
from urllib.parse import unquote

# A repository that answers only with this token, as a gated model does.
PRIVATE_REPO = "test-org/private"
TOKEN = "hf_secret"

@dataclass
class HubFile:
    data: bytes
    sha256: str | None  # what the tree API publishes; None = a plain (non-LFS) entry


@dataclass
class FakeHub:
    files: dict[tuple[str, str], HubFile]
    ignore_range: bool = False
    drop_after: int | None = None  # the first download sends this many bytes, then hangs up
    ranges: list[str | None] = field(default_factory=list)  # the Range header of each download request
    requests: list[str] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)  # the Authorization header of each request
    # A careless or hostile hub: a file list without sizes, bodies sent
    # chunked (no Content-Length), extra entries in the list, and a Link
    # header that continues the list at this URL.
    list_sizes: bool = True
    chunked: bool = False
    extra_entries: list[dict] = field(default_factory=list)
    next_page: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""


def make_handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet test output
            pass

        def _plain(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _authorised(self, repo: str) -> bool:
            return repo != PRIVATE_REPO or self.headers.get("Authorization") == f"Bearer {TOKEN}"

        def do_GET(self) -> None:
            path = unquote(self.path)
            with hub.lock:
                hub.requests.append(path)
                hub.authorizations.append(self.headers.get("Authorization"))
            tree = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path)
            resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            match = tree or resolve
            if match is None or match.group(2) != "main":
                return self._plain(404, b"not found")
            repo = match.group(1)
            if not self._authorised(repo):
                return self._plain(401, b"unauthorised")
            if not any(r == repo for r, _ in hub.files):
                return self._plain(404, b"no such repo")
            if tree:
                return self._tree(repo, match.group(3) or "")
            return self._resolve(repo, match.group(3))

        def _tree(self, repo: str, folder: str) -> None:
            entries = []
            for (r, path), hub_file in hub.files.items():
                if r != repo or str(Path(path).parent).replace(".", "") != folder:
                    continue
                entry = {"type": "file", "path": path, "size": len(hub_file.data), "oid": "0" * 40}
                if hub_file.sha256 is not None:
                    entry["lfs"] = {"oid": hub_file.sha256, "size": len(hub_file.data), "pointerSize": 134}
                if not hub.list_sizes:
                    entry.pop("size")
                    entry.get("lfs", {}).pop("size", None)
                entries.append(entry)
            headers = {"Content-Type": "application/json"}
            if hub.next_page:
                headers["Link"] = f'<{hub.next_page}>; rel="next"'
            self._plain(200, json.dumps(entries + hub.extra_entries).encode(), headers)

        def _resolve(self, repo: str, path: str) -> None:
            hub_file = hub.files.get((repo, path))
            if hub_file is None:
                return self._plain(404, b"entry not found", {"X-Error-Code": "EntryNotFound"})
            data, size = hub_file.data, len(hub_file.data)
            requested = self.headers.get("Range")
            with hub.lock:
                hub.ranges.append(requested)
                drop, hub.drop_after = hub.drop_after, None
            start = 0
            if requested and not hub.ignore_range:
                start = int(re.fullmatch(r"bytes=(\d+)-", requested).group(1))
                if start >= size:
                    return self._plain(416, b"", {"Content-Range": f"bytes */{size}"})
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
            else:
                self.send_response(200)
            if hub.chunked:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Content-Length", str(size - start))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            end = size if drop is None else start + drop
            view = memoryview(data)
            try:
                for offset in range(start, end, 1 << 20):
                    block = view[offset:min(offset + (1 << 20), end)]
                    if hub.chunked:
                        self.wfile.write(f"{len(block):x}\r\n".encode() + bytes(block) + b"\r\n")
                    else:
                        self.wfile.write(block)
                if hub.chunked:
                    self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the client hung up (a cancel)
                return
            if drop is not None:
                # Hang up mid-body, as a dropped connection does.
                self.close_connection = True

    return Handler


@contextlib.contextmanager
def serve_hub(state: FakeHub) -> Iterator[FakeHub]:
    """The hub on a free loopback port (state.url) for the length of the block."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
