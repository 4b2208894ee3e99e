"""What the service's relay costs per streamed token, in CPU time, not wall
time: on a machine other work loads, throughput in tokens/s is noise, the
CPU seconds a process spent per token are not. Prints numbers; asserts nothing.

    .venv/bin/python benchmarks/relay_cost.py [--mode fake|real|both] [--tokens 2000] [--code DIR]

- fake: the real Service and app in this process, its workers fake, their
  upstream a llama-server-shaped SSE stream (tests/fakes/upstream.py) that
  sends its events as fast as it can; a client streams through the app. The
  process's CPU per token is the relay's (plus the fake upstream's and the
  client's, the same on both sides of a comparison), and a cProfile of one
  run names the hot functions.
- real: `tray-app serve` on the bundled model (a subprocess, as the tests
  start it); the router process's CPU per token (psutil), and as the
  anchor, llama-server's own CPU per token, through the service and alone.

One stream of --tokens tokens, then 4 concurrent streams of --tokens/4;
in fake mode also 200 tiny requests (max_tokens 1) in a row: the CPU the
service spends per request outside the relay.
- hop: the client side of the hop to a worker alone, 200 tiny streamed
  requests to llama-server, the CPU per request by how it is made: httpx
  (its own transport, and over LoopbackTransport), LoopbackTransport alone,
  LoopbackHop (core/dispatch/loopback_http.py, the relay's), raw streams.
--code DIR runs another checkout of the code (the old one, from
`git archive`), so before and after run back to back on one machine.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import AsyncIterator


def _code_root() -> Path:
    """--code DIR, read before the project's imports: they must come from DIR."""
    if "--code" in sys.argv:
        return Path(sys.argv[sys.argv.index("--code") + 1]).resolve()
    return Path(__file__).resolve().parents[1]


CODE = _code_root()
sys.path.insert(0, str(CODE))
# `python -m tray_app serve` (the real mode's router) finds the package from its working folder.
os.chdir(CODE)

import httpx  # noqa: E402
import psutil  # noqa: E402

STREAMS = 4
PROFILE_TOP = 15
# Requests for one token each, one after another: the service's own cost per request.
TINY_REQUESTS = 200
# Varied tokens, as a model writes them: ASCII words, a quote, non-ASCII.
TOKENS = [" the", " relay", " \"quoted\"", " caf\u00e9", " \u2028line", " 42", ",", " \U0001F600"]


def chat_body(max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}


async def stream_tokens(client: httpx.AsyncClient, max_tokens: int, path: str = "/v1/chat/completions") -> int:
    """Stream one chat; the content events that reached the client."""
    tokens = 0
    async with client.stream("POST", path, json=chat_body(max_tokens)) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:") and '"content":' in line and '"content":""' not in line \
                    and '"content":null' not in line:
                tokens += 1
    return tokens


async def streams(client: httpx.AsyncClient, count: int, max_tokens: int) -> int:
    return sum(await asyncio.gather(*(stream_tokens(client, max_tokens) for _ in range(count))))


def per_token_us(cpu_s: float, tokens: int) -> str:
    return f"{cpu_s / max(tokens, 1) * 1e6:8.1f} us/token ({tokens} tokens, {cpu_s:.3f} s CPU)"


# ----- fake upstream, in-process ---------------------------------------------------------

FAKE_CONFIG = """
[gpu]
simulate_mib = 8192
n_ctx = 8192
reserve_mib = 256
queue_limit = 64
yield_to_other_apps = false
idle_unload_s = 0
[cpu]
max_concurrency = 1
ram_floor_mib = 256
"""


async def llama_server_events(tokens: list[str], chat: bool, body: dict, script, request) -> AsyncIterator[bytes]:
    """llama-server's stream byte for byte (its key order, compact JSON, raw
    UTF-8, as recorded from the bundled build), as fast as it can go; the
    test fake's own events are json.dumps-shaped, which no real worker sends."""
    created = int(time.time())
    tail = (f',"id":"chatcmpl-upstream","model":"upstream-model","system_fingerprint":"b1-0c1e570",'
            f'"object":"chat.completion.chunk"}}\n\n')

    def event(choice: dict) -> bytes:
        return (f'data: {{"choices":[{json.dumps(choice, ensure_ascii=False, separators=(",", ":"))}],'
                f'"created":{created}{tail}').encode()

    limit = body.get("max_tokens")
    answer = tokens[:limit] if isinstance(limit, int) else tokens
    yield event({"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}})
    for token in answer:
        yield event({"finish_reason": None, "index": 0, "delta": {"content": token}})
    yield event({"finish_reason": "length", "index": 0, "delta": {}})
    yield b"data: [DONE]\n\n"


async def fake_mode(tokens: int) -> None:
    from tests.fakes import upstream
    from tests.fakes.service import in_process_service

    upstream.sse_events = llama_server_events

    with tempfile.TemporaryDirectory(prefix="relay_cost_") as tmp:
        for name in ("CONFIG", "STATE", "DATA", "CACHE"):
            os.environ[f"XDG_{name}_HOME"] = str(Path(tmp) / name.lower())
        async with in_process_service(Path(tmp), FAKE_CONFIG) as inproc:
            inproc.upstream.script("gpu").tokens = [TOKENS[i % len(TOKENS)] for i in range(tokens)]
            client = inproc.client
            await streams(client, 1, 16)  # warm: imports, first-request paths
            print(f"== fake upstream (in-process: relay + fake upstream + client), code {CODE} ==")
            for count in (1, STREAMS):
                per_stream = tokens // count
                started = time.process_time()
                got = await streams(client, count, per_stream)
                print(f"  {count} stream(s): {per_token_us(time.process_time() - started, got)}")
            started = time.process_time()
            await tiny_requests(client, TINY_REQUESTS)
            print(f"  a tiny request (max_tokens 1, not streamed): "
                  f"{(time.process_time() - started) / TINY_REQUESTS * 1e3:.3f} ms CPU each ({TINY_REQUESTS} in a row)")
            for count in (1, STREAMS):
                profile = cProfile.Profile()
                profile.enable()
                got = await streams(client, count, tokens // count)
                profile.disable()
                print_profile(profile, f"{count} stream(s), {got} tokens")
            profile = cProfile.Profile()
            profile.enable()
            await tiny_requests(client, TINY_REQUESTS)
            profile.disable()
            print_profile(profile, f"{TINY_REQUESTS} tiny requests")


async def tiny_requests(client: httpx.AsyncClient, count: int) -> None:
    for _ in range(count):
        response = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0})
        response.raise_for_status()


def print_profile(profile: cProfile.Profile, what: str) -> None:
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(PROFILE_TOP)
    print(f"-- cProfile, {what}, top {PROFILE_TOP} by tottime --")
    print("\n".join(line for line in text.getvalue().splitlines()
                    if line.strip() and not line.lstrip().startswith(("Ordered by", "List reduced"))))


# ----- the real service and llama-server -------------------------------------------------

def real_config(tokens: int) -> str:
    n_ctx = tokens + 256
    return f"""
[gpu]
simulate_mib = 8192
n_ctx = {n_ctx}
max_concurrency = {STREAMS}
queue_limit = 64
reserve_mib = 256
first_token_timeout_s = 300
token_timeout_s = 120
yield_to_other_apps = false
idle_unload_s = 0
[cpu]
n_ctx = 1024
max_concurrency = 1
ram_floor_mib = 256
[server]
queue_timeout_s = 600
"""


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far."""
    times = psutil.Process(pid).cpu_times()
    return times.user, times.system


def idle_rate(pid: int, seconds: float = 5.0) -> float:
    """CPU seconds per second a process spends with nothing in flight (its
    samplers, timers): subtracted from a run's CPU over the run's wall time."""
    before, started = sum(cpu_split(pid)), time.monotonic()
    time.sleep(seconds)
    return (sum(cpu_split(pid)) - before) / (time.monotonic() - started)


def measure(url: str, pids: dict[str, int], count: int, max_tokens: int) -> tuple[int, float, dict[str, tuple]]:
    """(tokens, wall seconds, {name: (user s, system s)}) of `count` streams."""
    async def run() -> int:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            return await streams(client, count, max_tokens)

    before = {name: cpu_split(pid) for name, pid in pids.items()}
    started = time.monotonic()
    got = asyncio.run(run())
    wall = time.monotonic() - started
    return got, wall, {name: tuple(a - b for a, b in zip(cpu_split(pid), before[name])) for name, pid in pids.items()}


def report(count: int, name: str, got: int, wall: float, spent: tuple, idle: float = 0.0) -> None:
    user, system = spent
    net = user + system - idle * wall
    print(f"  {count} stream(s) {name:26}: {per_token_us(user + system, got)}; user {user / got * 1e6:.1f}, "
          f"system {system / got * 1e6:.1f} us/token; less idle {net / got * 1e6:.1f} us/token; {got / wall:.0f} tok/s")


def real_mode(tokens: int) -> None:
    from benchmarks import anchors
    from tests.harness import RunningService

    with tempfile.TemporaryDirectory(prefix="relay_cost_") as tmp:
        service = RunningService(Path(tmp) / "service", real_config(tokens))
        try:
            status = service.wait_ready()
            gpu_pid = next(w["pid"] for w in status["workers"] if w["role"] == "gpu")
            pids = {"router": service.process.pid, "llama-server (GPU worker)": gpu_pid}
            asyncio.run(_warm(service.url))
            idle = idle_rate(service.process.pid)
            print(f"== real service on the bundled model ({status['engine']['runtime']}), code {CODE} ==")
            print(f"  router idle: {idle * 100:.2f} % of a core (subtracted below as 'less idle')")
            for count in (1, STREAMS):
                got, wall, spent = measure(service.url, pids, count, tokens // count)
                for name, seconds in spent.items():
                    report(count, name, got, wall, seconds, idle if name == "router" else 0.0)
        finally:
            service.stop()
        direct = anchors.llama_server(Path(tmp) / "direct.log", n_ctx=tokens + 256, parallel=STREAMS)
        try:
            asyncio.run(_warm(direct.url))
            print("== anchor: llama-server alone, same model ==")
            for count in (1, STREAMS):
                got, wall, spent = measure(direct.url, {"llama-server": direct.process.pid}, count, tokens // count)
                report(count, "llama-server", got, wall, spent["llama-server"])
        finally:
            direct.stop()


# ----- the hop to a worker alone ------------------------------------------------------------

def hop_mode(requests: int) -> None:
    """The CPU a client spends on one tiny streamed request to llama-server
    (what the service does once per request, towards its worker), by how
    it is made, alternating: httpx's own transport; httpx's client over the
    service's LoopbackTransport; that transport called directly (httpx's
    Request and Response, no client); LoopbackHop, the relay's hop (no httpx
    objects); and, as the floor, asyncio's streams read to the end."""
    from benchmarks import anchors
    from tray_app.core.dispatch.loopback_http import LoopbackHop, LoopbackTransport

    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0, "stream": True}
    raw_body = json.dumps(body, separators=(",", ":")).encode()

    async def through_client(url: str, transport: httpx.AsyncBaseTransport | None) -> None:
        mounts = {"http://127.0.0.1": transport} if transport is not None else None
        async with httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), trust_env=False,
                                     mounts=mounts) as client:
            for _ in range(requests):
                async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                    async for _ in response.aiter_bytes():
                        pass

    async def through_transport(url: str) -> None:
        transport = LoopbackTransport()
        for _ in range(requests):
            response = await transport.handle_async_request(httpx.Request(
                "POST", f"{url}/v1/chat/completions", json=body, extensions={"timeout": {"connect": 5.0}}))
            async for _ in response.stream:
                pass
            await response.aclose()

    async def through_hop(url: str) -> None:
        hop = LoopbackHop()
        for _ in range(requests):
            response = await hop.post(f"{url}/v1/chat/completions", body, {})
            async for _ in response.aiter_bytes():
                pass
            await response.aclose()

    async def raw_streams(url: str) -> None:
        port = int(url.rsplit(":", 1)[1])
        for _ in range(requests):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(raw_body)
                         + raw_body)
            while await reader.read(65536):
                pass
            writer.close()

    ways = {
        "httpx's own transport": lambda url: through_client(url, None),
        "httpx + LoopbackTransport": lambda url: through_client(url, LoopbackTransport()),
        "LoopbackTransport alone": through_transport,
        "LoopbackHop (the relay's)": through_hop,
        "raw asyncio streams": raw_streams,
    }

    def cpu_each(run, url: str) -> float:
        started = time.process_time()
        asyncio.run(run(url))
        return (time.process_time() - started) / requests

    with tempfile.TemporaryDirectory(prefix="relay_cost_") as tmp:
        direct = anchors.llama_server(Path(tmp) / "direct.log", n_ctx=512, parallel=1)
        try:
            for run in ways.values():  # warm
                cpu_each(run, direct.url)
            print(f"== the hop to a worker: client CPU per tiny streamed request ({requests} in a row), code {CODE} ==")
            results: dict[str, list[float]] = {name: [] for name in ways}
            for round_index in range(3):
                for name in (list(ways) if round_index % 2 == 0 else reversed(list(ways))):
                    results[name].append(cpu_each(ways[name], direct.url))
            for name, values in results.items():
                print(f"  {name:26}: {statistics.median(values) * 1e3:.3f} ms CPU each (median of 3)")
        finally:
            direct.stop()


async def _warm(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await streams(client, STREAMS, 8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("fake", "real", "both", "hop"), default="both")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--code", default=None, help="the checkout whose code runs (default: this one)")
    args = parser.parse_args()
    if args.mode in ("fake", "both"):
        asyncio.run(fake_mode(args.tokens))
    if args.mode in ("real", "both"):
        real_mode(args.tokens)
    if args.mode == "hop":
        hop_mode(TINY_REQUESTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
