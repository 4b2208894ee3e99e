"""Soak: N concurrent clients for a while, with faults, and a strict account.

    .venv/bin/python benchmarks/soak.py [--clients 8] [--seconds 600] [--url URL]

Without --url it starts its own service on a simulated GPU. Meanwhile a chaos
loop injects faults in turn: it kills the GPU worker (SIGKILL or SIGABRT),
moves simulated VRAM pressure, and cancels a request in flight. Each tick
injects the kind that has landed least so far, every ~5.5 s (sooner in a
short soak, so that each kind lands at least MIN_FAULTS_EACH times).

A soak is long enough when its sample is: past --seconds, the clients go on
until each fault kind has landed MIN_FAULTS_EACH times and MIN_COMPLETED
requests have completed (a loaded machine needs longer for the same sample),
at most max(60 s, --seconds) more.

Every request ends in exactly one bucket:
  completed       a full answer (finish_reason, or [DONE] on a stream)
  clear_error     an error in the OpenAI envelope (HTTP error or a stream error event)
  rejected        refused at admission (503 capacity with Retry-After, 4xx): never accepted
  lost            accepted but no answer and no clear error (a hang, a cut
                  connection, a stream that just stops): must be 0
Duplicated: a request id that the service says completed more than once
(its execution ledger), or that answered twice here: must be 0.
Exit status 1 if anything was lost or duplicated.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.configs import service_config  # noqa: E402

PROMPTS = [
    "Say hello.", "Name three fruits.", "What is 2 + 2?", "Write a haiku about rain.",
    "Explain gravity in one sentence.", "Write a long story about a lighthouse keeper.",
]
FAULT_KINDS = ("gpu_killed", "pressure_changed", "canceled")
# Each fault kind lands at least this often in a soak with chaos: once could be
# luck; three show the service recovers again and again.
MIN_FAULTS_EACH = 3
# The long soak's cadence: a fault every 3 to 8 s.
CHAOS_INTERVAL_S = 5.5
# Fewer answers than this say little about what was lost or run twice.
MIN_COMPLETED = 21
ADMISSION_CODES = {"cpu_queue_full", "ram_floor", "deadline_too_short", "cpu_context_cap", "no_worker",
                   "context_length_exceeded"}


@dataclass
class SoakReport:
    seconds: float
    clients: int
    outcomes: Counter = field(default_factory=Counter)
    error_codes: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    lost_examples: list[str] = field(default_factory=list)
    duplicated_here: int = 0
    duplicated_service: int = 0
    faults: Counter = field(default_factory=Counter)
    rss_start_mib: float | None = None
    rss_end_mib: float | None = None

    @property
    def accepted(self) -> int:
        return sum(self.outcomes.values()) - self.outcomes["rejected"]

    @property
    def p95_s(self) -> float:
        if len(self.latencies) < 2:
            return self.latencies[0] if self.latencies else 0.0
        return statistics.quantiles(self.latencies, n=20, method="inclusive")[18]

    @property
    def ok(self) -> bool:
        return self.outcomes["lost"] == 0 and self.duplicated_here == 0 and self.duplicated_service == 0

    def render(self) -> str:
        rss = (f"{self.rss_start_mib:.1f} -> {self.rss_end_mib:.1f} MiB"
               if self.rss_start_mib is not None and self.rss_end_mib is not None else "unknown")
        lines = [
            f"soak: {self.clients} clients for {self.seconds:.0f} s; faults injected: {dict(self.faults)}",
            f"  sent          {sum(self.outcomes.values())}",
            f"  accepted      {self.accepted}",
            f"  completed     {self.outcomes['completed']}",
            f"  clear errors  {self.outcomes['clear_error']}  {dict(self.error_codes)}",
            f"  rejected      {self.outcomes['rejected']} (at admission, never accepted)",
            f"  lost          {self.outcomes['lost']}",
            f"  duplicated    {self.duplicated_here} here, {self.duplicated_service} by the service's ledger",
            f"  p95 latency   {self.p95_s:.2f} s (completed requests)",
            f"  service RSS   {rss}",
        ]
        lines += [f"  lost: {example}" for example in self.lost_examples[:5]]
        return "\n".join(lines)


class Soak:
    def __init__(self, url: str, clients: int, seconds: float, service_pid: int | None,
                 chaos: bool, seed: int = 7) -> None:
        self.url = url
        self.clients = clients
        self.seconds = seconds
        self.service_pid = service_pid
        self.chaos = chaos
        self.random = random.Random(seed)
        self.report = SoakReport(seconds, clients)
        self._lock = threading.Lock()
        self._answers: Counter = Counter()
        self._stop = threading.Event()

    def run(self) -> SoakReport:
        status = httpx.get(f"{self.url}/status", timeout=10).json()
        pid = self.service_pid or status["service"].get("pid")
        process = psutil.Process(pid) if pid else None
        if process:
            self.report.rss_start_mib = process.memory_info().rss / 2**20
        threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(self.clients)]
        if self.chaos:
            threads.append(threading.Thread(target=self._chaos_loop, daemon=True))
        started = time.monotonic()
        for thread in threads:
            thread.start()
        time.sleep(self.seconds)
        # Bounded, for a service that stopped answering: the asserts then say so.
        overtime_until = time.monotonic() + max(60.0, self.seconds)
        while not self._sample_big_enough() and time.monotonic() < overtime_until:
            time.sleep(0.5)
        self._stop.set()
        self.report.seconds = time.monotonic() - started
        for thread in threads:
            thread.join(timeout=180)
        final = httpx.get(f"{self.url}/status", timeout=10).json()
        self.report.duplicated_service = final.get("accounting", {}).get("duplicate_executions", 0)
        self.report.duplicated_here = sum(1 for count in self._answers.values() if count > 1)
        if process:
            self.report.rss_end_mib = process.memory_info().rss / 2**20
        return self.report

    def _sample_big_enough(self) -> bool:
        with self._lock:
            completed = self.report.outcomes["completed"]
        faults_landed = not self.chaos or all(self.report.faults[k] >= MIN_FAULTS_EACH for k in FAULT_KINDS)
        return completed >= MIN_COMPLETED and faults_landed

    def _record(self, outcome: str, latency: float | None = None, code: str | None = None,
                example: str | None = None, request_id: str | None = None) -> None:
        with self._lock:
            self.report.outcomes[outcome] += 1
            if code:
                self.report.error_codes[code] += 1
            if latency is not None and outcome == "completed":
                self.report.latencies.append(latency)
            if example and outcome == "lost":
                self.report.lost_examples.append(example)
            if request_id and outcome == "completed":
                self._answers[request_id] += 1

    def _client(self, index: int) -> None:
        rng = random.Random(index * 7919)
        client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(120.0, connect=10.0))
        number = 0
        while not self._stop.is_set():
            number += 1
            request_id = f"soak-{index}-{number}"
            body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                    "max_tokens": rng.randint(4, 24), "temperature": 0, "stream": rng.random() < 0.5}
            headers = {"X-Request-Id": request_id}
            if rng.random() < 0.15:
                headers["X-Force-Path"] = "cpu"
            started = time.monotonic()
            try:
                if body["stream"]:
                    self._streamed(client, body, headers, request_id, started)
                else:
                    self._plain(client, body, headers, request_id, started)
            except httpx.HTTPError as exc:
                self._record("lost", example=f"{request_id}: {type(exc).__name__}: {exc}")
        client.close()

    def _plain(self, client, body, headers, request_id, started) -> None:
        response = client.post("/v1/chat/completions", json=body, headers=headers)
        latency = time.monotonic() - started
        if response.status_code == 200:
            finish = response.json()["choices"][0].get("finish_reason")
            if finish in ("stop", "length"):
                self._record("completed", latency, request_id=request_id)
            else:
                self._record("lost", example=f"{request_id}: 200 without finish_reason")
            return
        self._classify_error(response.status_code, response.content, request_id, response.headers.get("retry-after"))

    def _streamed(self, client, body, headers, request_id, started) -> None:
        with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                response.read()
                self._classify_error(response.status_code, response.content, request_id, response.headers.get("retry-after"))
                return
            last = None
            for line in response.iter_lines():
                if line.startswith("data:"):
                    last = line[5:].strip()
            latency = time.monotonic() - started
        if last == "[DONE]":
            self._record("completed", latency, request_id=request_id)
            return
        try:
            code = json.loads(last or "{}").get("error", {}).get("code")
        except ValueError:
            code = None
        if code:
            self._record("clear_error", code=code)
        else:
            self._record("lost", example=f"{request_id}: stream ended without [DONE] or an error event")

    def _classify_error(self, status: int, content: bytes, request_id: str, retry_after: str | None = None) -> None:
        try:
            code = json.loads(content)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            self._record("lost", example=f"{request_id}: HTTP {status} not in the envelope: {content[:200]!r}")
            return
        if code in ADMISSION_CODES:
            self._record("rejected", code=code)
            # A well-behaved client waits as told before trying again.
            self._stop.wait(min(5.0, float(retry_after or 1)))
        else:
            self._record("clear_error", code=code)

    def _chaos_interval_s(self) -> float:
        """The mean time between faults: the long soak's 5.5 s, or shorter where
        that would not fit MIN_FAULTS_EACH of every kind (and two spare ticks)
        into the soak."""
        return min(CHAOS_INTERVAL_S, self.seconds / (len(FAULT_KINDS) * MIN_FAULTS_EACH + 2))

    def _chaos_loop(self) -> None:
        client = httpx.Client(base_url=self.url, timeout=10)
        mean_s = self._chaos_interval_s()
        while not self._stop.wait(mean_s * self.random.uniform(0.55, 1.45)):
            # The kind that has landed least goes next; one that could not land
            # (no GPU worker to kill, no request to cancel) is tried again.
            fewest = min(self.report.faults[kind] for kind in FAULT_KINDS)
            kind = self.random.choice([k for k in FAULT_KINDS if self.report.faults[k] == fewest])
            try:
                if self._inject(client, kind, client.get("/status").json()):
                    self.report.faults[kind] += 1
            except (httpx.HTTPError, ProcessLookupError, KeyError):
                continue
        client.post("/admin/gpu", json={"simulated_pressure_mib": 0})
        client.close()

    def _inject(self, client: httpx.Client, kind: str, status: dict) -> bool:
        """One fault of this kind; False when there was nothing to inject it into."""
        if kind == "gpu_killed":
            gpu = next((w for w in status["workers"] if w["role"] == "gpu" and w["pid"]), None)
            if gpu:
                os.kill(gpu["pid"], self.random.choice([signal.SIGKILL, signal.SIGABRT]))
            return gpu is not None
        if kind == "pressure_changed":
            if not status["gpu"].get("simulated"):
                return False
            total = status["gpu"]["total_mib"]
            mib = self.random.choice([0, 0, total * 0.3, total * 0.6, total * 0.95])
            client.post("/admin/gpu", json={"simulated_pressure_mib": mib})
            return True
        if not status["requests"]:
            return False
        victim = self.random.choice(status["requests"])["id"]
        return client.delete(f"/v1/requests/{victim}").status_code == 200


# The soak's pressure tests admission against a worker that stays loaded.
SOAK_CONFIG = service_config(simulate_mib=2048, stays_loaded=True,
                             gpu={"n_ctx": 1024, "queue_limit": 2, "first_token_timeout_s": 20, "token_timeout_s": 10},
                             cpu={"n_ctx": 2048, "queue_limit": 6},
                             breaker={"failure_threshold": 3, "window_s": 30, "cooldown_s": 5},
                             worker={"backoff_base_s": 0.2, "backoff_cap_s": 2})


def run_local_soak(clients: int, seconds: float, workdir: Path) -> SoakReport:
    from tests.harness import RunningService

    service = RunningService(workdir, SOAK_CONFIG)
    try:
        service.wait_ready()
        return Soak(service.url, clients, seconds, service.process.pid, chaos=True).run()
    finally:
        service.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--url", help="soak a running service (no faults injected)")
    args = parser.parse_args()
    if args.url:
        report = Soak(args.url.rstrip("/"), args.clients, args.seconds, None, chaos=False).run()
    else:
        with tempfile.TemporaryDirectory(prefix="soak_") as tmp:
            report = run_local_soak(args.clients, args.seconds, Path(tmp))
    print(report.render())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
