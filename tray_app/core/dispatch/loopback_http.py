"""The HTTP hop to a worker on this machine, lean: one plain-HTTP/1.1
request per connection on asyncio's own streams.

Two faces of one exchange:
- `LoopbackHop.post`, the relay's hop to a worker (Backend): a JSON body out,
  a `HopResponse` back (status_code, aiter_bytes, aread, aclose: what
  upstream.stream_attempt reads), no httpx objects on the way. Measured
  against llama-server (benchmarks/relay_cost.py --mode hop), a client's
  CPU per tiny streamed request: 2.37 ms through httpx's own transport,
  1.67 through httpx's client over this transport, 1.12 through the
  transport alone with httpx's Request and Response, 0.94 here, and 0.77
  reading raw bytes to the end. On 2 cores that CPU is taken from
  llama.cpp's threads and adds to every request's latency.
- `LoopbackTransport`, the same exchange as an httpx transport, for callers
  that keep httpx's interface (Service mounts it for http://127.0.0.1).

Both raise httpx's errors (ConnectError, ReadError, RemoteProtocolError...),
which the callers already handle. A pool of kept connections doesn't help:
llama-server closes its connection after every streamed answer, and
reusing one it was closing broke a request.

Only plain http to a loopback address comes here; a peer on the LAN, TLS
or a proxy go through httpx's own transport."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Awaitable, Mapping
from urllib.parse import urlsplit

import httpx

# The most of a response body held at once: a chunk announced larger
# (a peer that misbehaves) is read and handed on in pieces of this size.
PIECE_BYTES = 64 * 1024
# The most a status line and headers may take (asyncio's own line limit).
HEAD_LIMIT_BYTES = 64 * 1024
# As the service's httpx client: a worker on this machine answers a connect at once or not at all.
CONNECT_TIMEOUT_S = 5.0


class HopResponse:
    """A worker's answer as the relay reads it: the status, and the body
    once, streamed (aiter_bytes) or whole (aread)."""

    def __init__(self, status_code: int, pieces: AsyncIterator[bytes], writer: asyncio.StreamWriter) -> None:
        self.status_code = status_code
        self._pieces = pieces
        self._writer = writer

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        return self._pieces

    async def aread(self) -> bytes:
        return b"".join([piece async for piece in self._pieces])

    async def aclose(self) -> None:
        # Closing before the end is how a cancel reaches the worker: it
        # sees the connection go and stops generating.
        self._writer.close()
        await self._pieces.aclose()  # type: ignore[attr-defined]


class LoopbackHop:
    """POSTs a JSON body to a worker on loopback; the answer streamed."""

    async def post(self, url: str, body: Any, headers: Mapping[str, str]) -> HopResponse:
        parts = urlsplit(url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        # As httpx writes JSON (compact, UTF-8, NaN refused), so a worker sees the same bytes.
        content = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
        pairs = [(b"Host", parts.netloc.encode()), (b"Content-Type", b"application/json"),
                 (b"Content-Length", str(len(content)).encode()),
                 *((name.encode(), value.encode()) for name, value in headers.items())]
        status, _, pieces, writer = await _exchange(parts.hostname or "127.0.0.1", parts.port or 80, "POST",
                                                    target.encode(), pairs, content, CONNECT_TIMEOUT_S, None, None)
        return HopResponse(status, pieces, writer)


class LoopbackTransport(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        status, headers, pieces, writer = await _exchange(
            request.url.host, request.url.port or 80, request.method, request.url.raw_path, request.headers.raw,
            await request.aread(), timeouts.get("connect"), timeouts.get("read"), request)
        return httpx.Response(status, headers=headers, stream=_Body(pieces, writer),
                              extensions={"http_version": b"HTTP/1.1"})


async def _exchange(host: str, port: int, method: str, target: bytes, headers: Any, content: bytes,
                    connect_timeout_s: float | None, read_timeout_s: float | None, request: httpx.Request | None
                    ) -> tuple[int, list[tuple[bytes, bytes]], AsyncIterator[bytes], asyncio.StreamWriter]:
    """One request on a new connection: (status, headers, the body's pieces, the writer to close)."""
    try:
        # asyncio.timeout, not wait_for: no task of its own for every request.
        async with asyncio.timeout(connect_timeout_s):
            reader, writer = await asyncio.open_connection(host, port, limit=HEAD_LIMIT_BYTES)
    except TimeoutError:
        raise httpx.ConnectTimeout(f"no connection to {host}:{port} in time", request=request) from None
    except OSError as exc:
        raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from None
    read = _Reader(reader, read_timeout_s, method, request)
    try:
        writer.write(_request_bytes(method, target, headers, content))
        status, head = await _read_head(read)
        return status, head, _body(read, status, head), writer
    except BaseException:
        writer.close()
        raise


class _Reader:
    """The connection's reads, each under httpx's read timeout (None: no
    limit, the streamed hop's case, whose deadlines stream_attempt keeps),
    and their failures as the httpx errors callers handle."""

    def __init__(self, reader: asyncio.StreamReader, timeout_s: float | None, method: str,
                 request: httpx.Request | None) -> None:
        self._reader = reader
        self._timeout_s = timeout_s
        self.method = method
        self.request = request

    async def until(self, separator: bytes) -> bytes:
        return await self._within(self._reader.readuntil(separator))

    async def exactly(self, size: int) -> bytes:
        return await self._within(self._reader.readexactly(size))

    async def some(self, size: int) -> bytes:
        return await self._within(self._reader.read(size))

    def broken(self, message: str) -> httpx.RemoteProtocolError:
        return httpx.RemoteProtocolError(message, request=self.request)

    async def _within(self, read: Awaitable[bytes]) -> bytes:
        try:
            return await (read if self._timeout_s is None else asyncio.wait_for(read, self._timeout_s))
        except asyncio.TimeoutError:
            raise httpx.ReadTimeout(f"nothing read in {self._timeout_s:g} s", request=self.request) from None
        except asyncio.IncompleteReadError as exc:
            raise _Closed(exc.partial) from None
        except asyncio.LimitOverrunError:
            raise self.broken("a line longer than the limit") from None
        except OSError as exc:
            raise httpx.ReadError(str(exc) or type(exc).__name__, request=self.request) from None


class _Closed(Exception):
    """The connection ended before what was read was complete."""

    def __init__(self, partial: bytes) -> None:
        super().__init__()
        self.partial = partial


def _request_bytes(method: str, target: bytes, headers: Any, content: bytes) -> bytes:
    """The request in one write: head and body together (two writes cost
    two wake-ups of the worker)."""
    lines = [b"%s %s HTTP/1.1" % (method.encode(), target)]
    lines += [b"%s: %s" % (name, value) for name, value in headers if name.lower() != b"connection"]
    # One request per connection: the worker needn't hold an HTTP thread for us.
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + content


async def _read_head(read: _Reader) -> tuple[int, list[tuple[bytes, bytes]]]:
    try:
        head = await read.until(b"\r\n\r\n")
    except _Closed:
        # As httpcore says it: a worker that died before it answered.
        raise read.broken("Server disconnected without sending a response.") from None
    status_line, *header_lines = head[:-4].split(b"\r\n")
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise read.broken(f"not an HTTP/1.1 status line: {status_line[:80]!r}")
    headers = []
    for line in header_lines:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise read.broken(f"a malformed header line: {line[:80]!r}")
        headers.append((name, value.strip()))
    return int(parts[1]), headers


def _body(read: _Reader, status: int, headers: list[tuple[bytes, bytes]]) -> AsyncIterator[bytes]:
    framing = {name.lower(): value for name, value in headers}
    if read.method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return _nothing()
    if b"chunked" in framing.get(b"transfer-encoding", b"").lower():
        return _whole(read, _chunked(read))
    length = framing.get(b"content-length")
    if length is not None:
        if not length.isdigit():
            raise read.broken(f"a malformed Content-Length: {length[:40]!r}")
        return _whole(read, _sized(read, int(length)))
    return _to_end(read)


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield  # an async generator that yields nothing


async def _whole(read: _Reader, pieces: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A framed body: one that ends before its framing says is broken."""
    try:
        async for piece in pieces:
            yield piece
    except _Closed:
        raise read.broken("peer closed connection without sending complete message body") from None


async def _chunked(read: _Reader) -> AsyncIterator[bytes]:
    while True:
        size_line = await read.until(b"\r\n")
        try:
            size = int(size_line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise read.broken(f"a malformed chunk size: {size_line[:40]!r}") from None
        if size == 0:
            # Trailers, if any, up to the empty line that ends the body.
            while await read.until(b"\r\n") != b"\r\n":
                pass
            return
        while size > 0:
            piece = await read.exactly(min(size, PIECE_BYTES))
            size -= len(piece)
            yield piece
        if await read.exactly(2) != b"\r\n":
            raise read.broken("a chunk that doesn't end with CRLF")


async def _sized(read: _Reader, length: int) -> AsyncIterator[bytes]:
    while length > 0:
        piece = await read.exactly(min(length, PIECE_BYTES))
        length -= len(piece)
        yield piece


async def _to_end(read: _Reader) -> AsyncIterator[bytes]:
    while piece := await read.some(PIECE_BYTES):
        yield piece


class _Body(httpx.AsyncByteStream):
    def __init__(self, pieces: AsyncIterator[bytes], writer: asyncio.StreamWriter) -> None:
        self._pieces = pieces
        self._writer = writer

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for piece in self._pieces:
            yield piece

    async def aclose(self) -> None:
        # Closing before the end is how a cancel reaches the worker: it
        # sees the connection go and stops generating.
        self._writer.close()
        await self._pieces.aclose()
