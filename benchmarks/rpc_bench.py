"""The model split over llama.cpp's RPC backend on loopback, against the same
llama-server with the model local (the anchor), in one run.

    .venv/bin/python benchmarks/rpc_bench.py [--rounds 5] [--tokens 128]

Both are the bundled llama-server on the bundled model; the RPC one puts
every layer on `tray-app rpc-worker`'s device (this machine's CPU, over TCP
on 127.0.0.1). Loopback has no network latency, so this measures the
protocol's own cost; a LAN adds a round trip per graph split and token.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tray_app.core.config import bundled_model_path  # noqa: E402
from tray_app.core.engine.runtime import bundled_llama_server, library_dirs  # noqa: E402
from tray_app.core.engine.worker import free_loopback_port  # noqa: E402


def wait_ok(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


def tokens_per_s(port: int, rounds: int, tokens: int) -> float:
    rates = []
    for _ in range(rounds):
        started = time.perf_counter()
        body = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
            "max_tokens": tokens, "temperature": 0, "logit_bias": {"2": -100}}).json()
        rates.append(body["usage"]["completion_tokens"] / (time.perf_counter() - started))
    return statistics.median(rates)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    server = bundled_llama_server()
    if server is None:
        raise SystemExit("llama-server is not installed; run packaging/install.sh")
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(str(d) for d in library_dirs(server))}
    rpc_port = free_loopback_port()
    rpc = subprocess.Popen([sys.executable, "-m", "tray_app", "rpc-worker", "--port", str(rpc_port),
                            "--threads", str(args.threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = {}
    try:
        time.sleep(1.0)
        for name, extra in (("local", []), ("rpc", ["--rpc", f"127.0.0.1:{rpc_port}"])):
            port = free_loopback_port()
            process = subprocess.Popen([str(server), "-m", str(bundled_model_path()), "--port", str(port), "-c", "1024",
                                        "-ngl", "99", "-t", str(args.threads), *extra],
                                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_ok(f"http://127.0.0.1:{port}/health")
                tokens_per_s(port, 1, 8)  # warm
                results[name] = tokens_per_s(port, args.rounds, args.tokens)
            finally:
                process.terminate()
                process.wait(15)
    finally:
        rpc.terminate()
        rpc.wait(15)
    print(f"{args.tokens} tokens, median of {args.rounds}, {args.threads} threads, bundled model")
    print(f"  local (anchor)        {results['local']:7.1f} tok/s")
    print(f"  over RPC on loopback  {results['rpc']:7.1f} tok/s  (x{results['rpc'] / results['local']:.2f} the anchor)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
