"""The service's uvicorn server ticks once a second when idle (issue 32,
idle), yet stops at once when asked, from its own loop or another thread."""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn

from tray_app.core.api.http_server import CalmServer, ThreadedServer


async def _app(scope, receive, send) -> None:  # never called: no request is made
    raise AssertionError("no request expected")


def _server(cls: type[uvicorn.Server] = CalmServer) -> uvicorn.Server:
    return cls(uvicorn.Config(_app, lifespan="off"))


def _ticks_in(server: uvicorn.Server, seconds: float) -> int:
    """How many times the main loop ticked while idle for `seconds`."""
    ticks = 0
    original = server.on_tick

    async def counting_tick(counter: int) -> bool:
        nonlocal ticks
        ticks += 1
        return await original(counter)

    server.on_tick = counting_tick  # type: ignore[method-assign]

    async def run() -> None:
        asyncio.get_running_loop().call_later(seconds, setattr, server, "should_exit", True)
        await server.main_loop()

    asyncio.run(run())
    return ticks


def test_an_idle_server_ticks_about_once_a_second_not_ten_times() -> None:
    # uvicorn's own loop ticks 10 times a second: 15 or more in 1.5 s.
    assert _ticks_in(_server(), 1.5) <= 3


def test_the_date_header_is_still_renewed_every_tick() -> None:
    # on_tick renews the header when counter % 10 == 0: each calm tick must be such a counter.
    server = _server()
    counters: list[int] = []
    original = server.on_tick

    async def recording_tick(counter: int) -> bool:
        counters.append(counter)
        return await original(counter)

    server.on_tick = recording_tick  # type: ignore[method-assign]
    server.TICK_S = 0.01  # type: ignore[misc]

    async def run() -> None:
        asyncio.get_running_loop().call_later(0.2, setattr, server, "should_exit", True)
        await server.main_loop()

    asyncio.run(run())
    assert len(counters) > 3
    assert all(counter % 10 == 0 for counter in counters)


def test_should_exit_set_from_another_thread_wakes_the_loop_at_once() -> None:
    server = _server(ThreadedServer)
    server.TICK_S = 60  # type: ignore[misc]
    done = threading.Event()
    took: list[float] = []

    def serve_loop() -> None:
        async def run() -> None:
            started = time.monotonic()
            await server.main_loop()
            took.append(time.monotonic() - started)
        asyncio.run(run())
        done.set()

    thread = threading.Thread(target=serve_loop, daemon=True)
    thread.start()
    time.sleep(0.3)  # the loop is waiting on its 60 s tick by now
    server.should_exit = True  # as ServiceRunner._request_exit does, from the Qt thread
    assert done.wait(10), "the main loop did not wake when should_exit was set"
    assert took[0] < 10


def test_should_exit_set_before_the_loop_runs_ends_it_at_the_first_tick() -> None:
    server = _server()
    server.TICK_S = 60  # type: ignore[misc]
    server.should_exit = True

    async def run() -> None:
        await asyncio.wait_for(server.main_loop(), 5)

    asyncio.run(run())
    assert server.should_exit is True
