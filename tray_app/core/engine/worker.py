"""One supervised llama.cpp server process.

A single task (`_supervise`) owns the process and is the only writer of its
state. Callers send commands (start, stop, restart, report_failure) and wait
on events; nobody checks a state and then acts on it from outside.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx

from ..base.policies import RestartPolicy
from .exits import ExitKind, ExitReport
from .launch_env import LaunchExtras, WorkerSpec, launch_request, worker_environment
from .process import exits_within, liveness_problem, pid_alive, spawn, terminate, wait_ready
from .restart import Command, Commands, Outcome, backoff_delay, ending_report
from .runtime import WorkerRuntime
from .worker_log import LOG_FILE_BACKUPS, LOG_FILE_BYTES, LOG_TAIL_LINES, WorkerLog
from .worker_main import parse_device_line

# Also importable from here, where their users have always found them.
__all__ = ["LOG_FILE_BACKUPS", "LOG_FILE_BYTES", "RestartPolicy", "backoff_delay", "pid_alive",
           "worker_environment", "free_loopback_port", "Worker", "WorkerSpec", "WorkerState", "WorkerEvent",
           "WorkerHooks", "LaunchExtras"]

log = logging.getLogger(__name__)

# After a request fails, how long a dying process gets to finish dying before we kill it.
FAILURE_GRACE_S = 1.0


class WorkerState(str, enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    STOPPING = "stopping"


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class WorkerEvent:
    role: str
    state: WorkerState
    exit: ExitReport | None = None


class WorkerHooks:
    """Service-side effects around the process life; defaults do nothing."""

    async def before_spawn(self, worker: "Worker") -> LaunchExtras:
        return LaunchExtras()

    def on_event(self, event: WorkerEvent) -> None:
        pass


class Worker:
    def __init__(
        self,
        spec: WorkerSpec,
        runtime: WorkerRuntime,
        log_dir: Path,
        policy: RestartPolicy = RestartPolicy(),
        hooks: WorkerHooks | None = None,
        clock: Callable[[], float] = time.monotonic,
        log_name: str | None = None,
    ) -> None:
        self.spec = spec
        # The log file's name: the role's, unless several workers share a
        # role (each library model has a GPU and a CPU worker).
        self._log_name = log_name or spec.role
        self.runtime = runtime
        self.policy = policy
        self._hooks = hooks or WorkerHooks()
        self._clock = clock
        self._state = WorkerState.STOPPED
        self._state_changed = asyncio.Event()
        self._process: asyncio.subprocess.Process | None = None
        self._port: int | None = None
        self._commands = Commands()
        self._task: asyncio.Task | None = None
        self._log = WorkerLog(log_dir, self._log_name)
        self.last_exit: ExitReport | None = None
        # How many processes have exited so far: a request notes it when it
        # starts, to ask afterwards how *its* process ended.
        self.exits = 0
        self.restarts = 0
        self.ready_since: float | None = None
        # When the current load began (the worker's clock), while it loads.
        self.loading_since: float | None = None
        self.last_ready_duration_s: float | None = None
        self.unhealthy_reason: str | None = None
        self.gave_up: str | None = None
        # The devices the running process's llama.cpp sees, as it names them
        # (the wrapper lists them for a llama-server that offloads); empty
        # for a CPU worker and for llama-cpp-python's server.
        self.devices: list[dict] = []
        # The worker's port is on loopback, where any local process or web
        # page could reach it: it answers only requests that carry this
        # secret, which only the service knows, so nothing skips admission.
        self._secret = secrets.token_urlsafe(32)
        self._http = httpx.AsyncClient(headers=self.auth_headers)

    # ----- read side -----------------------------------------------------

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def state(self) -> WorkerState:
        return self._state

    @property
    def pid(self) -> int | None:
        process = self._process
        return process.pid if process is not None and process.returncode is None else None

    @property
    def port(self) -> int | None:
        return self._port

    @property
    def base_url(self) -> str | None:
        return f"http://127.0.0.1:{self._port}" if self._port else None

    def load_eta_s(self, prior_s: float) -> float:
        """Seconds until this worker would be ready: 0 when it is; else its
        last measured load (or `prior_s`), less what a load under way has
        already taken. A load running late is still expected to end soon:
        at least a second."""
        if self._state is WorkerState.READY:
            return 0.0
        total = self.last_ready_duration_s if self.last_ready_duration_s is not None else prior_s
        elapsed = self._clock() - self.loading_since if self.loading_since is not None else 0.0
        return max(1.0, total - elapsed)

    def liveness_problem(self) -> str | None:
        """Why the process can make no progress right now, or None (see process.liveness_problem)."""
        return liveness_problem(self._process)

    @property
    def auth_headers(self) -> dict[str, str]:
        """Headers every request to this worker must carry."""
        return {"Authorization": f"Bearer {self._secret}"}

    @property
    def log_path(self) -> Path:
        return self._log.path

    def log_tail(self, lines: int = 50) -> list[str]:
        return self._log.tail(lines)

    @property
    def log_lines(self) -> int:
        """How many lines the worker has written so far (a mark for log_since)."""
        return self._log.lines

    def log_since(self, mark: int) -> list[str]:
        """The lines written after `mark` (as many as the tail still holds)."""
        return self._log.since(mark)

    def snapshot(self) -> dict:
        return {
            "role": self.role,
            "state": self._state.value,
            "pid": self.pid,
            "port": self._port,
            "model": self.spec.model_name,
            "model_path": str(self.spec.model_path),
            "n_ctx": self.spec.n_ctx,
            "n_gpu_layers": self.spec.n_gpu_layers,
            "speculative": self.spec.spec_type,
            "draft_model": self.spec.draft_model.name if self.spec.draft_model else None,
            "devices": list(self.devices) if self.pid else [],
            "runtime": self.runtime.name,
            "restarts": self.restarts,
            "unhealthy_reason": self.unhealthy_reason,
            "gave_up": self.gave_up,
            "last_exit": None if self.last_exit is None else self.last_exit.as_status(),
            "last_load_s": self.last_ready_duration_s,
            "log": str(self.log_path),
        }

    async def wait_for_state(self, *states: WorkerState, timeout: float | None = None) -> WorkerState:
        async def _wait() -> WorkerState:
            while self._state not in states:
                self._state_changed.clear()
                await self._state_changed.wait()
            return self._state

        return await asyncio.wait_for(_wait(), timeout)

    async def exit_after(self, exits_seen: int, timeout: float) -> ExitReport | None:
        """How the process that was running when `exits` was `exits_seen`
        ended, waiting up to `timeout` for it; None if it is still running."""
        async def _wait() -> None:
            while self.exits <= exits_seen:
                self._state_changed.clear()
                await self._state_changed.wait()

        try:
            await asyncio.wait_for(_wait(), timeout)
        except asyncio.TimeoutError:
            return None
        return self.last_exit

    async def ensure_ready(self, timeout: float | None = None) -> bool:
        """Start if needed and wait for READY; False if it gave up or timed out.

        A stop under way (an idle unload, an eviction) is waited out first,
        then the worker starts again: starting into it would be a no-op that
        ends with the stop. Here, not in callers, because a caller that reads
        the state and then starts races the owner (llama-swap's EnsureReady)."""
        async def _ready() -> None:
            if self._state is WorkerState.STOPPING:
                await self.wait_for_state(WorkerState.STOPPED, WorkerState.STARTING, WorkerState.READY)
            self.start()
            await self._until_ready_or_given_up()

        try:
            await asyncio.wait_for(_ready(), timeout)
        except asyncio.TimeoutError:
            return False
        return self._state is WorkerState.READY

    async def _until_ready_or_given_up(self) -> None:
        # Also ends when the owner task does (the worker was stopped meanwhile).
        while (self._state is not WorkerState.READY and self.gave_up is None
               and self._task is not None and not self._task.done()):
            self._state_changed.clear()
            await self._state_changed.wait()

    # ----- commands ------------------------------------------------------

    def start(self) -> None:
        if self._task is None or self._task.done():
            self.gave_up = None
            # Commands for the owner that ended are moot (a second stop of it).
            self._commands = Commands()
            self._task = asyncio.create_task(self._supervise(), name=f"worker-{self.role}")

    def request_stop(self) -> None:
        """Ask the owner to stop the process, without waiting. The state says
        STOPPING from this moment, for everyone who looks: no request may be
        sent to the process in the moment before its owner acts."""
        task = self._task
        if task is None or task.done():
            self._set_state(WorkerState.STOPPED)
            return
        self._commands.put(Command.STOP, "stop requested")
        self._set_state(WorkerState.STOPPING)

    async def stop(self) -> None:
        self.request_stop()
        task = self._task
        if task is not None and not task.done():
            await asyncio.shield(task)

    def restart(self, reason: str = "restart requested") -> None:
        if self._task is None or self._task.done():
            self.start()
        else:
            self._commands.put(Command.RESTART, reason)

    def report_failure(self, reason: str, process: int | None = None) -> None:
        """A request failed on this worker: ask the owner to replace it. The
        owner marks it unhealthy; callers keep work away from it themselves
        meanwhile (see Backend), they never write its state.

        `process` is `exits` as it was when the failing request started: a
        report about a process that has exited since is moot, and must not
        take down its healthy replacement."""
        if process is not None and process != self.exits:
            return
        self._commands.put(Command.FAILED, reason)

    async def close(self) -> None:
        await self.stop()
        await self._http.aclose()
        self._log.close()

    # ----- the owner loop ------------------------------------------------

    async def _supervise(self) -> None:
        attempt = 0
        try:
            while True:
                self._commands.drop_stale()
                outcome = await self._run_once()
                if outcome.stop:
                    break
                if outcome.exit.kind is ExitKind.BAD_MODEL:
                    # Restarting cannot fix a file that does not load.
                    self.gave_up = outcome.exit.describe()
                    break
                if outcome.immediate:
                    attempt = 0
                    continue
                delay = backoff_delay(attempt, self.policy.backoff_base_s, self.policy.backoff_cap_s)
                attempt = 0 if outcome.was_ready else attempt + 1
                log.info("%s worker restarting in %.1f s after %s", self.role, delay, outcome.exit.describe())
                if await self._commands.sleep_unless_stopped(delay, self._clock):
                    break
        finally:
            self._port = None
            self.loading_since = None
            self._set_state(WorkerState.STOPPED)

    async def _run_once(self) -> Outcome:
        self.loading_since = self._clock()
        self._set_state(WorkerState.STARTING)
        extras = await self._hooks.before_spawn(self)
        self._port = free_loopback_port()
        launch = launch_request(self.spec, self._port, extras, self._secret)
        argv = self.runtime.argv(launch)
        self._log.new_process()
        self.devices = []
        self._log.note("---- starting %s worker: %s", self.role, " ".join(argv))
        spawned_at = self._clock()
        env = worker_environment(os.environ, self.runtime.environment(launch), shares=self.spec.shares_cores)
        self._process = process = await spawn(argv, env)
        assert process.stdout is not None
        pump = asyncio.create_task(self._log.capture(process.stdout, self._note_device), name=f"log-{self.role}")
        exited = asyncio.create_task(process.wait())
        command: Command | None = None
        why_replaced: str | None = None
        try:
            ready = await wait_ready(lambda url: self.runtime.probe(self._http, url), self.base_url or "", exited,
                                     self._commands.pending, self._clock, self.policy.ready_timeout_s)
            loading_since, self.loading_since = self.loading_since, None
            if ready:
                # From the start of the load, as load_eta_s counts it: what
                # before_spawn waited (VRAM coming back) is part of a load.
                self.last_ready_duration_s = round(self._clock() - (loading_since or spawned_at), 3)
                self.ready_since = time.time()
                self.unhealthy_reason = None
                self._set_state(WorkerState.READY)
                command, why_replaced = await self._wait_exit_or_command(exited)
                if command is Command.FAILED:
                    self.unhealthy_reason = why_replaced
                    self._set_state(WorkerState.UNHEALTHY)
                if command is Command.FAILED and await exits_within(exited, FAILURE_GRACE_S):
                    # The failure the service saw was the process dying: classify
                    # it as the crash it is, not as something we did.
                    command, why_replaced = None, None
            elif not exited.done():
                if self._commands.pending():
                    command, why_replaced = self._commands.take_nowait()
                else:
                    why_replaced = f"did not become ready within {self.policy.ready_timeout_s:g} s"
            if command in (Command.STOP, Command.RESTART):
                self._set_state(WorkerState.STOPPING)
            elif why_replaced is not None and not exited.done():
                self.unhealthy_reason = why_replaced
                self._set_state(WorkerState.UNHEALTHY)
            if not exited.done():
                await terminate(process, exited, self.policy.stop_timeout_s)
            await exited
            await pump
        except asyncio.CancelledError:
            if process.returncode is None:
                await terminate(process, exited, self.policy.stop_timeout_s)
            raise
        report = ending_report(process.returncode, self._log.tail(LOG_TAIL_LINES), command, why_replaced)
        return self._record_exit(report, stop=command is Command.STOP, immediate=command is Command.RESTART,
                                 was_ready=ready)

    async def _wait_exit_or_command(self, exited: asyncio.Task) -> tuple[Command | None, str | None]:
        command_task = asyncio.create_task(self._commands.take())
        done, _ = await asyncio.wait({exited, command_task}, return_when=asyncio.FIRST_COMPLETED)
        if command_task in done:
            return command_task.result()
        command_task.cancel()
        return None, None

    def _record_exit(self, report: ExitReport, stop: bool, immediate: bool, was_ready: bool) -> Outcome:
        self.last_exit = report
        self.exits += 1
        self._state_changed.set()
        self._process = None
        self.ready_since = None
        self._log.note("---- %s worker exited: %s", self.role, report.describe())
        if report.kind is not ExitKind.CLEAN_STOP:
            log.warning("%s worker exited: %s", self.role, report.describe())
            self.unhealthy_reason = report.describe()
            self._set_state(WorkerState.UNHEALTHY, report)
        else:
            self._hooks.on_event(WorkerEvent(self.role, self._state, report))
        if not stop:
            self.restarts += 1
        return Outcome(report, stop=stop, immediate=immediate, was_ready=was_ready)

    def _note_device(self, line: str) -> None:
        if (device := parse_device_line(line)) is not None:
            self.devices.append(device)

    def _set_state(self, state: WorkerState, exit: ExitReport | None = None) -> None:
        if state is self._state and exit is None:
            return
        self._state = state
        self._state_changed.set()
        self._hooks.on_event(WorkerEvent(self.role, state, exit))
