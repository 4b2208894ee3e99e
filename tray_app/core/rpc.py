"""Whether each llama.cpp RPC server in [gpu] rpc_servers answers.

A TCP connect every few seconds, off the request path: what /status and the
tray show for each remote device. A remote device that disappears mid-request
takes the GPU worker down with it (llama.cpp aborts on a broken RPC link),
which the breaker and the replay rules already handle like a local GPU
failure; this only says which machine went away.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

PROBE_INTERVAL_S = 5.0
PROBE_TIMEOUT_S = 1.0


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class RpcHealth:
    def __init__(self, addresses: tuple[str, ...], clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._servers: dict[str, dict[str, Any]] = {
            address: {"address": address, "reachable": None, "latency_ms": None, "error": None, "since": None}
            for address in addresses
        }
        self._task: asyncio.Task | None = None

    async def probe(self, address: str) -> None:
        host, port = split_address(address)
        started = time.perf_counter()
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), PROBE_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            self._set(address, False, None, str(exc) or type(exc).__name__)
            return
        latency_ms = round((time.perf_counter() - started) * 1000, 1)
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
        self._set(address, True, latency_ms, None)

    def _set(self, address: str, reachable: bool, latency_ms: float | None, error: str | None) -> None:
        server = self._servers[address]
        if server["reachable"] is not reachable:
            server["since"] = self._clock()
        server.update(reachable=reachable, latency_ms=latency_ms, error=error)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(address) for address in self._servers))

    async def _run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(PROBE_INTERVAL_S)

    def start(self) -> None:
        if self._servers and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def status(self) -> list[dict[str, Any]]:
        return [dict(server) for server in self._servers.values()]
