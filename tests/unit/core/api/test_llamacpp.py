"""llama.cpp's /completion body as an OpenAI completion body, and the answer
back in llama-server's shape: the pure parts of api/llamacpp.py."""

from __future__ import annotations

import json

import pytest

from tray_app.core.api.llamacpp import (
    LlamaCppCompletion, error_body, prompt_token_ids, round_trip_problem, token_ids_problem, translate_completion,
)
from tray_app.core.api.openai_request import InvalidRequest
from tray_app.core.api.requests import screen_llama_server_fields
from tray_app.core.dispatch.jobs import Attempt, Job, JobFailed, JobKind, JobRequest

CONTEXT = 2048


def refused(body: dict) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        translate_completion(body, CONTEXT)
    return caught.value


def test_n_predict_is_the_limit_and_minus_one_is_until_the_context_is_full():
    assert translate_completion({"prompt": "x", "n_predict": 5}, CONTEXT)["max_tokens"] == 5
    assert "n_predict" not in translate_completion({"prompt": "x", "n_predict": 5}, CONTEXT)
    protocol = LlamaCppCompletion(CONTEXT, None)
    for until_full in ({"n_predict": -1}, {"n_predict": -2}, {}, {"max_tokens": -1}):
        translated = protocol.translate({"prompt": "x", **until_full}, JobKind.COMPLETION)
        # No limit in the body: the router's, which lets the answer fill the context.
        assert "max_tokens" not in translated.body and translated.fills_context
    assert not protocol.translate({"prompt": "x", "n_predict": 5}, JobKind.COMPLETION).fills_context
    assert translate_completion({"prompt": "x", "n_predict": 10**9}, CONTEXT)["max_tokens"] == CONTEXT
    # max_tokens is llama-server's alias; n_predict wins when both are sent.
    assert translate_completion({"prompt": "x", "max_tokens": 7}, CONTEXT)["max_tokens"] == 7
    assert translate_completion({"prompt": "x", "max_tokens": 7, "n_predict": 3}, CONTEXT)["max_tokens"] == 3
    for bad in (0, -3, 1.5, True, "5"):
        assert refused({"prompt": "x", "n_predict": bad}).param == "n_predict"


def test_json_schema_is_the_structured_output_path_and_excludes_a_grammar():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    body = translate_completion({"prompt": "x", "json_schema": schema}, CONTEXT)
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}
    assert "json_schema" not in body
    assert refused({"prompt": "x", "json_schema": schema, "grammar": 'root ::= "a"'}).param == "json_schema"
    assert refused({"prompt": "x", "json_schema": "{}"}).param == "json_schema"
    # An empty grammar is none, as in llama-server; a real one goes on to the grammar checks.
    assert "grammar" not in translate_completion({"prompt": "x", "grammar": ""}, CONTEXT)
    assert translate_completion({"prompt": "x", "grammar": 'root ::= "a"'}, CONTEXT)["grammar"] == 'root ::= "a"'


def test_sampling_fields_pass_and_neutral_router_fields_are_dropped():
    sampling = {"temperature": 0.5, "top_k": 20, "top_p": 0.9, "min_p": 0.1, "seed": 3, "repeat_penalty": 1.1,
                "presence_penalty": 0.2, "frequency_penalty": 0.3, "stop": ["\n"], "mirostat": 2}
    body = translate_completion({"prompt": "x", "stream": True, "cache_prompt": False, "id_slot": -1,
                                 "n_probs": 0, "return_tokens": False, **sampling}, CONTEXT)
    # llama-server's own fields at their defaults are the shared check's to drop (requests.validate).
    screen_llama_server_fields(body)
    assert body == {"prompt": "x", "stream": True, **sampling}
    # A value that takes the decision stays in the body, for the router's check to refuse by name.
    assert translate_completion({"prompt": "x", "id_slot": 2}, CONTEXT)["id_slot"] == 2
    assert translate_completion({"prompt": "x", "n_probs": 5}, CONTEXT)["n_probs"] == 5
    assert refused({"prompt": "x", "cache_prompt": "yes"}).param == "cache_prompt"
    assert refused({"prompt": "x", "multimodal_data": ["..."]}).param == "multimodal_data"
    assert refused({"n_predict": 3}).param == "prompt"


def test_llama_cpps_logit_bias_list_and_random_seed_are_translated():
    body = translate_completion({"prompt": "x", "logit_bias": [[15, 2.5], [16, False]], "seed": -1}, CONTEXT)
    assert body["logit_bias"] == {"15": 2.5, "16": -100} and "seed" not in body
    assert "logit_bias" not in translate_completion({"prompt": "x", "logit_bias": []}, CONTEXT)
    assert translate_completion({"prompt": "x", "logit_bias": {"15": 1}}, CONTEXT)["logit_bias"] == {"15": 1}
    for bad in ([["hello", 1]], [[1]], [5], [[-1, 1]], [[True, 1]]):
        assert refused({"prompt": "x", "logit_bias": bad}).param == "logit_bias"


def test_a_prompt_of_token_ids_is_one_list_of_whole_numbers():
    assert prompt_token_ids("text") is None and prompt_token_ids(["text"]) is None
    assert prompt_token_ids([1, 2, 3]) == [1, 2, 3] and prompt_token_ids([[4, 5]]) == [4, 5]
    for bad in ([], [1, "two"], [[1], [2]], ["a", "b"], [1.0], [True], 7, {"prompt_string": "x"}):
        with pytest.raises(InvalidRequest) as caught:
            prompt_token_ids(bad)
        assert caught.value.param == "prompt"


def test_token_ids_are_checked_against_the_vocabulary():
    assert token_ids_problem([0, 5, 9], 10, "tokens") is None
    assert "tokens[1]" in token_ids_problem([0, 10], 10, "tokens")
    for bad in (-1, 10**30, True, 1.0, "1", None):
        assert token_ids_problem([bad], 10, "tokens") is not None


def test_a_token_prompt_is_sound_when_its_text_gives_the_same_tokens_back():
    bos = 1
    assert round_trip_problem([5, 6], [5, 6], bos) is None
    # The BOS the worker adds to a string prompt is not a difference...
    assert round_trip_problem([5, 6], [bos, 5, 6], bos) is None
    assert round_trip_problem([bos, 5, 6], [bos, 5, 6], bos) is None
    # ...but tokens that merge or split differently are.
    assert "position 0" in round_trip_problem([5, 6], [56], bos)
    assert "position 1" in round_trip_problem([5, 6, 7], [5, 67], bos)


def _job(tokens: int = 3) -> Job:
    job = Job(JobRequest(id="req-1", kind=JobKind.COMPLETION, body={"prompt": "x"}, stream=True, prompt_tokens=8))
    job.attempts.append(Attempt(path="gpu", started_at=10.0, first_token_at=10.5, ended_at=11.0, tokens=tokens))
    return job


def _chunk(text: str, finish: str | None = None) -> dict:
    return {"model": "m", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def _lines(data: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in data.decode().split("\n\n") if line]


def test_the_stream_is_llama_cpps_data_lines_and_a_last_one_with_stop_true():
    protocol = LlamaCppCompletion(CONTEXT, None)
    job = _job()
    encoder = protocol.encoder(job)
    out = b"".join(encoder.event(_chunk(text)) for text in ("a", "b", ""))
    out += encoder.event(_chunk("", "length")) + encoder.done(job, {})
    assert b"[DONE]" not in out
    events = _lines(out)
    assert [(e["content"], e["stop"]) for e in events] == [("a", False), ("b", False), ("", True)]
    last = events[-1]
    assert last["stop_type"] == "limit" and last["stopped_limit"] and not last["stopped_eos"]
    assert last["tokens_predicted"] == 3 and last["tokens_evaluated"] == 8 and last["model"] == "m"
    assert last["timings"]["prompt_ms"] == pytest.approx(500) and last["timings"]["predicted_per_second"] == 6
    failed = _lines(encoder.failed(JobFailed(503, "worker_failed", "the GPU died")))
    assert failed == [{"error": {"code": 503, "message": "the GPU died", "type": "unavailable_error"}}]


def test_the_answer_and_the_errors_are_in_llama_cpps_shape():
    protocol = LlamaCppCompletion(CONTEXT, None)
    answer = protocol.answer({"model": "m", "choices": [{"text": "hi\n", "finish_reason": "stop"}]}, _job())
    assert answer["content"] == "hi\n" and answer["stop"] and answer["stop_type"] == "eos" and answer["has_new_line"]
    assert error_body(404, "no such model") == {"error": {"code": 404, "message": "no such model",
                                                          "type": "not_found_error"}}
    # Checks after the translation name the fields as this route calls them.
    response = protocol.error(400, "'max_tokens' is too big", "invalid_value", "max_tokens")
    assert json.loads(response.body)["error"] == {"code": 400, "message": "'n_predict' is too big",
                                                  "type": "invalid_request_error", "param": "n_predict"}


def test_errors_before_the_route_runs_are_in_llama_cpps_envelope_too():
    from tray_app.core.api.errors import error_body_for_path

    assert error_body_for_path("/completion", 405, "GET is not allowed on /completion", "method_not_allowed") == {
        "error": {"code": 405, "message": "GET is not allowed on /completion", "type": "invalid_request_error"}}
    assert error_body_for_path("/completions", 404, "x", "not_found")["error"]["code"] == "not_found"
