"""Small HTTP facts every layer shares: which hosts are this machine's
loopback, how an API key is sent, and where an SSE stream's lines end. Here,
below api/ and dispatch/, so the HTTP app, the peer path, the config, the
command line, the drill and the UI use one rule."""

from __future__ import annotations

import ipaddress
from typing import AsyncIterable, AsyncIterator, Iterable, Iterator

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bearer_header(api_key: str) -> dict[str, str]:
    """The Authorization header a client sends with `api_key`; none without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class SseLineTooLong(ValueError):
    """An SSE line ran past the splitter's limit without ending."""


class SseLineSplitter:
    """The lines of a `text/event-stream`, fed as bytes, split only where SSE
    splits them: LF and CRLF. str.splitlines and httpx's iter_lines also
    split on U+0085, U+2028 and U+2029, which JSON leaves raw inside
    strings: a model that writes one cuts an event in two (the fuzzer found
    it). Every SSE reader here (the service's upstreams, the drill, the UI)
    splits with this one."""

    def __init__(self, max_line_bytes: int | None = None) -> None:
        self._pending = b""
        self._max_line_bytes = max_line_bytes

    def feed(self, chunk: bytes) -> list[str]:
        """The lines `chunk` completes; the rest waits for the next one."""
        *complete, self._pending = (self._pending + chunk).split(b"\n")
        if self._max_line_bytes is not None and len(self._pending) > self._max_line_bytes:
            # No event is this large: an upstream that never ends its line
            # must not fill our memory.
            raise SseLineTooLong(f"an SSE line longer than {self._max_line_bytes} bytes")
        return [_decoded(line) for line in complete]

    def finish(self) -> list[str]:
        """The last line, when the stream ended without its line feed."""
        rest, self._pending = self._pending, b""
        return [_decoded(rest)] if rest else []


def _decoded(line: bytes) -> str:
    return line.removesuffix(b"\r").decode("utf-8", "replace")


def sse_lines(chunks: Iterable[bytes], max_line_bytes: int | None = None) -> Iterator[str]:
    """The SSE lines of a blocking byte stream (httpx's iter_bytes())."""
    splitter = SseLineSplitter(max_line_bytes)
    for chunk in chunks:
        yield from splitter.feed(chunk)
    yield from splitter.finish()


async def aiter_sse_lines(chunks: AsyncIterable[bytes], max_line_bytes: int | None = None) -> AsyncIterator[str]:
    """The SSE lines of an async byte stream (httpx's aiter_bytes())."""
    splitter = SseLineSplitter(max_line_bytes)
    async for chunk in chunks:
        for line in splitter.feed(chunk):
            yield line
    for line in splitter.finish():
        yield line
