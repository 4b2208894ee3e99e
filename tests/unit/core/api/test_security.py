from __future__ import annotations

import pytest

from tests.fakes.clock import FakeClock
from tray_app.core.config import ConfigError, parse_config_text
from tray_app.core.api.connections import (
    CONNECTION_SCOPE_KEY, FREE_KEY_FAILURES, ClientConnection, ConnectionLedger,
)
from tray_app.core.api.security import API_KEY_ENV, AccessGuard, AccessPolicy, bearer_header, effective_api_key


def policy(allowed_hosts=()) -> AccessPolicy:
    return AccessPolicy.build(api_key="", bind_address="127.0.0.1", allowed_hosts=allowed_hosts, cors_origins=())


def test_the_environment_key_wins_over_the_configured_one(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert effective_api_key("from-config") == "from-env"


def test_the_configured_key_applies_without_an_environment_key(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert effective_api_key("from-config") == "from-config"


def test_an_empty_environment_key_does_not_hide_the_configured_one(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "")
    assert effective_api_key("from-config") == "from-config"


def test_bearer_header_only_with_a_key():
    assert bearer_header("k") == {"Authorization": "Bearer k"}
    assert bearer_header("") == {}


def test_a_listed_name_is_allowed_and_a_rebinding_name_is_not():
    allowed = policy(allowed_hosts=["myhost.lan"])
    assert allowed.host_allowed("myhost.lan:8642") and allowed.host_allowed("localhost:8642")
    assert not allowed.host_allowed("evil.example:8642")


def test_a_star_in_allowed_hosts_is_not_a_wildcard():
    assert not policy(allowed_hosts=["*"]).host_allowed("evil.example:8642")


LOOKALIKE_ORIGINS = (
    "null", "http://evil.example", "http://localhost.evil.example:3000", "http://127.0.0.1.evil.example",
    "http://localhost:3000.evil.example", "http://user@localhost:3000", "http://localhost:3000/path",
    "file://localhost", "ws://localhost:3000", "http://127.0.0.2:3000", "http://0.0.0.0:3000",
)


@pytest.mark.parametrize("origin", [
    "http://localhost:3000", "http://127.0.0.1:8080", "https://localhost", "http://[::1]:5173",
    "http://LOCALHOST:3000/",
])
def test_pages_on_this_machine_are_allowed_origins_by_default_and_lookalikes_are_not(origin):
    assert policy().origin_allowed(origin)
    assert not any(policy().origin_allowed(lookalike) for lookalike in LOOKALIKE_ORIGINS)


def test_configured_origins_are_allowed_besides_the_local_ones():
    configured = AccessPolicy.build(api_key="", bind_address="127.0.0.1", allowed_hosts=(),
                                    cors_origins=["app://obsidian.md"])
    assert configured.origin_allowed("app://obsidian.md") and configured.origin_allowed("http://localhost:3000")


@pytest.mark.parametrize("hosts", ['["*"]', '["myhost.lan", "*.lan"]'])
def test_config_refuses_wildcards_in_allowed_hosts(hosts):
    with pytest.raises(ConfigError, match=r"\[server\] allowed_hosts takes host names, not wildcards"):
        parse_config_text(f"[server]\nallowed_hosts = {hosts}\n")


# ----- the guard with a connection ledger (issue 27, part 3) -------------------------------

KEY = "the-right-key-0123456789"
LAN = "192.168.1.50"


async def _ok(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def keyed_guard(clock: FakeClock) -> tuple[AccessGuard, ConnectionLedger]:
    ledger = ConnectionLedger(256, key_required=True)
    keyed = AccessPolicy.build(api_key=KEY, bind_address="0.0.0.0", allowed_hosts=(), cors_origins=())
    return AccessGuard(_ok, keyed, ledger, clock=clock), ledger


async def ask(guard: AccessGuard, connection: ClientConnection, key: str | None, path: str = "/status"):
    headers = [(b"host", b"localhost")] + ([(b"authorization", f"Bearer {key}".encode())] if key else [])
    scope = {"type": "http", "method": "GET", "path": path, "headers": headers, "client": (connection.address, 4000),
             "extensions": {CONNECTION_SCOPE_KEY: connection}}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await guard(scope, receive, send)
    start = sent[0]
    return start["status"], {name.decode(): value.decode() for name, value in start["headers"]}


async def test_the_right_key_marks_the_connection_authenticated():
    guard, ledger = keyed_guard(FakeClock())
    connection, _ = ledger.open(LAN)
    assert ledger.held_by(LAN) == (1, 1)
    status, _ = await ask(guard, connection, KEY)
    assert status == 200 and connection.authenticated and ledger.held_by(LAN) == (1, 0)


async def test_a_refusal_at_the_door_closes_the_connection():
    guard, ledger = keyed_guard(FakeClock())
    connection, _ = ledger.open(LAN)
    status, headers = await ask(guard, connection, None)
    assert status == 401 and headers["connection"] == "close" and not connection.authenticated


async def test_an_address_sending_wrong_keys_must_wait_and_learns_nothing_meanwhile():
    clock = FakeClock()
    guard, ledger = keyed_guard(clock)
    trusted, _ = ledger.open(LAN)
    assert (await ask(guard, trusted, KEY))[0] == 200
    statuses = []
    for _ in range(FREE_KEY_FAILURES + 1):
        connection, _ = ledger.open(LAN)
        statuses.append((await ask(guard, connection, "guess"))[0])
        ledger.closed(connection)
    assert statuses == [401] * (FREE_KEY_FAILURES + 1)
    # Now even the right key is refused unchecked, so a guess can't be confirmed.
    guesser, _ = ledger.open(LAN)
    status, headers = await ask(guard, guesser, KEY)
    assert status == 429 and headers["retry-after"] == "1" and headers["connection"] == "close"
    assert not guesser.authenticated
    # A connection that showed the key before carries on.
    assert (await ask(guard, trusted, KEY))[0] == 200
    clock.now += 1.0
    assert (await ask(guard, guesser, KEY))[0] == 200


async def test_a_missing_key_is_refused_but_is_not_a_guess():
    clock = FakeClock()
    guard, ledger = keyed_guard(clock)
    for _ in range(3 * FREE_KEY_FAILURES):
        connection, _ = ledger.open(LAN)
        assert (await ask(guard, connection, None))[0] == 401
        ledger.closed(connection)
    assert ledger.key_wait_s(LAN, clock.now) is None


async def test_this_machine_is_never_made_to_wait():
    guard, ledger = keyed_guard(FakeClock())
    for _ in range(3 * FREE_KEY_FAILURES):
        connection, _ = ledger.open("127.0.0.1")
        assert (await ask(guard, connection, "guess"))[0] == 401
    tray, _ = ledger.open("127.0.0.1")
    assert (await ask(guard, tray, KEY))[0] == 200
