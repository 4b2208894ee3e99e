"""Model servers started on their own, outside the service: what a benchmark
compares the service against, on the same model file and thread count."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from tray_app.core.config import bundled_model_path
from tray_app.core.engine.runtime import LLAMA_SERVER_ENV, bundled_llama_server, library_dirs
from tray_app.core.engine.worker import free_loopback_port


class Anchor:
    """One server process on a free loopback port, stopped with stop()."""

    def __init__(self, name: str, port: int, argv: list[str], env: dict[str, str], ready_path: str,
                 log: Path) -> None:
        self.name = name
        self.port = port
        self._log = open(log, "wb")
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **env})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the {name} anchor exited with {self.process.returncode}; see {log}")
            try:
                if httpx.get(f"{self.url}{ready_path}", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the {name} anchor did not start; see {log}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss_mib(self) -> float:
        return psutil.Process(self.process.pid).memory_info().rss / 2**20

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


def llama_server(log: Path, *, n_ctx: int, parallel: int, threads: int = 0, model: Path | None = None,
                 env: dict[str, str] | None = None, extra_args: tuple[str, ...] = ()) -> Anchor:
    """The llama-server the service would run (TRAY_APP_LLAMA_SERVER, else
    the bundled one) as its README would start it: n_ctx per slot; threads
    0 = its own default; `env` on top of this process's; `extra_args` last."""
    chosen = os.environ.get(LLAMA_SERVER_ENV)
    binary = Path(chosen) if chosen else bundled_llama_server()
    if binary is None:
        raise SystemExit("llama-server is not installed: run packaging/install.sh")
    port = free_loopback_port()
    argv = [str(binary), "--model", str(model or bundled_model_path()), "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(parallel), "--ctx-size", str(n_ctx * parallel), "--jinja", "--no-webui",
            *(["--threads", str(threads)] if threads > 0 else []), *extra_args]
    # As the service's runtime does: the binary's own folders first, then the
    # inherited path (where the GPU check's CUDA libraries are).
    inherited = os.environ.get("LD_LIBRARY_PATH", "")
    env = {**(env or {}), "LD_LIBRARY_PATH": os.pathsep.join(
        [*(str(d) for d in library_dirs(binary, bundled=not chosen)), *([inherited] if inherited else [])])}
    return Anchor("llama-server", port, argv, env, "/health", log)


def llama_cpp_python(log: Path, *, n_ctx: int, threads: int, model: Path | None = None) -> Anchor:
    """llama-cpp-python's server, with the settings its runtime launches workers with."""
    port = free_loopback_port()
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(model or bundled_model_path()),
            "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx), "--n_gpu_layers", "0",
            "--n_threads", str(threads), "--interrupt_requests", "False", "--logits_all", "False"]
    return Anchor("llama-cpp-python", port, argv, {}, "/v1/models", log)
