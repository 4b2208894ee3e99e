"""Remote image URLs on a real router and a real worker with the tiny projector.

The image is served by an HTTP server in this process. It listens on
loopback, which the router refuses to fetch from for a client, so the
service trusts it by name ([server] remote_image_hosts = ["127.0.0.1"]), as a
home user would list a camera on the LAN; "localhost", the same address
under a name that is not listed, stays refused."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

from tests.harness import RunningService, running
from tests.integration.test_keys_and_usage import add_key, bearer
from tests.tiny_projector import png_bomb
from tests.integration.test_images import IMAGE_TOKENS, MODEL, PNG, ask, image_config, openai_client, \
    text_prompt_tokens

pytestmark = pytest.mark.integration

FETCHING = '[server]\nallow_remote_images = true\nremote_image_hosts = ["127.0.0.1"]\n'


BOMB = png_bomb(16000, 16000)


class ImageServer:
    """Serves PNG at /cat.png (and at /slow.png after a second), a 16000 x
    16000 PNG of 250 KB at /bomb.png, and counts the requests it gets and
    how many it serves at once; while `down`, answers 503."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.down = False
        self.serving_now = self.most_at_once = 0
        served = self
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                served.requests.append(self.path)
                if served.down:
                    self.send_error(503)
                    return
                with lock:
                    served.serving_now += 1
                    served.most_at_once = max(served.most_at_once, served.serving_now)
                try:
                    if self.path == "/slow.png":
                        time.sleep(1.0)
                    image = BOMB if self.path == "/bomb.png" else PNG
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(image)))
                    self.end_headers()
                    self.wfile.write(image)
                finally:
                    with lock:
                        served.serving_now -= 1

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]

    def url(self, host: str = "127.0.0.1", name: str = "cat.png") -> str:
        return f"http://{host}:{self.port}/{name}"

    @contextlib.contextmanager
    def serving(self):
        thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()


@pytest.fixture(scope="module")
def images():
    with ImageServer().serving() as server:
        yield server


@pytest.fixture(scope="module")
def fetching(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("remote-images")
    with running(tmp, image_config(tmp, cpu_sees=True) + FETCHING, roles=("gpu",)) as service:
        yield service


def test_a_remote_image_from_a_trusted_host_is_fetched_once_and_run(fetching, images):
    images.requests.clear()
    reply = openai_client(fetching).chat.completions.create(
        model=MODEL, messages=ask("What is in the picture?", images.url()), max_tokens=2)
    # The worker ran the fetched image: its 16 tokens are in the prompt.
    assert reply.usage.prompt_tokens == text_prompt_tokens(fetching, "What is in the picture?") + IMAGE_TOKENS
    assert images.requests == ["/cat.png"]


def test_a_retry_with_its_idempotency_key_is_answered_without_fetching_again(fetching, images):
    """The retry of a request whose answer got lost on the way back: replayed from the first
    run, even while the image's server is down now, and the image is not fetched twice."""
    images.requests.clear()
    body = {"model": MODEL, "messages": ask("What is in the picture?", images.url()), "max_tokens": 2}
    headers = {"Idempotency-Key": "camera-snapshot-1"}
    first = fetching.http.post("/v1/chat/completions", json=body, headers=headers)
    assert first.status_code == 200, first.text
    images.down = True
    try:
        again = fetching.http.post("/v1/chat/completions", json=body, headers=headers)
    finally:
        images.down = False
    assert again.status_code == 200, again.text
    assert again.headers["X-Idempotent-Replay"] == "true" and again.json() == first.json()
    assert images.requests == ["/cat.png"]


def test_an_image_that_could_not_be_fetched_does_not_use_up_its_idempotency_key(fetching, images):
    images.requests.clear()
    body = {"model": MODEL, "messages": ask("What is in the picture?", images.url()), "max_tokens": 2}
    headers = {"Idempotency-Key": "camera-snapshot-2"}
    images.down = True
    try:
        failed = fetching.http.post("/v1/chat/completions", json=body, headers=headers)
    finally:
        images.down = False
    assert failed.status_code == 400 and failed.json()["error"]["code"] == "remote_image_http_error"
    assert failed.json()["error"]["param"] == "messages[0].content[1]"
    # The server is back: the retry with the same key runs for real, not the failure replayed.
    retried = fetching.http.post("/v1/chat/completions", json=body, headers=headers)
    assert retried.status_code == 200, retried.text
    assert "X-Idempotent-Replay" not in retried.headers
    assert images.requests == ["/cat.png", "/cat.png"]


def test_the_same_address_under_an_unlisted_name_is_refused(fetching, images):
    images.requests.clear()
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client(fetching).chat.completions.create(
            model=MODEL, messages=ask("What is in the picture?", images.url("localhost")), max_tokens=2)
    error = refused.value.body
    assert error["code"] == "remote_image_address_refused" and error["param"] == "messages[0].content[1]"
    assert "loopback" in error["message"]
    assert images.requests == []


def test_with_the_setting_off_a_remote_image_is_a_400_naming_the_setting(tmp_path_factory, images):
    tmp = tmp_path_factory.mktemp("remote-images-off")
    images.requests.clear()
    # The refusal comes before admission: no worker needs to be ready for it.
    service = RunningService(tmp, image_config(tmp, cpu_sees=True))
    try:
        service.wait_ready(roles=())
        with pytest.raises(openai.BadRequestError) as refused:
            openai_client(service).chat.completions.create(
                model=MODEL, messages=ask("What is in the picture?", images.url()), max_tokens=2)
    finally:
        service.stop()
    error = refused.value.body
    assert error["code"] == "remote_image_refused" and error["param"] == "messages[0].content[1]"
    assert "allow_remote_images" in error["message"]
    assert images.requests == []


def test_a_fetched_image_counts_against_max_body_bytes(tmp_path_factory, images):
    """Inline, a fetched image may not make a request bigger than a client could have sent:
    queue_limit x max_body_bytes is what bounds a queue's memory."""
    tmp = tmp_path_factory.mktemp("remote-images-body")
    images.requests.clear()
    service = RunningService(tmp, image_config(tmp, cpu_sees=True) + FETCHING + "max_body_bytes = 1024\n")
    try:
        service.wait_ready(roles=())  # refused before admission: no worker needs to be ready
        question = "What is in the picture? " + "Look closely. " * 56
        body = {"model": MODEL, "messages": ask(question, images.url()), "max_tokens": 2}
        sent = len(json.dumps(body, separators=(",", ":")))  # as httpx sends it
        assert 900 < sent < 1024  # under the limit as sent; the 74-byte image inline would take it over
        refused = service.http.post("/v1/chat/completions", json=body)
    finally:
        service.stop()
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "image_too_large" and error["param"] == "messages[0].content[1]"
    assert "max_body_bytes" in error["message"]


def test_a_remote_decompression_bomb_is_refused_before_any_worker_decodes_it(fetching, images):
    """250 KB that decode to 256 megapixels (1 GiB in the worker, 12 s):
    refused from its header, named by its part, and no worker's memory moves."""
    rss_before = {w["role"]: w["rss_mib"] for w in fetching.status()["workers"]}
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client(fetching).chat.completions.create(
            model=MODEL, messages=ask("What is in the picture?", images.url(name="bomb.png")), max_tokens=2)
    error = refused.value.body
    assert error["code"] == "image_too_large" and error["param"] == "messages[0].content[1]"
    assert "256.0 megapixels" in error["message"]
    rss_after = {w["role"]: w["rss_mib"] for w in fetching.status()["workers"]}
    assert all((rss_after[role] or 0) < (rss_before[role] or 0) + 100 for role in rss_before), (rss_before, rss_after)


def test_a_keys_remote_images_are_fetched_within_its_concurrency(tmp_path_factory, images):
    """A key limited to one request at a time started six fetches at once:
    the fetch now holds one of its slots."""
    tmp = tmp_path_factory.mktemp("remote-images-key")
    service = RunningService(tmp, image_config(tmp, cpu_sees=True) + FETCHING)
    try:
        service.wait_ready(roles=("gpu",))
        key = add_key(service, "camera-app", "--max-concurrency", "1")
        images.most_at_once = 0
        body = {"model": MODEL, "messages": ask("What is in the picture?", images.url(name="slow.png")),
                "max_tokens": 2}
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: service.http.post("/v1/chat/completions", json=body, headers=bearer(key),
                                                                timeout=120), range(6)))
    finally:
        service.stop()
    statuses = sorted(answer.status_code for answer in answers)
    assert images.most_at_once == 1, statuses
    assert 200 in statuses and set(statuses) <= {200, 429}
    assert all(a.json()["error"]["code"] == "key_concurrency_limit" for a in answers if a.status_code == 429)
