"""The lean hop to a worker, against a real loopback socket that answers with
scripted bytes: LoopbackTransport through a real httpx client, and
LoopbackHop, the relay's, with no httpx objects."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from tray_app.core.dispatch.loopback_http import PIECE_BYTES, LoopbackHop, LoopbackTransport
from tray_app.core.engine.worker import free_loopback_port

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[None]]


@contextlib.asynccontextmanager
async def server(answer: Answer) -> AsyncIterator[dict]:
    """A loopback server: each connection's request (head and body) is read
    and recorded, then `answer` writes the response."""
    seen: dict = {"requests": []}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        request = head + await reader.readexactly(length)
        seen["requests"].append(request)
        try:
            await answer(reader, writer, request)
        finally:
            writer.close()

    listening = await asyncio.start_server(handle, "127.0.0.1", 0)
    seen["url"] = f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}"
    async with listening:
        yield seen


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(mounts={"http://127.0.0.1": LoopbackTransport()}, trust_env=False)


def replying(raw: bytes) -> Answer:
    async def answer(reader, writer, request) -> None:
        writer.write(raw)
        await writer.drain()
    return answer


async def hop_body(url: str) -> bytes:
    """The body LoopbackHop reads from `url`, whole; the answer closed however it ends."""
    response = await LoopbackHop().post(url, {}, {})
    try:
        return b"".join([piece async for piece in response.aiter_bytes()])
    finally:
        await response.aclose()


async def test_a_streamed_answer_arrives_chunk_by_chunk_and_the_request_whole():
    body = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"8\r\ndata: a\n\r\n9;ext=1\r\ndata: bc\n\r\n0\r\nTrailer: x\r\n\r\n")
    async with server(replying(body)) as seen, client() as http:
        request = http.build_request("POST", f"{seen['url']}/v1/chat/completions?x=1", json={"n": 1},
                                     headers={"Authorization": "Bearer k"})
        response = await http.send(request, stream=True)
        pieces = [piece async for piece in response.aiter_raw()]
        await response.aclose()
    assert response.status_code == 200 and response.headers["content-type"] == "text/event-stream"
    assert pieces == [b"data: a\n", b"data: bc\n"]
    sent = seen["requests"][0]
    assert sent.startswith(b"POST /v1/chat/completions?x=1 HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer k\r\n" in sent and b"\r\nConnection: close\r\n" in sent
    assert sent.endswith(b'\r\n\r\n{"n":1}') or sent.endswith(b'\r\n\r\n{"n": 1}')


async def test_a_sized_answer_a_large_chunk_and_an_answer_to_the_end():
    large = b"x" * (PIECE_BYTES * 2 + 5)
    cases = {
        b"HTTP/1.1 400 Bad Request\r\nContent-Length: 11\r\n\r\n{\"error\":1}": [b'{"error":1}'],
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + f"{len(large):x}".encode() + b"\r\n" + large
        + b"\r\n0\r\n\r\n": [large[:PIECE_BYTES], large[PIECE_BYTES:2 * PIECE_BYTES], large[2 * PIECE_BYTES:]],
        b"HTTP/1.1 200 OK\r\n\r\nto the end": [b"to the end"],
    }
    for raw, expected in cases.items():
        async with server(replying(raw)) as seen, client() as http:
            async with http.stream("GET", seen["url"]) as response:
                assert [piece async for piece in response.aiter_raw()] == expected
                assert response.status_code == int(raw.split(b" ")[1])


async def test_a_chunked_stream_split_anywhere_reads_the_same():
    # llama-server's chunks can arrive cut at any byte: the size line, the data, the CRLF.
    events = [b"data: {\"n\":%d}\n\n" % i for i in range(5)]
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\nX-Trailer: 1\r\n\r\n"
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body

    for cut in (1, 2, 3, 7, 13):
        async def trickle(reader, writer, request, cut=cut) -> None:
            for at in range(0, len(raw), cut):
                writer.write(raw[at:at + cut])
                await writer.drain()
                await asyncio.sleep(0)

        async with server(trickle) as seen:
            got = await hop_body(seen["url"])
        assert got == b"".join(events), cut


@pytest.mark.parametrize("bad", [b"-5\r\nxxxxx\r\n0\r\n\r\n", b"zz\r\n", b"5\r\nxxxxxYY0\r\n\r\n",
                                 b"f" * 70000])
async def test_a_malformed_chunk_is_a_protocol_error(bad):
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + bad
    async with server(replying(raw)) as seen:
        with pytest.raises(httpx.RemoteProtocolError):
            await hop_body(seen["url"])


async def test_a_refused_connection_is_a_connect_error():
    async with client() as http:
        with pytest.raises(httpx.ConnectError):
            await http.get(f"http://127.0.0.1:{free_loopback_port()}/health")


BROKEN_ANSWERS = [
    (b"", httpx.RemoteProtocolError),  # closed before any answer: a worker that died
    (b"SSH-2.0-OpenSSH\r\n\r\n", httpx.RemoteProtocolError),
    (b"HTTP/1.1 200 OK\r\nbroken header\r\n\r\n", httpx.RemoteProtocolError),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nonly part", httpx.RemoteProtocolError),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", httpx.RemoteProtocolError),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", httpx.RemoteProtocolError),
]


@pytest.mark.parametrize("raw, error", BROKEN_ANSWERS)
async def test_a_broken_answer_is_the_transport_error_httpx_gives(raw, error):
    # Backend's rules turn an httpx.TransportError into a WorkerFailure (replay
    # before the first byte); anything else would escape as a 500.
    async with server(replying(raw)) as seen, client() as http:
        with pytest.raises(error):
            async with http.stream("POST", seen["url"], json={}) as response:
                async for _ in response.aiter_raw():
                    pass


async def test_closing_an_answer_early_closes_the_connection_so_the_worker_stops():
    gone = asyncio.Event()

    async def endless(reader, writer, request) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        # Until the client closes: then the read sees the end (a cancel, as llama-server sees it).
        writer.write(b"5\r\ntoken\r\n")
        await writer.drain()
        await reader.read()
        gone.set()

    async with server(endless) as seen, client() as http:
        response = await http.send(http.build_request("POST", seen["url"], json={}), stream=True)
        assert await response.aiter_raw().__anext__() == b"token"
        await response.aclose()
        await asyncio.wait_for(gone.wait(), 10)


async def test_a_read_timeout_is_kept_per_read():
    # The embedding path gives its worker a read timeout: a hung worker must trip it.
    async def silent_after_headers(reader, writer, request) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with server(silent_after_headers) as seen, client() as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(seen["url"], json={}, timeout=httpx.Timeout(5.0, read=0.2))


# ----- LoopbackHop: the relay's hop, no httpx objects ------------------------------------------


async def test_the_hop_posts_compact_json_in_one_request_and_streams_the_answer():
    body = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"8\r\ndata: a\n\r\n9\r\ndata: bc\n\r\n0\r\n\r\n")
    async with server(replying(body)) as seen:
        response = await LoopbackHop().post(f"{seen['url']}/v1/chat/completions",
                                             {"messages": [{"role": "user", "content": "h\u00e9"}], "n": 1},
                                             {"Authorization": "Bearer k"})
        pieces = [piece async for piece in response.aiter_bytes()]
        await response.aclose()
    assert response.status_code == 200
    assert pieces == [b"data: a\n", b"data: bc\n"]
    sent = seen["requests"][0]
    head, _, content = sent.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/chat/completions HTTP/1.1"
    host = seen["url"].removeprefix("http://").encode()
    assert {b"Host: " + host, b"Content-Type: application/json", b"Authorization: Bearer k",
            b"Connection: close", b"Content-Length: %d" % len(content)} <= set(lines[1:])
    # As httpx's json= writes it: compact and UTF-8, so a worker sees the same bytes as before.
    assert content == '{"messages":[{"role":"user","content":"hé"}],"n":1}'.encode()


async def test_the_hop_reads_an_error_answer_whole():
    async with server(replying(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 11\r\n\r\n{\"error\":1}")) as seen:
        response = await LoopbackHop().post(seen["url"], {}, {})
        assert response.status_code == 400
        assert await response.aread() == b'{"error":1}'
        await response.aclose()


@pytest.mark.parametrize("raw, error", BROKEN_ANSWERS)
async def test_the_hops_broken_answer_is_the_transport_error_httpx_gives(raw, error):
    async with server(replying(raw)) as seen:
        with pytest.raises(error):
            await hop_body(seen["url"])


async def test_the_hop_to_a_closed_port_is_a_connect_error_and_nan_is_refused_before_sending():
    with pytest.raises(httpx.ConnectError):
        await LoopbackHop().post(f"http://127.0.0.1:{free_loopback_port()}/v1/chat/completions", {}, {})
    async with server(replying(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")) as seen:
        with pytest.raises(ValueError):
            await LoopbackHop().post(seen["url"], {"temperature": float("nan")}, {})
        assert seen["requests"] == []


async def test_closing_the_hops_answer_early_closes_the_connection_so_the_worker_stops():
    gone = asyncio.Event()

    async def endless(reader, writer, request) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\ntoken\r\n")
        await writer.drain()
        await reader.read()
        gone.set()

    async with server(endless) as seen:
        response = await LoopbackHop().post(seen["url"], {}, {})
        assert await response.aiter_bytes().__anext__() == b"token"
        await response.aclose()
        await asyncio.wait_for(gone.wait(), 10)
