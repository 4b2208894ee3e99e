"""Benchmark of the core service. Prints numbers; asserts nothing.

    .venv/bin/python benchmarks/service_bench.py [--rounds 5] [--max-tokens 64] [--idle-s 10]

1. Model load to ready, per worker (the supervisor's own measurement).
2. Time to first token and tokens per second for the same prompts, sent
   straight to a llama-server started on its own with the CPU worker's
   settings (the anchor: the workers themselves only answer the
   router) and through the router (X-Force-Path: cpu), interleaved in one
   run, with the router/direct ratio.
3. The service process's own RSS (workers excluded) and its CPU use while idle.
4. Failover latency: kill -9 the GPU worker while a streaming request is in
   prompt evaluation, and time from the kill to the first byte the client gets
   (served by the CPU), against the CPU worker's own time to first token for
   the same prompt. Then the same with SIGSTOP (a frozen worker), where the
   time is mostly detection: the liveness check, not a deadline, finds it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import anchors  # noqa: E402
from benchmarks.configs import service_config  # noqa: E402
from tests.harness import RunningService  # noqa: E402

CONFIG = service_config(simulate_mib=4096, n_ctx=2048)
PROMPTS = [
    "Write a short poem about autumn leaves.",
    "Explain what a hash table is.",
    "Give three tips for growing tomatoes.",
    "Describe the water cycle.",
    "What makes a good cup of tea?",
]
LONG_PROMPT = "word " * 400 + "\nSay ok."


def stream_timing(client: httpx.Client, url: str, prompt: str, max_tokens: int, headers: dict | None = None):
    """(time to first token, tokens per second after it, tokens, headers) of one streamed chat."""
    started = time.perf_counter()
    first = None
    tokens = 0
    with client.stream("POST", url, json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0, "stream": True,
    }, headers=headers or {}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:") or "[DONE]" in line:
                continue
            # The server sends its first event once the first token exists.
            if first is None:
                first = time.perf_counter()
            if '"content"' in line:
                tokens += 1
        end = time.perf_counter()
        rate = (tokens - 1) / (end - first) if tokens > 1 and first is not None else 0.0
        return (first or end) - started, rate, tokens, response.headers


def median(values):
    return statistics.median(values) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--idle-s", type=float, default=10.0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="service_bench_") as tmp:
        service = RunningService(Path(tmp), CONFIG)
        anchor = None
        try:
            status = service.wait_ready()
            print("== model load to ready ==")
            for worker in status["workers"]:
                print(f"  {worker['role']} worker: {worker['last_load_s']:.2f} s")

            anchor = start_anchor(Path(tmp))
            direct = httpx.Client(base_url=anchor.url, timeout=120)
            routed = httpx.Client(base_url=service.url, timeout=120)
            rows = {"direct": [], "router": []}
            # Warm both paths so the first measurement isn't a cold cache.
            stream_timing(direct, "/v1/chat/completions", "hi", 4)
            stream_timing(routed, "/v1/chat/completions", "hi", 4, {"X-Force-Path": "cpu"})
            def flush() -> None:
                # llama.cpp reuses the previous prompt's KV prefix; without this
                # the second send of a prompt would look faster than the first.
                stream_timing(direct, "/v1/chat/completions", "Name a colour.", 2)

            for round_index in range(args.rounds):
                prompt = PROMPTS[round_index % len(PROMPTS)]
                order = ["direct", "router"] if round_index % 2 == 0 else ["router", "direct"]
                for path in order:
                    flush()
                    if path == "direct":
                        rows[path].append(stream_timing(direct, "/v1/chat/completions", prompt, args.max_tokens))
                    else:
                        rows[path].append(stream_timing(routed, "/v1/chat/completions", prompt, args.max_tokens,
                                                        {"X-Force-Path": "cpu"}))
            print(f"== CPU worker, {args.rounds} prompts x {args.max_tokens} tokens, medians ==")
            ttft = {k: median([r[0] for r in v]) for k, v in rows.items()}
            tps = {k: median([r[1] for r in v]) for k, v in rows.items()}
            print(f"  {'':8} {'TTFT ms':>9} {'tokens/s':>9}")
            for key in ("direct", "router"):
                print(f"  {key:8} {ttft[key] * 1000:9.1f} {tps[key]:9.1f}")
            print(f"  router/direct: TTFT x{ttft['router'] / ttft['direct']:.3f}, "
                  f"tokens/s x{tps['router'] / tps['direct']:.3f}")

            own = psutil.Process(service.process.pid)
            own.cpu_percent(None)
            time.sleep(args.idle_s)
            idle_cpu = own.cpu_percent(None)
            print("== the service process itself (workers excluded) ==")
            print(f"  RSS {own.memory_info().rss / 2**20:.1f} MiB, idle CPU {idle_cpu:.2f} % "
                  f"over {args.idle_s:g} s (1 core = 100 %)")

            cpu_ttft = []
            for _ in range(3):
                stream_timing(direct, "/v1/chat/completions", "Name a colour.", 2)
                cpu_ttft.append(stream_timing(direct, "/v1/chat/completions", LONG_PROMPT, 4)[0])
            for sig, what in ((signal.SIGKILL, "kill -9 of"), (signal.SIGSTOP, "SIGSTOP (freeze) of")):
                print(f"== failover latency ({what} the GPU worker before its first token) ==")
                results = [r for r in (failover_once(service, direct, routed, sig, f"failover-{sig.name}-{n}")
                                       for n in range(3)) if r is not None]
                print(f"  CPU's own TTFT for the prompt (direct): {median(cpu_ttft) * 1000:.0f} ms")
                if results:
                    print(f"  fault -> first CPU byte at the client: median {median(results) * 1000:.0f} ms "
                          f"over {len(results)} runs; detection and overhead "
                          f"{(median(results) - median(cpu_ttft)) * 1000:+.0f} ms")
        finally:
            service.stop()
            if anchor is not None:
                anchor.stop()
    return 0


def start_anchor(tmp: Path) -> anchors.Anchor:
    """llama-server on its own, with the CPU worker's settings (2 slots x n_ctx 2048)."""
    return anchors.llama_server(tmp / "anchor.log", n_ctx=2048, parallel=2)


def failover_once(service, direct: httpx.Client, routed: httpx.Client, sig: signal.Signals,
                  request_id: str) -> float | None:
    """Seconds from the fault to the first byte the client gets, or None if
    the GPU answered before the fault landed."""
    service.reset()
    # The replay must evaluate the whole prompt, as the anchor did: flush the
    # service's CPU worker's prefix cache (it may hold this prompt from the last run).
    stream_timing(routed, "/v1/chat/completions", "Name a colour.", 2, {"X-Force-Path": "cpu"})
    gpu_pid = service.worker("gpu")["pid"]
    faulted_at = []

    def fault_when_running() -> None:
        service.wait_for(lambda s: any(r["id"] == request_id and r["state"] == "running"
                                       and r["path"] == "gpu" for r in s["requests"]),
                         interval=0.005, what="running on gpu")
        faulted_at.append(time.perf_counter())
        os.kill(gpu_pid, sig)

    faulter = threading.Thread(target=fault_when_running)
    faulter.start()
    started = time.perf_counter()
    first_byte, _, _, headers = stream_timing(routed, "/v1/chat/completions", LONG_PROMPT, 4,
                                              {"X-Request-Id": request_id})
    faulter.join()
    if sig is signal.SIGSTOP:
        with contextlib.suppress(ProcessLookupError):
            os.kill(gpu_pid, signal.SIGCONT)
    if headers.get("x-route-reason") != "gpu_failed_replayed":
        print(f"  {request_id}: GPU answered before the fault; not counted")
        return None
    return started + first_byte - faulted_at[0]


if __name__ == "__main__":
    sys.exit(main())
