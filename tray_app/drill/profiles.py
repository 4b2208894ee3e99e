"""`tray-app drill --profiles`: the three offload profiles side by side.

GPU-resident (every layer on the GPU), a planned split (half the layers), and
the independent CPU fallback (no GPU at all). Each is started as the service
starts a worker, alone, and measured: load time, VRAM, RAM, time to first
token and tokens per second.

Without an NVIDIA GPU this is a harness on the simulated device and says so:
llama.cpp here is a CPU build, so all three run on the CPU, and VRAM is the
memory model's estimate rather than a measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil

from ..core.config import bundled_model_path
from ..core.engine.runtime import LaunchRequest, LlamaCppPythonRuntime
from ..core.engine.worker import free_loopback_port
from ..core.base.http_basics import sse_lines
from ..core.memory.estimate import MIB, WorkerSettings, estimate_worker
from ..core.memory.gguf_info import ModelInfo, read_model_info
from .units import quantity

PROFILE_CTX = 2048
RUNS = 3
ANSWER_TOKENS = 64
READY_TIMEOUT_S = 180.0
PROMPT = "Write a long story about a lighthouse keeper and the sea."


@dataclass
class ProfileResult:
    key: str
    title: str
    n_gpu_layers: int
    layers_on_gpu: str
    load_s: float | None = None
    vram_mib: float | None = None
    vram_source: str = ""
    ram_mib: float | None = None
    ttft_s: float | None = None
    tokens_per_s: float | None = None
    runs: int = 0
    error: str | None = None


def profiles_for(info: ModelInfo) -> list[tuple[str, str, int]]:
    # The split puts half of llama.cpp's n_layer + 1 offloadable layers on the
    # GPU (it offloads the last ones first, output layer included).
    split = (info.n_layer + 1) // 2
    return [
        ("gpu_resident", "GPU-resident", -1),
        ("planned_split", f"planned split (n_gpu_layers {split})", split),
        ("cpu_fallback", "independent CPU fallback", 0),
    ]


def measure_profile(info: ModelInfo, key: str, title: str, n_gpu_layers: int, *, real_gpu: bool,
                    workdir: Path) -> ProfileResult:
    settings = WorkerSettings(n_ctx=PROFILE_CTX, n_gpu_layers=n_gpu_layers, logits_all=False)
    footprint = estimate_worker(info, settings)
    result = ProfileResult(key, title, n_gpu_layers, f"{footprint.layers_on_gpu}/{info.n_layer + 1}")
    runtime = LlamaCppPythonRuntime()
    port = free_loopback_port()
    launch = LaunchRequest(model_path=info.path, port=port, n_ctx=PROFILE_CTX, n_gpu_layers=n_gpu_layers,
                           n_batch=512, n_threads=0)
    vram_before = _device_used_mib() if real_gpu else None
    log_path = workdir / f"profile-{key}.log"
    started = time.monotonic()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(runtime.argv(launch), stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **runtime.environment(launch)})
    try:
        base = f"http://127.0.0.1:{port}"
        if not _wait_ready(runtime, base, process):
            result.error = f"the worker did not load (exit {process.poll()}); see {log_path}"
            return result
        result.load_s = round(time.monotonic() - started, 2)
        ttfts, speeds, peak_rss = [], [], 0.0
        for _ in range(RUNS):
            ttft, speed = _one_stream(base)
            peak_rss = max(peak_rss, psutil.Process(process.pid).memory_info().rss / MIB)
            if ttft is not None:
                ttfts.append(ttft)
            if speed is not None:
                speeds.append(speed)
        result.runs = len(ttfts)
        result.ttft_s = round(statistics.median(ttfts), 3) if ttfts else None
        result.tokens_per_s = round(statistics.median(speeds), 1) if speeds else None
        result.ram_mib = round(peak_rss, 1)
        if real_gpu:
            used = _process_vram_mib(process.pid)
            if used is not None:
                result.vram_mib, result.vram_source = round(used, 1), "NVML, per process"
            elif vram_before is not None and (after := _device_used_mib()) is not None:
                result.vram_mib, result.vram_source = round(after - vram_before, 1), "NVML, device used before/after"
        else:
            result.vram_mib, result.vram_source = round(footprint.gpu.total / MIB, 1), "estimate (no GPU to measure)"
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return result


def _wait_ready(runtime: LlamaCppPythonRuntime, base: str, process: subprocess.Popen) -> bool:
    async def wait() -> bool:
        deadline = time.monotonic() + READY_TIMEOUT_S
        async with httpx.AsyncClient() as client:
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    return False
                if await runtime.probe(client, base):
                    return True
                await asyncio.sleep(0.2)
        return False
    return asyncio.run(wait())


def _one_stream(base: str) -> tuple[float | None, float | None]:
    """Time to first token, and tokens per second after it, for one streamed answer."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": ANSWER_TOKENS, "temperature": 0,
            "stream": True}
    sent = time.monotonic()
    stamps = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=300.0) as response:
        for line in sse_lines(response.iter_bytes()):
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            delta = (event.get("choices") or [{}])[0].get("delta") or {}
            if delta.get("content"):
                stamps.append(time.monotonic())
    if not stamps:
        return None, None
    ttft = stamps[0] - sent
    speed = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else None
    return ttft, speed


def _device_used_mib() -> float | None:
    from ..core.memory.telemetry import NvmlGpuReader

    reader = NvmlGpuReader()
    try:
        return reader.read().used_mib
    finally:
        reader.close()


def _process_vram_mib(pid: int) -> float | None:
    from ..core.memory.telemetry import NvmlGpuReader

    reader = NvmlGpuReader()
    try:
        reading = reader.read()
    finally:
        reader.close()
    for device in reading.devices:
        for process in device.processes:
            if process.pid == pid:
                return process.used_mib
    return None


def render_profiles(results: list[ProfileResult], *, real_gpu: bool, device: str) -> str:
    header = ["profile", "n_gpu_layers", "layers on GPU", "load", "VRAM", "RAM", "first token", "tokens/s"]
    rows = []
    for r in results:
        rows.append([
            r.title, str(r.n_gpu_layers), r.layers_on_gpu, quantity(r.load_s, "s"),
            quantity(r.vram_mib, "MiB", 0) + ("" if real_gpu or r.vram_mib is None else " (est.)"),
            quantity(r.ram_mib, "MiB", 0), quantity(r.ttft_s, "s", 3), quantity(r.tokens_per_s, "", 1),
        ] if r.error is None else [r.title, str(r.n_gpu_layers), r.layers_on_gpu, "failed: " + r.error, "", "", "", ""])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "-" * (sum(widths) + 2 * (len(widths) - 1))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def harness_note(real_gpu: bool, device: str) -> str:
    if real_gpu:
        return f"Real comparison on {device}: VRAM measured through NVML."
    return ("No NVIDIA GPU here: this is the harness on the simulated device. llama.cpp is a CPU build, so all three "
            "profiles run on the CPU and their speeds are the CPU's; VRAM is the memory model's estimate, not a "
            "measurement. Run it on a machine with a GPU for the real comparison.")


def run_profiles(args: argparse.Namespace) -> int:
    import tempfile

    from .target import detect_device

    simulated, device, why = detect_device(args.simulated_gpu)
    real_gpu = not simulated
    info = read_model_info(Path(args.model) if args.model else bundled_model_path())
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(harness_note(real_gpu, device), file=sys.stderr)
    results = []
    with tempfile.TemporaryDirectory(prefix="tray-app-profiles-") as workdir:
        for key, title, layers in profiles_for(info):
            print(f"  measuring {title} ...", file=sys.stderr, flush=True)
            results.append(measure_profile(info, key, title, layers, real_gpu=real_gpu, workdir=Path(workdir)))
    table = render_profiles(results, real_gpu=real_gpu, device=device)
    payload = {"device": device, "device_note": why, "real_gpu": real_gpu, "note": harness_note(real_gpu, device),
               "model": info.path.name, "n_ctx": PROFILE_CTX, "runs_per_profile": RUNS,
               "answer_tokens": ANSWER_TOKENS, "profiles": [asdict(r) for r in results]}
    (out_dir / "profiles.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out_dir / "profiles.md").write_text(
        f"# Offload profiles: {info.path.name}, n_ctx {PROFILE_CTX}\n\n{harness_note(real_gpu, device)}\n\n"
        f"Medians of {RUNS} streamed answers of up to {ANSWER_TOKENS} tokens each.\n\n```\n{table}\n```\n")
    print(f"offload profiles on a {device}: {info.path.name}, n_ctx {PROFILE_CTX}, medians of {RUNS} runs\n")
    print(table)
    print(f"\n{harness_note(real_gpu, device)}\nwritten: {out_dir / 'profiles.md'}, {out_dir / 'profiles.json'}")
    return 0 if all(r.error is None for r in results) else 1
