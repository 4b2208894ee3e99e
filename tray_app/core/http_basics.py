"""Small HTTP facts every layer shares: which hosts are this machine's
loopback, and how an API key is sent. Here, below api/ and dispatch/, so the
HTTP app, the peer path, the config and the command line use one rule."""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bearer_header(api_key: str) -> dict[str, str]:
    """The Authorization header a client sends with `api_key`; none without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
