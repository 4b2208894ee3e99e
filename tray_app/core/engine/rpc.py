"""Each llama.cpp RPC server in [gpu] rpc_servers: whether it answers, and
its devices' memory, read with llama.cpp's own RPC protocol.

Off the request path, every few seconds: what /status and the tray show for
each remote device, and the remote memory the estimator splits the model
over (host.ModelHost.gpu_footprint). A remote device that disappears
mid-request takes the GPU worker down with it (llama.cpp aborts on a broken
RPC link), which the breaker and the replay rules already handle like a
local GPU failure; this only says which machine went away.

ggml-rpc-server serves one client at a time, inline in its accept loop, with
a listen backlog of 1. While our GPU worker is connected a memory query
would wait until it times out, and every connection we open sits in the
server's accept queue until the GPU worker lets go; after two, further
connects time out as if the machine were gone. So the memory is read only
while no GPU worker of ours is up: first in start(), before the service
spawns its GPU worker, then whenever the worker is unloaded. While it is up
the probe is a bare TCP connect that sends nothing, and a connect that times
out then is the full queue, not a lost machine. The last reading is kept
with its time. No connection is ever held open.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 5.0
PROBE_TIMEOUT_S = 1.0  # the TCP connect
REPLY_TIMEOUT_S = 1.0  # HELLO and the memory replies, once connected: about a millisecond on a LAN

MIB = 1024 * 1024

# ----- llama.cpp's RPC wire format -------------------------------------------------------------
# As in ggml/src/ggml-rpc/ggml-rpc.cpp and include/ggml-rpc.h of the llama.cpp
# that llama-cpp-python 0.3.36 vendors (and that packaging/install.sh builds
# ggml-rpc-server from): protocol 7.0.0. Everything is little-endian and packed.
#   request: | command (u8) | payload size (u64) | payload |
#   reply:   | payload size (u64) | payload |
# The first command on a connection must be HELLO; the server answers with its
# version, and the client (ggml-rpc.cpp's negotiate_hello) refuses a server
# whose major differs or whose minor is newer.
RPC_PROTO_MAJOR = 7
RPC_PROTO_MINOR = 0
CMD_GET_DEVICE_MEMORY = 11
CMD_HELLO = 14  # "must be always 14", whatever the version
CMD_DEVICE_COUNT = 15
# HELLO's payload is the client's transport capabilities (RDMA); all zeros
# asks for plain TCP, so the server never tries to upgrade the socket.
CONN_CAPS_SIZE = 24
HELLO_REPLY_SIZE = 4 + CONN_CAPS_SIZE  # major, minor, patch, padding, the server's caps
DEVICE_COUNT_REPLY_SIZE = 4  # u32
DEVICE_MEMORY_REPLY_SIZE = 16  # u64 free, u64 total (bytes)
# Larger replies than any of these mean another protocol (or not an RPC
# server at all): read no more than this to say which version it speaks.
MAX_HELLO_REPLY = 256
# A sanity bound, not llama.cpp's: a server with more devices than this is not believed.
MAX_DEVICES = 64


class RpcProtocolError(Exception):
    """The server speaks another version of the RPC protocol, or something else entirely."""


def encode_command(command: int, payload: bytes = b"") -> bytes:
    return struct.pack("<BQ", command, len(payload)) + payload


def encode_hello() -> bytes:
    return encode_command(CMD_HELLO, bytes(CONN_CAPS_SIZE))


def encode_device_count() -> bytes:
    return encode_command(CMD_DEVICE_COUNT)


def encode_get_device_memory(device: int) -> bytes:
    return encode_command(CMD_GET_DEVICE_MEMORY, struct.pack("<I", device))


def decode_size(header: bytes) -> int:
    (size,) = struct.unpack("<Q", header)
    return size


def expect_size(size: int, expected: int, what: str) -> None:
    if size != expected:
        raise RpcProtocolError(f"{what} reply is {size} bytes, protocol v{RPC_PROTO_MAJOR}.{RPC_PROTO_MINOR} "
                               f"sends {expected}: another llama.cpp RPC protocol version")


def decode_hello(payload: bytes) -> tuple[int, int, int]:
    """The server's (major, minor, patch), checked as llama.cpp's client checks it."""
    if len(payload) < 3:
        raise RpcProtocolError(f"HELLO reply of {len(payload)} bytes: not a llama.cpp RPC server")
    major, minor, patch = payload[0], payload[1], payload[2]
    if major != RPC_PROTO_MAJOR or minor > RPC_PROTO_MINOR:
        raise RpcProtocolError(f"the server speaks RPC protocol v{major}.{minor}.{patch}; this llama.cpp speaks "
                               f"v{RPC_PROTO_MAJOR}.{RPC_PROTO_MINOR}.x: run the same llama.cpp release on both "
                               "machines (the GPU worker can't use it either)")
    expect_size(len(payload), HELLO_REPLY_SIZE, "HELLO")
    return major, minor, patch


def decode_device_count(payload: bytes) -> int:
    expect_size(len(payload), DEVICE_COUNT_REPLY_SIZE, "DEVICE_COUNT")
    (count,) = struct.unpack("<I", payload)
    if count > MAX_DEVICES:
        raise RpcProtocolError(f"the server claims {count} devices")
    return count


def decode_device_memory(payload: bytes) -> tuple[int, int]:
    """(free, total) in bytes. A CPU device reports the machine's physical RAM
    as both: ggml calls free system memory ill-defined and assumes all of it."""
    expect_size(len(payload), DEVICE_MEMORY_REPLY_SIZE, "GET_DEVICE_MEMORY")
    free, total = struct.unpack("<QQ", payload)
    return free, total


@dataclass(frozen=True)
class DeviceMemory:
    index: int  # the server's device number (the RPC client names them RPC0, RPC1... across servers)
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class MemoryReading:
    version: tuple[int, int, int]
    devices: tuple[DeviceMemory, ...]
    read_at: float  # the health's clock (wall time)
    query_ms: float  # HELLO plus the memory queries, after the connect


class ServerBusy(Exception):
    """Connected, but no answer in time: the server is serving another client."""


async def _reply(reader: asyncio.StreamReader, expected: int, what: str) -> bytes:
    size = decode_size(await reader.readexactly(8))
    expect_size(size, expected, what)
    return await reader.readexactly(size)


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                    ) -> tuple[tuple[int, int, int], tuple[DeviceMemory, ...]]:
    writer.write(encode_hello())
    await writer.drain()
    try:
        size = decode_size(await reader.readexactly(8))
    except asyncio.IncompleteReadError as exc:
        # A server of another version drops a HELLO of the wrong size without a word.
        raise RpcProtocolError(f"the server closed the connection on HELLO: not a llama.cpp RPC server, or "
                               f"not protocol v{RPC_PROTO_MAJOR}.{RPC_PROTO_MINOR}") from exc
    if size > MAX_HELLO_REPLY:
        raise RpcProtocolError(f"HELLO reply of {size} bytes: not a llama.cpp RPC server")
    version = decode_hello(await reader.readexactly(size))
    writer.write(encode_device_count())
    await writer.drain()
    count = decode_device_count(await _reply(reader, DEVICE_COUNT_REPLY_SIZE, "DEVICE_COUNT"))
    devices = []
    for index in range(count):
        writer.write(encode_get_device_memory(index))
        await writer.drain()
        free, total = decode_device_memory(await _reply(reader, DEVICE_MEMORY_REPLY_SIZE, "GET_DEVICE_MEMORY"))
        devices.append(DeviceMemory(index, free, total))
    return version, tuple(devices)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset. A request left unanswered in the server's queue
    would otherwise be read and answered once the server gets to it, and
    writing to our closed socket raises SIGPIPE there, which kills an
    ggml-rpc-server started without `tray-app rpc-worker` (Python's ignored
    SIGPIPE is inherited through exec; llama.cpp does not ignore it). After a
    reset the server's first read fails and it moves on."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


async def read_memory(host: str, port: int, *, connect_timeout_s: float = PROBE_TIMEOUT_S,
                      reply_timeout_s: float = REPLY_TIMEOUT_S, clock: Callable[[], float] = time.time
                      ) -> tuple[float, MemoryReading]:
    """(connect latency in ms, the reading). Raises OSError or TimeoutError
    when the connect fails, ServerBusy when connected but not answered,
    RpcProtocolError when the server speaks another protocol."""
    started = time.perf_counter()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), connect_timeout_s)
    connected = time.perf_counter()
    try:
        version, devices = await asyncio.wait_for(_exchange(reader, writer), reply_timeout_s)
    except asyncio.TimeoutError:
        _reset(writer)
        raise ServerBusy(f"connected, but no answer in {reply_timeout_s:g} s: it is serving another client") from None
    except BaseException:
        _reset(writer)
        raise
    done = time.perf_counter()
    # Everything sent was answered: an ordinary close, which the server reads as the end.
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return (round((connected - started) * 1000, 1),
            MemoryReading(version, devices, clock(), round((done - connected) * 1000, 1)))


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


# What status() says a server is doing.
IDLE = "idle"  # answered: free for a GPU worker
IN_USE = "in_use"  # our GPU worker is up and holds its one client slot
BUSY = "busy"  # connected, no answer: serving someone else's client
INCOMPATIBLE = "incompatible"  # answers, in another protocol
UNREACHABLE = "unreachable"
# ggml-rpc-server listens with a backlog of 1: Linux queues two connections.
ACCEPT_QUEUE = 2


class RpcHealth:
    def __init__(self, addresses: tuple[str, ...], clock: Callable[[], float] = time.time,
                 in_use: Callable[[], bool] = lambda: False, *, connect_timeout_s: float = PROBE_TIMEOUT_S,
                 reply_timeout_s: float = REPLY_TIMEOUT_S) -> None:
        """in_use: whether a GPU worker of ours is up, and so holds every
        server's one client slot (only GPU workers are given the servers)."""
        self._clock = clock
        self._in_use = in_use
        self._connect_timeout_s = connect_timeout_s
        self._reply_timeout_s = reply_timeout_s
        self._servers: dict[str, dict[str, Any]] = {
            address: {"address": address, "reachable": None, "latency_ms": None, "error": None, "since": None,
                      "state": None, "checked_at": None}
            for address in addresses
        }
        self._memory: dict[str, MemoryReading] = {}
        # Bare connects that got through while our GPU worker holds a server:
        # they wait in its accept queue (room for two) until the worker lets go.
        self._queued: dict[str, int] = {address: 0 for address in addresses}
        self._task: asyncio.Task | None = None

    async def probe(self, address: str) -> None:
        """Never raises: what a server does is its state in /status, and the
        service's start (which awaits the first probe) must not fail on it."""
        try:
            if self._in_use():
                await self._probe_connect(address)
            else:
                self._queued[address] = 0  # the server has drained them with the worker gone
                await self._probe_memory(address)
        except Exception as exc:  # noqa: BLE001 - shown as the server's error, not raised
            log.warning("RPC server %s: probe failed: %r", address, exc)
            self._set(address, False, None, f"probe failed: {type(exc).__name__}: {exc}", UNREACHABLE)

    async def _probe_connect(self, address: str) -> None:
        """A bare connect, while our GPU worker holds the server: sends nothing,
        so nothing waits in the server's queue to be answered later. Each one
        that gets through waits in the server's accept queue, which holds two:
        after that every connect times out whatever the machine does, so the
        probing stops, and the state says since when it is unverified (the
        GPU worker's own next request finds a lost machine)."""
        server = self._servers[address]
        if self._queued[address] >= ACCEPT_QUEUE:
            server.update(state=IN_USE, error=None, checked_at=self._clock())
            return
        host, port = split_address(address)
        started = time.perf_counter()
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), self._connect_timeout_s)
        except asyncio.TimeoutError:
            if self._queued[address]:
                # Ours (and a memory query's reset connection, which also
                # waits to be accepted) fill it: nothing more to learn now.
                self._queued[address] = ACCEPT_QUEUE
                server.update(state=IN_USE, error=None, checked_at=self._clock())
                server.setdefault("unverified_since", self._clock())
                return
            # Not one connect got through since the worker took it: gone.
            self._set(address, False, None, f"no answer to connect in {self._connect_timeout_s:g} s", UNREACHABLE)
            return
        except OSError as exc:
            self._set(address, False, None, str(exc) or type(exc).__name__, UNREACHABLE)
            return
        self._queued[address] += 1
        latency_ms = round((time.perf_counter() - started) * 1000, 1)
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
        self._set(address, True, latency_ms, None, IN_USE)
        if self._queued[address] >= ACCEPT_QUEUE:
            server["unverified_since"] = self._clock()

    async def _probe_memory(self, address: str) -> None:
        host, port = split_address(address)
        try:
            latency_ms, reading = await read_memory(host, port, connect_timeout_s=self._connect_timeout_s,
                                                    reply_timeout_s=self._reply_timeout_s, clock=self._clock)
        except asyncio.TimeoutError:
            if self._servers[address]["state"] == BUSY:
                # Its accept queue of two is full behind the client it serves.
                self._set(address, True, None, "serving another client; its queue is full", BUSY)
            else:
                self._set(address, False, None, f"no answer to connect in {self._connect_timeout_s:g} s",
                          UNREACHABLE)
        except ServerBusy as exc:
            # Our GPU worker may have started while we asked.
            self._set(address, True, None, None if self._in_use() else str(exc), IN_USE if self._in_use() else BUSY)
        except RpcProtocolError as exc:
            self._set(address, True, None, str(exc), INCOMPATIBLE)
        except (OSError, asyncio.IncompleteReadError) as exc:
            self._set(address, False, None, str(exc) or type(exc).__name__, UNREACHABLE)
        else:
            self._memory[address] = reading
            self._set(address, True, latency_ms, None, IDLE)

    def _set(self, address: str, reachable: bool, latency_ms: float | None, error: str | None, state: str) -> None:
        server = self._servers[address]
        server.pop("unverified_since", None)
        if server["reachable"] is not reachable:
            server["since"] = self._clock()
        server.update(reachable=reachable, latency_ms=latency_ms, error=error, state=state, checked_at=self._clock())

    async def reread_memory(self) -> None:
        """Read every server's memory now, whatever in_use says: called just
        before our GPU worker starts, when no process of ours holds them. A
        server that doesn't answer keeps no reading, so the estimate charges
        the whole model to the local GPU rather than trust an old one."""
        for address in self._servers:
            self._queued[address] = 0
        await asyncio.gather(*(self._fresh_memory(address) for address in self._servers), return_exceptions=True)

    async def _fresh_memory(self, address: str) -> None:
        self._memory.pop(address, None)
        try:
            await self._probe_memory(address)
        except Exception as exc:  # noqa: BLE001 - shown as the server's error, not raised
            self._set(address, False, None, f"probe failed: {type(exc).__name__}: {exc}", UNREACHABLE)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(address) for address in self._servers), return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            await self.probe_all()

    async def start(self) -> None:
        """The first probe, awaited: called before the GPU worker spawns, so
        the servers are still free to answer and their memory is known when
        the estimator first needs it. Then one probe every few seconds."""
        if self._servers and self._task is None:
            await self.probe_all()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def free_mib(self) -> list[float] | None:
        """Every remote device's free memory at its last reading, over all
        servers; None unless every server's memory has been read (then the
        estimator charges the whole model to the local GPU)."""
        if not self._servers or any(address not in self._memory for address in self._servers):
            return None
        if any(d.total_bytes == 0 for address in self._servers for d in self._memory[address].devices):
            return None  # llama.cpp weighs such a device by our host's RAM: not worth guessing
        return [device.free_bytes / MIB for address in self._servers for device in self._memory[address].devices]

    def status(self) -> list[dict[str, Any]]:
        return [self._server_status(address, server) for address, server in self._servers.items()]

    def _server_status(self, address: str, server: dict[str, Any]) -> dict[str, Any]:
        entry = dict(server)
        reading = self._memory.get(address)
        devices = [] if reading is None else [
            {"index": d.index, "free_mib": round(d.free_bytes / MIB, 1), "total_mib": round(d.total_bytes / MIB, 1)}
            for d in reading.devices]
        entry.update(
            devices=devices,
            free_mib=round(sum(d["free_mib"] for d in devices), 1) if reading is not None else None,
            total_mib=round(sum(d["total_mib"] for d in devices), 1) if reading is not None else None,
            protocol=".".join(map(str, reading.version)) if reading is not None else None,
            memory_read_at=reading.read_at if reading is not None else None,
            memory_age_s=round(self._clock() - reading.read_at, 1) if reading is not None else None,
            query_ms=reading.query_ms if reading is not None else None,
        )
        return entry
