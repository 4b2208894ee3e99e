"""The service the drill runs against, and what the drill may do to it.

`OwnService` starts `python -m tray_app serve` in a subprocess with the
drill's config and isolated XDG directories (so the user's config, logs and
models are untouched), on a simulated GPU when NVML finds none and on the
real device otherwise. It can inject faults: kill the GPU worker and take
VRAM away. `LiveService` is a service someone else started (`--url`): the
drill only sends requests to it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ..core.api.security import bearer_header, effective_api_key
from ..core.config import bundled_model_path, parse_config_text
from ..core.engine.worker import free_loopback_port
from ..core.status_contract import Status, WorkerStatus
from . import plan as plans
from .pressure import Pressure, RealGpuPressure, SimulatedPressure

READY_TIMEOUT_S = 180.0


def detect_device(force_simulated: bool) -> tuple[bool, str, str]:
    """(simulated, short name, why) of the device for the drill's own service."""
    simulated_name = f"simulated GPU ({plans.SIMULATED_GPU_MIB} MiB)"
    if force_simulated:
        return True, simulated_name, "--simulated-gpu was given"
    from ..core.engine.offload_probe import workers_gpu_offload_support
    from ..core.memory.telemetry import NvmlGpuReader

    reader = NvmlGpuReader()
    try:
        reading = reader.read()
    finally:
        reader.close()
    if not reading.available:
        return True, simulated_name, f"NVML found no GPU: {reading.reason}"
    # Asked of the worker's own llama-server, in a child: a check in this
    # process would hold a GPU context here while the drill measures VRAM.
    support = workers_gpu_offload_support()
    if support.supported is False:
        return True, simulated_name, f"a GPU is present, but {support.message}"
    device = reading.devices[0]
    return False, f"real GPU ({device.name}, {device.total_mib:,.0f} MiB)", "NVML found an NVIDIA GPU"


class Target:
    """What every target offers; fault injection only where `can_inject` is true."""

    url: str
    # What the service checks requests against (security.effective_api_key); "" = none.
    api_key: str = ""
    description: str
    simulated: bool
    can_inject: bool = False
    pressure: Pressure | None = None

    def start(self) -> Status:
        raise NotImplementedError

    def stop(self) -> None:
        pass

    def log_tail(self) -> str:
        return ""


class LiveService(Target):
    def __init__(self, url: str, api_key: str = "") -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.device = "live service"
        self.description = f"live service at {self.url} (no faults injected)"
        self.simulated = False

    def start(self) -> Status:
        try:
            status = httpx.get(f"{self.url}/status", headers=bearer_header(self.api_key), timeout=10.0).json()
        except (httpx.HTTPError, ValueError) as exc:
            raise TargetError(f"no tray-app service answers at {self.url} ({type(exc).__name__}: {exc})") from None
        self.simulated = bool((status.get("gpu") or {}).get("simulated"))
        return status


class OwnService(Target):
    can_inject = True

    def __init__(self, workdir: Path, *, simulated: bool, device: str, model: str | None = None) -> None:
        self.workdir = workdir
        self.simulated = simulated
        self.device = device
        self.description = f"own service on a {device}"
        self.port = free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        second = Path(model).expanduser().resolve() if model else bundled_model_path()
        self.config_text = plans.service_config(simulated=simulated, model_path=str(second))
        # The service inherits our environment, so a TRAY_APP_API_KEY there is its key.
        self.api_key = effective_api_key(parse_config_text(self.config_text).server.api_key)
        self._model = model
        self._process: subprocess.Popen | None = None
        self._log_path = workdir / "service.log"
        self._log = None

    def start(self) -> Status:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "config.toml"
        config.write_text(self.config_text)
        env = {
            **os.environ,
            # Isolated: the drill must not read the user's config or write into their logs.
            "XDG_CONFIG_HOME": str(self.workdir / "config"),
            "XDG_STATE_HOME": str(self.workdir / "state"),
            "XDG_DATA_HOME": str(self.workdir / "data"),
            "XDG_CACHE_HOME": str(self.workdir / "cache"),
            "PYTHONUNBUFFERED": "1",
        }
        argv = [sys.executable, "-m", "tray_app", "serve", "--config", str(config), "--port", str(self.port)]
        if self._model:
            argv += ["--model", self._model]
        self._log = open(self._log_path, "wb")
        self._process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        status = self._wait_ready()
        self.pressure = (SimulatedPressure(self.url, self.api_key) if self.simulated
                         else RealGpuPressure(self.url, status, self.workdir))
        return status

    def _wait_ready(self) -> Status:
        deadline = time.monotonic() + READY_TIMEOUT_S
        with httpx.Client(base_url=self.url, headers=bearer_header(self.api_key), timeout=5.0) as http:
            while time.monotonic() < deadline:
                assert self._process is not None
                if self._process.poll() is not None:
                    raise TargetError(f"the service exited with {self._process.returncode}:\n{self.log_tail()}")
                try:
                    status = http.get("/status").json()
                    if all(w["state"] == "ready" for w in status["workers"]) and status["breaker"]["state"] == "closed":
                        return status
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                time.sleep(0.2)
        raise TargetError(f"the service was not ready within {READY_TIMEOUT_S:g} s:\n{self.log_tail()}")

    def kill_gpu_worker(self, status: Status, sig: signal.Signals) -> int:
        pid = gpu_worker(status)["pid"]
        if not pid:
            raise TargetError("the GPU worker has no process to kill")
        os.kill(pid, sig)
        return pid

    def stop(self) -> None:
        if self.pressure is not None:
            self.pressure.release()
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._log is not None:
            self._log.close()

    def log_tail(self) -> str:
        try:
            return self._log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""


def gpu_worker(status: Status) -> WorkerStatus:
    """The GPU worker's line; the phases that ask for it are skipped on a service without one."""
    found = next((w for w in status["workers"] if w["role"] == "gpu"), None)
    if found is None:
        raise TargetError("the service has no GPU worker")
    return found


class TargetError(Exception):
    """The drill could not start or reach its service."""
