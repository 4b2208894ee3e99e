"""What any Python proxy adds to a tiny request on this machine: the floor
under the service's own number. Prints numbers; asserts nothing.

    .venv/bin/python benchmarks/proxy_floor.py [--rounds 6]

llama-server on the bundled model, and in front of it, each in its own
process, proxies of growing weight (a tiny chat, max_tokens 1, not
streamed, the request engine_bench times):

  raw asyncio      asyncio's streams on uvloop: read the request, open a
                   connection to llama-server, write it, read the answer
                   to its end, write it back. No framework, no checks.
  uvicorn          uvicorn with its h11 parser (the service's), a bare
                   ASGI app, the same raw hop.
  uvicorn+hop      the same, the hop through the service's LoopbackHop.
  uvicorn+httpx    the same, the hop through httpx's client over
                   LoopbackTransport (the service's hop before issue 32).
  uvicorn httptools  uvicorn with its httptools parser (a C parser of the
                   client's bytes: the service doesn't use it, see below),
                   only if httptools is installed.

For each: the latency it adds at p50 to llama-server's own, and its CPU
per request, alternating rounds against llama-server directly. The
service's own numbers are engine_bench's. Why httptools is only measured:
the service parses no untrusted input natively (a crash there takes every
request and the tray with it), and h11 is pure Python.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import anchors  # noqa: E402
from benchmarks.engine_bench import N_CTX, SLOTS, tiny  # noqa: E402

# Each proxy: `python -c PROXY <kind> <upstream port> <port>`; prints "ready" when listening.
PROXY = r'''
import asyncio, sys
kind, up_port, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sys.path.insert(0, sys.argv[4])
import uvloop


async def raw_hop(body: bytes) -> tuple[bytes, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", up_port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    answer = await reader.read(-1)
    writer.close()
    head, _, rest = answer.partition(b"\r\n\r\n")
    if b"chunked" in head.lower():
        body, rest = b"", rest
        while True:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            body, rest = body + rest[:size], rest[size + 2:]
        return head, body
    return head, rest


async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            _, body = await raw_hop(await reader.readexactly(length))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                         % len(body) + body)
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if kind == "uvicorn+hop":
        import json
        response = await hop.post(f"http://127.0.0.1:{up_port}/v1/chat/completions", json.loads(body or b"{}"), {})
        out = await response.aread()
        await response.aclose()
    elif kind == "uvicorn+httpx":
        response = await client.post(f"http://127.0.0.1:{up_port}/v1/chat/completions", content=body,
                                     headers={"Content-Type": "application/json"})
        out = response.content
    else:
        _, out = await raw_hop(body)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})


if kind == "raw asyncio":
    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        print("ready", flush=True)
        await server.serve_forever()
    uvloop.run(main())
else:
    import httpx, uvicorn
    from tray_app.core.dispatch.loopback_http import LoopbackHop, LoopbackTransport
    hop = LoopbackHop()
    client = httpx.AsyncClient(transport=LoopbackTransport(), timeout=60)
    print("ready", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, loop="uvloop",
                http="httptools" if kind == "uvicorn httptools" else "h11")
'''

KINDS = ["raw asyncio", "uvicorn", "uvicorn+hop", "uvicorn+httpx", "uvicorn httptools"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_listening(url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit(f"nothing listens at {url}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=40, help="tiny requests per round and side")
    args = parser.parse_args()
    kinds = [k for k in KINDS if k != "uvicorn httptools" or importlib.util.find_spec("httptools")]
    root = str(Path(__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory(prefix="proxy_floor_") as tmp:
        direct = anchors.llama_server(Path(tmp) / "direct.log", n_ctx=N_CTX, parallel=SLOTS)
        proxies: dict[str, subprocess.Popen] = {}
        try:
            urls = {"direct": direct.url}
            for kind in kinds:
                port = free_port()
                proxies[kind] = subprocess.Popen([sys.executable, "-c", PROXY, kind, str(direct.port), str(port), root],
                                                 stdout=subprocess.PIPE)
                proxies[kind].stdout.readline()  # type: ignore[union-attr]
                urls[kind] = f"http://127.0.0.1:{port}"
                wait_listening(urls[kind])
            for url in urls.values():
                asyncio.run(tiny(url, 10))
            times: dict[str, list[float]] = {side: [] for side in urls}
            cpu: dict[str, list[float]] = {kind: [] for kind in proxies}
            for round_index in range(args.rounds):
                for side in (list(urls) if round_index % 2 == 0 else list(reversed(urls))):
                    process = psutil.Process(proxies[side].pid) if side in proxies else None
                    before = process.cpu_times() if process else None
                    times[side].append(asyncio.run(tiny(urls[side], args.requests)))
                    if process and before:
                        after = process.cpu_times()
                        cpu[side].append((after.user + after.system - before.user - before.system) / args.requests)
            direct_s = statistics.median(times["direct"])
            print(f"llama-server alone, a tiny request p50: {direct_s * 1000:.2f} ms; {args.rounds} rounds of "
                  f"{args.requests}, alternating; load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
            for kind in proxies:
                added = statistics.median(times[kind]) - direct_s
                print(f"  {kind:18} adds {added * 1000:+.2f} ms at p50, {statistics.median(cpu[kind]) * 1000:.2f} ms "
                      "of its CPU per request")
        finally:
            for process in proxies.values():
                process.kill()
            direct.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
