"""/v1/embeddings on the real service with the real model, through the
`openai` package: the embedding worker loads on the first request, answers
in OpenAI's shape (floats and base64), refuses bad input in the envelope,
and has its own admission, so it answers while the CPU lane is busy."""

from __future__ import annotations

import concurrent.futures
import math
import time

import openai
import pytest

from tests.harness import BASE_CONFIG, running
from tray_app.core.api.embeddings import MAX_VALUES_PER_REQUEST

pytestmark = pytest.mark.integration

N_CTX = 64
IDLE_UNLOAD_S = 5.0
CONFIG = BASE_CONFIG + f"""
[embeddings]
n_ctx = {N_CTX}
idle_unload_s = {IDLE_UNLOAD_S}
"""


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with running(tmp_path_factory.mktemp("embeddings"), CONFIG) as service:
        yield service


@pytest.fixture(scope="module")
def client(service):
    with openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


def embeddings(service) -> dict:
    return service.status()["embeddings"]


def test_the_worker_loads_on_the_first_request(service, client):
    before = embeddings(service)
    assert before["enabled"] and before["state"] == "stopped" and before["pid"] is None
    # Not one of the generation workers that /status["workers"] lists.
    assert {w["role"] for w in service.status()["workers"]} == {"gpu", "cpu"}

    answer = client.embeddings.create(model=service.status()["service"]["model"], input="The lighthouse keeper")
    assert len(answer.data) == 1 and answer.data[0].index == 0
    assert norm(answer.data[0].embedding) == pytest.approx(1.0, abs=1e-3)
    assert answer.usage.prompt_tokens > 0 and answer.usage.total_tokens == answer.usage.prompt_tokens

    after = embeddings(service)
    assert after["state"] == "ready" and after["pid"] and after["requests_served"] == 1
    assert after["pooling"] == "mean" and after["dimensions"] == len(answer.data[0].embedding)
    assert after["queue"]["concurrency"] == 2
    # Its memory is counted as ours (from the next memory reading on).
    service.wait_for(lambda s: str(after["pid"]) in s["ram"]["rss_mib_by_pid"], timeout=10,
                     what="the embedding worker's RSS in the readings")


def test_a_batch_keeps_its_order_and_identical_texts_agree(service, client):
    texts = ["The sea was calm.", "Stock prices fell sharply.", "The sea was calm."]
    answer = client.embeddings.create(model="default", input=texts, encoding_format="float")
    assert [item.index for item in answer.data] == [0, 1, 2]
    vectors = [item.embedding for item in answer.data]
    assert len({len(v) for v in vectors}) == 1
    assert all(norm(v) == pytest.approx(1.0, abs=1e-3) for v in vectors)
    assert vectors[0] == pytest.approx(vectors[2], abs=1e-5)
    assert vectors[0] != pytest.approx(vectors[1], abs=1e-3)
    # Alone, a text embeds as it does in a batch.
    alone = client.embeddings.create(model="default", input="Stock prices fell sharply.", encoding_format="float")
    assert alone.data[0].embedding == pytest.approx(vectors[1], abs=1e-4)


def test_token_ids_embed_as_their_text_does(service, client):
    """OpenAI's API takes token ids (LangChain's default sends them): here
    the model's own ids, checked against its vocabulary and round-tripped."""
    text = "The sea was calm."
    ids = service.http.post("/tokenize", json={"content": text}).json()["tokens"]
    by_text = client.embeddings.create(model="default", input=text, encoding_format="float").data[0].embedding
    by_ids = client.embeddings.create(model="default", input=ids, encoding_format="float")
    batch = client.embeddings.create(model="default", input=[ids, ids[:3]], encoding_format="float")
    assert by_ids.data[0].embedding == pytest.approx(by_text, abs=1e-4) and len(batch.data) == 2
    assert by_ids.usage.prompt_tokens == len(ids)
    for bad, param in (([10**9], "input"), ([ids, [-1]], "input[1]")):
        refused = service.http.post("/v1/embeddings", json={"input": bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text


def test_base64_decodes_to_the_floats(service, client):
    texts = ["one", "two words"]
    floats = client.embeddings.create(model="default", input=texts, encoding_format="float")
    # The openai package asks for base64 when no format is given, and decodes it.
    decoded = client.embeddings.create(model="default", input=texts)
    raw = service.http.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"})
    assert raw.status_code == 200 and isinstance(raw.json()["data"][0]["embedding"], str)
    assert raw.headers["x-served-by"] == "embed" and raw.headers["x-request-id"]
    for got, want in zip(decoded.data, floats.data):
        assert got.embedding == pytest.approx(want.embedding, abs=1e-6)


@pytest.mark.parametrize("body, status, param", [
    ({"input": ""}, 400, "input"),
    ({"input": ["fine", 3]}, 400, "input[1]"),
    ({"input": ["fine", "word " * (4 * N_CTX)]}, 400, "input[1]"),
    ({"input": "x", "model": "gpt-4"}, 404, "model"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "dimensions": 3}, 400, "dimensions"),
    ({}, 400, "input"),
])
def test_bad_requests_are_refused_in_the_envelope(service, body, status, param):
    response = service.http.post("/embeddings", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    if "word" in str(body):
        assert "tokens" in error["message"] and str(N_CTX) in error["message"]


def test_the_sdk_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="gpt-4", input="x")
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="default", input="")


# SmolLM2's <|endoftext|> and <|im_end|>, banned: the generation can't end early.
NO_END = {"0": -100, "2": -100}


def test_an_embedding_does_not_wait_behind_a_long_generation(service, client):
    # Nearly the CPU's whole context, with no way to end sooner: 2000 tokens take
    # 30 s on an idle machine (minutes on a busy one), an embedding well under a
    # second, loading included. So an embedding that waited for the CPU slot
    # answers after the generation; one that doesn't answers while it runs, and
    # the generation is then cancelled instead of run to its end.
    long_story = {"messages": [{"role": "user", "content": "Write a very long story about the sea."}],
                  "max_tokens": 2000, "logit_bias": NO_END, "temperature": 0, "stream": True}

    def generate() -> str:
        """The stream's last line: its error event, or the 499's envelope when
        the cancel came before the first token."""
        # Forced to the CPU, whose one slot ([cpu] max_concurrency = 1) it fills.
        with service.http.stream("POST", "/v1/chat/completions", json=long_story,
                                 headers={"X-Force-Path": "cpu", "X-Request-Id": "long-one"}) as response:
            return [line for line in response.iter_lines() if line.strip()][-1]

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        generation = pool.submit(generate)
        service.wait_for(lambda s: s["queues"]["cpu"]["running"] == 1, timeout=30, what="the CPU slot taken")
        started = time.monotonic()
        answer = client.embeddings.create(model="default", input=["while the CPU is busy"], encoding_format="float")
        took = time.monotonic() - started
        still_running = any(r["id"] == "long-one" for r in service.status()["requests"])
        assert len(answer.data) == 1
        # Answered while the generation still held the CPU slot.
        assert still_running, f"the generation finished first; the embedding took {took:.1f} s"
        assert service.http.delete("/v1/requests/long-one").status_code == 200
        last_line = generation.result(60)
    assert "request_canceled" in last_line, last_line


def test_the_worker_unloads_when_idle_and_loads_again(service, client):
    client.embeddings.create(model="default", input="loaded now", encoding_format="float")
    assert embeddings(service)["state"] == "ready"
    service.wait_for(lambda s: s["embeddings"]["state"] == "stopped", timeout=IDLE_UNLOAD_S + 15,
                     what="the embedding worker unloaded when idle")
    assert any(e["kind"] == "embed_unloaded_idle" for e in service.status()["events"])
    again = client.embeddings.create(model="default", input="back again", encoding_format="float")
    assert len(again.data[0].embedding) == embeddings(service)["dimensions"]
    assert embeddings(service)["state"] == "ready"


@pytest.mark.parametrize("route, field", [("/v1/embeddings", "input"), ("/api/embed", "input")])
def test_a_request_for_too_many_numbers_is_refused_with_the_cap(service, route, field):
    # 8 KB of one-letter inputs used to ask for 24 MB of JSON (170 MB with an 8B model).
    dimensions = embeddings(service)["dimensions"]
    too_many = MAX_VALUES_PER_REQUEST // dimensions + 1
    response = service.http.post(route, json={"model": "default", field: ["a"] * too_many})
    assert response.status_code == 400, response.text[:300]
    message = response.json()["error"]
    message = message if isinstance(message, str) else message["message"]
    assert str(MAX_VALUES_PER_REQUEST) in message and f"at most {too_many - 1} inputs" in message


def test_ollamas_older_route_embeds_one_prompt_and_refuses_a_list(service):
    # It used to embed the whole list and answer only the first vector.
    single = service.http.post("/api/embeddings", json={"model": "default", "prompt": "The sea"})
    assert single.status_code == 200 and len(single.json()["embedding"]) == embeddings(service)["dimensions"]
    listed = service.http.post("/api/embeddings", json={"model": "default", "prompt": ["The sea", "The land"]})
    assert listed.status_code == 400 and "/api/embed" in listed.json()["error"]
    before = embeddings(service)["inputs_served"]
    assert service.http.post("/api/embeddings", json={"model": "default", "prompt": ["x"]}).status_code == 400
    assert embeddings(service)["inputs_served"] == before
