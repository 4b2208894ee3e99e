"""How a llama.cpp server process is launched and probed, in one place.

Everything that depends on *which* server runs (llama-cpp-python's server
today; the native `llama-server` binary later, which batches concurrent
requests) lives behind WorkerRuntime. The supervisor and router only use
this interface.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx


@dataclass(frozen=True)
class LaunchRequest:
    """What the supervisor wants started; the runtime turns it into argv."""

    model_path: Path
    port: int
    n_ctx: int
    n_gpu_layers: int
    n_batch: int
    n_threads: int  # 0 = runtime default
    # For a simulated device: what the worker would allocate, and what is free.
    simulated_vram_need_mib: float | None = None
    simulated_vram_free_mib: float | None = None
    # The secret the worker must demand of every request (see Worker).
    api_key: str | None = None


# The worker wrapper takes the secret from here and removes it from its
# environment, so it is never in argv (visible to every user in ps) and never
# inherited by anything the worker starts.
WORKER_KEY_VARIABLE = "TRAY_APP_WORKER_KEY"
# The supervisor's pid, set by whoever launches the wrapper. Only the parent
# knows it for certain: by the time the child can call os.getppid(), a dead
# parent has already been replaced by init (or a subreaper).
PARENT_PID_ENV = "TRAY_APP_PARENT_PID"


def parent_pid_environment() -> dict[str, str]:
    """What a launcher adds to the worker wrapper's environment, read in the launcher."""
    return {PARENT_PID_ENV: str(os.getpid())}


class WorkerRuntime(Protocol):
    name: str
    # Requests one process serves at once without one cutting another short.
    max_parallel: int

    def argv(self, launch: LaunchRequest) -> list[str]: ...

    def environment(self, launch: LaunchRequest) -> dict[str, str]:
        """Variables to set on top of ours."""
        ...

    async def probe(self, client: httpx.AsyncClient, base_url: str) -> bool:
        """True once the server can answer completions."""
        ...


class LlamaCppPythonRuntime:
    """llama-cpp-python's OpenAI server, started through our thin wrapper.

    The wrapper (tray_app.core.engine.worker_main) ties the worker's life to ours and
    plays the simulated device's allocator; the rest is the stock server.
    """

    name = "llama-cpp-python"
    # The server holds one lock around the model: it runs one request at a time.
    max_parallel = 1

    def __init__(self, python: str = sys.executable) -> None:
        self._python = python

    def argv(self, launch: LaunchRequest) -> list[str]:
        args = [self._python, "-m", "tray_app.core.engine.worker_main"]
        if launch.simulated_vram_need_mib is not None and launch.simulated_vram_free_mib is not None:
            args += [
                "--sim-vram-need-mib", f"{launch.simulated_vram_need_mib:.1f}",
                "--sim-vram-free-mib", f"{launch.simulated_vram_free_mib:.1f}",
            ]
        args += [
            "--",
            "--model", str(launch.model_path),
            "--host", "127.0.0.1",
            "--port", str(launch.port),
            "--n_ctx", str(launch.n_ctx),
            "--n_gpu_layers", str(launch.n_gpu_layers),
            "--n_batch", str(launch.n_batch),
            # Without this a new request aborts the stream in progress.
            "--interrupt_requests", "False",
            # The default keeps a float32 vocabulary-sized row of logits per
            # context token: 1.5 GiB for SmolLM2 at 8k. Only logprobs need it.
            "--logits_all", "False",
        ]
        if launch.n_threads > 0:
            args += ["--n_threads", str(launch.n_threads)]
        return args

    def environment(self, launch: LaunchRequest) -> dict[str, str]:
        env = parent_pid_environment()
        if launch.api_key:
            env[WORKER_KEY_VARIABLE] = launch.api_key
        if launch.n_gpu_layers == 0:
            # A CUDA build at -ngl 0 still makes a CUDA context and a GPU compute
            # buffer; the CPU fallback must not be able to run out of VRAM.
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    async def probe(self, client: httpx.AsyncClient, base_url: str) -> bool:
        # The server loads the model before it listens, so an answer from
        # /v1/models means the model is in memory.
        try:
            response = await client.get(f"{base_url}/v1/models", timeout=2.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200
