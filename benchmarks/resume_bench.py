"""Benchmark of continuing a cut answer. Prints numbers; asserts nothing.

    .venv/bin/python benchmarks/resume_bench.py [--rounds 3] [--tokens 200] [--cut 100]

On the simulated device, with real workers: a whole (non-streamed) answer
of --tokens tokens, temperature 0, whose GPU worker is SIGKILLed once it has
made --cut tokens. The CPU continues it from those tokens. The anchor, in
the same run: the same request on the CPU from nothing (X-Force-Path: cpu),
which is what the replay did before answers were continued. Reported:
- after the fault: the time from the kill to the whole answer, continued,
  against the anchor's whole time (what a replay from nothing costs after
  the fault), as a ratio, and the seconds saved;
- the seam: the fault to the continuation's first new token (/status
  failover.resume_last_s);
- for a stream cut after --cut events: the seam, next to the CPU's own time
  to first token for a prompt of the same length (the request's message
  with the text sent after it, on the CPU from nothing, streamed);
- whether the continued text is the CPU's own answer from the start.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import BASE_CONFIG, RunningService, running  # noqa: E402

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]


def ask(service: RunningService, tokens: int, headers: dict | None = None):
    return service.http.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": tokens,
                                                           "temperature": 0}, headers=headers or {}, timeout=600)


def gpu_tokens(service: RunningService, request_id: str) -> int:
    for request in service.status()["requests"]:
        if request["id"] == request_id and request["path"] == "gpu" and request["attempts"]:
            return request["attempts"][-1]["tokens"]
    return 0


def one_round(service: RunningService, n: int, tokens: int, cut: int) -> dict[str, float | bool | int]:
    started = time.perf_counter()
    anchor = ask(service, tokens, {"X-Force-Path": "cpu"})
    anchor_s = time.perf_counter() - started
    service.wait_workers_ready()
    request_id = f"resume-bench-{n}"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(ask, service, tokens, {"X-Request-Id": request_id})
        while gpu_tokens(service, request_id) < cut:
            time.sleep(0.02)
        made = gpu_tokens(service, request_id)
        os.kill(service.worker("gpu")["pid"], signal.SIGKILL)
        killed_at = time.perf_counter()
        answer = future.result()
    after_fault_s = time.perf_counter() - killed_at
    body = answer.json()
    status = service.status()
    return {"anchor_s": anchor_s, "after_fault_s": after_fault_s, "cut_at": made,
            "seam_s": status["failover"]["resume_last_s"] or float("nan"),
            "resumed": "resumed" in body,
            "same_text": body["choices"][0]["message"]["content"] == anchor.json()["choices"][0]["message"]["content"]}


def streamed_round(service: RunningService, cut: int, tokens: int) -> dict[str, float]:
    gpu_pid = service.worker("gpu")["pid"]
    sent: list[str] = []
    events = 0
    body = {"messages": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True}
    with service.http.stream("POST", "/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            events += 1
            if events <= cut:
                for choice in json.loads(line[5:]).get("choices") or ():
                    sent.append((choice.get("delta") or {}).get("content") or "")
            if events == cut:
                os.kill(gpu_pid, signal.SIGKILL)
    seam_s = service.status()["failover"]["resume_last_s"] or float("nan")
    service.wait_workers_ready()
    # The same text as one user message: llama-server would echo an assistant prefill at once.
    same_length = {"messages": [{"role": "user", "content": PROMPT[0]["content"] + "\n" + "".join(sent)}],
                   "max_tokens": 1, "temperature": 0, "stream": True, "cache_prompt": False}
    started = time.perf_counter()
    first = float("nan")
    with service.http.stream("POST", "/v1/chat/completions", json=same_length, headers={"X-Force-Path": "cpu"},
                             timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and '"content"' in line:
                first = time.perf_counter() - started
                break
    return {"seam_s": seam_s, "cpu_ttft_s": first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--cut", type=int, default=100)
    args = parser.parse_args()
    config = BASE_CONFIG.replace("n_ctx = 1024", "n_ctx = 2048")
    with tempfile.TemporaryDirectory() as tmp, running(Path(tmp), config) as service:
        rounds = []
        for n in range(args.rounds):
            rounds.append(one_round(service, n, args.tokens, args.cut))
            service.wait_workers_ready()
        streamed = []
        for _ in range(args.rounds):
            streamed.append(streamed_round(service, args.cut, args.tokens))
            service.wait_workers_ready()
    print(f"continuing a whole answer of {args.tokens} tokens cut after ~{args.cut} on the GPU, "
          f"{args.rounds} rounds\n")
    print(f"{'round':>5} {'cut at':>6} {'anchor s':>9} {'after fault s':>14} {'ratio':>6} {'saved s':>8} "
          f"{'seam s':>7} {'resumed':>8} {'same text':>9}")
    for n, r in enumerate(rounds):
        print(f"{n:>5} {r['cut_at']:>6} {r['anchor_s']:>9.2f} {r['after_fault_s']:>14.2f} "
              f"{r['after_fault_s'] / r['anchor_s']:>6.2f} {r['anchor_s'] - r['after_fault_s']:>8.2f} "
              f"{r['seam_s']:>7.3f} {str(r['resumed']):>8} {str(r['same_text']):>9}")
    ratios = [r["after_fault_s"] / r["anchor_s"] for r in rounds]
    print(f"\nmedian after-fault time / replay from nothing: x{statistics.median(ratios):.2f} "
          f"(range x{min(ratios):.2f}-x{max(ratios):.2f})")
    print(f"\na stream cut after {args.cut} events: the seam (kill to first continued token) against the CPU's own "
          "time to first token for a prompt of the same length")
    print(f"{'round':>5} {'seam s':>7} {'CPU TTFT s':>11}")
    for n, r in enumerate(streamed):
        print(f"{n:>5} {r['seam_s']:>7.3f} {r['cpu_ttft_s']:>11.3f}")


if __name__ == "__main__":
    main()
