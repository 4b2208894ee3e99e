"""Peers on loopback, each number against its anchor in one run.

    .venv/bin/python benchmarks/peer_bench.py [--rounds 5] [--tokens 64] [--kills 3]

Two instances of the service, as tests/integration/test_peers.py starts
them: "a" with its GPU paused and [[peers]] naming "b". Printed:

1. The hop: a short chat sent to "a" and served by peer "b", against the
   same chat sent to "b" directly (the anchor): what the extra server in
   the path costs (medians).
2. Failover: "b" is SIGKILLed while it serves a request of "a" (before any
   byte reached the client: the request is not streamed), and the request
   is answered once by "a"'s CPU. The time from the kill to the answer,
   against the same request served by "a"'s CPU from the start (the
   anchor): the difference is what a dead peer costs a request.
   "b" is restarted on the same port for each kill.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import BASE_CONFIG, RunningService  # noqa: E402
from tray_app.core.engine.worker import free_loopback_port  # noqa: E402

KEY = "bench-peer-key"


def chat(service: RunningService, tokens: int, request_id: str | None = None, **headers: str):
    headers = {**headers, **({"X-Request-Id": request_id} if request_id else {})}
    started = time.perf_counter()
    response = service.http.post("/v1/chat/completions", headers=headers, timeout=300, json={
        "messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
        "max_tokens": tokens, "temperature": 0, "logit_bias": {"2": -100}})
    response.raise_for_status()
    return time.perf_counter() - started, response


def start_peer(tmp: Path, port: int) -> RunningService:
    peer = RunningService(tmp, BASE_CONFIG + f'[server]\napi_key = "{KEY}"\n', port=port)
    peer.http.headers["Authorization"] = f"Bearer {KEY}"
    peer.wait_ready()
    return peer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--kills", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="peer-bench-"))
    peer_port = free_loopback_port()
    peer = start_peer(tmp / "b0", peer_port)
    local = RunningService(tmp / "a", BASE_CONFIG + f'[[peers]]\nname = "b"\nurl = "{peer.url}"\napi_key = "{KEY}"\n')
    try:
        local.wait_ready()
        local.wait_for(lambda s: s["peers"][0]["healthy"], timeout=30, what="the peer healthy")
        local.http.post("/admin/gpu", json={"paused": True})
        via, direct = [], []
        for _ in range(args.rounds):  # interleaved, so both see the same machine
            took, response = chat(local, args.tokens)
            assert response.headers["x-served-by"] == "peer", response.headers
            via.append(took)
            direct.append(chat(peer, args.tokens)[0])
        hop, anchor = statistics.median(via), statistics.median(direct)
        print(f"hop: {args.tokens} tokens through peer b {hop:.3f} s, b directly {anchor:.3f} s "
              f"(x{hop / anchor:.3f}, +{(hop - anchor) * 1000:.0f} ms)")

        failovers, cpu_alone = [], []
        for kill in range(args.kills):
            if kill:
                peer = start_peer(tmp / f"b{kill}", peer_port)
                local.wait_for(lambda s: s["peers"][0]["healthy"], timeout=30, what="the peer healthy again")
            request_id = f"bench-kill-{kill}"
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                future = pool.submit(chat, local, args.tokens, request_id)
                peer.wait_for(lambda s: any(r["id"] == request_id and r["state"] == "running" for r in s["requests"]),
                              interval=0.01, what="running on the peer")
                killed = time.perf_counter()
                peer.process.send_signal(signal.SIGKILL)
                _, response = future.result()
                failovers.append(time.perf_counter() - killed)
            peer.stop()
            assert response.headers["x-route-reason"] == "peer_failed_replayed", response.headers
            cpu_alone.append(chat(local, args.tokens, **{"X-Force-Path": "cpu"})[0])
        status = local.status()
        assert status["accounting"]["duplicate_executions"] == 0
        failover, alone = statistics.median(failovers), statistics.median(cpu_alone)
        print(f"failover: kill -> answer from the local CPU {failover:.3f} s (runs: "
              f"{', '.join(f'{x:.3f}' for x in failovers)}); the same request on the CPU alone {alone:.3f} s; "
              f"a dead peer costs +{(failover - alone) * 1000:.0f} ms (x{failover / alone:.2f})")
        print(f"duplicate executions: {status['accounting']['duplicate_executions']}")
    finally:
        local.stop()
        peer.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
