"""The failover story on a real NVIDIA GPU, in one run; or the same script
on the simulated device, so it can't rot between GPU loans.

    python -m benchmarks.gpu_check.run --out DIR [--simulated] [--quick] [--checks LIST]

Checks (each one starts its own service on a tiny generated model, through
tests.harness.RunningService: `python -m tray_app serve`, real llama-server
workers, real signals):
- estimator: the memory estimate against what the device says the GPU
  worker took (NVML's per-process reading, else the device's used memory
  before and after), for three contexts; and the router itself must hold
  0 MiB (it hides the GPUs from its own llama.cpp);
- start_oom: a context whose KV cache can't fit; the worker's exit must be
  classified as out of memory, the breaker must open and requests must go
  to the CPU;
- pressure: "the other app" (a torch/cupy ballast, or the simulated knob)
  takes VRAM step by step until admission sends requests to the CPU, then
  gives it back; GPU admission must resume (the GPU worker is unloaded for
  the other app and reloaded);
- replay: the GPU worker is killed with SIGKILL, then SIGABRT, while a
  request runs on it; the request must be answered once from the CPU, with
  nothing lost and nothing duplicated;
- throughput: the same request on the GPU and forced onto the CPU;
- drill: `tray-app drill --short` on the same device;
- speculation: what checking a draft costs on the card, in decode steps
  (on Llama 3.2 1B's shape), and spec_bench's A/B of the n-gram types
  against none (random weights: it shows they run, not what they gain).

On a real GPU the card is first made into a home-sized one (--card-mib,
default 6 GiB): a ballast process holds the rest of its free memory, the way
a game or a desktop does, and every check then works inside what is left.

--quick runs each check at its smallest size (the test suite's run on the
simulated device, so the kit can't rot at little cost): the same services,
signals and code paths, with small contexts, short answers, one throughput
round and a squeeze in big steps. The real-GPU run is the full size.

Results: DIR/gpu_check.json and DIR/gpu_check.md. Exit 0 when every check
passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

from benchmarks.gpu_check import tiny_model
from tests.harness import RunningService
from tray_app.drill.ballast import Ballast

# In the order of what the issue most needs proven, so a run cut short by its
# deadline has the most important results.
CHECKS = ("start_oom", "replay", "pressure", "estimator", "throughput", "drill", "speculation")
# Roughly what each needs on the GPU machine; a check that no longer fits
# before --deadline-s is skipped (and said so), not cut off mid-way.
BUDGET_S = {"start_oom": 30, "replay": 45, "pressure": 90, "estimator": 45, "throughput": 30, "drill": 150,
            "speculation": 90}
# SmolLM2's <|endoftext|> and <|im_end|>: banned, so random weights can't end an answer early.
NO_END = {"0": -100, "2": -100}
SLOTS = 4


@dataclass(frozen=True)
class Sizes:
    """How much work each check does. The real GPU run is FULL; QUICK keeps
    every check's code path (three estimator services, both signals' replays,
    a yield and a reload, both paths' speed) at the least work that shows it."""

    # The tiny model's KV cache is 2 KiB per token (4 layers, 128-wide K and V,
    # f16); with 4 slots a 128k context per slot is 1 GiB.
    estimator_contexts: tuple[int, ...]
    # With the end tokens banned, the GPU is still decoding when the kill lands
    # (it lands within milliseconds of "running"); the CPU then decodes it all again.
    replay_tokens: int
    throughput_rounds: int
    throughput_tokens: int
    # Full: take half the way to the reserve each step (at most 512 MiB), the
    # way a game grows. Quick: straight to 64 MiB above the reserve, then
    # 128 MiB steps, until the GPU gives way.
    pressure_in_big_steps: bool


FULL = Sizes(estimator_contexts=(8_192, 32_768, 131_072), replay_tokens=1500, throughput_rounds=3,
             throughput_tokens=256, pressure_in_big_steps=False)
QUICK = Sizes(estimator_contexts=(1_024, 2_048, 4_096), replay_tokens=200, throughput_rounds=1,
              throughput_tokens=32, pressure_in_big_steps=True)
SERVING_CONTEXT = 16_384
KV_BYTES_PER_TOKEN = tiny_model.kv_bytes_per_token(n_layer=4, n_embd=128, n_head=4, n_head_kv=4)
CARRIED_TOKENIZER = Path(".gpu_carry") / "tokenizer.json.gz"
PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


# ----- the device -----------------------------------------------------------------------

class Device:
    """The real GPU through NVML, or the simulated one (a declared size)."""

    def __init__(self, simulated: bool, card_mib: int) -> None:
        self.simulated = simulated
        self.card_mib = card_mib
        self.ballast: Ballast | None = None
        self.facts: dict[str, Any] = {"simulated": simulated}
        if simulated:
            self.facts.update(name=f"simulated {card_mib} MiB device", card_mib=card_mib)
            return
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(self._handle)
        driver = pynvml.nvmlSystemGetDriverVersion()
        self.facts.update(name=name.decode() if isinstance(name, bytes) else name,
                          driver=driver.decode() if isinstance(driver, bytes) else driver,
                          total_mib=round(self.memory()["total_mib"]))

    def memory(self) -> dict[str, float]:
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        return {"total_mib": info.total / 2**20, "used_mib": info.used / 2**20, "free_mib": info.free / 2**20}

    def process_mib(self, pid: int) -> float | None:
        """NVML's reading of one process's memory; None where the driver
        reports no per-process use (some containers)."""
        try:
            for process in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
                if process.pid == pid and process.usedGpuMemory is not None:
                    return process.usedGpuMemory / 2**20
        except Exception:  # noqa: BLE001 - NVMLError, or nvidia-ml-py's version-mismatch error (not a subclass)
            return None
        return None

    def own_mib(self, pid: int, witness_pid: int) -> float | None:
        """What one process holds on the device: 0 when NVML lists the
        witness (a process known to hold memory) but not this one; None when
        it lists neither, which says nothing (no per-process readings)."""
        mib = self.process_mib(pid)
        if mib is not None:
            return mib
        return 0.0 if self.process_mib(witness_pid) is not None else None

    def shrink_to_card(self) -> None:
        """Hold all but card_mib of the free memory: a home-sized card."""
        if self.simulated:
            return
        self.ballast = Ballast()
        for _ in range(4):
            gap = self.memory()["free_mib"] - self.card_mib
            if abs(gap) <= 64:
                break
            self.ballast.hold(self.ballast.held_mib + gap)
        self.facts.update(ballast_mib=self.ballast.held_mib, ballast_library=self.ballast.library,
                          free_after_ballast_mib=round(self.memory()["free_mib"]))

    def close(self) -> None:
        if self.ballast is not None:
            self.ballast.close()


# ----- the service ---------------------------------------------------------------------

def service_config(device: Device, model: Path, *, gpu: dict[str, Any] | None = None,
                   cpu: dict[str, Any] | None = None) -> str:
    gpu_keys = {"n_ctx": SERVING_CONTEXT, "max_concurrency": SLOTS, "reserve_mib": 256, "queue_limit": 4,
                "first_token_timeout_s": 60, "token_timeout_s": 30, "yield_to_other_apps": False,
                "idle_unload_s": 0, **(gpu or {})}
    if device.simulated:
        gpu_keys["simulate_mib"] = device.card_mib
    cpu_keys = {"n_ctx": 8192, "max_concurrency": 1, "queue_limit": 8, **(cpu or {})}
    sections = {
        "model": {"path": str(model)},
        "gpu": gpu_keys,
        "cpu": cpu_keys,
        "breaker": {"failure_threshold": 2, "window_s": 60, "cooldown_s": 5},
        "worker": {"backoff_base_s": 0.2, "backoff_cap_s": 2, "stop_timeout_s": 5},
        "embeddings": {"enabled": False},
    }
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


class Service(RunningService):
    def wait_listening(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the service exited with {self.process.returncode}:\n{self.log_text()}")
            try:
                self.http.get("/health", timeout=2)
                return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise TimeoutError(f"the service did not answer within {timeout:g} s")

    def gpu_worker(self, status: dict[str, Any] | None = None) -> dict[str, Any]:
        return next(w for w in (status or self.status())["workers"] if w["role"] == "gpu")

    def chat(self, max_tokens: int = 8, headers: dict[str, str] | None = None, **extra: Any) -> httpx.Response:
        return self.http.post("/v1/chat/completions", headers=headers or {}, timeout=300, json={
            "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "seed": 1, **extra})


def with_service(workdir: Path, name: str, config: str, body: Callable[[Service], dict[str, Any]],
                 roles: tuple[str, ...] = ("gpu", "cpu")) -> dict[str, Any]:
    service = Service(workdir / name, config)
    try:
        # No roles: the check itself waits for the state it expects, once the service answers.
        service.wait_ready(roles=roles) if roles else service.wait_listening()
        return body(service)
    finally:
        service.stop()


# ----- the checks ----------------------------------------------------------------------

def check_estimator(device: Device, model: Path, workdir: Path, sizes: Sizes = FULL) -> dict[str, Any]:
    rows = []
    for n_ctx in sizes.estimator_contexts:
        before = None if device.simulated else device.memory()["used_mib"]

        def measure(service: Service) -> dict[str, Any]:
            if device.simulated:
                # The worker is charged to the device from the sampler's next reading on.
                service.wait_for(lambda s: s["gpu"]["used_mib"] > 0, timeout=30, what="the worker on the device")
            else:
                time.sleep(1.0)  # NVML's process list lags a load by a moment
            worker = service.gpu_worker()
            row: dict[str, Any] = {"n_ctx_per_slot": n_ctx, "slots": SLOTS,
                                   "estimated_mib": worker["estimated_vram_mib"]}
            if not device.simulated:
                # The router must hold no GPU context of its own (it hides the
                # GPUs from its tokenizer's llama.cpp): memory it held would be
                # counted as another app's, and taken from the model.
                row["router_mib"] = device.own_mib(service.status()["service"]["pid"], worker["pid"])
            if device.simulated:
                # The simulated device charges the estimate itself: this checks the
                # plumbing, not the estimator.
                gpu = service.status()["gpu"]
                row.update(measured_mib=gpu["used_mib"], source="simulated device")
            else:
                own = device.process_mib(worker["pid"])
                if own is not None:
                    row.update(measured_mib=round(own, 1), source="NVML per-process")
                else:
                    row.update(measured_mib=round(device.memory()["used_mib"] - before, 1),
                               source="device used, before and after")
            measured = row["measured_mib"]
            row["error_pct"] = (round(100.0 * (row["estimated_mib"] - measured) / measured, 1) if measured > 0
                                else None)
            return row

        # The CPU worker plays no part here: on demand, it never loads.
        config = service_config(device, model, gpu={"n_ctx": n_ctx}, cpu={"keep": "on_demand"})
        rows.append(with_service(workdir, f"estimator-{n_ctx}", config, measure, roles=("gpu",)))
    errors = [row["error_pct"] for row in rows if row["error_pct"] is not None]
    worst = max((abs(error) for error in errors), default=None)
    # Admission trusts the estimate: under-estimating by more than a tenth
    # would admit work that can't fit; over-estimating only wastes room.
    ok = len(errors) == len(rows) and all(-10.0 <= error <= 35.0 for error in errors)
    # None: NVML reports no per-process use here, so the router can't be checked.
    router_clean = all(row.get("router_mib") in (0.0, None) for row in rows)
    return {"ok": ok and router_clean, "rows": rows, "worst_abs_error_pct": worst,
            "router_holds_no_gpu_memory": router_clean}


def check_start_oom(device: Device, model: Path, workdir: Path, sizes: Sizes = FULL) -> dict[str, Any]:
    # Twice the card's KV room per slot: the worker can't allocate at load.
    n_ctx = int(device.card_mib * 2 * 2**20 / (SLOTS * KV_BYTES_PER_TOKEN))

    def watch(service: Service) -> dict[str, Any]:
        status = service.wait_for(lambda s: s["breaker"]["state"] == "open" and any(
            w["role"] == "cpu" and w["state"] == "ready" for w in s["workers"]), timeout=180, what="breaker open")
        exit_ = service.gpu_worker(status)["last_exit"] or {}
        response = service.chat()
        return {
            "ok": (exit_.get("kind") == "out_of_memory" and response.status_code == 200
                   and response.headers.get("x-served-by") == "cpu"),
            "n_ctx_per_slot": n_ctx, "estimated_mib": service.gpu_worker(status)["estimated_vram_mib"],
            "exit_kind": exit_.get("kind"), "evidence": exit_.get("evidence"), "breaker": status["breaker"]["state"],
            "request_served_by": response.headers.get("x-served-by"),
            "route_reason": response.headers.get("x-route-reason"), "status_code": response.status_code,
        }

    return with_service(workdir, "start-oom", service_config(device, model, gpu={"n_ctx": n_ctx}), watch, roles=())


class OtherApp:
    """Takes VRAM the way another program does: a real ballast process on a
    GPU, the service's pressure knob on the simulated device."""

    def __init__(self, device: Device, service: Service) -> None:
        self._service = service
        self._ballast = None if device.simulated else Ballast()

    def hold(self, mib: float) -> float:
        if self._ballast is not None:
            return float(self._ballast.hold(mib))
        self._service.http.post("/admin/gpu", json={"simulated_pressure_mib": mib}).raise_for_status()
        return mib

    def close(self) -> None:
        if self._ballast is not None:
            self._ballast.close()
        else:
            self._service.http.post("/admin/gpu", json={"simulated_pressure_mib": 0})


def check_pressure(device: Device, model: Path, workdir: Path, sizes: Sizes = FULL) -> dict[str, Any]:
    config = service_config(device, model, gpu={"yield_to_other_apps": True, "reload_settle_s": 2,
                                                "yield_drain_s": 5})

    def squeeze(service: Service) -> dict[str, Any]:
        other = OtherApp(device, service)
        steps: list[dict[str, Any]] = []
        try:
            taken = 0.0
            redirected = None
            for _ in range(24):
                gpu = service.status()["gpu"]
                above_reserve = gpu["free_mib"] - gpu["reserve_mib"]
                if sizes.pressure_in_big_steps:
                    step = above_reserve - 64 if above_reserve > 128 else 128.0
                else:
                    # Halve the way to the reserve each step (at most 512 MiB), so
                    # the step that crosses it does not leave the card at zero.
                    step = max(32.0, min(512.0, above_reserve / 2))
                asked = taken + step
                taken = other.hold(asked)
                time.sleep(2.5)  # the sampler confirms a yield over about a second
                response = service.chat()
                status = service.status()
                steps.append({"other_app_mib": taken, "free_mib": round(status["gpu"]["free_mib"]),
                              "served_by": response.headers.get("x-served-by"),
                              "reason": response.headers.get("x-route-reason"),
                              "residency": status["gpu"]["residency"]["state"]})
                if response.headers.get("x-served-by") == "cpu":
                    redirected = steps[-1]
                    break
                if taken < asked - 32:
                    break  # the device refused more: nothing left to take
            other.close()
            released_at = time.monotonic()
            back = None
            while time.monotonic() - released_at < 120:
                response = service.chat()
                if response.headers.get("x-served-by") == "gpu":
                    back = round(time.monotonic() - released_at, 2)
                    break
                time.sleep(1.0)
            residency = service.status()["gpu"]["residency"]
        finally:
            other.close()
        return {"ok": redirected is not None and back is not None, "steps": steps, "redirected_at": redirected,
                "gpu_again_after_release_s": back, "yields": residency["yields"], "reloads": residency["reloads"],
                "last_release_s": residency["last_release_s"], "last_load_s": residency["last_load_s"]}

    return with_service(workdir, "pressure", config, squeeze)


def check_replay(device: Device, model: Path, workdir: Path, sizes: Sizes = FULL) -> dict[str, Any]:
    def kill_twice(service: Service) -> dict[str, Any]:
        rounds = []
        for sig in (signal.SIGKILL, signal.SIGABRT):
            for attempt in (1, 2):
                service.wait_ready()
                pid = service.gpu_worker()["pid"]
                request_id = f"replay-{sig.name}-{attempt}"
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    future = pool.submit(service.chat, sizes.replay_tokens, {"X-Request-Id": request_id},
                                         logit_bias=NO_END)
                    service.wait_for(lambda s: any(r["id"] == request_id and r["state"] == "running"
                                                   and r["path"] == "gpu" for r in s["requests"]),
                                     interval=0.005, what="running on the GPU")
                    os.kill(pid, sig)
                    response = future.result()
                if response.headers.get("x-served-by") != "gpu" or attempt == 2:
                    break  # else the GPU finished before the kill landed: once more
            body = response.json() if response.status_code == 200 else {}
            rounds.append({"signal": sig.name, "attempt": attempt, "status_code": response.status_code,
                           "served_by": response.headers.get("x-served-by"),
                           "reason": response.headers.get("x-route-reason"),
                           "completion_tokens": (body.get("usage") or {}).get("completion_tokens")})
        # Two GPU failures in a minute open the breaker: the workers come back,
        # the breaker waits for its cool-down.
        status = service.wait_workers_ready()
        lost = sum(1 for r in rounds if r["status_code"] != 200)
        duplicated = status["accounting"]["duplicate_executions"]
        exits = service.gpu_worker(status)["last_exit"]
        # Answered once by the CPU: replayed from the start, or, when the GPU had
        # already produced part of the answer, continued from there (resumed).
        replayed = sum(1 for r in rounds if r["reason"] == "gpu_failed_replayed")
        resumed = sum(1 for r in rounds if r["reason"] == "gpu_failed_resumed")
        return {"ok": lost == 0 and duplicated == 0 and replayed + resumed == len(rounds), "rounds": rounds,
                "lost": lost, "duplicated": duplicated, "replayed": replayed, "resumed": resumed, "last_exit": exits,
                "breaker": status["breaker"]["state"]}

    return with_service(workdir, "replay", service_config(device, model), kill_twice)


def check_throughput(device: Device, model: Path, workdir: Path, sizes: Sizes = FULL) -> dict[str, Any]:
    def measure(service: Service) -> dict[str, Any]:
        rates = {}
        for path, headers in (("gpu", {}), ("cpu", {"X-Force-Path": "cpu"})):
            service.chat(8, headers)  # warm
            took, tokens = [], 0
            for _ in range(sizes.throughput_rounds):
                started = time.perf_counter()
                response = service.chat(sizes.throughput_tokens, headers, temperature=1.0)
                took.append(time.perf_counter() - started)
                assert response.headers.get("x-served-by") == path, response.headers
                tokens += response.json()["usage"]["completion_tokens"]
            rates[path] = round(tokens / sum(took), 1)
        status = service.status()
        return {"ok": True, "tokens_per_s": rates, "gpu_over_cpu": round(rates["gpu"] / rates["cpu"], 2),
                "engine": status["engine"]["version"], "offload_supported": status["gpu"]["offload_supported"]}

    return with_service(workdir, "throughput", service_config(device, model), measure)


# SmolLM2-135M's shape (random weights): the drill times its faults against
# requests that take a while, which the 4-layer model finishes too soon.
DRILL_SHAPE = {"n_layer": 30, "n_embd": 576, "n_head": 9, "n_head_kv": 3, "n_ff": 1536, "context_length": 8192}


def check_drill(device: Device, tiny: Path, workdir: Path, out: Path, timeout_s: float = 420) -> dict[str, Any]:
    import shutil
    import subprocess

    model = workdir / "smollm2-shaped.gguf"
    tiny_model.write_tiny_model(workdir / "tokenizer.json.gz", model, **DRILL_SHAPE)

    # The device tool returns at most 8 files: the drill's logs stay behind,
    # its report comes back beside ours.
    drill_out = workdir / "drill"
    argv = [sys.executable, "-m", "tray_app", "drill", "--short", "--no-progress", "--model", str(model),
            "--out", str(drill_out)]
    if device.simulated:
        argv.append("--simulated-gpu")
    started = time.monotonic()
    with open(workdir / "drill.log", "wb") as log:
        code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    report_path = drill_out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    for name in ("report.json", "report.md"):
        if (drill_out / name).exists():
            shutil.copyfile(drill_out / name, out / f"drill-{name}")
    phases = [{"phase": p["title"], "failed": [f"{c['name']}: {c.get('detail')}" for c in p.get("checks", [])
                                               if not c.get("passed") and c.get("severity") != "finding"],
               "findings": [c["name"] for c in p.get("checks", []) if not c.get("passed") and c.get("severity") == "finding"]}
              for p in report.get("phases", [])]
    return {"ok": code == 0, "exit_code": code, "seconds": round(time.monotonic() - started, 1),
            "verdict": report.get("verdict"), "phases": phases,
            "log_tail": None if code == 0 else (workdir / "drill.log").read_text(errors="replace")[-3000:]}


# Llama 3.2 1B's shape (random weights, f16): what speculation costs on the
# card is a matter of the model's shape, and the 4-layer model is all launch
# overhead on a GPU.
SPECULATION_SHAPE = {"n_layer": 16, "n_embd": 2048, "n_head": 32, "n_head_kv": 8, "n_ff": 8192,
                     "context_length": 8192}
SPECULATION_TYPES = ("ngram-mod", "ngram-simple")


def check_speculation(device: Device, tiny: Path, workdir: Path, sizes: Sizes = FULL) -> dict[str, Any]:
    """Speculative decoding on the GPU worker's llama-server: what checking a
    draft costs on this card (spec_bench.verify_cost, weights don't matter),
    and spec_bench's A/B, each type against none. The A/B's acceptance comes
    from random weights, which write what no user reads: it shows the types
    run on the card, not what they gain there. The gain is the acceptance a
    real model gets (spec_bench on the CPU, the same for a model on any
    device) against this cost."""
    from benchmarks import spec_bench
    from benchmarks.anchors import llama_server

    model = tiny
    if sizes is FULL:
        model = workdir / "speculation-shaped.gguf"
        tiny_model.write_tiny_model(workdir / "tokenizer.json.gz", model, **SPECULATION_SHAPE)
    offload = ("--n-gpu-layers", "0" if device.simulated else "99")
    server = llama_server(workdir / "speculation-cost.log", n_ctx=4096, parallel=1, model=model, extra_args=offload)
    try:
        cost = spec_bench.verify_cost(server.url, rounds=sizes.throughput_rounds + 2)
    finally:
        server.stop()
    settings, workloads = ["off", *SPECULATION_TYPES], ["code", "chat"]
    cells = spec_bench.run_ab(settings, workloads, rounds=sizes.throughput_rounds, repeats=2,
                              max_tokens=sizes.throughput_tokens, threads=0, model=model, server_args=offload,
                              body={"logit_bias": NO_END})
    return {"ok": all(row["cost_in_steps"] > 0 for row in cost["batches"]),
            "model": "Llama 3.2 1B's shape, random weights, f16" if sizes is FULL else "the tiny model",
            "verify_cost": cost, "ab": spec_bench.table(cells, workloads, settings)}


# ----- the report ----------------------------------------------------------------------

def markdown(results: dict[str, Any]) -> str:
    device = results["device"]
    lines = [f"# GPU check: {device.get('name')}", "",
             f"- date: {results['date']}", f"- device: {json.dumps(device)}",
             f"- host: {results['host']}", f"- total: {results['seconds']} s", ""]
    for name, result in results["checks"].items():
        verdict = "PASS" if result.get("ok") else "FAIL"
        lines.append(f"## {name}: {verdict}")
        lines.append("")
        lines.append("```json")
        lines.append(json.dumps({k: v for k, v in result.items() if k != "log_tail"}, indent=1))
        lines.append("```")
        if result.get("log_tail"):
            lines += ["", "```", result["log_tail"], "```"]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where gpu_check.json and gpu_check.md go")
    parser.add_argument("--simulated", action="store_true", help="the simulated device even if a GPU is present")
    parser.add_argument("--quick", action="store_true",
                        help="each check at its smallest size (the suite's simulated run; not for a real GPU's numbers)")
    parser.add_argument("--card-mib", type=int, default=6144, help="the home-sized card to make (default 6144)")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"a subset of {','.join(CHECKS)}")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json.gz (default: the carry's, else the bundled model's)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="seconds this run may take; checks that no longer fit are skipped")
    args = parser.parse_args(argv)
    checks = [name.strip() for name in args.checks.split(",") if name.strip()]
    unknown = set(checks) - set(CHECKS)
    if unknown:
        parser.error(f"unknown checks: {', '.join(sorted(unknown))}")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "host": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
                               "quick": args.quick,
                               "checks": {}}
    def left_s() -> float:
        return float("inf") if args.deadline_s is None else args.deadline_s - (time.monotonic() - started)

    def write() -> None:
        # After every check: a run killed at the command's limit still brings back what it measured.
        results["seconds"] = round(time.monotonic() - started, 1)
        results["passed"] = bool(results["checks"]) and all(r["ok"] for r in results["checks"].values())
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / "gpu_check.md").write_text(markdown(results))

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        workdir = Path(tmp)
        model = model_for_check(workdir, args.tokenizer)
        simulated = args.simulated or not real_gpu_present()
        device = None
        try:
            device = Device(simulated, args.card_mib)
            device.shrink_to_card()
            results["device"] = device.facts
        except Exception:  # noqa: BLE001 - said in the report, which is still written
            results["device"] = {"simulated": simulated, "error": traceback.format_exc()[-3000:]}
            device = None
        try:
            for name in checks if device is not None else ():
                if left_s() < BUDGET_S[name]:
                    results["checks"][name] = {"ok": False, "skipped": f"{left_s():.0f} s left, needs ~{BUDGET_S[name]} s"}
                    print(f"gpu_check: {name} skipped: no time left", flush=True)
                    continue
                print(f"gpu_check: {name}…", flush=True)
                began = time.monotonic()
                try:
                    if name == "drill":
                        result = check_drill(device, model, workdir, args.out, min(420.0, left_s() - 10))
                    else:
                        result = globals()[f"check_{name}"](device, model, workdir, QUICK if args.quick else FULL)
                except Exception:  # noqa: BLE001 - one broken check must not hide the others' results
                    result = {"ok": False, "error": traceback.format_exc()[-3000:]}
                result["seconds"] = round(time.monotonic() - began, 1)
                results["checks"][name] = result
                write()
                print(f"gpu_check: {name} {'PASS' if result['ok'] else 'FAIL'} in {result['seconds']} s", flush=True)
        finally:
            if device is not None:
                device.close()
    write()
    return 0 if results["passed"] else 1


def model_for_check(workdir: Path, tokenizer: Path | None) -> Path:
    """The tiny model, written here from the carried tokenizer (or, off the
    GPU machine, from the bundled model's); the tokenizer stays in workdir."""
    import shutil

    if tokenizer is None and CARRIED_TOKENIZER.exists():
        tokenizer = CARRIED_TOKENIZER
    if tokenizer is None:
        from tray_app.core.config import bundled_model_path

        tiny_model.export_tokenizer(bundled_model_path(), workdir / "tokenizer.json.gz")
    else:
        shutil.copyfile(tokenizer, workdir / "tokenizer.json.gz")
    tokenizer = workdir / "tokenizer.json.gz"
    model = workdir / "tiny.gguf"
    tiny_model.write_tiny_model(tokenizer, model)
    return model


def real_gpu_present() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:  # noqa: BLE001 - no driver, no library, no device: all mean "simulate"
        return False


if __name__ == "__main__":
    sys.exit(main())
