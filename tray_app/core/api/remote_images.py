"""Remote image URLs, fetched by the service for a client ([server] allow_remote_images).

A server that fetches what a client names can be pointed at what only it can
reach: its own loopback ports, the LAN, a cloud metadata address. So every
connection (the first and each redirect's) goes to an address checked after
DNS resolution, and the check and the connection use the same address, so a
name that resolves differently the second time (DNS rebinding) gains
nothing. A host in [server] remote_image_hosts skips the address check: a
camera or NAS on the LAN is the usual reason to turn fetching on at home.

The fetch runs in the service before admission, never in a worker: the bytes
go through the same image check as an inline data: URI and replace the URL
in the body as one, so the worker never fetches, and a replay on the CPU
sends the same bytes without fetching again.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import socket
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpcore
import httpx

from .openai_request import (MAX_IMAGE_BYTES, InvalidRequest, RemoteImage, add_image_pixels, image_bytes_uri,
                             image_pixels)

FETCH_DEADLINE_S = 10.0  # a request's fetches in all: DNS, connections, redirects, the bodies
MAX_REDIRECTS = 3

# (host, port) -> the addresses it resolves to. The seam lets tests name a
# host that "resolves" to loopback without a DNS server.
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def system_resolver(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


# NAT64 (RFC 6052): a gateway turns 64:ff9b::a.b.c.d into the IPv4 address
# a.b.c.d. The local-use prefix (RFC 8215) may embed it anywhere, so none of
# it is fetched from.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_LOCAL_NAT64 = ipaddress.IPv6Network("64:ff9b:1::/48")


def refused_address(address: str) -> str | None:
    """Why the server must not connect to this address for a client, or None."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone (fe80::1%eth0) is not part of it
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _LOCAL_NAT64:
            return f"{address} is a local-use NAT64 address, which reaches this network's IPv4 addresses"
        # ::ffff:127.0.0.1, 2002:7f00:1:: and 64:ff9b::7f00:1 (NAT64) reach IPv4's
        # loopback: judge the IPv4 address they carry.
        nat64 = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if ip in _NAT64 else None
        ip = ip.ipv4_mapped or ip.sixtofour or nat64 or ip
    for refused, name in ((ip.is_unspecified, "unspecified"), (ip.is_loopback, "loopback"),
                          (ip.is_link_local, "link-local"), (ip.is_multicast, "multicast"),
                          (ip.is_private, "private")):
        if refused:
            return f"{address} is a {name} address"
    if not ip.is_global:  # shared (100.64/10), reserved and documentation ranges
        return f"{address} is not a public address"
    return None


class Refused(Exception):
    """A fetch the server won't make or finish; the message says why."""

    def __init__(self, why: str, code: str) -> None:
        super().__init__(why)
        self.why, self.code = why, code


class _CheckedNetwork(httpcore.AsyncNetworkBackend):
    """httpcore's network, connecting only to checked addresses: every TCP
    connection (redirects included) resolves its host here and connects to
    the address it checked. TLS still verifies the certificate against the
    host name, which httpcore passes separately."""

    def __init__(self, resolver: Resolver, trusted_hosts: frozenset[str]) -> None:
        self._inner = httpcore.AnyIOBackend()
        self._resolver = resolver
        self._trusted_hosts = trusted_hosts

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None, socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        try:
            addresses = await self._resolver(host, port)
        except OSError as error:
            raise Refused(f"its host {host} does not resolve ({error})", "remote_image_unreachable") from None
        if not addresses:
            raise Refused(f"its host {host} does not resolve", "remote_image_unreachable")
        if host.lower() not in self._trusted_hosts:
            for candidate in addresses:
                # Every address, not only the first: a name may list a public
                # and a private one and let the OS pick.
                why = refused_address(candidate)
                if why is not None:
                    raise Refused(f"its host {host} resolves to {why}; the server does not fetch from the LAN or "
                                  "itself for a client (a trusted host goes in [server] remote_image_hosts)",
                                  "remote_image_address_refused")
        address = addresses[0]
        return await self._inner.connect_tcp(address, port, timeout=timeout, local_address=local_address,
                                             socket_options=socket_options)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        raise Refused("a Unix socket is not a remote image", "remote_image_address_refused")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


# httpcore's errors as httpx's, most specific first: `fetch` catches
# httpx.HTTPError, and names the error's type in its message.
_HTTPX_ERROR_FOR = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout), (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout), (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError), (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError), (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError), (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError), (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
)


@contextlib.contextmanager
def _as_httpx_errors() -> Iterator[None]:
    try:
        yield
    except Exception as error:
        for core_error, httpx_error in _HTTPX_ERROR_FOR:
            if isinstance(error, core_error):
                raise httpx_error(str(error)) from error
        raise  # Refused, and anything that is not httpcore's, as it is


class _BodyStream(httpx.AsyncByteStream):
    def __init__(self, core_stream: AsyncIterable[bytes]) -> None:
        self._core_stream = core_stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx_errors():
            async for chunk in self._core_stream:
                yield chunk

    async def aclose(self) -> None:
        close = getattr(self._core_stream, "aclose", None)  # httpcore's response stream has one
        if close is not None:
            await close()


class _CheckedTransport(httpx.AsyncBaseTransport):
    """An httpx transport over an httpcore pool on the checked network.
    httpx's own transport takes no network backend, so this one builds its
    pool and maps requests and answers itself, with httpx's and httpcore's
    public API only: an httpx upgrade can't swap the network underneath it."""

    def __init__(self, resolver: Resolver, trusted_hosts: frozenset[str]) -> None:
        self._pool = httpcore.AsyncConnectionPool(ssl_context=httpx.create_ssl_context(),
                                                  network_backend=_CheckedNetwork(resolver, trusted_hosts))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.AsyncByteStream)
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(scheme=request.url.raw_scheme, host=request.url.raw_host, port=request.url.port,
                             target=request.url.raw_path),
            headers=request.headers.raw, content=request.stream, extensions=request.extensions)
        with _as_httpx_errors():
            core_response = await self._pool.handle_async_request(core_request)
        assert isinstance(core_response.stream, AsyncIterable)
        return httpx.Response(status_code=core_response.status, headers=core_response.headers,
                              stream=_BodyStream(core_response.stream), extensions=core_response.extensions)

    async def aclose(self) -> None:
        await self._pool.aclose()


@dataclass(frozen=True)
class RemoteImageFetcher:
    """Fetches clients' remote image URLs under the server's bounds."""

    allowed: bool = False
    trusted_hosts: frozenset[str] = frozenset()
    resolver: Resolver = system_resolver
    deadline_s: float = FETCH_DEADLINE_S
    max_bytes: int = MAX_IMAGE_BYTES
    # [server] max_body_bytes: a body with its images inline is no bigger (None: no such bound).
    max_body_bytes: int | None = None

    @classmethod
    def from_config(cls, server: Any) -> RemoteImageFetcher:
        return cls(allowed=server.allow_remote_images,
                   trusted_hosts=frozenset(host.lower() for host in server.remote_image_hosts),
                   max_body_bytes=server.max_body_bytes)

    async def fetch_into(self, body: dict[str, Any], remote: tuple[RemoteImage, ...], pixels: int = 0) -> int:
        """Each remote image in a checked body fetched, checked and put in its
        place as a data: URI; a 400 naming the first part that fails.

        The request's images share one deadline and one byte budget, so a
        body that lists many URLs can't multiply what a fetch may cost. The
        body with its images inline may not be bigger than max_body_bytes,
        what a client could have sent, which is what bounds a queue's
        memory. The body measured is the one the worker will get: a Responses
        follow-up's stored conversation counts too. `pixels` are the inline
        images' (their decoded size); returns them with the fetched ones'."""
        if not remote:
            return pixels
        until = asyncio.get_running_loop().time() + self.deadline_s
        budget = self.max_bytes  # what the request's remote images may still bring, as bytes
        body_room = None if self.max_body_bytes is None else self.max_body_bytes - json_size(body)
        for image in remote:
            room, limit = budget, (f"{_size(budget)} limit for a request's remote images" if budget == self.max_bytes
                                   else f"{_size(budget)} left of the {_size(self.max_bytes)} a request's "
                                   "remote images may bring")
            # Inline, the image's data: URI takes the place of its URL.
            if body_room is not None and _raw_fitting(body_room + len(image.url)) < room:
                room = _raw_fitting(body_room + len(image.url))
                limit = (f"{_size(room)} that [server] max_body_bytes ({_size(self.max_body_bytes or 0)}) leaves this "
                         "request for it, counted inline as base64")
            raw = await self.fetch(image.url, image.where, until=until, room=room, limit=limit)
            budget -= len(raw)
            uri = image_bytes_uri(raw, image.where)
            pixels = add_image_pixels(pixels, image_pixels(raw), image.where)
            if body_room is not None:
                body_room -= len(uri) - len(image.url)
            body["messages"][image.message]["content"][image.part]["image_url"]["url"] = uri
        return pixels

    async def fetch(self, url: str, where: str, *, until: float | None = None, room: int | None = None,
                    limit: str | None = None) -> bytes:
        """The bytes at url, or a 400 naming the part and why: over room
        bytes, it is over the limit the words name."""
        until = asyncio.get_running_loop().time() + self.deadline_s if until is None else until
        room = self.max_bytes if room is None else room
        limit = f"{_size(room)} limit for a request's remote images" if limit is None else limit
        try:
            async with asyncio.timeout_at(until):
                return await self._fetch(url, room, limit)
        except TimeoutError:
            why, code = (f"it did not arrive within the {self.deadline_s:g} s a request's remote images have",
                         "remote_image_timeout")
        except Refused as refused:
            why, code = refused.why, refused.code
        except httpx.HTTPError as error:
            why, code = f"it could not be fetched ({type(error).__name__}: {error})", "remote_image_unreachable"
        except (httpx.InvalidURL, ValueError) as error:  # "http://0177.0.0.1/", "http://[::1/": was a 500
            why, code = f"it is not a URL this server fetches ({error})", "remote_image_refused"
        raise InvalidRequest(400, f"{where}: the image at {_shown(url)} was not fetched: {why}", code, where)

    async def _fetch(self, url: str, room: int, limit: str) -> bytes:
        if room <= 0:  # no image fits: don't ask its server for one
            raise Refused(f"no image fits in the {limit}", "image_too_large")
        transport = _CheckedTransport(self.resolver, self.trusted_hosts)
        # trust_env off: a proxy from the environment would make the
        # connection the check never sees.
        async with httpx.AsyncClient(transport=transport, trust_env=False, follow_redirects=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                if urlsplit(url).scheme not in ("http", "https"):
                    raise Refused(f"it redirects to {_shown(url)}, which is not http(s)", "remote_image_refused")
                # identity: the byte bound holds for what is read, not for what a compressed body expands to.
                headers = {"Accept": "image/*", "Accept-Encoding": "identity"}
                async with client.stream("GET", url, headers=headers) as response:
                    if response.is_redirect:
                        url = urljoin(url, response.headers.get("location", ""))
                        continue
                    if response.status_code >= 400:
                        raise Refused(f"its server answered HTTP {response.status_code}", "remote_image_http_error")
                    return await self._read_bounded(response, room, limit)
            raise Refused(f"it redirects more than {MAX_REDIRECTS} times", "remote_image_refused")

    async def _read_bounded(self, response: httpx.Response, room: int, limit: str) -> bytes:
        too_large = Refused(f"it is over the {limit}", "image_too_large")
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > room:
            raise too_large
        received = bytearray()
        async for chunk in response.aiter_bytes():
            received += chunk
            if len(received) > room:
                raise too_large  # stop reading: the connection closes with the stream
        return bytes(received)


def _raw_fitting(encoded_room: int) -> int:
    """The most image bytes whose data: URI (base64, 4 characters per 3
    bytes, after a head of at most 23: "data:image/jpeg;base64,") fits in
    encoded_room."""
    return max(0, (encoded_room - 23) // 4 * 3)


def json_size(body: Any) -> int:
    """A body's size as compact JSON: what it holds, near enough, and what a client's would have been."""
    return len(json.dumps(body, separators=(",", ":")))


def _size(count: int) -> str:
    """Whole MiB as MiB; anything else to the byte, so a limit read after a
    first image (20 MiB less 5 kB) isn't rounded back up to the whole."""
    count = max(count, 0)
    return f"{count // 2**20} MiB" if count and count % 2**20 == 0 else f"{count:,} bytes"


def _shown(url: str) -> str:
    """The URL for a message, shortened: a client may send a long one."""
    return url if len(url) <= 200 else url[:200] + "..."
