"""llama.cpp's own server routes (/completion, /tokenize, /detokenize,
/apply-template, /props) against the real service on the real small model
(issue 30, part 4). llama.cpp has no official Python client: httpx speaking
llama-server's native shapes is the client, and the worker's own
llama-server is the reference for what the router answers itself."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.harness import BASE_CONFIG, running
from tests.integration.test_engine import worker_secret

pytestmark = pytest.mark.integration


def native_stream(http: httpx.Client, body: dict, headers: dict | None = None) -> tuple[httpx.Headers, list[bytes]]:
    with http.stream("POST", "/completion", json={**body, "stream": True}, headers=headers or {}) as response:
        assert response.status_code == 200, response.read()
        return response.headers, [line.encode() for line in response.iter_lines() if line]


def events_of(lines: list[bytes]) -> list[dict]:
    assert all(line.startswith(b"data: ") for line in lines), lines
    return [json.loads(line[6:]) for line in lines]


def worker_call(service, path: str, body: dict | None = None) -> dict:
    """The same request to the GPU worker's own llama-server (a GET without a body)."""
    worker = service.worker("gpu")
    response = httpx.request("GET" if body is None else "POST", f"http://127.0.0.1:{worker['port']}{path}",
                             json=body, timeout=30,
                             headers={"Authorization": f"Bearer {worker_secret(worker['pid'])}"})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_completion_answers_in_llama_cpps_shape(fresh):
    response = fresh.http.post("/completion", json={"prompt": "One, two, three,", "n_predict": 3, "temperature": 0,
                                                    "cache_prompt": True, "id_slot": -1, "n_probs": 0})
    assert response.status_code == 200, response.text
    assert response.headers["x-served-by"] in ("gpu", "cpu") and response.headers["x-request-id"]
    answer = response.json()
    assert answer["stop"] is True and answer["content"] and answer["tokens_predicted"] == 3
    assert answer["stop_type"] == "limit" and answer["stopped_limit"] is True and answer["stopped_eos"] is False
    assert answer["tokens_evaluated"] > 3 and answer["model"]
    assert answer["timings"]["predicted_n"] == 3 and answer["timings"]["prompt_n"] == answer["tokens_evaluated"]


def test_n_predict_minus_one_fills_the_gpus_context_rather_than_going_to_the_larger_cpu_one(fresh):
    """Until the context is full means the smallest context the prompt fits
    in, as for a chat without a limit: the GPU's 1024 here, not the CPU's
    2048, which would send every such request to the CPU. The grammar ends
    the answer after one word."""
    for until_full in ({"n_predict": -1}, {}):
        response = fresh.http.post("/completion", json={"prompt": "One, two, three,", "temperature": 0,
                                                        "grammar": 'root ::= " four"', **until_full})
        assert response.status_code == 200, response.text
        assert response.headers["x-served-by"] == "gpu" and response.json()["content"] == " four"


def test_a_stream_is_llama_cpps_data_lines_ending_with_stop_true(fresh):
    headers, lines = native_stream(fresh.http, {"prompt": "Monday, Tuesday, Wednesday,", "n_predict": 4,
                                                "temperature": 0})
    assert headers["content-type"].startswith("text/event-stream")
    events = events_of(lines)  # every line is data: JSON, no [DONE]
    assert [event["stop"] for event in events] == [False] * (len(events) - 1) + [True]
    assert len(events) >= 2 and all(event["content"] for event in events[:-1])
    last = events[-1]
    assert last["content"] == "" and last["stop_type"] == "limit" and last["tokens_predicted"] == 4


def test_a_request_shaped_like_sillytaverns_is_served(fresh):
    """The fields SillyTavern's llama.cpp text completion writes, each at
    its default: many stop strings, a list-form logit_bias, seed -1, an
    empty grammar, llama.cpp-only samplers."""
    names = ["Alice", "Bob", "Carol", "Dave", "Eve", "Mallory", "Trent"]
    body = {"prompt": "Alice: Hi Bob!\nBob:", "n_predict": 3, "max_tokens": 3, "temperature": 0, "top_k": 40,
            "top_p": 0.95, "min_p": 0.05, "typical_p": 1, "repeat_penalty": 1.1, "repeat_last_n": 64,
            "presence_penalty": 0, "frequency_penalty": 0, "seed": -1, "grammar": "", "cache_prompt": True,
            "stop": [f"\n{name}:" for name in names] + ["<|im_end|>", "<|im_start|>user", "<|im_start|>assistant"],
            "logit_bias": [[2, False]], "ignore_eos": False, "mirostat": 0, "dry_multiplier": 0,
            "samplers": ["top_k", "top_p", "min_p", "temperature"], "n_probs": 0, "id_slot": -1}
    response = fresh.http.post("/completion", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["stop"] is True and response.json()["tokens_predicted"] <= 3


def test_an_idempotency_key_retry_gets_the_first_answer(fresh):
    body = {"prompt": "Once upon a time", "n_predict": 4, "temperature": 1.5, "seed": 7}
    headers = {"Idempotency-Key": "llamacpp-retry-1"}
    first = fresh.http.post("/completion", json=body, headers=headers)
    again = fresh.http.post("/completion", json=body, headers=headers)
    assert first.status_code == again.status_code == 200
    assert again.headers["x-idempotent-replay"] == "true" and again.json() == first.json()


def test_a_token_prompt_is_the_same_request_as_its_text(fresh):
    text = "The capital of France is"
    tokens = fresh.http.post("/tokenize", json={"content": text}).json()["tokens"]
    by_text = fresh.http.post("/completion", json={"prompt": text, "n_predict": 4, "temperature": 0}).json()
    by_tokens = fresh.http.post("/completion", json={"prompt": tokens, "n_predict": 4, "temperature": 0}).json()
    assert by_tokens["content"] == by_text["content"]
    assert by_tokens["tokens_evaluated"] == by_text["tokens_evaluated"]


def test_a_schema_constrains_the_answer(fresh):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"]}
    answer = fresh.http.post("/completion", json={"prompt": "Is the sky blue? JSON:", "n_predict": 30,
                                                  "temperature": 0, "json_schema": schema}).json()
    assert json.loads(answer["content"])["answer"] in ("yes", "no")


def test_the_refusals_are_in_llama_cpps_envelope_and_name_the_field(fresh):
    for body, param in (({"prompt": "hi", "id_slot": 2}, "id_slot"),
                        ({"prompt": "hi", "n_probs": 5}, "n_probs"),
                        ({"prompt": "hi", "n_predict": 0}, "n_predict"),
                        ({"prompt": [1, "two"]}, "prompt"),
                        ({"prompt": [[1, 2], [3]]}, "prompt"),
                        ({"prompt": [49152]}, "prompt"),
                        ({"prompt": "hi", "json_schema": {"type": "object"}, "grammar": "root ::= \"a\""},
                         "json_schema"),
                        ({"prompt": "hi", "json_schema": {"type": "object", "properties": {"a": {"maxLength": 10**6}}}},
                         "json_schema")):
        response = fresh.http.post("/completion", json=body)
        error = response.json()["error"]
        assert response.status_code == 400 and error["code"] == 400, response.text
        assert error["type"] == "invalid_request_error" and error["param"] == param, response.text
        assert param in error["message"] or "JSON schema" in error["message"], response.text


def test_tokenize_and_detokenize_round_trip_as_the_worker_does(fresh, service):
    text = "Hello <|im_start|> world, ça va? 🙂"
    ours = fresh.http.post("/tokenize", json={"content": text, "with_pieces": True}).json()
    assert ours == worker_call(service, "/tokenize", {"content": text, "with_pieces": True})
    tokens = [piece["id"] for piece in ours["tokens"]]
    # A multi-byte character split over tokens: its pieces are byte lists, as llama-server writes them.
    assert any(isinstance(piece["piece"], list) for piece in ours["tokens"])
    assert fresh.http.post("/detokenize", json={"tokens": tokens}).json() == {"content": text}
    with_bos = fresh.http.post("/tokenize", json={"content": text, "add_special": True}).json()
    assert with_bos == worker_call(service, "/tokenize", {"content": text, "add_special": True})


def test_apply_template_renders_what_the_worker_renders(fresh, service):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": [{"type": "text",
                                                                                            "text": "Again?"}]}]
    ours = fresh.http.post("/apply-template", json={"messages": messages})
    assert ours.status_code == 200, ours.text
    assert ours.json() == worker_call(service, "/apply-template", {"messages": messages})
    bad = fresh.http.post("/apply-template", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].role"


def test_bad_token_ids_and_huge_inputs_are_400s(fresh):
    for path, body, param in (("/detokenize", {"tokens": [1, -1]}, "tokens"),
                              ("/detokenize", {"tokens": [10**30]}, "tokens"),
                              ("/detokenize", {"tokens": [True]}, "tokens"),
                              ("/detokenize", {"tokens": "1 2"}, "tokens"),
                              ("/detokenize", {"tokens": [0] * 200_000}, "tokens"),
                              ("/tokenize", {"content": "x" * 300_000}, "content"),
                              ("/tokenize", {"content": ["a", 1]}, "content"),
                              ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces")):
        response = fresh.http.post(path, json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (path, response.text)
    # The router is still up and still tokenizes.
    assert fresh.http.post("/detokenize", json={"tokens": [19556]}).json() == {"content": "Hello"}


def test_props_says_what_this_server_is(fresh, service):
    props = fresh.http.get("/props").json()
    reference = worker_call(service, "/props")
    assert props["chat_template"] == reference["chat_template"] and props["chat_template"]
    assert props["bos_token"] == reference["bos_token"] and props["eos_token"] == reference["eos_token"]
    assert props["modalities"]["vision"] is False
    # The larger of the GPU's context (1024 in the harness) and the CPU's (2048).
    assert props["default_generation_settings"]["n_ctx"] == 2048
    assert props["total_slots"] == reference["total_slots"]
    assert props["model_path"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and props["build_info"].startswith("tray-app")
    missing = fresh.http.get("/props", params={"model": "gpt-3.5-turbo"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_gpu_death_before_the_first_byte_replays_once_on_the_cpu(fresh, service):
    """A native stream whose GPU worker dies before any piece reached the
    client is run again on the CPU; the client sees one clean stream."""
    prompt = "word " * 900 + "\nSay ok."

    def run():
        return native_stream(service.http, {"prompt": prompt, "n_predict": 4, "temperature": 0},
                             headers={"X-Request-Id": "llamacpp-replay"})

    headers, lines = fresh.kill_gpu_before_first_token("llamacpp-replay", run)
    assert headers["x-route-reason"] == "gpu_failed_replayed" and headers["x-served-by"] == "cpu"
    events = events_of(lines)
    assert "error" not in json.dumps(events)
    assert [event["stop"] for event in events].count(True) == 1 and events[-1]["stop"] is True
    assert events[-1]["tokens_predicted"] >= 1
    status = fresh.wait_workers_ready()
    assert status["accounting"]["duplicate_executions"] == 0


def test_unknown_names_are_the_default_model_only_when_configured(fresh, tmp_path):
    body = {"model": "gpt-3.5-turbo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    refused = fresh.http.post("/v1/chat/completions", json=body)
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
    config = BASE_CONFIG.replace("[gpu]\n", "[model]\nunknown_name = \"default\"\n[gpu]\n", 1)
    with running(tmp_path, config, roles=("gpu",)) as lenient:
        answered = lenient.http.post("/v1/chat/completions", json=body)
        assert answered.status_code == 200, answered.text
        assert answered.headers["x-model"] == "SmolLM2-135M-Instruct.Q4_1"
        native = lenient.http.post("/completion", json={"model": "gpt-3.5-turbo", "prompt": "Hi", "n_predict": 2})
        assert native.status_code == 200 and native.headers["x-model"] == "SmolLM2-135M-Instruct.Q4_1"
