"""One supervised llama.cpp server process.

A single task (`_supervise`) owns the process and is the only writer of its
state. Callers send commands (start, stop, restart, report_failure) and wait
on events; nobody checks a state and then acts on it from outside.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import logging.handlers
import os
import secrets
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import psutil

from ..files import PrivateRotatingFileHandler, make_private_dir
from .exits import ExitKind, ExitReport, classify_exit
from .gpu_env import user_environment
from .runtime import LaunchRequest, WorkerRuntime
from .worker_main import parse_device_line

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 200
LOG_FILE_BYTES = 2 * 1024 * 1024
LOG_FILE_BACKUPS = 3
# After a request fails, how long a dying process gets to finish dying before we kill it.
FAILURE_GRACE_S = 1.0


class WorkerState(str, enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    STOPPING = "stopping"


@dataclass(frozen=True)
class RestartPolicy:
    # Also the [worker] section of the config (config.WorkerConfig extends it).
    ready_timeout_s: float = 180.0
    stop_timeout_s: float = 5.0
    backoff_base_s: float = 0.5
    backoff_cap_s: float = 30.0


def backoff_delay(attempt: int, base_s: float, cap_s: float) -> float:
    """Delay before restart number `attempt` (0-based): base * 2^attempt, capped."""
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    return min(cap_s, base_s * (2 ** min(attempt, 30)))


# What a worker inherits from our environment: what it needs to find its
# libraries, its locale and its device, and to size its threads. Nothing else:
# llama-cpp-python's server reads unprefixed settings (HOST, PORT, API_KEY,
# CONFIG_FILE, ...) from the environment, so a stray variable in the user's
# shell could put a worker on the LAN or stop it from starting.
_INHERITED_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR",
    "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "SYSTEMROOT",
})
_INHERITED_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "HIP_", "ROCR_", "GGML_", "VK_", "OMP_", "OPENBLAS_", "MKL_",
                       "GOMP_", "KMP_")


# llama.cpp's OpenMP threads spin after each parallel region before they
# sleep (libgomp's default spin count is 300,000). Two llama.cpp processes
# busy on the same cores then mostly spin against each other: the CPU worker
# answering while the GPU worker loads (after an idle unload, a give-back or
# a crash), or while a game needs the cores. Measured on 2 cores, a CPU answer
# during a (simulated) GPU load took 6.3 s at the default and 0.7 s at 5,000,
# while one stream alone decoded 104-116 tok/s against 116-125 at the
# default. OMP_WAIT_POLICY=passive (no spinning) cost 60 % of that speed. A
# user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
OPENMP_SPIN_DEFAULT = {"GOMP_SPINCOUNT": "5000"}


def worker_environment(parent: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    """The environment a worker starts with: an allowlist of the user's, plus the runtime's own.

    The user's, not ours: the router hides the GPUs from itself (gpu_env),
    and the GPU worker is the one process that must see them."""
    kept = {name: value for name, value in user_environment(parent).items()
            if name in _INHERITED_NAMES or name.startswith(_INHERITED_PREFIXES)}
    spin = {} if {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & kept.keys() else OPENMP_SPIN_DEFAULT
    return {**spin, **kept, **extra}


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


@dataclass(frozen=True)
class LaunchExtras:
    simulated_vram_need_mib: float | None = None
    simulated_vram_free_mib: float | None = None


@dataclass(frozen=True)
class WorkerSpec:
    role: str  # "gpu" or "cpu"
    model_path: Path
    model_name: str
    n_ctx: int
    n_gpu_layers: int
    n_batch: int = 512
    n_threads: int = 0
    # Slots: requests the process decodes at once, each with its own n_ctx.
    parallel: int = 1
    rpc_servers: tuple[str, ...] = ()


class _Command(enum.Enum):
    STOP = "stop"
    RESTART = "restart"
    FAILED = "failed"


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
        self._command: asyncio.Queue[tuple[_Command, str]] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._log_tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._log_lines = 0
        self._file_log = self._make_file_logger(log_dir)
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
        # secret, which only the router knows, so nothing skips admission.
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
        """Why the process can make no progress right now, or None. Cheap
        enough to ask every second while a request waits on it: a frozen
        worker (SIGSTOP, a debugger) is found in seconds, not at the
        first-token deadline."""
        process = self._process
        if process is None or process.returncode is not None:
            return "the worker process is gone"
        try:
            status = psutil.Process(process.pid).status()
        except psutil.Error:
            return "the worker process is gone"
        if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
            return "the worker process is stopped (SIGSTOP or a debugger) and makes no progress"
        if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return "the worker process has exited"
        return None

    @property
    def auth_headers(self) -> dict[str, str]:
        """Headers every request to this worker must carry."""
        return {"Authorization": f"Bearer {self._secret}"}

    @property
    def log_path(self) -> Path:
        return Path(self._file_handler.baseFilename)

    def log_tail(self, lines: int = 50) -> list[str]:
        return list(self._log_tail)[-lines:]

    @property
    def log_lines(self) -> int:
        """How many lines the worker has written so far (a mark for log_since)."""
        return self._log_lines

    def log_since(self, mark: int) -> list[str]:
        """The lines written after `mark` (as many as the tail still holds)."""
        count = min(self._log_lines - mark, len(self._log_tail))
        return list(self._log_tail)[-count:] if count > 0 else []

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
            "devices": list(self.devices) if self.pid else [],
            "runtime": self.runtime.name,
            "restarts": self.restarts,
            "unhealthy_reason": self.unhealthy_reason,
            "gave_up": self.gave_up,
            "last_exit": None if self.last_exit is None else {
                "kind": self.last_exit.kind.value,
                "returncode": self.last_exit.returncode,
                "signal": self.last_exit.signal_name,
                "evidence": self.last_exit.evidence,
                "description": self.last_exit.describe(),
            },
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
            self._command = asyncio.Queue()
            self._task = asyncio.create_task(self._supervise(), name=f"worker-{self.role}")

    def request_stop(self) -> None:
        """Ask the owner to stop the process, without waiting. The state says
        STOPPING from this moment, for everyone who looks: no request may be
        sent to the process in the moment before its owner acts."""
        task = self._task
        if task is None or task.done():
            self._set_state(WorkerState.STOPPED)
            return
        self._command.put_nowait((_Command.STOP, "stop requested"))
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
            self._command.put_nowait((_Command.RESTART, reason))

    def report_failure(self, reason: str, process: int | None = None) -> None:
        """A request failed on this worker: ask the owner to replace it. The
        owner marks it unhealthy; callers keep work away from it themselves
        meanwhile (see Backend), they never write its state.

        `process` is `exits` as it was when the failing request started: a
        report about a process that has exited since is moot, and must not
        take down its healthy replacement."""
        if process is not None and process != self.exits:
            return
        self._command.put_nowait((_Command.FAILED, reason))

    async def close(self) -> None:
        await self.stop()
        await self._http.aclose()
        self._file_log.removeHandler(self._file_handler)
        self._file_handler.close()

    # ----- the owner loop ------------------------------------------------

    async def _supervise(self) -> None:
        attempt = 0
        try:
            while True:
                self._drain_stale_commands()
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
                if await self._sleep_unless_stopped(delay):
                    break
        finally:
            self._port = None
            self.loading_since = None
            self._set_state(WorkerState.STOPPED)

    @dataclass(frozen=True)
    class _Outcome:
        exit: ExitReport
        stop: bool
        immediate: bool
        was_ready: bool

    async def _run_once(self) -> "Worker._Outcome":
        self.loading_since = self._clock()
        self._set_state(WorkerState.STARTING)
        extras = await self._hooks.before_spawn(self)
        self._port = free_loopback_port()
        launch = LaunchRequest(
            model_path=self.spec.model_path,
            port=self._port,
            n_ctx=self.spec.n_ctx,
            n_gpu_layers=self.spec.n_gpu_layers,
            n_batch=self.spec.n_batch,
            n_threads=self.spec.n_threads,
            simulated_vram_need_mib=extras.simulated_vram_need_mib,
            simulated_vram_free_mib=extras.simulated_vram_free_mib,
            api_key=self._secret,
            parallel=self.spec.parallel,
            rpc_servers=self.spec.rpc_servers,
        )
        argv = self.runtime.argv(launch)
        self._log_tail.clear()
        self.devices = []
        self._file_log.info("---- starting %s worker: %s", self.role, " ".join(argv))
        spawned_at = self._clock()
        # No shell: the model path is one argv element whatever it contains.
        process = await asyncio.create_subprocess_exec(
            *argv,
            env=worker_environment(dict(os.environ), self.runtime.environment(launch)),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            # Own session: a Ctrl-C in the terminal reaches the service, which
            # then stops workers in order, instead of killing them mid-request.
            start_new_session=True,
        )
        self._process = process
        pump = asyncio.create_task(self._pump_output(process), name=f"log-{self.role}")
        exited = asyncio.create_task(process.wait())
        command: _Command | None = None
        why_replaced: str | None = None
        try:
            ready = await self._wait_ready(exited)
            loading_since, self.loading_since = self.loading_since, None
            if ready:
                # From the start of the load, as load_eta_s counts it: what
                # before_spawn waited (VRAM coming back) is part of a load.
                self.last_ready_duration_s = round(self._clock() - (loading_since or spawned_at), 3)
                self.ready_since = time.time()
                self.unhealthy_reason = None
                self._set_state(WorkerState.READY)
                command, why_replaced = await self._wait_exit_or_command(exited)
                if command is _Command.FAILED:
                    self.unhealthy_reason = why_replaced
                    self._set_state(WorkerState.UNHEALTHY)
                if command is _Command.FAILED and await self._exits_within(exited, FAILURE_GRACE_S):
                    # The failure the router saw was the process dying: classify
                    # it as the crash it is, not as something we did.
                    command, why_replaced = None, None
            elif not exited.done():
                if not self._command.empty():
                    command, why_replaced = self._command.get_nowait()
                else:
                    why_replaced = f"did not become ready within {self.policy.ready_timeout_s:g} s"
            if command is _Command.STOP:
                self._set_state(WorkerState.STOPPING)
            elif command is _Command.RESTART:
                self._set_state(WorkerState.STOPPING)
            elif why_replaced is not None and not exited.done():
                self.unhealthy_reason = why_replaced
                self._set_state(WorkerState.UNHEALTHY)
            if not exited.done():
                await self._terminate(exited)
            await exited
            await pump
        except asyncio.CancelledError:
            if process.returncode is None:
                await self._terminate(exited)
            raise
        we_killed_it = why_replaced is not None
        report = classify_exit(process.returncode, list(self._log_tail), we_killed_it)
        if report.kind is ExitKind.CLEAN_STOP and command not in (_Command.STOP, _Command.RESTART) and why_replaced:
            # We ended it because it failed a request or never got ready: not a clean stop.
            report = ExitReport(ExitKind.ERROR, report.returncode, report.signal_name, why_replaced)
        return self._record_exit(
            report,
            stop=command is _Command.STOP,
            immediate=command is _Command.RESTART,
            was_ready=ready,
        )

    async def _exits_within(self, exited: asyncio.Task, seconds: float) -> bool:
        try:
            await asyncio.wait_for(asyncio.shield(exited), seconds)
        except asyncio.TimeoutError:
            return False
        return True

    async def _wait_exit_or_command(self, exited: asyncio.Task) -> tuple[_Command | None, str | None]:
        command_task = asyncio.create_task(self._command.get())
        done, _ = await asyncio.wait({exited, command_task}, return_when=asyncio.FIRST_COMPLETED)
        if command_task in done:
            return command_task.result()
        command_task.cancel()
        return None, None

    def _record_exit(self, report: ExitReport, stop: bool, immediate: bool, was_ready: bool) -> "Worker._Outcome":
        self.last_exit = report
        self.exits += 1
        self._state_changed.set()
        self._process = None
        self.ready_since = None
        self._file_log.info("---- %s worker exited: %s", self.role, report.describe())
        if report.kind is not ExitKind.CLEAN_STOP:
            log.warning("%s worker exited: %s", self.role, report.describe())
            self.unhealthy_reason = report.describe()
            self._set_state(WorkerState.UNHEALTHY, report)
        else:
            self._hooks.on_event(WorkerEvent(self.role, self._state, report))
        if not stop:
            self.restarts += 1
        return Worker._Outcome(report, stop=stop, immediate=immediate, was_ready=was_ready)

    async def _wait_ready(self, exited: asyncio.Task) -> bool:
        deadline = self._clock() + self.policy.ready_timeout_s
        base_url = self.base_url
        delay = 0.05
        while self._clock() < deadline:
            if exited.done():
                return False
            if not self._command.empty():
                return False
            if await self.runtime.probe(self._http, base_url):
                return True
            try:
                await asyncio.wait_for(asyncio.shield(exited), timeout=delay)
            except asyncio.TimeoutError:
                pass
            delay = min(0.5, delay * 1.5)
        return False

    async def _terminate(self, exited: asyncio.Task) -> None:
        """SIGTERM, then SIGKILL after the stop timeout."""
        process = self._process
        assert process is not None
        try:
            process.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            await asyncio.wait_for(asyncio.shield(exited), self.policy.stop_timeout_s)
        except asyncio.TimeoutError:
            try:
                process.kill()
            except ProcessLookupError:
                pass
            await exited

    async def _pump_output(self, process) -> None:
        assert process.stdout is not None
        while True:
            line = await process.stdout.readline()
            if not line:
                return
            text = line.decode("utf-8", "replace").rstrip("\n")
            if (device := parse_device_line(text)) is not None:
                self.devices.append(device)
            self._log_tail.append(text)
            self._log_lines += 1
            self._file_log.info("%s", text)

    async def _sleep_unless_stopped(self, delay: float) -> bool:
        """Sleep for the backoff; True if a stop arrived meanwhile."""
        deadline = self._clock() + delay
        while True:
            remaining = deadline - self._clock()
            if remaining <= 0:
                return False
            try:
                command, _ = await asyncio.wait_for(self._command.get(), remaining)
            except asyncio.TimeoutError:
                return False
            if command is _Command.STOP:
                return True
            if command is _Command.RESTART:
                return False

    def _drain_stale_commands(self) -> None:
        # Failure reports about a process that is already gone are moot; a stop is not.
        pending = []
        while not self._command.empty():
            pending.append(self._command.get_nowait())
        for command, reason in pending:
            if command is _Command.STOP:
                self._command.put_nowait((command, reason))

    def _set_state(self, state: WorkerState, exit: ExitReport | None = None) -> None:
        if state is self._state and exit is None:
            return
        self._state = state
        self._state_changed.set()
        self._hooks.on_event(WorkerEvent(self.role, state, exit))

    def _make_file_logger(self, log_dir: Path) -> logging.Logger:
        make_private_dir(log_dir)
        logger = logging.getLogger(f"tray_app.worker_output.{self.spec.role}.{id(self)}")
        logger.propagate = False
        logger.setLevel(logging.INFO)
        handler = PrivateRotatingFileHandler(
            log_dir / f"{self._log_name}-worker.log", maxBytes=LOG_FILE_BYTES, backupCount=LOG_FILE_BACKUPS,
            encoding="utf-8",
        )
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logger.addHandler(handler)
        self._file_handler = handler
        return logger


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
