"""llama.cpp's RPC protocol as rpc.py speaks it (v7.0.0, as vendored by
llama-cpp-python 0.3.36): the bytes, the version check, and the health
probe against fake servers on loopback: one that answers, one of another
version, one busy with another client (a listen backlog, never accepted),
and none at all."""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest

from tray_app.core.engine.rpc import (
    BUSY, IDLE, IN_USE, INCOMPATIBLE, UNREACHABLE, RpcHealth, RpcProtocolError, ServerBusy, decode_device_count,
    decode_device_memory, decode_hello, decode_size, encode_device_count, encode_get_device_memory, encode_hello,
    read_memory,
)
from tray_app.core.engine.worker import free_loopback_port

GIB = 1024 ** 3


def u64(value: int) -> bytes:
    return value.to_bytes(8, "little")


# ----- the bytes -----------------------------------------------------------------------------


def test_requests_are_command_byte_then_u64_size_then_payload():
    # HELLO is command 14 in every version, with 24 bytes of (zero: plain TCP) transport caps.
    assert encode_hello() == bytes([14]) + u64(24) + bytes(24)
    assert encode_device_count() == bytes([15]) + u64(0)
    assert encode_get_device_memory(2) == bytes([11]) + u64(4) + (2).to_bytes(4, "little")


def test_replies_decode_little_endian():
    assert decode_size(u64(28)) == 28
    assert decode_hello(bytes([7, 0, 3, 0]) + bytes(24)) == (7, 0, 3)
    assert decode_device_count((3).to_bytes(4, "little")) == 3
    assert decode_device_memory(struct.pack("<QQ", 6 * GIB, 8 * GIB)) == (6 * GIB, 8 * GIB)


@pytest.mark.parametrize("version", [(8, 0, 0), (6, 9, 9), (7, 1, 0)])
def test_another_protocol_version_is_refused_as_llama_cpp_refuses_it(version):
    # negotiate_hello: the major must match and the minor may not be newer.
    with pytest.raises(RpcProtocolError, match=r"speaks RPC protocol v%d\.%d\.%d; this llama\.cpp speaks v7\.0"
                       % version):
        decode_hello(bytes([*version, 0]) + bytes(24))


@pytest.mark.parametrize("payload", [b"", bytes([7, 0]), bytes([7, 0, 0, 0]), bytes([7, 0, 0, 0]) + bytes(30)])
def test_a_hello_of_the_wrong_size_is_refused(payload):
    with pytest.raises(RpcProtocolError):
        decode_hello(payload)


def test_other_replies_of_the_wrong_size_or_nonsense_are_refused():
    with pytest.raises(RpcProtocolError, match="GET_DEVICE_MEMORY reply is 8 bytes"):
        decode_device_memory(u64(1))
    with pytest.raises(RpcProtocolError):
        decode_device_count(u64(1))
    with pytest.raises(RpcProtocolError, match="claims 100000 devices"):
        decode_device_count((100000).to_bytes(4, "little"))


# ----- fake servers --------------------------------------------------------------------------


def fake_rpc_server(version=(7, 0, 0), devices=((6 * GIB, 8 * GIB),)):
    """A llama.cpp RPC server's replies to HELLO, DEVICE_COUNT and GET_DEVICE_MEMORY."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                command = (await reader.readexactly(1))[0]
                payload = await reader.readexactly(decode_size(await reader.readexactly(8)))
                if command == 14:
                    reply = bytes([*version, 0]) + bytes(24)
                elif command == 15:
                    reply = len(devices).to_bytes(4, "little")
                elif command == 11:
                    reply = struct.pack("<QQ", *devices[int.from_bytes(payload, "little")])
                else:
                    break
                writer.write(u64(len(reply)) + reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    return serve


def busy_server() -> socket.socket:
    """A listening socket that never accepts: ggml-rpc-server while it serves
    another client (backlog 1: the kernel completes two more connects, then
    lets the rest time out)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    return server


def test_read_memory_from_a_server():
    async def scenario():
        server = await asyncio.start_server(fake_rpc_server(devices=((6 * GIB, 8 * GIB), (1 * GIB, 2 * GIB))),
                                            "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            return await read_memory("127.0.0.1", port, clock=lambda: 50.0)
        finally:
            server.close()
            await server.wait_closed()

    latency_ms, reading = asyncio.run(scenario())
    assert latency_ms >= 0 and reading.query_ms >= 0 and reading.read_at == 50.0
    assert reading.version == (7, 0, 0)
    assert [(d.index, d.free_bytes, d.total_bytes) for d in reading.devices] == [(0, 6 * GIB, 8 * GIB),
                                                                                 (1, 1 * GIB, 2 * GIB)]


def test_a_question_left_unanswered_is_reset_not_left_to_be_answered():
    """The server reads what waited in its queue once it gets to it; answering
    into a socket we closed normally raises SIGPIPE there, which kills a bare
    ggml-rpc-server. After our reset its first write fails instead."""
    async def scenario():
        server = busy_server()
        port = server.getsockname()[1]
        with pytest.raises(ServerBusy):
            await read_memory("127.0.0.1", port, reply_timeout_s=0.2)
        await asyncio.sleep(0.1)  # the loop closes the aborted socket
        connection, _ = server.accept()
        with connection, server:
            assert connection.recv(64)[:1] == bytes([14])  # our HELLO, still queued
            with pytest.raises(ConnectionResetError):
                connection.send(u64(28))

    asyncio.run(scenario())


def _health(port: int, in_use: list[bool], clock=lambda: 100.0) -> RpcHealth:
    return RpcHealth((f"127.0.0.1:{port}",), clock=clock, in_use=lambda: in_use[0], connect_timeout_s=0.3,
                     reply_timeout_s=0.3)


def test_the_health_reads_the_memory_while_no_gpu_worker_holds_the_server():
    async def scenario():
        server = await asyncio.start_server(fake_rpc_server(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        in_use = [False]
        now = [100.0]
        health = _health(port, in_use, clock=lambda: now[0])
        before = (health.status()[0], health.free_mib())
        await health.probe_all()
        idle = (health.status()[0], health.free_mib())
        # Up: a bare connect, and the reading from before is kept with its age.
        in_use[0] = True
        now[0] = 400.0
        await health.probe_all()
        held = (health.status()[0], health.free_mib())
        server.close()
        await server.wait_closed()
        return before, idle, held

    (before, unknown), (idle, free), (held, kept) = asyncio.run(scenario())
    assert before["reachable"] is None and before["state"] is None and before["free_mib"] is None and unknown is None
    assert idle["reachable"] is True and idle["state"] == IDLE and idle["latency_ms"] is not None
    assert idle["devices"] == [{"index": 0, "free_mib": 6144.0, "total_mib": 8192.0}]
    assert idle["free_mib"] == 6144.0 and idle["total_mib"] == 8192.0 and idle["protocol"] == "7.0.0"
    assert idle["memory_read_at"] == 100.0 and idle["memory_age_s"] == 0.0 and free == [6144.0]
    assert held["state"] == IN_USE and held["reachable"] is True and held["since"] == 100.0
    assert held["free_mib"] == 6144.0 and held["memory_age_s"] == 300.0 and kept == [6144.0]


def test_a_server_held_by_our_gpu_worker_stays_reachable_when_its_queue_fills():
    """ggml-rpc-server accepts nothing while it serves the GPU worker: two
    connects queue, the rest time out. That is not a lost machine."""
    async def scenario():
        server = busy_server()
        in_use = [False]
        health = _health(server.getsockname()[1], in_use)
        await health.probe_all()  # the GPU worker took it just before: connected, no answer
        in_use[0] = True
        states = []
        for _ in range(4):
            await health.probe_all()
            states.append(health.status()[0])
        server.close()
        return states

    states = asyncio.run(scenario())
    assert [s["state"] for s in states] == [IN_USE] * 4
    assert all(s["reachable"] is True for s in states)
    assert states[0]["latency_ms"] is not None and "unverified_since" not in states[0]
    # Once its queue is full of ours, nothing more can be learnt: it says so.
    assert states[-1]["unverified_since"] == 100.0


def test_a_held_server_whose_first_connect_times_out_is_unreachable():
    """No connect got through since our GPU worker took it: the machine is
    gone (here: a queue already full of others' connects stands in for it)."""
    async def scenario():
        server = busy_server()
        port = server.getsockname()[1]
        fillers = []
        for _ in range(2):
            filler = socket.socket()
            filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        health = _health(port, [True])
        await health.probe_all()
        for filler in fillers:
            filler.close()
        server.close()
        return health.status()[0]

    state = asyncio.run(scenario())
    assert state["state"] == "unreachable" and state["reachable"] is False
    assert state["error"] == "no answer to connect in 0.3 s"


def test_the_memory_is_read_afresh_before_the_gpu_worker_starts():
    async def scenario():
        devices = [(6 * GIB, 8 * GIB)]
        server = await asyncio.start_server(fake_rpc_server(devices=devices), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        in_use = [False]
        health = _health(port, in_use)
        await health.start()
        first = health.free_mib()
        in_use[0] = True  # the worker loaded, crashed, and is about to start again
        devices[0] = (2 * GIB, 8 * GIB)  # the lending PC's own apps took memory meanwhile
        await health.reread_memory()
        second = health.free_mib()
        server.close()
        await server.wait_closed()
        await health.reread_memory()  # and a server that doesn't answer keeps no reading
        third = health.free_mib()
        await health.stop()
        return first, second, third

    first, second, third = asyncio.run(scenario())
    assert first == [6144.0] and second == [2048.0] and third is None


def test_a_server_busy_with_someone_else_is_busy_not_unreachable():
    async def scenario():
        server = busy_server()
        health = _health(server.getsockname()[1], [False])
        states = []
        for _ in range(4):
            await health.probe_all()
            states.append(health.status()[0])
        server.close()
        return states, health.free_mib()

    states, free = asyncio.run(scenario())
    assert [s["state"] for s in states] == [BUSY] * 4 and all(s["reachable"] for s in states)
    assert "another client" in states[0]["error"] and free is None


def test_a_server_of_another_version_is_named_with_its_version():
    async def scenario():
        server = await asyncio.start_server(fake_rpc_server(version=(8, 1, 0)), "127.0.0.1", 0)
        health = _health(server.sockets[0].getsockname()[1], [False])
        await health.probe_all()
        server.close()
        await server.wait_closed()
        return health.status()[0], health.free_mib()

    status, free = asyncio.run(scenario())
    assert status["state"] == INCOMPATIBLE and status["reachable"] is True and free is None
    assert "v8.1.0" in status["error"] and "v7.0" in status["error"]


def test_a_server_that_hangs_up_on_hello_is_incompatible():
    """A newer ggml-rpc-server drops a HELLO of the wrong size without a word."""
    async def scenario():
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        health = _health(server.sockets[0].getsockname()[1], [False])
        await health.probe_all()
        server.close()
        await server.wait_closed()
        return health.status()[0]

    status = asyncio.run(scenario())
    assert status["state"] == INCOMPATIBLE and "closed the connection on HELLO" in status["error"]


def test_no_server_is_unreachable_whether_or_not_a_worker_is_up():
    async def scenario():
        port = free_loopback_port()
        results = []
        for in_use in (False, True):
            health = _health(port, [in_use])
            await health.probe_all()
            results.append(health.status()[0])
        return results

    for status in asyncio.run(scenario()):
        assert status["state"] == UNREACHABLE and status["reachable"] is False and status["error"]


def test_free_memory_is_known_only_when_every_server_was_read():
    async def scenario():
        server = await asyncio.start_server(fake_rpc_server(devices=((3 * GIB, 4 * GIB), (GIB, GIB))),
                                            "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        both = RpcHealth((f"127.0.0.1:{port}", f"127.0.0.1:{free_loopback_port()}"), connect_timeout_s=0.3)
        one = RpcHealth((f"127.0.0.1:{port}",))
        await both.probe_all()
        await one.probe_all()
        server.close()
        await server.wait_closed()
        return both.free_mib(), one.free_mib()

    both, one = asyncio.run(scenario())
    assert both is None and one == [3072.0, 1024.0]
    assert RpcHealth(()).free_mib() is None
