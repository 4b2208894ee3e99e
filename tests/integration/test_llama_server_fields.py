"""Every request field llama-server reads, with hostile values, through every
door: no worker dies and no answer is a 5xx.

One field the service once passed through (`grammar_triggers` with type 9)
hit a GGML_ASSERT in the GPU worker, then in the CPU worker on the replay.
The rule that stops it is engine/request_fields.py's; this test holds the
real service, with real llama-server workers, to it: the workers' pids are
the same after thousands of hostile requests as before them.
"""

from __future__ import annotations

import concurrent.futures
import json

import pytest

from tests.harness import BASE_CONFIG, RunningService
from tray_app.core.engine import request_fields

pytestmark = [pytest.mark.integration, pytest.mark.long_running]

# llama-server's /completion documentation (tools/server/README.md of the
# vendored llama.cpp), then the fields its request schema reads beyond it
# (server-schema.cpp), then its chat parameters (server-common.cpp).
DOCUMENTED = (
    "prompt temperature dynatemp_range dynatemp_exponent top_k top_p min_p n_predict n_indent n_keep n_cmpl "
    "n_cache_reuse stream stop typical_p repeat_penalty repeat_last_n presence_penalty frequency_penalty "
    "dry_multiplier dry_base dry_allowed_length dry_penalty_last_n dry_sequence_breakers xtc_probability "
    "xtc_threshold mirostat mirostat_tau mirostat_eta grammar json_schema seed ignore_eos logit_bias n_probs "
    "min_keep t_max_predict_ms id_slot cache_prompt return_tokens samplers timings_per_token return_progress "
    "sse_ping_interval post_sampling_probs response_fields lora").split()
SCHEMA_ONLY = (
    "verbose stream_options top_n_sigma adaptive_target adaptive_decay backend_sampling grammar_lazy chat_format "
    "reasoning_format generation_prompt parse_tool_calls chat_parser continue_final_message echo preserved_tokens "
    "grammar_triggers reasoning_control reasoning_budget_tokens reasoning_budget_start_tag "
    "reasoning_budget_end_tags reasoning_budget_end_tag reasoning_budget_message max_tokens "
    "max_completion_tokens n logprobs top_logprobs").split()
CHAT_PARAMETERS = (
    "messages tools tool_choice parallel_tool_calls add_generation_prompt chat_template_kwargs reasoning_effort "
    "thinking_budget_tokens response_format grammar_type input_prefix input_suffix input_extra multimodal_data "
    "image_data").split()
FIELDS = tuple(dict.fromkeys(DOCUMENTED + SCHEMA_ONLY + CHAT_PARAMETERS))


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


# Values chosen to reach what asserts or allocates: an unknown enum, the
# int32 edges, a number past any float, a ring buffer of 2^31 tokens, a
# string of a hundred thousand characters, nesting, wrong types.
HOSTILE_VALUES = (
    2**31, -(2**31) - 1, 10**40, 1e308, -1, 0, 3, True, False, "", "x" * 100_000, "\u0000",
    [{"type": 9, "value": "x"}], [{"type": -1, "value": "x"}], [[10**12, 1]], ["infill", "adaptive_p"],
    [""], {"a": {"b": [1]}}, _nested(40), [None] * 1000,
)

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
COMPLETION = {"prompt": "Hi", "max_tokens": 1}
NATIVE = {"prompt": "Hi", "n_predict": 1}
DOORS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION, "/completion": NATIVE}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    running = RunningService(tmp_path_factory.mktemp("fields"), BASE_CONFIG)
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()


def test_every_llama_server_field_is_forwarded_bounded_or_refused():
    """The rule has an answer for every field llama-server reads: forwarded
    (and checked), or refused unless neutral. None is passed on unread."""
    forwarded = request_fields.FORWARDED["chat"] | request_fields.FORWARDED["completion"]
    # Read by the service itself (never forwarded as sent).
    service_reads = {"stream_options", "response_format", "max_completion_tokens"}
    unanswered = [f for f in FIELDS if f not in forwarded and f not in request_fields.LLAMA_SERVER_ONLY
                  and f not in service_reads]
    assert unanswered == []


def _send(service: RunningService, path: str, body: dict) -> tuple[str, int, str]:
    # A generous timeout: in CI the suite's other worker runs llama.cpp on the same cores.
    response = service.http.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                                 timeout=600)
    return f"{path} {body}"[:300], response.status_code, response.text[:300]


def test_hostile_fields_through_every_door_kill_no_worker(service):
    before = {w["role"]: w["pid"] for w in service.status()["workers"]}
    cases = [(path, {**base, field: value}) for path, base in DOORS.items()
             for field in FIELDS for value in HOSTILE_VALUES]
    # The translating doors (Ollama, Anthropic, Responses) build their own
    # bodies; each gets every field at once, and in Ollama's options too.
    every_field = {field: [{"type": 9, "value": "x"}] for field in FIELDS if field not in ("messages", "prompt")}
    cases += [
        ("/api/generate", {"model": "default", "prompt": "Hi", "stream": False, "options": {
            **every_field, "num_predict": 1}, **every_field}),
        ("/api/chat", {"model": "default", "messages": CHAT["messages"], "stream": False,
                       "options": {**every_field, "num_predict": 1}, **every_field}),
        ("/v1/messages", {**every_field, "model": "default", "messages": CHAT["messages"], "max_tokens": 1}),
        ("/v1/responses", {**every_field, "model": "default", "input": "Hi", "max_output_tokens": 16}),
    ]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda case: _send(service, *case), cases))
    server_errors = [answer for answer in answers if answer[1] >= 500]
    assert server_errors == [], server_errors[:5]
    # The crash this test was written for: refused by name, not passed on.
    refused = [a for a in answers if "'grammar_triggers'" in a[2]]
    assert refused and all(status == 400 for _, status, _ in refused)
    status = service.status()
    assert {w["role"]: w["pid"] for w in status["workers"]} == before
    assert all(w["restarts"] == 0 for w in status["workers"]), status["workers"]
    assert status["breaker"]["state"] == "closed"
    assert service.http.post("/v1/chat/completions", json=CHAT).status_code == 200


@pytest.mark.parametrize("path, base", list(DOORS.items()))
@pytest.mark.parametrize("trigger_type", [9, -1])
def test_the_grammar_trigger_that_aborted_both_workers_is_a_400(service, path, base, trigger_type):
    before = service.worker_pids()
    answer = service.http.post(path, json={**base, "grammar_triggers": [{"type": trigger_type, "value": "x"}]})
    assert answer.status_code == 400, answer.text
    assert "grammar_triggers" in answer.text
    assert service.worker_pids() == before
