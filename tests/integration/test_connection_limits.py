"""Issue 27, part 3: anyone who can connect could lock everyone out. The
real server, bound to every address with a key, and raw sockets from this
machine's LAN address (a client on "another machine": the server sees a
non-loopback peer) and from loopback (the tray)."""

from __future__ import annotations

import contextlib
import socket
import time

import psutil
import pytest

from tests.harness import BASE_CONFIG, RunningService
from tray_app.core.api.connections import (
    FREE_KEY_FAILURES, MAX_CONNECTIONS_PER_CLIENT, MAX_UNAUTHENTICATED_PER_CLIENT,
)

pytestmark = pytest.mark.integration

KEY = "connection-limits-key-0123456789"
# Long enough that no connection a test holds is cut off by the server's own
# timers while the test runs; the tests never wait for them.
CONFIG = BASE_CONFIG + """
[server]
header_timeout_s = 120.0
body_timeout_s = 120.0
"""


def lan_address() -> str | None:
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    return None


LAN = lan_address()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    if LAN is None:
        pytest.skip("this machine has no non-loopback IPv4 address to play the remote client from")
    running = RunningService(tmp_path_factory.mktemp("limits"), CONFIG, extra_args=("--host", "0.0.0.0"),
                             env={"TRAY_APP_API_KEY": KEY})
    running.http.headers["Authorization"] = f"Bearer {KEY}"
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()


def connect(port: int, host: str) -> socket.socket:
    return socket.create_connection((host, port), timeout=30)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One whole response (status, headers, body): by its Content-Length, or
    up to the end of the connection without one."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a whole response: {data!r}")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, value in (line.split(":", 1) for line in lines[1:])}
    while "content-length" not in headers or len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def get(sock: socket.socket, path: str, key: str | None = None, host: str = "localhost"):
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{auth}\r\n".encode())
    return read_response(sock)


def hold_authenticated(port: int) -> socket.socket:
    """A LAN connection that has shown the key and stays open: a POST whose
    body never comes. The server's "100 Continue" says the key was taken
    (the access guard let it through to a route that reads the body)."""
    sock = connect(port, LAN)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n"
                 "Content-Type: application/json\r\nContent-Length: 100\r\nExpect: 100-continue\r\n\r\n".encode())
    reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 100"), reply[:300]
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed the connection after its last response: a
    further request gets no answer."""
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        return sock.recv(65536) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def wait_until_lan_is_admitted(port: int) -> None:
    """Sockets a test closed are let go by the server as it reads their end,
    not at once: wait until a new LAN connection is served again."""
    deadline = time.monotonic() + 30
    while True:
        with connect(port, LAN) as sock:
            try:
                if get(sock, "/health")[0] == 200:
                    return
            except ConnectionError:
                pass
        assert time.monotonic() < deadline, "the server never let go of the closed connections"
        time.sleep(0.1)


@contextlib.contextmanager
def closing_all(sockets: list[socket.socket]):
    try:
        yield sockets
    finally:
        for sock in sockets:
            sock.close()


def test_one_address_cannot_take_every_connection_and_the_tray_still_gets_in(keyed):
    with closing_all([]) as held:
        # Connections that never show the key: only a few per address.
        held += [connect(keyed.port, LAN) for _ in range(MAX_UNAUTHENTICATED_PER_CLIENT)]
        with connect(keyed.port, LAN) as refused:
            status, _, body = read_response(refused)
        assert status == 503 and b"too_many_connections_from_client" in body, body
        assert b"API key" in body
        # This machine's clients (the tray) are not held back by it.
        assert keyed.http.get("/status").status_code == 200
    wait_until_lan_is_admitted(keyed.port)


def test_connections_that_showed_the_key_may_be_more_up_to_the_per_client_cap(keyed):
    with closing_all([]) as held:
        held += [hold_authenticated(keyed.port) for _ in range(MAX_CONNECTIONS_PER_CLIENT)]
        with connect(keyed.port, LAN) as refused:
            status, _, body = read_response(refused)
        assert status == 503 and f"{MAX_CONNECTIONS_PER_CLIENT} connections".encode() in body, body
        assert keyed.http.get("/status").status_code == 200
    wait_until_lan_is_admitted(keyed.port)


@pytest.mark.parametrize("host, key, status", [("localhost", None, 401), ("localhost", "wrong-key", 401),
                                               ("evil.example", KEY, 403)])
def test_a_refusal_at_the_door_closes_the_connection(keyed, host, key, status):
    # A GET's connection used to stay open until keep-alive ran out, so a
    # client retrying every few seconds never let go of it.
    with connect(keyed.port, "127.0.0.1") as sock:
        got, headers, _ = get(sock, "/status", key, host=host)
        assert got == status and headers["connection"] == "close"
        assert closed_by_server(sock)


def test_wrong_keys_from_one_address_are_slowed_down_and_the_tray_is_not(keyed):
    statuses = []
    for _ in range(FREE_KEY_FAILURES):
        with connect(keyed.port, LAN) as sock:
            statuses.append(get(sock, "/status", "a-wrong-guess")[0])
    assert statuses == [401] * FREE_KEY_FAILURES
    # Each further wrong key makes the address wait, longer each time, until
    # a guess arrives within its wait: then it is refused unchecked.
    for _ in range(10):
        with connect(keyed.port, LAN) as sock:
            status, headers, body = get(sock, "/status", "a-wrong-guess")
            if status == 429:
                assert b"too_many_wrong_keys" in body and headers["connection"] == "close"
                assert closed_by_server(sock)
                break
            assert status == 401
    else:
        pytest.fail("wrong keys were never slowed down")
    # This machine's own clients never wait, whatever they send.
    with connect(keyed.port, "127.0.0.1") as sock:
        assert get(sock, "/status", "a-wrong-guess")[0] == 401
    assert keyed.http.get("/status").status_code == 200
    # Once the wait is over, the right key is taken from that address again.
    time.sleep(int(headers["retry-after"]))
    with connect(keyed.port, LAN) as sock:
        assert get(sock, "/status", KEY)[0] == 200
