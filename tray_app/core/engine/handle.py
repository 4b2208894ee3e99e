"""`WorkerHandle`: what the layers above the engine use of a worker.

`Backend`, residency and the embedding path depend on this protocol, not on
the concrete `Worker`, so the service and the HTTP app can run in-process in
tests with a stand-in worker (tests/fakes/) whose HTTP goes to a fake
upstream: no llama.cpp process. `Worker` is the one real implementation.

Read side and commands only: nobody above the engine writes a worker's
state; they send commands to its owner and wait (see engine/worker.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

from .exits import ExitReport
from .runtime import WorkerRuntime
from .worker import WorkerSpec, WorkerState


# Checkable at run time, so a test can hold the real Worker and the fake to it.
@runtime_checkable
class WorkerHandle(Protocol):
    spec: WorkerSpec
    runtime: WorkerRuntime
    # How many processes have exited so far: a request notes it when it
    # starts, to ask afterwards how *its* process ended.
    exits: int
    restarts: int
    last_exit: ExitReport | None
    gave_up: str | None
    unhealthy_reason: str | None
    last_ready_duration_s: float | None
    devices: list[dict]

    # ----- read side -----------------------------------------------------

    @property
    def role(self) -> str: ...

    @property
    def state(self) -> WorkerState: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def base_url(self) -> str | None: ...

    @property
    def auth_headers(self) -> dict[str, str]: ...

    @property
    def log_path(self) -> Path: ...

    @property
    def log_lines(self) -> int: ...

    def log_since(self, mark: int) -> list[str]: ...

    def log_tail(self, lines: int = 50) -> list[str]: ...

    def load_eta_s(self, prior_s: float) -> float: ...

    def liveness_problem(self) -> str | None: ...

    def snapshot(self) -> dict[str, Any]: ...

    async def wait_for_state(self, *states: WorkerState, timeout: float | None = None) -> WorkerState: ...

    async def exit_after(self, exits_seen: int, timeout: float) -> ExitReport | None: ...

    async def ensure_ready(self, timeout: float | None = None) -> bool: ...

    # ----- commands ------------------------------------------------------

    def start(self) -> None: ...

    def request_stop(self) -> None: ...

    async def stop(self) -> None: ...

    def restart(self, reason: str = "restart requested") -> None: ...

    def report_failure(self, reason: str, process: int | None = None) -> None: ...

    async def close(self) -> None: ...


# How the service builds a worker: Worker's constructor, or a test's stand-in.
# Called as Worker(spec, runtime, log_dir, policy, hooks, clock, log_name=...).
WorkerFactory = Callable[..., WorkerHandle]
