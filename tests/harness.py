"""Test harness: the real service (`python -m tray_app serve`) in a
subprocess on a free loopback port, with real llama.cpp workers on SmolLM2
and a simulated GPU. Tests talk to it only over HTTP, like any client."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tray_app.core.engine.worker import free_loopback_port, pid_alive

READY_TIMEOUT_S = 120

BASE_CONFIG = """
[gpu]
simulate_mib = 2048
n_ctx = 1024
reserve_mib = 256
queue_limit = 1
first_token_timeout_s = 20
token_timeout_s = 10
# The sharing tests turn these on themselves; the rest test routing with a
# worker that stays loaded.
yield_to_other_apps = false
idle_unload_s = 0
[cpu]
n_ctx = 2048
# One CPU slot: the queue tests fill the CPU lane with one running request.
# The GPU path keeps llama-server's default of 4 slots.
max_concurrency = 1
queue_limit = 2
ram_floor_mib = 256
[breaker]
failure_threshold = 2
window_s = 60
cooldown_s = 3
[worker]
backoff_base_s = 0.2
backoff_cap_s = 2
stop_timeout_s = 3
"""


def sharing_config(tmp: Path, cpu: dict | None = None, **gpu: object) -> str:
    """BASE_CONFIG with GPU sharing on (give VRAM back to other apps on the
    simulated device in tmp/device, a short settle time) and these keys."""
    gpu_keys = {"simulate_dir": str(tmp / "device"), "yield_to_other_apps": True, "reload_settle_s": 2.0,
                "yield_drain_s": 10, "idle_unload_s": 0, **gpu}
    # BASE_CONFIG pins both off; a TOML table may not repeat a key.
    base = BASE_CONFIG.replace("yield_to_other_apps = false\n", "").replace("idle_unload_s = 0\n", "")
    base = base.replace("[gpu]\n", "[gpu]\n" + _toml_lines(gpu_keys), 1)
    return base.replace("[cpu]\n", "[cpu]\n" + _toml_lines(cpu or {}), 1)


def _toml_lines(values: dict) -> str:
    return "".join(f"{key} = {json.dumps(value)}\n" for key, value in values.items())


@contextlib.contextmanager
def running(tmp: Path, config_text: str = BASE_CONFIG, roles: tuple[str, ...] = ("gpu", "cpu")):
    """A service with `roles` ready, for the length of a fixture or a
    benchmark, stopped after it."""
    service = RunningService(tmp, config_text)
    try:
        service.wait_ready(roles=roles)
        yield service
    finally:
        service.stop()


class RunningService:
    def __init__(self, tmp: Path, config_text: str = BASE_CONFIG, extra_args: tuple[str, ...] = (),
                 port: int | None = None, env: dict[str, str] | None = None) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp = tmp
        self.port = port or free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp / "config.toml"
        config.write_text(config_text)
        self.env = {
            **os.environ,
            "XDG_CONFIG_HOME": str(tmp / "config"),
            "XDG_STATE_HOME": str(tmp / "state"),
            "XDG_DATA_HOME": str(tmp / "data"),
            "XDG_CACHE_HOME": str(tmp / "cache"),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.log_file = open(tmp / "service.log", "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tray_app", "serve", "--config", str(config), "--port", str(self.port), *extra_args],
            stdout=self.log_file, stderr=subprocess.STDOUT, env=self.env,
        )
        self.http = httpx.Client(base_url=self.url, timeout=60.0)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S, roles: tuple[str, ...] = ("gpu", "cpu")) -> dict:
        """Wait for the workers of these roles to be ready (a CPU worker that
        loads on demand is not started until a request needs it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"service exited with {self.process.returncode}:\n{self.log_text()}")
            try:
                status = self.http.get("/status", timeout=5).json()
                if (all(w["state"] == "ready" for w in status["workers"] if w["role"] in roles)
                        and status["breaker"]["state"] == "closed"):
                    return status
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"service not ready in {timeout}s:\n{self.log_text()}")

    def wait_workers_ready(self, timeout: float = READY_TIMEOUT_S) -> dict:
        return self.wait_for(lambda s: all(w["state"] == "ready" for w in s["workers"]), timeout, what="workers ready")

    def status(self) -> dict:
        return self.http.get("/status").json()

    def worker(self, role: str) -> dict:
        return next(w for w in self.status()["workers"] if w["role"] == role)

    def wait_for(self, predicate, timeout: float = 60.0, interval: float = 0.05, what: str = "condition"):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = self.status()
            if predicate(last):
                return last
            time.sleep(interval)
        raise TimeoutError(f"timed out waiting for {what}; last status: {last}")

    def kill_gpu_before_first_token(self, request_id: str, run):
        """Run `run()` (a request sent with X-Request-Id `request_id`) in a
        thread, SIGKILL the GPU worker as soon as the request is running on it,
        and return what `run` returned. Skips the test when the GPU answered
        before the kill landed: the race is the machine's, not the code's."""
        gpu_pid = self.worker("gpu")["pid"]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(run)
            self.wait_for(lambda s: any(r["id"] == request_id and r["state"] == "running" and r["path"] == "gpu"
                                        for r in s["requests"]), interval=0.01, what=f"{request_id} running on gpu")
            os.kill(gpu_pid, signal.SIGKILL)
            headers, items = future.result()
        if headers["x-served-by"] == "gpu":
            pytest.skip("the GPU produced its first token before the kill landed")
        return headers, items

    def kill_gpu_mid_stream(self, body, kill_after, headers=None, path="/v1/chat/completions", counting=None):
        """Stream `body`, SIGKILL the GPU worker once `kill_after` events came
        (those `counting(line)` is true of, if given); every SSE line
        (comments included) as the client got it."""
        gpu_pid = self.worker("gpu")["pid"]
        lines, events = [], 0
        with self.http.stream("POST", path, json={**body, "stream": True}, headers=headers or {}) as response:
            assert response.headers["x-served-by"] == "gpu"
            for line in response.iter_lines():
                if not line:
                    continue  # the blank line that ends each SSE event
                lines.append(line)
                if line.startswith(("data:", "{")) and (counting is None or counting(line)):  # SSE or NDJSON
                    events += 1
                    if events == kill_after:
                        os.kill(gpu_pid, signal.SIGKILL)
        return response, lines

    def reset(self) -> None:
        """Back to a healthy baseline between tests: no pressure, not paused, all
        ready, breaker closed. A breaker left open by an earlier test closes the
        way it does for users: one probe request once it is half-open."""
        self.http.post("/admin/gpu", json={"paused": False, "simulated_pressure_mib": 0})
        status = self.wait_for(lambda s: all(w["state"] == "ready" for w in s["workers"])
                               and s["breaker"]["state"] != "open", timeout=READY_TIMEOUT_S, what="ready, breaker not open")
        if status["breaker"]["state"] == "half_open":
            self.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        self.wait_ready()

    def worker_pids(self) -> list[int]:
        return [w["pid"] for w in self.status()["workers"] if w["pid"]]

    def log_text(self) -> str:
        self.log_file.flush()
        return (self.tmp / "service.log").read_text(errors="replace")[-6000:]

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.http.close()
        self.log_file.close()
        return self.process.returncode


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = pids
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if pid_alive(pid) and not _is_zombie(pid)]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def streamed_text(lines, field="content"):
    """One field of an OpenAI stream's deltas (a completion's text), joined."""
    text = []
    for line in lines:
        if line.startswith("data:") and line != "data: [DONE]":
            for choice in json.loads(line[5:]).get("choices") or ():
                text.append((choice.get("delta") or {}).get(field) or choice.get("text") or "")
    return "".join(text)
