"""Remote image URLs ([server] allow_remote_images): which addresses the
server refuses to fetch from, and the bounds on a fetch (size, deadline,
redirects), against a real HTTP server in this process.

That server listens on loopback, which the fetcher refuses, so the tests
reach it the way a deployment would reach a LAN camera: a resolver seam names
its host (images.test) and remote_image_hosts trusts it; the tests that check
refusals leave it untrusted."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import Awaitable, Callable

import pytest

from tests.tiny_projector import tiny_png
from tray_app.core.api.anthropic import translate_messages
from tray_app.core.api.ollama import OllamaChat, OllamaGenerate
from tray_app.core.api.openai_request import InvalidRequest, RemoteImage, image_bytes_uri
from tray_app.core.api.remote_images import RemoteImageFetcher, json_size, refused_address
from tray_app.core.api.requests import ModelNames, validate
from tray_app.core.api.responses import translate_request
from tray_app.core.dispatch.jobs import JobKind

PNG = tiny_png()
HOST = "images.test"
WHERE = "messages[0].content[1]"

Route = Callable[[asyncio.StreamWriter], Awaitable[None]]


@pytest.mark.parametrize("address", [
    "127.0.0.1", "127.8.9.10", "10.1.2.3", "172.16.0.1", "192.168.1.20", "169.254.169.254", "0.0.0.0",
    "224.0.0.251", "100.64.0.1", "::1", "::", "fe80::1%eth0", "fc00::1", "fd12:3456::1", "ff02::1",
    "::ffff:127.0.0.1", "::ffff:192.168.0.1", "2002:7f00:1::1",
    # NAT64: a gateway would carry these to 127.0.0.1 and 10.0.0.1.
    "64:ff9b::7f00:1", "64:ff9b::a00:1", "64:ff9b:1::a00:1", "64:ff9b:1:abcd::1",
])
def test_addresses_on_the_lan_or_the_server_itself_are_refused(address):
    assert refused_address(address) is not None


@pytest.mark.parametrize("address", ["93.184.215.14", "2606:4700:4700::1111", "::ffff:93.184.215.14",
                                     "64:ff9b::5db8:d70e"])
def test_public_addresses_pass(address):
    assert refused_address(address) is None


class ImageServer:
    """An HTTP server on loopback whose paths each answer as a test says."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.requests: list[str] = []
        self.port = 0

    def url(self, path: str, host: str = HOST) -> str:
        return f"http://{host}:{self.port}{path}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ")[1].decode()
            self.requests.append(path)
            await self.routes[path](writer)
        writer.close()


@pytest.fixture
async def server():
    image_server = ImageServer()
    listening = await asyncio.start_server(image_server._serve, "127.0.0.1", 0)
    image_server.port = listening.sockets[0].getsockname()[1]
    async with listening:
        yield image_server
        listening.close()


def answer(body: bytes, status: str = "200 OK", headers: str = "") -> Route:
    async def route(writer: asyncio.StreamWriter) -> None:
        writer.write(f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n{headers}\r\n"
                     .encode() + body)
        await writer.drain()
    return route


def redirect(location: str) -> Route:
    return answer(b"", "302 Found", f"Location: {location}\r\n")


def endless(chunk: bytes, pause_s: float, headers: str = "") -> Route:
    """A body with no declared length that never ends."""
    async def route(writer: asyncio.StreamWriter) -> None:
        writer.write(f"HTTP/1.1 200 OK\r\nConnection: close\r\n{headers}\r\n".encode())
        while True:
            writer.write(chunk)
            await writer.drain()
            await asyncio.sleep(pause_s)
    return route


async def to_loopback(host: str, port: int) -> list[str]:
    """The resolver seam: every name resolves to loopback, where the test server is."""
    return ["127.0.0.1"]


def fetcher(trusted: bool = True, **bounds) -> RemoteImageFetcher:
    return RemoteImageFetcher(allowed=True, trusted_hosts=frozenset({HOST}) if trusted else frozenset(),
                              resolver=to_loopback, **bounds)


async def refusal(fetch: RemoteImageFetcher, url: str) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as refused:
        await fetch.fetch(url, WHERE)
    assert refused.value.status == 400 and refused.value.param == WHERE and WHERE in refused.value.message
    return refused.value


async def test_a_trusted_host_is_fetched_into_the_body_as_a_data_uri(server):
    server.routes["/cat.png"] = answer(PNG)
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what?"},
                                                      {"type": "image_url", "image_url": {"url": "x"}}]}]}
    await fetcher().fetch_into(body, (RemoteImage(0, 1, WHERE, server.url("/cat.png")),))
    assert body["messages"][0]["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")


async def test_a_name_resolving_to_loopback_is_refused_before_any_request(server):
    server.routes["/cat.png"] = answer(PNG)
    refused = await refusal(fetcher(trusted=False), server.url("/cat.png"))
    assert refused.code == "remote_image_address_refused" and "127.0.0.1 is a loopback address" in refused.message
    assert server.requests == []


async def test_each_redirect_is_checked_again(server):
    # The trusted host sends the fetch on to another name that resolves to loopback.
    server.routes["/cat.png"] = redirect(server.url("/inner.png", host="elsewhere.test"))
    server.routes["/inner.png"] = answer(PNG)
    refused = await refusal(fetcher(), server.url("/cat.png"))
    assert refused.code == "remote_image_address_refused" and "elsewhere.test" in refused.message
    assert server.requests == ["/cat.png"]


async def test_more_than_three_redirects_are_refused(server):
    for hop in range(4):
        server.routes[f"/{hop}"] = redirect(f"/{hop + 1}")
    server.routes["/4"] = answer(PNG)
    assert await fetcher().fetch(server.url("/1"), WHERE) == PNG  # three redirects: fetched
    refused = await refusal(fetcher(), server.url("/0"))
    assert refused.code == "remote_image_refused" and "more than 3" in refused.message


async def test_a_redirect_to_another_scheme_is_refused(server):
    server.routes["/cat.png"] = redirect("file:///etc/passwd")
    refused = await refusal(fetcher(), server.url("/cat.png"))
    assert refused.code == "remote_image_refused" and "not http(s)" in refused.message


async def test_a_body_over_the_cap_is_refused(server):
    server.routes["/big.png"] = answer(b"x" * 2000)
    refused = await refusal(fetcher(max_bytes=1000), server.url("/big.png"))
    assert refused.code == "image_too_large"


async def test_an_endless_body_is_read_up_to_the_cap_and_no_further(server):
    # No length declared and no end: only stopping at the cap ends the fetch
    # (the deadline is far off, and its refusal would carry another code).
    server.routes["/big.png"] = endless(b"x" * 4096, pause_s=0)
    refused = await refusal(fetcher(max_bytes=100_000, deadline_s=60), server.url("/big.png"))
    assert refused.code == "image_too_large"


async def test_a_requests_remote_images_share_one_byte_budget(server):
    server.routes["/cat.png"] = answer(PNG)
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                                      {"type": "image_url", "image_url": {"url": "x"}}]}]}
    images = (RemoteImage(0, 0, "messages[0].content[0]", server.url("/cat.png")),
              RemoteImage(0, 1, WHERE, server.url("/cat.png")))
    await fetcher(max_bytes=2 * len(PNG)).fetch_into(body, images)  # both fit
    with pytest.raises(InvalidRequest) as refused:
        await fetcher(max_bytes=2 * len(PNG) - 1).fetch_into(body, images)
    assert refused.value.code == "image_too_large" and refused.value.param == WHERE


async def test_a_trickling_server_meets_the_deadline(server):
    server.routes["/slow.png"] = endless(b"x", pause_s=0.05)
    refused = await refusal(fetcher(deadline_s=0.5), server.url("/slow.png"))
    assert refused.code == "remote_image_timeout" and "0.5 s" in refused.message


async def test_an_http_error_names_its_status(server):
    server.routes["/gone.png"] = answer(b"not here", "404 Not Found")
    refused = await refusal(fetcher(), server.url("/gone.png"))
    assert refused.code == "remote_image_http_error" and "HTTP 404" in refused.message


def hang_up(head: bytes = b"") -> Route:
    """Sends `head` (perhaps nothing) and closes the connection."""
    async def route(writer: asyncio.StreamWriter) -> None:
        writer.write(head)
        await writer.drain()
    return route


@pytest.mark.parametrize("route", [
    hang_up(),  # before any answer: the transport's request
    hang_up(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\nhalf"),  # inside the body: its stream
])
async def test_a_server_that_hangs_up_is_a_400_not_a_crash(server, route):
    """The transport turns httpcore's errors into httpx's, on the request and
    while the body streams, so the fetch answers 400 rather than a 500."""
    server.routes["/cut.png"] = route
    refused = await refusal(fetcher(), server.url("/cut.png"))
    assert refused.code == "remote_image_unreachable" and "RemoteProtocolError" in refused.message


async def test_fetched_bytes_that_are_no_image_are_refused_like_an_inline_one(server):
    server.routes["/page.html"] = answer(b"<html>hello</html>")
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    with pytest.raises(InvalidRequest) as refused:
        await fetcher().fetch_into(body, (RemoteImage(0, 0, WHERE, server.url("/page.html")),))
    assert refused.value.code == "invalid_image" and refused.value.param == WHERE


# ----- refusals name the part as the client numbers it ------------------------------------------

BLIND = ModelNames("m", frozenset({"m"}), frozenset({"m"}))
SEEING = ModelNames("m", frozenset({"m"}), frozenset({"m"}), seeing=frozenset({"m"}), seeing_models=("m",))
PNG_B64 = base64.b64encode(PNG).decode()
REMOTE = "https://example.com/cat.png"


def refused_by_validation(body: dict, models: ModelNames = BLIND, *, remote_images: bool = False) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as refused:
        validate(body, JobKind.CHAT, models, 4096, remote_images=remote_images)
    return refused.value


@pytest.mark.parametrize("translate, where", [
    (lambda: OllamaChat(4096).translate({"model": "m", "messages": [
        {"role": "user", "content": "what?", "images": [PNG_B64, PNG_B64]}]}, JobKind.CHAT).body,
     "messages[0].images[0]"),
    (lambda: OllamaGenerate(4096).translate({"model": "m", "system": "be brief", "prompt": "what?",
                                             "images": [PNG_B64]}, JobKind.CHAT).body, "images[0]"),
    (lambda: translate_messages({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}}]}]}, 4096),
     "messages.0.content.1"),
    (lambda: translate_request({"model": "m", "instructions": "be brief", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what?"},
        {"type": "input_image", "image_url": f"data:image/png;base64,{PNG_B64}"}]}]}, 4096, [])[0],
     "input[0].content[1]"),
])
def test_a_blind_models_refusal_names_the_part_by_the_clients_numbering(translate, where):
    refused = refused_by_validation(translate())
    assert refused.code == "model_has_no_vision" and refused.param == where and refused.message.startswith(where)


@pytest.mark.parametrize("translate, where", [
    (lambda: {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": REMOTE}}]}]},
     "messages[0].content[1]"),
    (lambda: translate_messages({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what?"}, {"type": "image", "source": {"type": "url", "url": REMOTE}}]}]}, 4096),
     "messages.0.content.1"),
    (lambda: translate_request({"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what?"}, {"type": "input_image", "image_url": REMOTE}]}]}, 4096, [])[0],
     "input[0].content[1]"),
])
def test_a_remote_url_is_refused_naming_the_part_and_the_setting_while_it_is_off(translate, where):
    refused = refused_by_validation(translate(), SEEING)
    assert refused.code == "remote_image_refused" and refused.param == where
    assert "allow_remote_images" in refused.message


def test_a_remote_url_is_left_for_the_router_to_fetch_while_it_is_on():
    body = translate_messages({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what?"}, {"type": "image", "source": {"type": "url", "url": REMOTE}}]}]}, 4096)
    checked = validate(body, JobKind.CHAT, SEEING, 4096, remote_images=True)
    assert checked.images == 1
    assert checked.remote_images == (RemoteImage(0, 1, "messages.0.content.1", REMOTE),)
    # What reaches a worker carries no client-side name.
    assert body["messages"][0]["content"][1] == {"type": "image_url", "image_url": {"url": REMOTE}}


async def test_fetched_images_count_against_what_max_body_bytes_leaves(server):
    # Inline, the images may not make the body bigger than a client could have
    # sent: that is what bounds the memory of a queue of them.
    server.routes["/cat.png"] = answer(PNG)
    url = server.url("/cat.png")
    images = (RemoteImage(0, 0, "messages[0].content[0]", url), RemoteImage(0, 1, WHERE, url))

    def body() -> dict:
        return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                          {"type": "image_url", "image_url": {"url": url}}]}]}

    # What each image adds once its data: URI takes its URL's place; the room is judged
    # for the longest head (JPEG's), one character longer than PNG's: hence the + 1.
    inline = len(image_bytes_uri(PNG, WHERE)) - len(url)
    fits = body()
    await fetcher(max_body_bytes=json_size(body()) + 2 * inline + 1).fetch_into(fits, images)
    assert all(part["image_url"]["url"].startswith("data:") for part in fits["messages"][0]["content"])
    with pytest.raises(InvalidRequest) as refused:
        await fetcher(max_body_bytes=json_size(body()) + 2 * inline).fetch_into(body(), images)
    assert refused.value.code == "image_too_large" and refused.value.param == WHERE
    assert "max_body_bytes" in refused.value.message


async def test_a_body_already_at_max_body_bytes_asks_for_no_image(server):
    server.routes["/cat.png"] = answer(PNG)
    url = server.url("/cat.png")
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
    with pytest.raises(InvalidRequest) as refused:
        # Less room than a data: URI's head, even counting the URL's characters it frees.
        await fetcher(max_body_bytes=json_size(body) - len(url) + 20).fetch_into(
            body, (RemoteImage(0, 0, WHERE, url),))
    assert refused.value.code == "image_too_large" and "no image fits" in refused.value.message
    assert "max_body_bytes" in refused.value.message
    assert server.requests == []


async def test_a_limit_left_after_a_first_image_is_told_to_the_byte(server):
    # 1 MiB less a small first image is not "1 MiB left of the 1 MiB".
    server.routes["/cat.png"] = answer(PNG)
    server.routes["/big.png"] = answer(b"x" * 2**20)
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                                      {"type": "image_url", "image_url": {"url": "x"}}]}]}
    images = (RemoteImage(0, 0, "messages[0].content[0]", server.url("/cat.png")),
              RemoteImage(0, 1, WHERE, server.url("/big.png")))
    with pytest.raises(InvalidRequest) as refused:
        await fetcher(max_bytes=2**20).fetch_into(body, images)
    assert refused.value.code == "image_too_large"
    assert f"over the {2**20 - len(PNG):,} bytes left of the 1 MiB a request's remote images" in refused.value.message


@pytest.mark.parametrize("url", ["http://0177.0.0.1/x.png", "http://[::1/x.png", "http://a b/x.png"])
async def test_a_url_httpx_cant_read_is_a_400_not_a_500(url):
    refused = await refusal(fetcher(trusted=False), url)
    assert refused.code in ("remote_image_refused", "remote_image_unreachable", "remote_image_address_refused")
