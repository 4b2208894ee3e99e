"""Who may hold the port's connections and how fast an address may guess
keys (issue 27, part 3): the ledger's rules, without sockets. The real
server's use of them is tested in tests/integration/test_connection_limits.py."""

from __future__ import annotations

import pytest

from tray_app.core.api.connections import (
    FIRST_KEY_DELAY_S, FREE_KEY_FAILURES, KEY_FAILURE_WINDOW_S, MAX_KEY_DELAY_S, ConnectionLedger, client_key,
    retry_after_header,
)

LAN = "192.168.1.50"
OTHER = "192.168.1.51"


def ledger(max_connections=256, key_required=True, per_client=6, unauthenticated=3) -> ConnectionLedger:
    return ConnectionLedger(max_connections, key_required=key_required, per_client=per_client,
                            unauthenticated_per_client=unauthenticated)


def test_an_address_may_hold_only_so_many_connections_that_have_not_shown_the_key():
    book = ledger()
    held = [book.open(LAN) for _ in range(3)]
    assert all(refusal is None for _, refusal in held)
    _, refusal = book.open(LAN)
    assert refusal is not None and refusal.code == "too_many_connections_from_client"
    assert LAN in refusal.message and "3" in refusal.message and "key" in refusal.message
    # Another address is not held back by it.
    assert book.open(OTHER)[1] is None


def test_showing_the_key_frees_a_place_up_to_the_per_address_cap():
    book = ledger()
    held = [book.open(LAN)[0] for _ in range(3)]
    for connection in held:
        book.authenticated(connection)
    more = [book.open(LAN) for _ in range(3)]
    assert all(refusal is None for _, refusal in more)
    assert book.held_by(LAN) == (6, 3)
    for connection, _ in more:
        book.authenticated(connection)
    _, refusal = book.open(LAN)
    assert refusal is not None and "6 connections" in refusal.message


def test_a_closed_connection_gives_its_place_back_once():
    book = ledger()
    held = [book.open(LAN)[0] for _ in range(3)]
    book.authenticated(held[0])
    book.closed(held[0])
    book.closed(held[0])
    book.closed(held[1])
    assert book.held_by(LAN) == (1, 1)
    assert book.open(LAN)[1] is None and book.open(LAN)[1] is None
    # A refused connection was never counted: closing it changes nothing.
    extra, refusal = book.open(LAN)
    assert refusal is not None
    book.closed(extra)
    assert book.held_by(LAN) == (3, 3)


def test_without_a_key_every_connection_counts_as_authenticated():
    book = ledger(key_required=False)
    assert all(book.open(LAN)[1] is None for _ in range(6))
    assert book.open(LAN)[1] is not None  # the per-address cap still holds


def test_loopback_is_held_only_by_the_server_wide_cap():
    book = ledger(max_connections=20)
    assert all(book.open("127.0.0.1")[1] is None for _ in range(20))
    _, refusal = book.open("127.0.0.1")
    assert refusal is not None and refusal.code == "too_many_connections" and "20" in refusal.message


def test_other_machines_cannot_take_the_places_kept_for_this_one():
    book = ledger(max_connections=20, per_client=100, unauthenticated=100)
    admitted = 0
    for index in range(20):
        if book.open(f"10.0.0.{index}")[1] is None:
            admitted += 1
    assert admitted == 20 - book.loopback_reserve and book.loopback_reserve > 0
    _, refusal = book.open("10.0.1.1")
    assert refusal is not None and "this machine's own clients" in refusal.message
    assert book.open("127.0.0.1")[1] is None and book.open("::1")[1] is None


def test_wrong_keys_are_free_a_few_times_then_each_costs_a_growing_wait():
    book = ledger()
    for second in range(FREE_KEY_FAILURES):
        book.key_failed(LAN, float(second))
        assert book.key_wait_s(LAN, float(second)) is None
    now = float(FREE_KEY_FAILURES)
    book.key_failed(LAN, now)
    assert book.key_wait_s(LAN, now) == pytest.approx(FIRST_KEY_DELAY_S)
    assert book.key_wait_s(LAN, now + FIRST_KEY_DELAY_S) is None
    now += FIRST_KEY_DELAY_S
    book.key_failed(LAN, now)
    assert book.key_wait_s(LAN, now) == pytest.approx(2 * FIRST_KEY_DELAY_S)
    for _ in range(20):
        now += book.key_wait_s(LAN, now) or 0.0  # each guess once its wait is over
        book.key_failed(LAN, now)
    assert book.key_wait_s(LAN, now) == pytest.approx(MAX_KEY_DELAY_S)
    # Another address, and this machine, are never held back by it.
    assert book.key_wait_s(OTHER, now) is None
    for _ in range(50):
        book.key_failed("127.0.0.1", now)
    assert book.key_wait_s("127.0.0.1", now) is None


def test_old_failures_are_forgotten_after_the_window():
    book = ledger()
    for second in range(FREE_KEY_FAILURES):
        book.key_failed(LAN, float(second))
    later = KEY_FAILURE_WINDOW_S + FREE_KEY_FAILURES
    book.key_failed(LAN, later)
    assert book.key_wait_s(LAN, later) is None


def test_an_ipv6_client_counts_as_its_whole_64():
    assert client_key("2001:db8::1") == client_key("2001:db8::beef:2") == "2001:db8::/64"
    assert client_key("2001:db8:0:1::1") != client_key("2001:db8::1")
    assert client_key("::ffff:10.0.0.7") == "10.0.0.7"
    assert client_key("::1") == "::1" and client_key("10.0.0.7") == "10.0.0.7"
    assert client_key(None) == "localhost"


def test_retry_after_rounds_up_to_whole_seconds():
    assert retry_after_header(0.2) == "1" and retry_after_header(1.0) == "1" and retry_after_header(1.01) == "2"
