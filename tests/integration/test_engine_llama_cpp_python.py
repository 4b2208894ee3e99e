"""The alternative engine, llama-cpp-python's server: a smaller set of the
suite, so that it keeps working. It is reached the way a user reaches it
when llama-server is missing: the service falls back and says why.

The tests are the suite's own, imported; this module's `service` fixture
runs them against llama-cpp-python workers."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal

import openai
import pytest

from tests.harness import BASE_CONFIG, running
from tests.integration.test_clients import (  # noqa: F401 - collected here too
    test_include_usage_sends_a_final_usage_chunk_on_both_paths,
    test_structured_output_with_parse_returns_the_schema,
)
from tests.integration.test_failover import (  # noqa: F401 - collected here too
    LONG_ANSWER,
    chat,
    running_on,
    test_cancel_a_running_request_stops_generation,
    test_client_disconnect_cancels_the_stream,
    test_idempotency_key_runs_once,
    test_temperature_zero_gives_the_same_tokens_on_both_paths,
)
from tests.integration.test_token_limits import (  # noqa: F401 - collected here too
    SMALL_CONTEXT,
    test_a_chat_without_a_limit_ends_at_the_context_with_length,
    test_output_that_never_completes_a_character_still_ends_with_length,
)

pytestmark = pytest.mark.integration

MISSING = "/nonexistent/llama-server"
FALLBACK = f"""
[engine]
runtime = "llama-server"
llama_server = "{MISSING}"
"""


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with running(tmp_path_factory.mktemp("llama-cpp-python"), BASE_CONFIG + FALLBACK) as service:
        yield service


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """128-token contexts, where llama-cpp-python once ran off its KV cache (issue 10)."""
    with running(tmp_path_factory.mktemp("llama-cpp-python-small"), SMALL_CONTEXT + FALLBACK) as service:
        yield service


@pytest.fixture(scope="module")
def client(service):
    with openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def test_a_missing_llama_server_falls_back_and_status_says_why(fresh):
    engine = fresh.status()["engine"]
    assert engine["runtime"] == "llama-cpp-python" and engine["configured"] == "llama-server"
    assert MISSING in engine["fallback_reason"] and "llama-cpp-python" in engine["fallback_reason"]
    # One request at a time per process, whatever max_concurrency says.
    assert engine["slots"] == {"gpu": 1, "cpu": 1}


def test_logprobs_are_refused_with_the_reason(fresh, client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="default", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                       logprobs=True, top_logprobs=2)
    assert "llama-cpp-python" in refused.value.body["message"]
    assert fresh.http.get("/v1/models").json()["data"][0]["capabilities"]["logprobs"] is False


# llama-cpp-python's server opens a new assistant turn after a chat's last
# assistant message instead of continuing it: an answer cut by a GPU failure
# can't go on from its text here. A stream ends with the explicit error, which
# says so; a whole answer is re-run from nothing on the CPU.


def test_a_cut_stream_ends_with_the_explicit_error_naming_the_engine(fresh):
    body = {"messages": LONG_ANSWER, "max_tokens": 200, "temperature": 0}
    response, lines = fresh.kill_gpu_mid_stream(body, kill_after=3)
    error = json.loads(lines[-1][5:])["error"]
    assert error["code"] == "gpu_worker_failed" and "llama-cpp-python" in error["message"]
    assert "safe to retry" in error["message"]


def test_a_cut_whole_answer_is_replayed_from_nothing_on_the_cpu(fresh):
    gpu_pid = fresh.worker("gpu")["pid"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(chat, fresh, LONG_ANSWER, 60, {"X-Request-Id": "lcp-replay"})
        fresh.wait_for(lambda s: running_on(s, "lcp-replay", "gpu"), what="request running on gpu")
        os.kill(gpu_pid, signal.SIGKILL)
        response = future.result()
    assert response.status_code == 200, response.text
    assert response.headers["x-route-reason"] == "gpu_failed_replayed"
    body = response.json()
    assert body["usage"]["completion_tokens"] == 60 and "resumed" not in body
    cpu_only = chat(fresh, LONG_ANSWER, 60, {"X-Force-Path": "cpu"})
    assert body["choices"][0]["message"]["content"] == cpu_only.json()["choices"][0]["message"]["content"]
