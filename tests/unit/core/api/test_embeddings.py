"""/v1/embeddings without processes: OpenAI's validation rules, the base64
encoding, the response's shape, and the embedding path's own admission
(queue, RAM floor, cancellation) against a stand-in worker over MockTransport."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import threading
from types import SimpleNamespace

import httpx
import pytest

from tests.fakes.worker import FakeWorker
from tray_app.core.api.embeddings import (
    MAX_INPUTS, MAX_VALUES_PER_REQUEST, EmbeddingOptions, check_body, check_inputs, encode_base64, input_texts,
    json_off_the_loop, response_body, too_long, too_many_values,
)
from tray_app.core.api.openai_request import InvalidRequest
from tray_app.core.api.requests import ModelNames
from tray_app.core.dispatch.jobs import JobFailed
from tray_app.core.dispatch.lanes import Lane
from tray_app.core.embeddings.path import EmbeddingPath, EmbeddingResult, EmbeddingRuntime, embedding_runtime
from tray_app.core.engine.runtime import LaunchRequest, LlamaCppPythonRuntime, LlamaServerRuntime
from tray_app.core.engine.worker import WorkerState

MODELS = ModelNames("smol", frozenset({"smol"}), frozenset({"smol", "smol.gguf", "default"}))


def invalid(call, *args) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        call(*args)
    return caught.value


# ----- input ------------------------------------------------------------------------------

def test_token_ids_are_one_input_or_a_batch_as_openais_api_takes_them():
    """LangChain's OpenAIEmbeddings sends them by default: checked and turned
    into text with the model's tokenizer (check_inputs), here kept as ids."""
    assert input_texts([1, 2, 3]) == [[1, 2, 3]]
    assert input_texts([[1, 2], [3]]) == [[1, 2], [3]]


def test_a_string_or_a_list_of_strings_is_the_input():
    assert input_texts("hello") == ["hello"]
    assert input_texts(["a", "b", "c"]) == ["a", "b", "c"]
    assert len(input_texts(["x"] * MAX_INPUTS)) == MAX_INPUTS


@pytest.mark.parametrize("value, param, code", [
    (None, "input", "missing_field"),
    ("", "input", "empty_input"),
    ([], "input", "empty_input"),
    (["a", ""], "input[1]", "empty_input"),
    (["a", 3, "b"], "input[1]", "invalid_type"),
    (["a", None], "input[1]", "invalid_type"),
    ({"text": "a"}, "input", "invalid_type"),
    (42, "input", "invalid_type"),
    ([[1, 2], []], "input[1]", "empty_input"),
    (["x"] * (MAX_INPUTS + 1), "input", "too_many_inputs"),
])
def test_bad_input_is_a_400_naming_the_item(value, param, code):
    bad = invalid(input_texts, value)
    assert (bad.status, bad.param, bad.code) == (400, param, code)


def test_the_param_name_is_the_callers():
    # Ollama's /api/embed calls the field "input" too, /api/embeddings "prompt".
    assert invalid(input_texts, "", "prompt").param == "prompt"


def test_an_input_over_the_limit_is_named_with_its_count():
    assert too_long([3, 4], 4, "input", single=False) is None
    bad = too_long([3, 9, 12], 8, "input", single=False)
    assert (bad.status, bad.param, bad.code) == (400, "input[1]", "input_too_long")
    assert "9 tokens" in bad.message and "8" in bad.message
    assert too_long([9], 8, "input", single=True).param == "input"


# ----- the other fields ---------------------------------------------------------------

def test_defaults_and_accepted_fields():
    assert check_body({"input": "x"}, MODELS, 576) == EmbeddingOptions("float")
    assert check_body({"input": "x", "model": "default", "encoding_format": "base64", "dimensions": 576,
                       "user": "me", "something_new": True}, MODELS, 576) == EmbeddingOptions("base64")
    assert check_body({"encoding_format": None}, MODELS, 576).encoding_format == "float"


@pytest.mark.parametrize("body, status, param", [
    ({"model": "gpt-4"}, 404, "model"),
    ({"model": 7}, 400, "model"),
    ({"encoding_format": "int8"}, 400, "encoding_format"),
    ({"dimensions": 256}, 400, "dimensions"),
    ({"dimensions": 0}, 400, "dimensions"),
    ({"dimensions": True}, 400, "dimensions"),
    ({"dimensions": "576"}, 400, "dimensions"),
    ({"user": 5}, 400, "user"),
])
def test_bad_fields_are_named(body, status, param):
    bad = invalid(check_body, body, MODELS, 576)
    assert (bad.status, bad.param) == (status, param)


# ----- the answer ----------------------------------------------------------------------

def test_base64_is_little_endian_float32():
    vector = [0.5, -1.25, 3.0e-3, 0.0]
    raw = base64.b64decode(encode_base64(vector))
    assert len(raw) == 16
    assert struct.unpack("<4f", raw) == pytest.approx(vector, rel=1e-6)
    # What the openai package does with it.
    numpy = pytest.importorskip("numpy")
    assert numpy.frombuffer(raw, dtype="float32").tolist() == pytest.approx(vector, rel=1e-6)


def test_the_response_has_openais_shape():
    result = EmbeddingResult([[1.0, 0.0], [0.0, 1.0]], 7, "smol")
    body = response_body(result, EmbeddingOptions("float"))
    assert body == {"object": "list", "model": "smol", "usage": {"prompt_tokens": 7, "total_tokens": 7},
                    "data": [{"object": "embedding", "index": 0, "embedding": [1.0, 0.0]},
                             {"object": "embedding", "index": 1, "embedding": [0.0, 1.0]}]}
    encoded = response_body(result, EmbeddingOptions("base64"))
    assert encoded["data"][1]["embedding"] == encode_base64([0.0, 1.0])


# ----- the runtime -----------------------------------------------------------------------

def test_the_embedding_worker_is_llama_server_with_embeddings_and_pooling(tmp_path):
    base = LlamaServerRuntime(tmp_path / "llama-server")
    runtime = embedding_runtime(base, "mean", 520)
    assert isinstance(runtime, EmbeddingRuntime)
    launch = LaunchRequest(model_path=tmp_path / "m.gguf", port=1, n_ctx=520, n_gpu_layers=0, n_batch=520,
                           n_threads=0, parallel=2)
    argv = runtime.argv(launch)
    assert argv[:len(base.argv(launch))] == base.argv(launch)
    assert argv[-5:] == ["--embeddings", "--pooling", "mean", "--ubatch-size", "520"]
    assert runtime.environment(launch) == base.environment(launch)


def test_llama_cpp_python_gets_no_embedding_worker_and_says_why():
    reason = embedding_runtime(LlamaCppPythonRuntime(), "mean", 520)
    assert isinstance(reason, str) and "llama-server" in reason


# ----- the path's admission, with a stand-in worker ------------------------------------------

def path_with(handler, *, worker=None, slots=1, queue=1, available_mib=8000.0) -> EmbeddingPath:
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return EmbeddingPath(worker or FakeWorker("embed"), Lane("embed", slots, queue), http, model="smol",
                         pooling="mean", n_ctx=512, dimensions=2, idle_unload_s=0, ready_timeout_s=5, ram_floor_mib=1024,
                         load_ram_mib=500, available_ram_mib=lambda: available_mib, note=lambda *a, **k: None,
                         changed=lambda: None)


def answer(request: httpx.Request) -> httpx.Response:
    texts = json.loads(request.content)["input"]
    # Base64 from the worker whatever the client asked: a few strings to
    # parse instead of megabytes of numbers.
    assert json.loads(request.content)["encoding_format"] == "base64"
    # Out of order on purpose: the path sorts by index.
    data = [{"index": i, "embedding": encode_base64([float(i), 1.0])} for i in reversed(range(len(texts)))]
    return httpx.Response(200, json={"data": data, "usage": {"prompt_tokens": 3 * len(texts)}})


def path_held_until(release: asyncio.Event) -> EmbeddingPath:
    """A path with one slot and one queue place, whose worker answers once `release` is set."""
    async def slow(request: httpx.Request) -> httpx.Response:
        await release.wait()
        return answer(request)

    return path_with(slow, slots=1, queue=1)


async def test_embed_returns_vectors_in_input_order():
    path = path_with(answer)
    result = await path.embed(["a", "b", "c"], request_id="r1")
    assert result == EmbeddingResult([[0.0, 1.0], [1.0, 1.0], [2.0, 1.0]], 9, "smol")
    assert path.requests_served == 1 and path.inputs_served == 3
    assert path.lane.snapshot()["running"] == 0


async def test_a_stopped_worker_is_loaded_by_the_first_request():
    worker = FakeWorker("embed", state=WorkerState.STOPPED)
    path = path_with(answer, worker=worker)
    await path.embed(["a"], request_id="r1")
    assert worker.loads_started == 1 and path.status()["state"] == "ready"


async def test_a_stopped_worker_is_not_loaded_under_the_ram_floor():
    worker = FakeWorker("embed", state=WorkerState.STOPPED)
    path = path_with(answer, worker=worker, available_mib=1200.0)
    with pytest.raises(JobFailed) as caught:
        await path.embed(["a"], request_id="r1")
    assert (caught.value.status, caught.value.code) == (503, "ram_floor")
    assert caught.value.retry_after_s and worker.loads_started == 0
    # A loaded worker costs no more RAM to use.
    loaded = path_with(answer, available_mib=1200.0)
    await loaded.embed(["a"], request_id="r2")


async def test_a_full_lane_is_a_503_with_retry_after_and_a_cancel_frees_the_place():
    release = asyncio.Event()
    path = path_held_until(release)
    running = asyncio.create_task(path.embed(["a"], request_id="same"))
    await asyncio.sleep(0.01)
    waiting = asyncio.create_task(path.embed(["b"], request_id="same"))  # a reused id is fine
    await asyncio.sleep(0.01)
    assert path.lane.snapshot()["running"] == 1 and path.lane.snapshot()["depth"] == 1
    with pytest.raises(JobFailed) as caught:
        await path.embed(["c"], request_id="third")
    assert (caught.value.status, caught.value.code) == (503, "embeddings_busy") and caught.value.retry_after_s
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert path.lane.snapshot()["depth"] == 0
    release.set()
    assert (await running).vectors == [[0.0, 1.0]]
    assert path.lane.snapshot()["running"] == 0


async def test_a_worker_that_breaks_is_reported_and_the_client_gets_a_503():
    def broken(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("server disconnected")

    worker = FakeWorker("embed")
    path = path_with(broken, worker=worker)
    with pytest.raises(JobFailed) as caught:
        await path.embed(["a"], request_id="r1")
    assert caught.value.status == 503 and worker.failures


async def test_a_worker_400_is_the_clients_and_a_deadline_is_kept():
    path = path_with(lambda request: httpx.Response(400, json={"error": {"message": "input is too large"}}))
    with pytest.raises(JobFailed) as caught:
        await path.embed(["a"], request_id="r1")
    assert caught.value.status == 400 and "too large" in caught.value.message

    async def never(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(30)
        raise AssertionError("unreachable")

    slow = path_with(never)
    with pytest.raises(JobFailed) as caught:
        await slow.embed(["a"], request_id="r2", deadline_s=0.05)
    assert caught.value.code == "request_timeout"
    assert slow.lane.snapshot()["running"] == 0


def test_without_an_embedding_path_the_route_says_why_with_a_501():
    from types import SimpleNamespace

    from tray_app.core.api.embeddings import embedding_path

    service = SimpleNamespace(embeddings=None, embeddings_off_reason="embeddings need the llama-server engine")
    with pytest.raises(JobFailed) as caught:
        embedding_path(service)
    assert caught.value.status == 501 and "llama-server" in caught.value.message


def test_the_config_section_checks_its_keys():
    from tray_app.core.config import Config, ConfigError, apply_overrides

    assert Config().embeddings.enabled and Config().embeddings.pooling == "mean"
    assert apply_overrides(Config(), {"embeddings": {"pooling": "last", "n_ctx": 256}}).embeddings.n_ctx == 256
    for bad in ({"pooling": "max"}, {"max_concurrency": 0}, {"n_ctx": 1}, {"idle_unload_s": -1.0}):
        with pytest.raises(ConfigError, match=r"\[embeddings\]"):
            apply_overrides(Config(), {"embeddings": bad})


# ----- what one request may cost (issue 27, part 4) ------------------------------------------

def test_inputs_times_dimensions_is_capped_and_the_error_says_the_cap():
    # 2048 one-letter inputs at the bundled model's 576 dimensions: 24 MB of JSON.
    bad = too_many_values(2048, 576, "input")
    assert (bad.status, bad.code, bad.param) == (400, "too_many_values", "input")
    assert str(MAX_VALUES_PER_REQUEST) in bad.message and "at most 1820 inputs" in bad.message
    assert too_many_values(1820, 576, "input") is None
    assert too_many_values(257, 4096, "input") is not None and too_many_values(256, 4096, "input") is None
    assert "at most 1 inputs" in too_many_values(2, MAX_VALUES_PER_REQUEST, "input").message


class CountingCounter:
    def __init__(self) -> None:
        self.counted: list[str] = []

    def count_text(self, text: str) -> int:
        self.counted.append(text)
        return 1


def counting_service() -> SimpleNamespace:
    return SimpleNamespace(counter=CountingCounter(), config=SimpleNamespace(embeddings=SimpleNamespace(n_ctx=512)))


async def test_a_full_lane_refuses_before_anything_is_tokenized():
    release = asyncio.Event()
    path = path_held_until(release)
    running = asyncio.create_task(path.embed(["a"], request_id="r1"))
    waiting = asyncio.create_task(path.embed(["b"], request_id="r2"))
    await asyncio.sleep(0.01)
    service = counting_service()
    with pytest.raises(JobFailed) as caught:
        await check_inputs(service, path, ["word " * 100] * 50)
    assert caught.value.code == "embeddings_busy" and service.counter.counted == []
    release.set()
    await asyncio.gather(running, waiting)
    texts, counted = await check_inputs(service, path, ["one", "two"])
    assert texts == ["one", "two"] and counted == 2


async def test_too_many_values_is_refused_before_anything_is_tokenized():
    service = counting_service()
    path = path_with(answer)
    path.dimensions = 4096  # an 8B model's
    with pytest.raises(InvalidRequest) as caught:
        await check_inputs(service, path, ["x"] * (MAX_VALUES_PER_REQUEST // 4096 + 1))
    assert caught.value.code == "too_many_values" and service.counter.counted == []


async def test_the_workers_answer_is_parsed_off_the_event_loop(monkeypatch):
    import tray_app.core.embeddings.path as embeddings_module

    parse = embeddings_module.parse_worker_answer
    threads = []

    def recording_parse(raw, inputs):
        threads.append(threading.current_thread())
        return parse(raw, inputs)

    monkeypatch.setattr(embeddings_module, "parse_worker_answer", recording_parse)
    result = await path_with(answer).embed(["a", "b"], request_id="r1")
    assert result.vectors == [[0.0, 1.0], [1.0, 1.0]]
    assert threads and threads[0] is not threading.main_thread()


async def test_the_answer_is_built_and_encoded_off_the_event_loop():
    threads = []

    def build():
        threads.append(threading.current_thread())
        return {"embedding": [0.5, -1.0], "text": "é"}

    response = await json_off_the_loop(build, {"X-Served-By": "embed"})
    assert threads and threads[0] is not threading.main_thread()
    assert json.loads(response.body) == {"embedding": [0.5, -1.0], "text": "é"}
    assert response.headers["content-type"] == "application/json" and response.headers["x-served-by"] == "embed"


def test_a_workers_answer_in_floats_is_taken_too_and_one_in_another_shape_is_a_502():
    from tray_app.core.embeddings.path import parse_worker_answer

    floats = b'{"data": [{"index": 1, "embedding": [0.5, 2]}, {"index": 0, "embedding": [1, 0]}]}'
    assert parse_worker_answer(floats, 2) == ([[1.0, 0.0], [0.5, 2.0]], 0)
    for raw, inputs in ((b"not json", 1), (b"[]", 1), (b'{"data": [{"index": 0}]}', 1),
                        (b'{"data": [{"index": 0, "embedding": [1]}]}', 2),
                        (b'{"data": [{"index": 0, "embedding": "not base64!"}]}', 1),
                        (b'{"data": [{"index": 0, "embedding": "AAAA"}]}', 1)):  # 3 bytes: no whole float32
        with pytest.raises(JobFailed) as caught:
            parse_worker_answer(raw, inputs)
        assert caught.value.status == 502, raw


@pytest.mark.parametrize("value", [
    {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -1e-07, 3.0]}],
     "model": "smol", "usage": {"prompt_tokens": 7, "total_tokens": 7}},
    {"model": "smol:latest", "embeddings": [[1.0, 2.0], [3.5, 4.25]], "total_duration": 12, "note": "é \" \u2028"},
    {"embedding": []}, {"embeddings": [[], [1.0]]}, {"mixed": [1, [2], {"a": None}, True, "s"]},
])
def test_json_in_pieces_is_what_starlette_writes(value):
    from starlette.responses import JSONResponse

    from tray_app.core.api.embeddings import json_in_pieces

    assert json_in_pieces(value) == JSONResponse(value).body


def test_json_in_pieces_never_encodes_more_than_one_vector_at_once(monkeypatch):
    # One json.dumps call over the whole answer holds the GIL, and the event
    # loop with it, until it ends (about a second for 2048 x 576 floats).
    import tray_app.core.api.embeddings as module
    from tray_app.core.api.embeddings import json_in_pieces

    longest = []
    dumps = json.dumps

    def measured(value, **kwargs):
        longest.append(len(value) if isinstance(value, list) else 0)
        return dumps(value, **kwargs)

    monkeypatch.setattr(module.json, "dumps", measured)
    vectors = [[float(i)] * 64 for i in range(100)]
    body = json_in_pieces(response_body(EmbeddingResult(vectors, 1, "smol"), EmbeddingOptions("float")))
    monkeypatch.undo()
    assert max(longest) == 64
    assert [row["embedding"] for row in json.loads(body)["data"]] == vectors
