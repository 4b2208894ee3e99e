"""Taking VRAM away from the service, on a simulated or a real GPU.

Simulated: the service's own pressure knob (POST /admin/gpu
{"simulated_pressure_mib": N}); the GPU worker's wrapper plays the device's
allocator, so a worker that no longer fits fails to start with llama.cpp's
CUDA out-of-memory lines.

Real: a ballast process (ballast.py) holding an exact amount with torch or
cupy when one is installed; otherwise a second llama.cpp server process per
chunk of memory, exactly what happens when another model takes the card. llama.cpp
allocates its KV cache and compute buffers when it loads, so a holder's
size is set by its context and micro-batch; NVML says what it really took
and more holders close the gap.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from ..core.api.security import bearer_header
from ..core.status_contract import GpuStatus, Status
from .ballast import Ballast, library as ballast_library

MIB = 1024 * 1024
HOLDER_READY_TIMEOUT_S = 120.0
MAX_HOLDERS = 12
# Close enough: a GPU request needs tens of MiB, a llama.cpp process can't be sized finer.
REAL_TOLERANCE_MIB = 96.0


class Pressure(Protocol):
    kind: str
    # Whether the memory a restarting GPU worker needs must be taken before the
    # worker is killed (simulated: the allocator is played at spawn time) or
    # after (real: the dying worker's memory has to come back first).
    starve_before_kill: bool

    def squeeze_to_spare(self, spare_mib: float, reserve_mib: float) -> dict[str, Any]: ...

    def starve_restart(self, need_mib: float) -> dict[str, Any]: ...

    def release(self) -> None: ...


class SimulatedPressure:
    kind = "simulated"
    starve_before_kill = True

    def __init__(self, url: str, api_key: str = "") -> None:
        self._http = httpx.Client(base_url=url, headers=bearer_header(api_key), timeout=10.0)

    def _gpu(self) -> GpuStatus:
        return self._http.get("/status").json()["gpu"]

    def _set(self, mib: float) -> GpuStatus:
        response = self._http.post("/admin/gpu", json={"simulated_pressure_mib": round(max(0.0, mib), 1)})
        response.raise_for_status()
        return response.json()["gpu"]

    def squeeze_to_spare(self, spare_mib: float, reserve_mib: float) -> dict[str, Any]:
        gpu = self._gpu()
        target_free = reserve_mib + spare_mib
        pressure = (gpu.get("pressure_mib") or 0.0) + (gpu["free_mib"] - target_free)
        after = self._set(pressure)
        return {"target_free_mib": round(target_free, 1), "free_mib": after["free_mib"],
                "pressure_mib": after.get("pressure_mib")}

    def starve_restart(self, need_mib: float) -> dict[str, Any]:
        gpu = self._gpu()
        # Half of what the worker needs stays free once it is gone: its restart can't allocate.
        after = self._set(gpu["total_mib"] - need_mib / 2)
        return {"pressure_mib": after.get("pressure_mib"), "free_after_worker_exit_mib": round(need_mib / 2, 1)}

    def release(self) -> None:
        try:
            self._set(0.0)
        except httpx.HTTPError:
            pass  # the service is already gone: nothing is held


@dataclass
class Holder:
    process: subprocess.Popen
    port: int
    n_ctx: int
    n_ubatch: int
    estimated_mib: float
    log_path: Path


class RealGpuPressure:
    kind = "real"
    starve_before_kill = False

    def __init__(self, url: str, status: Status, workdir: Path) -> None:
        from ..core.memory.gguf_info import read_model_info
        from ..core.memory.telemetry import NvmlGpuReader

        gpu_worker = next(w for w in status["workers"] if w["role"] == "gpu")
        self.model_path = Path(gpu_worker["model_path"])
        self.info = read_model_info(self.model_path)
        self._reader = NvmlGpuReader()
        self._workdir = workdir
        self.holders: list[Holder] = []
        # Started when a phase needs memory taken and closed by release(), so
        # between phases not even its CUDA context stays on the card.
        self.ballast: Ballast | None = None
        self._ballast_works = ballast_library() is not None

    def free_mib(self) -> float:
        free = self._reader.read().free_mib
        if free is None:
            raise PressureError("NVML can't read free VRAM")
        return free

    def squeeze_to_spare(self, spare_mib: float, reserve_mib: float) -> dict[str, Any]:
        target_free = reserve_mib + spare_mib
        self._take_down_to(target_free)
        return {"target_free_mib": round(target_free, 1), "free_mib": round(self.free_mib(), 1), **self._held()}

    def starve_restart(self, need_mib: float) -> dict[str, Any]:
        self._take_down_to(need_mib / 2)
        return {"free_mib": round(self.free_mib(), 1), **self._held()}

    def _held(self) -> dict[str, Any]:
        if self.ballast is not None:
            return {"ballast": self.ballast.library, "ballast_mib": self.ballast.held_mib}
        return {"holders": len(self.holders)}

    def _take_down_to(self, target_free_mib: float) -> None:
        if self.ballast is None and self._ballast_works:
            try:
                self.ballast = Ballast()
            except RuntimeError:
                self._ballast_works = False  # e.g. a CPU-only torch: llama.cpp holders instead
        if self.ballast is not None:
            # Closed loop on NVML's reading: a CUDA context of its own and the
            # driver's rounding make the first step land a little off.
            for _ in range(4):
                gap = self.free_mib() - target_free_mib
                if abs(gap) <= REAL_TOLERANCE_MIB:
                    return
                self.ballast.hold(self.ballast.held_mib + gap)
            return
        while len(self.holders) < MAX_HOLDERS:
            gap = self.free_mib() - target_free_mib
            if gap <= REAL_TOLERANCE_MIB:
                return
            self.holders.append(self._spawn_holder(gap))
        raise PressureError(f"{MAX_HOLDERS} llama.cpp processes could not bring free VRAM down to "
                            f"{target_free_mib:.0f} MiB (free: {self.free_mib():.0f} MiB)")

    def _spawn_holder(self, mib: float) -> Holder:
        from ..core.engine.worker import free_loopback_port
        from ..core.engine.runtime import parent_pid_environment

        n_ctx, n_ubatch, estimated = holder_size(self.info, mib)
        port = free_loopback_port()
        log_path = self._workdir / f"vram-holder-{len(self.holders) + 1}.log"
        # worker_main ties the holder's life to ours (PR_SET_PDEATHSIG): a
        # drill that dies can't leave VRAM taken.
        argv = [sys.executable, "-m", "tray_app.core.engine.worker_main", "--",
                "--model", str(self.model_path), "--host", "127.0.0.1", "--port", str(port),
                "--n_gpu_layers", "-1", "--n_ctx", str(n_ctx), "--n_batch", str(n_ubatch),
                "--n_ubatch", str(n_ubatch), "--logits_all", "False"]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, **parent_pid_environment()})
        holder = Holder(process, port, n_ctx, n_ubatch, estimated, log_path)
        deadline = time.monotonic() + HOLDER_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise PressureError(f"a VRAM holder (n_ctx {n_ctx}, n_ubatch {n_ubatch}) exited with "
                                    f"{process.returncode}; see {log_path}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2.0).status_code == 200:
                    return holder
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        process.kill()
        raise PressureError(f"a VRAM holder did not load within {HOLDER_READY_TIMEOUT_S:g} s; see {log_path}")

    def release(self) -> None:
        if self.ballast is not None:
            self.ballast.close()
            self.ballast = None
        for holder in self.holders:
            if holder.process.poll() is None:
                holder.process.send_signal(signal.SIGTERM)
        for holder in self.holders:
            try:
                holder.process.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(holder.process.pid, signal.SIGKILL)
                holder.process.wait()
        self.holders.clear()
        self._reader.close()


def holder_size(info: Any, target_mib: float) -> tuple[int, int, float]:
    """(n_ctx, n_ubatch, estimated MiB) of a llama.cpp process that takes about
    `target_mib` of VRAM, from the same memory model admission control uses.
    Not more than the target unless even the smallest holder is bigger: the
    next holder closes the gap, and an overshoot could starve the GPU worker
    when the step wanted headroom."""
    from ..core.memory.estimate import WorkerSettings, estimate_worker

    def size(n_ctx: int, n_ubatch: int) -> float:
        settings = WorkerSettings(n_ctx=n_ctx, n_gpu_layers=-1, n_batch=n_ubatch, n_ubatch=n_ubatch, logits_all=False)
        return estimate_worker(info, settings).gpu.total / MIB

    best = (256, 512, size(256, 512))
    # Big holders grow through the micro-batch (attention scores are n_ctx x
    # n_ubatch per head) rather than through a context far past what the
    # model was trained for.
    for n_ubatch in (512, 1024, 2048, 4096, 8192):
        low, high = 1, 512  # n_ctx in units of 256 tokens, up to 128k tokens
        while low < high:
            mid = (low + high + 1) // 2
            if size(mid * 256, n_ubatch) <= target_mib:
                low = mid
            else:
                high = mid - 1
        candidate = (low * 256, n_ubatch, size(low * 256, n_ubatch))
        if candidate[2] <= target_mib and candidate[2] > best[2]:
            best = candidate
    return best


class PressureError(Exception):
    """VRAM could not be taken the way the phase needs."""
