"""A worker with no process: a `WorkerHandle` whose life is a few lines.

It keeps Worker's contract where the layers above read it: state changes go
through one place and reach the hooks (`before_spawn` before a load,
`on_event` on each change), `ensure_ready` waits out a stop and then loads,
`exits` counts ended processes. Its HTTP is elsewhere: `base_url` names a
host the fake upstream (upstream.py) answers for.

Two modes. By default it is a stand-in for pure-logic tests: a failure
report is only recorded, `exit_after` answers `exit_report` at once. With
`live=True` (what FakeWorkers builds for an in-process Service) it acts as
an owned process does: a failure report replaces the process (UNHEALTHY,
one more exit, loading, READY) and `exit_after` waits for an exit.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Callable

from tray_app.core.engine.exits import ExitKind, ExitReport
from tray_app.core.engine.worker import WorkerEvent, WorkerHooks, WorkerSpec, WorkerState

CLEAN_STOP = ExitReport(ExitKind.CLEAN_STOP, 0, None, None)
KILLED = ExitReport(ExitKind.CRASH, -9, "SIGKILL", None)


def spec_for(role: str) -> WorkerSpec:
    return WorkerSpec(role, Path(f"/models/{role}.gguf"), role, n_ctx=2048, n_gpu_layers=99 if role == "gpu" else 0)


class FakeRuntime:
    """A WorkerRuntime nothing is launched with (FakeWorker has no process)."""

    name = "fake"
    max_parallel = 64
    supports_logprobs = True
    supports_rpc = False

    def describe(self) -> str:
        return "fake upstream (tests/fakes)"

    def argv(self, launch: Any) -> list[str]:
        raise AssertionError("a FakeWorker launches no process")

    def environment(self, launch: Any) -> dict[str, str]:
        return {}

    async def probe(self, http: Any, base_url: str) -> bool:
        return True


class FakeWorker:
    def __init__(self, spec: WorkerSpec | str = "gpu", runtime: Any = None, log_dir: Path | None = None,
                 policy: Any = None, hooks: WorkerHooks | None = None, clock: Callable[[], float] = time.monotonic,
                 log_name: str | None = None, *, state: WorkerState = WorkerState.READY, live: bool = False,
                 reject_stale_reports: bool = False) -> None:
        self.spec = spec_for(spec) if isinstance(spec, str) else spec
        self.runtime = runtime or FakeRuntime()
        self.name = log_name or self.spec.role
        self._log_dir = log_dir or Path("/nonexistent")
        self._hooks = hooks or WorkerHooks()
        self._clock = clock
        self._state = state
        self._changed = asyncio.Event()
        self._live = live
        # A report about a process that exited since is a caller's bug: the
        # dispatcher's tests turn this on to catch it (the real Worker ignores it).
        self._reject_stale_reports = reject_stale_reports
        self._load: asyncio.Task | None = None
        self._stopping: asyncio.Task | None = None
        self.exits = 0
        self.restarts = 0
        self.last_exit: ExitReport | None = None
        self.gave_up: str | None = None
        self.unhealthy_reason: str | None = None
        self.last_ready_duration_s: float | None = None
        self.devices: list[dict] = []
        # ----- knobs and records -----
        self.loads_started = 0
        self.failures: list[str] = []
        self.load_gate: asyncio.Event | None = None  # set: a load waits for it
        self.refuses_to_load: str | None = None  # a load gives up with this reason
        self.liveness: str | None = None  # what liveness_problem answers
        self.exit_report: ExitReport | None = None  # what exit_after answers (not live)
        self.exit_after_calls: list[tuple[int, float]] = []
        self.exit_gate: asyncio.Event | None = None  # set: exit_after waits for it

    # ----- read side -----------------------------------------------------

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def state(self) -> WorkerState:
        return self._state

    @state.setter
    def state(self, state: WorkerState) -> None:
        # Tests put a worker in a state directly; waiters wake as for a real change.
        self._set_state(state)

    pid = None  # no process: nothing of ours in the memory telemetry

    @property
    def base_url(self) -> str:
        return f"http://{self.name}.worker"

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer secret-of-{self.name}"}

    @property
    def log_path(self) -> Path:
        return self._log_dir / f"{self.name}-worker.log"

    log_lines = 0

    def log_since(self, mark: int) -> list[str]:
        return []

    def log_tail(self, lines: int = 50) -> list[str]:
        return []

    def load_eta_s(self, prior_s: float) -> float:
        return 0.0 if self._state is WorkerState.READY else prior_s

    def liveness_problem(self) -> str | None:
        return self.liveness

    def snapshot(self) -> dict[str, Any]:
        return {
            "role": self.role, "state": self._state.value, "pid": None, "port": None, "model": self.spec.model_name,
            "model_path": str(self.spec.model_path), "n_ctx": self.spec.n_ctx, "n_gpu_layers": self.spec.n_gpu_layers,
            "speculative": self.spec.spec_type,
            "draft_model": self.spec.draft_model.name if self.spec.draft_model else None,
            "devices": [], "runtime": self.runtime.name, "restarts": self.restarts,
            "unhealthy_reason": self.unhealthy_reason, "gave_up": self.gave_up,
            "last_exit": None if self.last_exit is None else {
                "kind": self.last_exit.kind.value, "returncode": self.last_exit.returncode,
                "signal": self.last_exit.signal_name, "evidence": self.last_exit.evidence,
                "description": self.last_exit.describe()},
            "last_load_s": self.last_ready_duration_s, "log": str(self.log_path),
        }

    async def wait_for_state(self, *states: WorkerState, timeout: float | None = None) -> WorkerState:
        await asyncio.wait_for(self._until(lambda: self._state in states), timeout)
        return self._state

    async def exit_after(self, exits_seen: int, timeout: float) -> ExitReport | None:
        self.exit_after_calls.append((exits_seen, timeout))
        if self.exit_gate is not None:
            await self.exit_gate.wait()
        if not self._live:
            return self.exit_report
        try:
            await asyncio.wait_for(self._until(lambda: self.exits > exits_seen), timeout)
        except asyncio.TimeoutError:
            return None
        return self.last_exit

    async def ensure_ready(self, timeout: float | None = None) -> bool:
        async def ready() -> None:
            if self._state is WorkerState.STOPPING:
                await self._until(lambda: self._state is not WorkerState.STOPPING)
            self.start()
            if self._load is not None:
                await asyncio.shield(self._load)

        try:
            await asyncio.wait_for(ready(), timeout)
        except asyncio.TimeoutError:
            return False
        return self._state is WorkerState.READY

    # ----- commands ------------------------------------------------------

    def start(self) -> None:
        if self._state is WorkerState.STOPPED:
            self.gave_up = None
            self._load = asyncio.create_task(self._run_load(), name=f"fake-load-{self.name}")

    def request_stop(self) -> None:
        if self._state is WorkerState.STOPPED or self._stopping is not None:
            return
        self._set_state(WorkerState.STOPPING)
        self._stopping = asyncio.create_task(self._run_stop(), name=f"fake-stop-{self.name}")

    async def stop(self) -> None:
        self.request_stop()
        if self._stopping is not None:
            await asyncio.shield(self._stopping)

    def restart(self, reason: str = "restart requested") -> None:
        if self._state is WorkerState.STOPPED:
            self.start()
        else:
            self._set_state(WorkerState.STOPPING)
            self._replace(CLEAN_STOP)

    def report_failure(self, reason: str, process: int | None = None) -> None:
        if process is not None and process != self.exits:
            assert not self._reject_stale_reports, "a report about a process that exited since"
            return
        self.failures.append(reason)
        if self._live and self._state is WorkerState.READY:
            self.unhealthy_reason = reason
            self._set_state(WorkerState.UNHEALTHY)
            self._replace(ExitReport(ExitKind.ERROR, -15, "SIGTERM", reason))

    async def close(self) -> None:
        await self.stop()

    def crash(self, report: ExitReport = KILLED) -> None:
        """The process dies now (killed, by default); a live worker's owner loads a new one."""
        if self._live:
            self._replace(report)
        else:
            self._record_exit(report)

    # ----- the owner's side --------------------------------------------------

    def _replace(self, report: ExitReport) -> None:
        """The process ended (`report`) and its owner loads a new one."""
        self._record_exit(report)
        self.restarts += 1
        self._load = asyncio.create_task(self._run_load(), name=f"fake-reload-{self.name}")

    async def _run_load(self) -> None:
        self.loads_started += 1
        began = self._clock()
        self._set_state(WorkerState.STARTING)
        await self._hooks.before_spawn(self)  # type: ignore[arg-type]
        if self.load_gate is not None:
            await self.load_gate.wait()
        if self.refuses_to_load is not None:
            self.gave_up = self.refuses_to_load
            self._record_exit(ExitReport(ExitKind.BAD_MODEL, 1, None, self.refuses_to_load))
            self._set_state(WorkerState.STOPPED)
            return
        self.last_ready_duration_s = round(self._clock() - began, 3)
        self.unhealthy_reason = None
        self._set_state(WorkerState.READY)

    async def _run_stop(self) -> None:
        try:
            load = self._load
            if load is not None and not load.done():
                load.cancel()
                await asyncio.gather(load, return_exceptions=True)
            self._record_exit(CLEAN_STOP)
            self._set_state(WorkerState.STOPPED)
        finally:
            self._stopping = None

    def _record_exit(self, report: ExitReport) -> None:
        self.last_exit = report
        self.exits += 1
        if report.kind is ExitKind.CLEAN_STOP:
            self._changed.set()
            self._hooks.on_event(WorkerEvent(self.role, self._state, report))
        else:
            self.unhealthy_reason = report.describe()
            self._set_state(WorkerState.UNHEALTHY, report)

    def _set_state(self, state: WorkerState, exit: ExitReport | None = None) -> None:
        if state is self._state and exit is None:
            return
        self._state = state
        self._changed.set()
        self._hooks.on_event(WorkerEvent(self.role, state, exit))

    async def _until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            self._changed.clear()
            await self._changed.wait()


class FakeWorkers:
    """A worker factory for Service(worker_factory=...): each worker it builds
    is a live FakeWorker, kept by its name (the log name: "gpu", "cpu",
    "gpu-<model>", "embed") so tests can reach it."""

    def __init__(self) -> None:
        self.built: dict[str, FakeWorker] = {}

    def __call__(self, spec: WorkerSpec, runtime: Any, log_dir: Path, policy: Any = None,
                 hooks: WorkerHooks | None = None, clock: Callable[[], float] = time.monotonic,
                 log_name: str | None = None) -> FakeWorker:
        worker = FakeWorker(spec, runtime, log_dir, policy, hooks, clock, log_name,
                            state=WorkerState.STOPPED, live=True)
        self.built[worker.name] = worker
        return worker

    def __getitem__(self, name: str) -> FakeWorker:
        return self.built[name]
