"""Every request reaches a worker with an explicit token limit that fits its
context, so a generation that runs to the end of the context ends with
finish_reason "length" instead of killing the stream (issue 10, item 1).

The contexts here are tiny (128 tokens) and the end-of-generation tokens are
banned with logit_bias, so every answer runs into the end of the context.
Without the limit, llama-cpp-python's server overruns its KV cache on
multi-byte output ("failed to find a memory slot") for some seeds.
"""

from __future__ import annotations

import json

import pytest

from tests.harness import BASE_CONFIG, running

pytestmark = pytest.mark.integration

SMALL_CONTEXT = BASE_CONFIG.replace("n_ctx = 1024", "n_ctx = 128").replace("n_ctx = 2048", "n_ctx = 128")
CONTEXT = 128
# SmolLM2's <|endoftext|> and <|im_end|>: banned, so only the limit can end an answer.
NEVER_STOP = {"0": -100, "2": -100}
MULTIBYTE = [{"role": "user", "content": "Write emoji and Japanese: 日本語 🎉🎉"}]
# Plain ASCII, so each streamed event carries one token and the count is exact.
ASCII = [{"role": "user", "content": "Count from one to one hundred in words."}]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    with running(tmp_path_factory.mktemp("small-context"), SMALL_CONTEXT) as service:
        yield service


@pytest.mark.parametrize("seed", range(4))
def test_a_chat_without_a_limit_ends_at_the_context_with_length(small, seed):
    response = small.http.post("/v1/chat/completions", json={
        "messages": MULTIBYTE, "temperature": 1.5, "seed": seed, "logit_bias": NEVER_STOP})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] <= CONTEXT


@pytest.mark.parametrize("seed", range(4))
def test_a_streamed_chat_without_a_limit_ends_with_done(small, seed):
    with small.http.stream("POST", "/v1/chat/completions", json={
            "messages": MULTIBYTE, "temperature": 1.5, "seed": seed, "logit_bias": NEVER_STOP,
            "stream": True}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    finishes = [json.loads(line[5:])["choices"][0].get("finish_reason") for line in lines[:-1]
                if json.loads(line[5:]).get("choices")]
    assert finishes[-1] == "length"


def test_a_limit_over_the_room_left_is_bounded_by_it(small):
    response = small.http.post("/v1/chat/completions", json={
        "messages": MULTIBYTE, "max_tokens": 120, "temperature": 1.5, "seed": 1, "logit_bias": NEVER_STOP})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] <= CONTEXT


def test_max_completion_tokens_is_honoured(small):
    response = small.http.post("/v1/chat/completions", json={
        "messages": ASCII, "max_completion_tokens": 5, "logit_bias": NEVER_STOP})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["finish_reason"] == "length"


def test_the_smaller_of_both_limit_names_wins(small):
    response = small.http.post("/v1/chat/completions", json={
        "messages": ASCII, "max_tokens": 7, "max_completion_tokens": 3, "logit_bias": NEVER_STOP})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


def test_a_completion_without_a_limit_gets_openais_default_of_16(small):
    # The fuzz case that failed CI: odd unicode stop strings, a hot sampler, max_tokens null.
    response = small.http.post("/v1/completions", json={
        "prompt": "Once upon a time", "temperature": 1.1, "stop": ["\u0000\u200b", "\U0001f600"],
        "max_tokens": None, "logit_bias": NEVER_STOP})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] <= 16
    assert body["choices"][0]["finish_reason"] in ("length", "stop")


# Found by benchmarks/fuzz_random.py (seed 1789476834): a prompt of 4-byte
# characters and a hot, repetition-loving sampler make the model emit byte
# tokens that never complete a UTF-8 character. llama-cpp-python skips its
# length check for every one of them and runs off the KV cache however large
# the margin; the answer must still end with "length", not a 502.
FUZZ_PROMPT = "Ø\U000fcc6d\U00076d57\U000cb5ce¹\x87ÀÖ<(\x00\U0009f0cdè\U000bab17"


@pytest.mark.parametrize("attempt", range(3))
def test_output_that_never_completes_a_character_still_ends_with_length(small, attempt):
    response = small.http.post("/v1/completions", json={
        "prompt": FUZZ_PROMPT, "max_completion_tokens": 125, "n": 1,
        "frequency_penalty": -1.8284665879213904, "temperature": 1.5252574763214284})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")
