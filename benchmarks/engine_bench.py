"""The llama-server engine through the service, against llama-server started
directly. Prints numbers and ratios measured in one run; asserts nothing.

    .venv/bin/python benchmarks/engine_bench.py [--rounds 5] [--threads N]

Both servers run the same binary on the same model file with the same
thread count and slots (4, n_ctx 2048 each). The service's other worker
(the CPU path) is loaded but idle. Runs alternate direct/service so that
drift (thermal, page cache) hits both sides alike.

1. 4 concurrent streams of 128 tokens: aggregate tokens/s and TTFT p50.
2. One stream: decode tokens/s; and a tiny request (max_tokens 1): latency p50.
3. A burst of 64 short requests (max_tokens 8) at once: answered, shed, and
   the time to the last answer, with the service's default queue limits
   (issue 32: none shed, done no later than llama-server alone).
4. RSS per worker: a llama-server worker against llama-cpp-python's server
   on the same model and context.
5. CPU only: the service with no GPU path (its CPU worker with the same
   slots and threads) against llama-server directly: one stream's decode
   and 4 streams' aggregate and TTFT p50.

The direct llama-server gets the OpenMP settings (OMP_*, GOMP_*) the
service's worker it is compared with runs under, read from that worker's
environment: the simulated GPU worker shares the cores with the CPU worker
and runs with a low spin count, which alone changes a tiny request's time.

--pin: the service process (every thread) and this script on core 0, the
workers and the direct llama-server on core 1 with one thread: what the
service costs when it doesn't take its time from llama.cpp's cores.

The load average is printed before and after: on a shared machine it says
how much of a difference is the machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import anchors  # noqa: E402
from tests.harness import RunningService  # noqa: E402

SLOTS = 4
# Issue 32's burst: none may be shed.
BURST = 64
N_CTX = 2048
PROMPTS = [
    "Write a short poem about autumn leaves.",
    "Explain what a hash table is.",
    "Give three tips for growing tomatoes.",
    "Describe the water cycle.",
]


def service_config(threads: int) -> str:
    # The GPU path is simulated (it runs on the CPU here): it is the path
    # with SLOTS slots that the service routes to by default.
    return f"""
[gpu]
simulate_mib = 8192
n_ctx = {N_CTX}
max_concurrency = {SLOTS}
reserve_mib = 256
first_token_timeout_s = 300
token_timeout_s = 120
[cpu]
n_ctx = {N_CTX}
max_concurrency = 1
n_threads = {threads}
ram_floor_mib = 256
[server]
queue_timeout_s = 600
"""


async def stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(TTFT s, total s, tokens) of one streamed chat that runs to max_tokens."""
    started = time.perf_counter()
    first = None
    tokens = 0
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:") and '"content":"' in line.replace(" ", ""):
                tokens += 1
                first = first or time.perf_counter()
    return (first or time.perf_counter()) - started, time.perf_counter() - started, tokens


async def concurrent(url: str, streams: int, max_tokens: int) -> tuple[float, float]:
    """(aggregate tokens/s, TTFT p50 s) of `streams` streams started together."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(stream(client, PROMPTS[i % len(PROMPTS)], max_tokens)
                                         for i in range(streams)))
        elapsed = time.perf_counter() - started
    return sum(r[2] for r in results) / elapsed, statistics.median(r[0] for r in results)


async def single(url: str, max_tokens: int) -> float:
    """Decode tokens/s of one stream, after its first token."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        ttft, total, tokens = await stream(client, PROMPTS[0], max_tokens)
    return (tokens - 1) / (total - ttft)


async def tiny(url: str, runs: int) -> float:
    """p50 seconds of a non-streamed request for one token."""
    times = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for _ in range(runs):
            started = time.perf_counter()
            response = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0})
            response.raise_for_status()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def cpu_only_config(threads: int) -> str:
    # No GPU path at all: every request is the CPU worker's, with the slots
    # and threads llama-server gets when started directly.
    return f"""
[gpu]
enabled = false
[cpu]
n_ctx = {N_CTX}
max_concurrency = {SLOTS}
n_threads = {threads}
ram_floor_mib = 256
[server]
queue_timeout_s = 600
"""


def measure(urls: dict[str, str], rounds: int, run) -> dict[str, list]:
    """`run(url)` on each side, `rounds` times, alternating which goes first
    so drift (thermal, page cache) hits both sides alike."""
    values: dict[str, list] = {side: [] for side in urls}
    for round_index in range(rounds):
        order = list(urls) if round_index % 2 == 0 else list(reversed(urls))
        for side in order:
            values[side].append(asyncio.run(run(urls[side])))
    return values


def round_ratios(values: dict[str, list[float]]) -> str:
    """Each round's service/direct ratio, as a range: the two sides of a
    round ran back to back, so drift between rounds cancels in it, and the
    range says how far one run's ratio can be trusted."""
    ratios = sorted(s / d for s, d in zip(values["service"], values["direct"]))
    return f"rounds x{ratios[0]:.2f} to x{ratios[-1]:.2f}"


def report_streams(urls: dict[str, str], rounds: int, max_tokens: int) -> None:
    """4 concurrent streams, then one stream's decode: medians, and the ratios."""
    both = measure(urls, rounds, lambda url: concurrent(url, SLOTS, max_tokens))
    tps_runs = {k: [v[0] for v in vs] for k, vs in both.items()}
    ttft_runs = {k: [v[1] for v in vs] for k, vs in both.items()}
    tps = {k: statistics.median(v) for k, v in tps_runs.items()}
    ttft = {k: statistics.median(v) for k, v in ttft_runs.items()}
    print(f"== {SLOTS} concurrent streams x {max_tokens} tokens (medians) ==")
    for side in urls:
        print(f"  {side:8} {tps[side]:7.1f} tokens/s   TTFT p50 {ttft[side] * 1000:7.1f} ms")
    print(f"  service/direct: tokens/s x{tps['service'] / tps['direct']:.3f} ({round_ratios(tps_runs)}), "
          f"TTFT x{ttft['service'] / ttft['direct']:.3f} ({round_ratios(ttft_runs)})")
    decode_runs = measure(urls, rounds, lambda url: single(url, max_tokens))
    decode = {k: statistics.median(v) for k, v in decode_runs.items()}
    print(f"== one stream: decode {', '.join(f'{side} {decode[side]:.1f}' for side in urls)} tokens/s; "
          f"service/direct x{decode['service'] / decode['direct']:.3f} ({round_ratios(decode_runs)}) ==")


def openmp_environment(pid: int) -> dict[str, str]:
    """The OpenMP settings a process runs under, from its environment."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    pairs = (entry.decode(errors="replace").partition("=") for entry in raw if b"=" in entry)
    return {key: value for key, _, value in pairs if key.startswith(("OMP_", "GOMP_", "KMP_"))}


def worker_pid(service: RunningService, role: str) -> int:
    return next(worker["pid"] for worker in service.status()["workers"] if worker["role"] == role)


def pin(pid: int, core: int) -> None:
    """Every thread of `pid` onto `core` (threads it starts later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), {core})


def pin_sides(service: RunningService, direct_pid: int) -> None:
    """The service and this script on core 0; workers and the anchor on core 1."""
    import psutil

    os.sched_setaffinity(0, {0})
    pin(service.process.pid, 0)
    for child in psutil.Process(service.process.pid).children(recursive=True):
        pin(child.pid, 1)
    pin(direct_pid, 1)


def report_tiny(urls: dict[str, str], rounds: int) -> None:
    runs = measure(urls, rounds, lambda url: tiny(url, 30))
    small = {k: statistics.median(v) for k, v in runs.items()}
    added = sorted((s - d) * 1000 for s, d in zip(runs["service"], runs["direct"]))
    print(f"== a tiny request (max_tokens=1) p50: "
          f"{', '.join(f'{side} {small[side] * 1000:.1f} ms' for side in urls)}; "
          f"the service adds {(small['service'] - small['direct']) * 1000:+.1f} ms "
          f"(rounds {added[0]:+.1f} to {added[-1]:+.1f} ms) ==")


def load_average() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


async def burst(url: str, requests: int) -> tuple[int, int, float]:
    """(answered, shed, seconds to the last answer) of `requests` sent at once."""
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=requests)) as client:
        started = time.perf_counter()
        responses = await asyncio.gather(*(client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": f"Count to {i}."}], "max_tokens": 8, "temperature": 0})
            for i in range(requests)))
        elapsed = time.perf_counter() - started
    answered = sum(r.status_code == 200 for r in responses)
    return answered, sum(r.status_code == 503 for r in responses), elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--pin", action="store_true",
                        help="service on core 0, workers and the direct llama-server on core 1 (one thread)")
    args = parser.parse_args()
    if args.pin:
        if len(os.sched_getaffinity(0)) < 2:
            raise SystemExit("--pin needs two cores")
        args.threads = 1

    with tempfile.TemporaryDirectory(prefix="engine_bench_") as tmp:
        service = RunningService(Path(tmp) / "service", service_config(args.threads))
        direct = None
        try:
            status = service.wait_ready()
            engine = status["engine"]
            if engine["runtime"] != "llama-server":
                print(f"the service runs {engine['runtime']}: {engine['fallback_reason']}")
                return 1
            same_openmp = openmp_environment(worker_pid(service, "gpu"))
            direct = anchors.llama_server(Path(tmp) / "direct.log", n_ctx=N_CTX, parallel=SLOTS,
                                          threads=args.threads, env=same_openmp)
            if args.pin:
                pin_sides(service, direct.process.pid)
            urls = {"direct": direct.url, "service": service.url}
            print(f"engine: {engine['version']}; {SLOTS} slots x n_ctx {N_CTX}, {args.threads} threads, "
                  f"{args.rounds} rounds, alternating{', pinned' if args.pin else ''}; OpenMP on both sides: "
                  f"{same_openmp or 'llama.cpp default'}; load average {load_average()}")
            for url in urls.values():  # warm both
                asyncio.run(concurrent(url, SLOTS, 8))

            report_streams(urls, args.rounds, args.max_tokens)
            report_tiny(urls, args.rounds)

            print(f"== burst of {BURST} requests, max_tokens 8, sent at once ==")
            took = {}
            for side in urls:
                answered, shed, took[side] = asyncio.run(burst(urls[side], BURST))
                print(f"  {side:8} answered {answered}/{BURST}, shed {shed}, last answer after {took[side]:.2f} s")
            print(f"  service/direct: time to the last answer x{took['service'] / took['direct']:.3f}")

            status = service.status()
            print("== RSS per worker (after the runs above) ==")
            for worker in status["workers"]:
                print(f"  service {worker['role']} worker (llama-server, {status['engine']['slots'][worker['role']]} "
                      f"slot(s) x n_ctx {N_CTX}): {worker['rss_mib']:.0f} MiB")
            print(f"  llama-server direct ({SLOTS} slots x n_ctx {N_CTX}): {direct.rss_mib():.0f} MiB")
            direct.stop()
            direct = None
            lcp = anchors.llama_cpp_python(Path(tmp) / "lcp.log", n_ctx=N_CTX, threads=args.threads)
            try:
                asyncio.run(tiny(lcp.url, 3))
                print(f"  llama-cpp-python's server (1 request at a time, n_ctx {N_CTX}): {lcp.rss_mib():.0f} MiB")
            finally:
                lcp.stop()
        finally:
            service.stop()
            if direct is not None:
                direct.stop()
        cpu_only(Path(tmp), args)
    print(f"load average at the end: {load_average()}")
    return 0


def cpu_only(tmp: Path, args: argparse.Namespace) -> None:
    """The service with no GPU path against llama-server directly."""
    service = RunningService(tmp / "cpu-only", cpu_only_config(args.threads))
    direct = None
    try:
        service.wait_ready(roles=("cpu",))
        same_openmp = openmp_environment(worker_pid(service, "cpu"))
        direct = anchors.llama_server(tmp / "direct-cpu.log", n_ctx=N_CTX, parallel=SLOTS, threads=args.threads,
                                      env=same_openmp)
        if args.pin:
            pin_sides(service, direct.process.pid)
        urls = {"direct": direct.url, "service": service.url}
        for url in urls.values():  # warm both
            asyncio.run(concurrent(url, SLOTS, 8))
        print(f"== CPU only: the service's CPU worker ({SLOTS} slots, no GPU path) against llama-server; "
              f"OpenMP on both sides: {same_openmp or 'llama.cpp default'}; load average {load_average()} ==")
        report_streams(urls, args.rounds, args.max_tokens)
        report_tiny(urls, args.rounds)
    finally:
        service.stop()
        if direct is not None:
            direct.stop()


if __name__ == "__main__":
    sys.exit(main())
