"""A worker's operating-system process: started, watched, ended."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Awaitable, Callable

import psutil


async def spawn(argv: list[str], env: dict[str, str]) -> asyncio.subprocess.Process:
    # No shell: the model path is one argv element whatever it contains.
    return await asyncio.create_subprocess_exec(
        *argv,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        # Own session: a Ctrl-C in the terminal reaches the service, which
        # then stops workers in order, instead of killing them mid-request.
        start_new_session=True,
    )


async def exits_within(exited: asyncio.Task, seconds: float) -> bool:
    """Whether the process ends within `seconds` (the wait does not cancel `exited`)."""
    try:
        await asyncio.wait_for(asyncio.shield(exited), seconds)
    except asyncio.TimeoutError:
        return False
    return True


async def terminate(process: asyncio.subprocess.Process, exited: asyncio.Task, stop_timeout_s: float) -> None:
    """SIGTERM, then SIGKILL after the stop timeout."""
    try:
        process.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        return
    if not await exits_within(exited, stop_timeout_s):
        try:
            process.kill()
        except ProcessLookupError:
            pass
        await exited


def liveness_problem(process: asyncio.subprocess.Process | None) -> str | None:
    """Why the process can make no progress right now, or None. Cheap enough
    to ask every second while a request waits on it: a frozen worker
    (SIGSTOP, a debugger) is found in seconds, not at the first-token deadline."""
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


async def wait_ready(probe: Callable[[str], Awaitable[bool]], base_url: str, exited: asyncio.Task,
                     interrupted: Callable[[], bool], clock: Callable[[], float], timeout_s: float) -> bool:
    """Poll `probe(base_url)` until it answers True (ready), with a growing
    pause; False when the process exits, a command is `interrupted` waiting
    for it, or `timeout_s` passes on `clock`."""
    deadline = clock() + timeout_s
    delay = 0.05
    while clock() < deadline:
        if exited.done() or interrupted():
            return False
        if await probe(base_url):
            return True
        await exits_within(exited, delay)
        delay = min(0.5, delay * 1.5)
    return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
