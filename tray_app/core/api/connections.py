"""Who may hold the port's connections, and how fast a client may guess keys.

One client must not be able to lock out the others. A server-wide cap on
open connections, checked before anyone has shown a key, let a single
address take all of them and answer every other client (the tray, apps,
peers) with a 503. So, besides that cap:

- each client address may hold only so many connections, and fewer that
  have not yet shown the key (a connection counts as authenticated once one
  of its requests carried the right key, or at once when no key is set);
- connections from other machines can't take the last few places, which
  stay free for this machine's own clients (the tray);
- an address that sends wrong keys again and again is slowed down, as SSH
  does: a few tries are free, then each further try has to wait, longer
  each time.

Loopback addresses are exempt from the per-address rules: everyone on this
machine already shares 127.0.0.1 (a per-address cap would be a lower
server-wide one), and a local user can read the key from the config anyway.

Pure: the HTTP server and the access guard call it with an address and the
time; it does no I/O.
"""

from __future__ import annotations

import ipaddress
import math
from collections import OrderedDict
from dataclasses import dataclass, field

from ..base.http_basics import is_loopback

# Where the HTTP server puts a request's ClientConnection in its ASGI scope
# (under "extensions"), for the access guard.
CONNECTION_SCOPE_KEY = "tray_app.connection"
# Connections one address may hold at once, authenticated or not.
MAX_CONNECTIONS_PER_CLIENT = 32
# Of those, how many may be waiting to show the key: enough for a client's
# connection pool to open before its first answers arrive, too few to matter.
MAX_UNAUTHENTICATED_PER_CLIENT = 8
# Places kept for this machine's own clients, as a share of [server]
# max_connections (at most this many).
LOOPBACK_RESERVE = 16
# Wrong keys one address may send within the window before it must wait.
FREE_KEY_FAILURES = 5
KEY_FAILURE_WINDOW_S = 600.0
# The wait after the first failure past the free ones; it doubles with each
# further one, up to the cap.
FIRST_KEY_DELAY_S = 1.0
MAX_KEY_DELAY_S = 60.0
# Addresses whose failures are remembered; past it the stalest is forgotten,
# so a sweep over many addresses can't grow the table without bound.
MAX_TRACKED_ADDRESSES = 4096


@dataclass(frozen=True)
class Refusal:
    """Why a new connection is refused, for the 503 the server sends before closing it."""
    code: str
    message: str


@dataclass
class ClientConnection:
    """One open connection, as the ledger knows it."""
    address: str
    authenticated: bool = False
    counted: bool = field(default=False, repr=False)


@dataclass
class _Failures:
    times: list[float] = field(default_factory=list)
    blocked_until: float = 0.0


def client_key(host: str | None) -> str:
    """The address a connection's limits are counted under. An IPv6 host
    owns a whole /64 (and picks new addresses in it at will), so it counts
    as one; a connection with no address (a Unix socket) is local."""
    if not host:
        return "localhost"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and not address.is_loopback:
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{address}/64", strict=False))
    return str(address)


class ConnectionLedger:
    """Open connections by client address, and failed keys by address."""

    def __init__(self, max_connections: int, *, key_required: bool,
                 per_client: int = MAX_CONNECTIONS_PER_CLIENT,
                 unauthenticated_per_client: int = MAX_UNAUTHENTICATED_PER_CLIENT) -> None:
        self.max_connections = max_connections
        self.key_required = key_required
        self.per_client = per_client
        self.unauthenticated_per_client = min(unauthenticated_per_client, per_client)
        self.loopback_reserve = min(LOOPBACK_RESERVE, max_connections // 4)
        self._open: dict[str, int] = {}
        self._unauthenticated: dict[str, int] = {}
        self._total = 0
        self._remote_total = 0
        self._failures: OrderedDict[str, _Failures] = OrderedDict()

    # ----- connections -----------------------------------------------------------------------

    def open(self, address: str) -> tuple[ClientConnection, Refusal | None]:
        """A new connection from `address`: counted when admitted, or why not."""
        connection = ClientConnection(address, authenticated=not self.key_required)
        refusal = self._refusal(address)
        if refusal is None:
            connection.counted = True
            self._total += 1
            if not is_loopback(address):
                self._remote_total += 1
                self._open[address] = self._open.get(address, 0) + 1
                if not connection.authenticated:
                    self._unauthenticated[address] = self._unauthenticated.get(address, 0) + 1
        return connection, refusal

    def _refusal(self, address: str) -> Refusal | None:
        if self._total >= self.max_connections:
            return Refusal("too_many_connections", f"the server already holds {self.max_connections} connections "
                           "([server] max_connections); retry shortly")
        if is_loopback(address):
            return None
        if self._remote_total >= self.max_connections - self.loopback_reserve:
            return Refusal("too_many_connections", f"connections from other machines already take "
                           f"{self._remote_total} of the {self.max_connections} places ([server] max_connections; "
                           f"the last {self.loopback_reserve} are kept for this machine's own clients); "
                           "retry shortly")
        if self._open.get(address, 0) >= self.per_client:
            return Refusal("too_many_connections_from_client", f"{address} already holds {self.per_client} "
                           "connections, the most one client may; reuse them (keep-alive) or close some")
        if not self.key_required:
            return None
        if self._unauthenticated.get(address, 0) >= self.unauthenticated_per_client:
            return Refusal("too_many_connections_from_client",
                           f"{address} already holds {self.unauthenticated_per_client} connections that have "
                           "not sent the API key, the most one client may; send the key "
                           "('Authorization: Bearer <key>') on the ones it has")
        return None

    def authenticated(self, connection: ClientConnection) -> None:
        """One of the connection's requests carried the right key."""
        if connection.authenticated:
            return
        connection.authenticated = True
        if connection.counted and not is_loopback(connection.address):
            self._decrement(self._unauthenticated, connection.address)

    def closed(self, connection: ClientConnection) -> None:
        if not connection.counted:
            return
        connection.counted = False
        self._total -= 1
        if is_loopback(connection.address):
            return
        self._remote_total -= 1
        self._decrement(self._open, connection.address)
        if not connection.authenticated:
            self._decrement(self._unauthenticated, connection.address)

    @staticmethod
    def _decrement(counts: dict[str, int], address: str) -> None:
        left = counts.get(address, 0) - 1
        if left > 0:
            counts[address] = left
        else:
            counts.pop(address, None)

    def held_by(self, address: str) -> tuple[int, int]:
        """(open, not yet authenticated) connections of a remote address."""
        return self._open.get(address, 0), self._unauthenticated.get(address, 0)

    # ----- failed keys -----------------------------------------------------------------------

    def key_failed(self, address: str, now: float) -> None:
        """A request from `address` offered a wrong key."""
        if is_loopback(address):
            return
        failures = self._failures.pop(address, None) or _Failures()
        self._failures[address] = failures  # most recently seen last
        while len(self._failures) > MAX_TRACKED_ADDRESSES:
            self._failures.popitem(last=False)
        failures.times = [t for t in failures.times if now - t < KEY_FAILURE_WINDOW_S] + [now]
        over = len(failures.times) - FREE_KEY_FAILURES
        if over > 0:
            delay = min(FIRST_KEY_DELAY_S * 2 ** (over - 1), MAX_KEY_DELAY_S)
            failures.blocked_until = max(failures.blocked_until, now + delay)

    def key_wait_s(self, address: str, now: float) -> float | None:
        """How long `address` must wait before its next key is checked, or None."""
        failures = self._failures.get(address)
        if failures is None or failures.blocked_until <= now:
            return None
        return failures.blocked_until - now


def retry_after_header(wait_s: float) -> str:
    """Whole seconds, rounded up, so a client that waits that long is let in."""
    return str(max(1, math.ceil(wait_s)))
