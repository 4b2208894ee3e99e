"""How close the latency estimate (X-Estimated-Latency) comes to the actual
time, on both paths. Prints numbers; asserts nothing.

    .venv/bin/python benchmarks/estimate_bench.py [--rounds 2] [--warm 1] [--stream]

The real service on the tiny model, with its simulated GPU (4 slots) and a
CPU worker with 2 slots. Each mix is sent at once, every request writing
all of its max_tokens (ignore_eos), so its actual time is what the
estimate promises:

- cpu: 8 requests forced onto the CPU (X-Force-Path: cpu), 100 tokens each
  (the case issue 32 measured at 0.38-0.68 of the actual time);
- cpu-mixed: 8 CPU requests of 40 to 160 tokens, short and long prompts;
- gpu-mixed: 12 requests on the simulated GPU's 4 slots, 40 to 160 tokens
  (those the CPU is expected to finish first go there: about half);
- gpu-queue: the same 12 with X-Fallback: never, so all of them wait in
  the GPU's queue (8 deep) and the GPU's estimate is measured over it.

Warm-up rounds (not counted) let each path measure its speed per number of
busy slots. A request's ratio is estimate / actual (1.0 = exact; the target
is 0.75-1.25); actual runs from the client's send to its last byte.
Admission's own estimate (what decided the route, from /status's
recent_decisions) is printed beside it. The answer's estimate is the one
its headers carry, made again at its first event (by then the requests
that came after admission are known): without --stream the answers are whole, and their header comes at
the end; with it they are streamed, and it goes out with the first event. Each
row also has its round, its wait for a slot (X-Queue-Wait), why it went
where it did (X-Route-Reason: gpu-mixed requests the CPU is expected to
finish first go there) and the 1-minute load average when its mix was
sent: the machine's cores are shared, and a round that ran while others
loaded them is slower than the speeds the estimate learned before it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.configs import service_config  # noqa: E402
from tests.harness import RunningService  # noqa: E402

CONFIG = service_config(simulate_mib=8192, n_ctx=4096, patient=True, stays_loaded=True,
                        gpu={"max_concurrency": 4, "queue_limit": 64}, cpu={"max_concurrency": 2, "queue_limit": 64})
SHORT_PROMPT = "Write a story about a lighthouse keeper."
LONG_PROMPT = "Summarise this: " + "the tide came in and the lamp was lit again. " * 30


@dataclass(frozen=True)
class Sent:
    max_tokens: int
    prompt: str
    force_cpu: bool
    gpu_only: bool = False


@dataclass(frozen=True)
class Measured:
    mix: str
    index: int
    sent: Sent
    served_by: str
    estimate_s: float | None
    actual_s: float
    queue_wait_s: float
    route_reason: str
    round: int = 0
    load_average: float = 0.0
    request_id: str = ""
    # Admission's own estimate (/status recent_decisions), which decided where it went.
    admission_s: float | None = None

    @property
    def ratio(self) -> float | None:
        return self.estimate_s / self.actual_s if self.estimate_s is not None else None

    @property
    def admission_ratio(self) -> float | None:
        return self.admission_s / self.actual_s if self.admission_s is not None else None


GPU_MIXED = [Sent(tokens, LONG_PROMPT if i % 4 == 0 else SHORT_PROMPT, False)
             for i, tokens in enumerate((40, 160, 100, 60, 120, 80, 160, 40, 100, 140, 60, 120))]
MIXES: dict[str, list[Sent]] = {
    "cpu": [Sent(100, SHORT_PROMPT, True)] * 8,
    "cpu-mixed": [Sent(tokens, LONG_PROMPT if i % 3 == 0 else SHORT_PROMPT, True)
                  for i, tokens in enumerate((40, 160, 100, 60, 120, 80, 160, 40))],
    "gpu-mixed": GPU_MIXED,
    "gpu-queue": [dataclasses.replace(sent, gpu_only=True) for sent in GPU_MIXED],
}


async def one(client: httpx.AsyncClient, mix: str, index: int, sent: Sent, stream: bool,
              request_id: str) -> Measured:
    """One request; streamed, its headers (and so its estimate) come with its first event."""
    headers = {"X-Force-Path": "cpu"} if sent.force_cpu else {"X-Fallback": "never"} if sent.gpu_only else {}
    headers["X-Request-Id"] = request_id
    body = {"messages": [{"role": "user", "content": sent.prompt}], "max_tokens": sent.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    started = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", headers=headers, json=body) as response:
        response.raise_for_status()
        async for _ in response.aiter_bytes():
            pass
    actual = time.perf_counter() - started
    estimate = response.headers.get("x-estimated-latency")
    return Measured(mix, index, sent, response.headers.get("x-served-by", "?"),
                    float(estimate) if estimate not in (None, "unknown") else None, actual,
                    float(response.headers.get("x-queue-wait", 0.0)), response.headers.get("x-route-reason", "?"),
                    request_id=request_id)


def load_average() -> float:
    """The machine's 1-minute load average (0 where /proc has none)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0


async def send_mix(url: str, mix: str, round_number: int = 0, stream: bool = False) -> list[Measured]:
    sent = MIXES[mix]
    load = load_average()
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=len(sent))) as client:
        # One at a time into the service, a millisecond apart, so the order
        # of arrival (and so each one's place in the queue) is the list's.
        tasks = []
        for index, request in enumerate(sent):
            request_id = f"bench-{round_number}-{mix}-{index}-{time.monotonic_ns()}"
            tasks.append(asyncio.create_task(one(client, mix, index, request, stream, request_id)))
            await asyncio.sleep(0.001)
        rows = await asyncio.gather(*tasks)
        # Admission's estimates: the first decision of each (a replay decides again).
        decisions = (await client.get("/status")).json()["recent_decisions"]
        admitted: dict[str, float | None] = {}
        for decision in decisions:
            admitted.setdefault(decision["id"], decision.get("estimated_latency_s"))
        return [dataclasses.replace(row, round=round_number, load_average=load,
                                    admission_s=admitted.get(row.request_id)) for row in rows]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summary(rows: list[Measured], admission: bool = False) -> str:
    ratios = [ratio for r in rows if (ratio := r.admission_ratio if admission else r.ratio) is not None]
    if not ratios:
        return "no estimates"
    # The worst decile: the tenth of the requests whose estimate is furthest off.
    off = sorted(ratios, key=lambda ratio: max(ratio, 1 / ratio) if ratio > 0 else float("inf"))
    worst = off[-max(1, len(off) // 10):]
    within = sum(0.75 <= ratio <= 1.25 for ratio in ratios)
    return (f"median {statistics.median(ratios):.2f}, p10 {quantile(ratios, 0.1):.2f}, "
            f"p90 {quantile(ratios, 0.9):.2f}, worst decile {min(worst):.2f}..{max(worst):.2f}; "
            f"{within}/{len(ratios)} within 0.75-1.25")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warm", type=int, default=1, help="warm-up rounds of every mix, not counted")
    parser.add_argument("--mix", action="append", choices=sorted(MIXES), help="only these mixes (repeatable)")
    parser.add_argument("--stream", action="store_true",
                        help="streamed requests: the estimate a streaming client gets, re-estimated when its "
                             "first event (and so its headers) goes out")
    args = parser.parse_args()
    mixes = args.mix or list(MIXES)

    with tempfile.TemporaryDirectory(prefix="estimate_bench_") as tmp:
        service = RunningService(Path(tmp), CONFIG)
        try:
            service.wait_ready()
            for _ in range(args.warm):
                for mix in mixes:
                    asyncio.run(send_mix(service.url, mix, stream=args.stream))
            rows: list[Measured] = []
            for round_number in range(args.rounds):
                for mix in mixes:
                    rows.extend(asyncio.run(send_mix(service.url, mix, round_number, args.stream)))
            print(f"{'round':5} {'load':>4} {'mix':10} {'#':>2} {'path':4} {'max_tok':>7} {'prompt':6} "
                  f"{'admitted s':>10} {'estimate s':>10} {'actual s':>8} {'ratio':>6} {'wait s':>6} reason")
            for row in rows:
                estimate = f"{row.estimate_s:10.2f}" if row.estimate_s is not None else f"{'-':>10}"
                admitted = f"{row.admission_s:10.2f}" if row.admission_s is not None else f"{'-':>10}"
                ratio = f"{row.ratio:6.2f}" if row.ratio is not None else f"{'-':>6}"
                print(f"{row.round:5} {row.load_average:4.1f} {row.mix:10} {row.index:2} {row.served_by:4} "
                      f"{row.sent.max_tokens:7} {'long' if row.sent.prompt is LONG_PROMPT else 'short':6} "
                      f"{admitted} {estimate} {row.actual_s:8.2f} {ratio} {row.queue_wait_s:6.2f} {row.route_reason}")
            print("== estimate / actual (the answer's X-Estimated-Latency) ==")
            for mix in mixes:
                print(f"  {mix:10} {summary([r for r in rows if r.mix == mix])}")
            print("== admission's estimate / actual (what decided the route) ==")
            for path in ("cpu", "gpu"):
                print(f"  {path + ' path':10} {summary([r for r in rows if r.served_by == path], admission=True)}")
            print("== estimate / actual per path and round ==")
            for path in ("cpu", "gpu"):
                print(f"  {path + ' path':10} {summary([r for r in rows if r.served_by == path])}")
                for round_number in range(args.rounds):
                    in_round = [r for r in rows if r.served_by == path and r.round == round_number]
                    loads = sorted({r.load_average for r in in_round})
                    load_text = f"{loads[0]:.1f}-{loads[-1]:.1f}" if loads else "-"
                    print(f"    round {round_number} (load {load_text}): {summary(in_round)}")
            speeds = service.status().get("speeds", {})
            print(f"speeds: {speeds}")
        finally:
            service.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
