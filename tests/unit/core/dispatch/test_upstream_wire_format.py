"""What the backend does to a worker's stream events on their way to the
client: pure helpers, tested with plain dicts."""

from __future__ import annotations

from tray_app.core.dispatch.upstream import AttemptShaping, _carries_token, _progress_only, _trim_logprobs, shape_event, worker_body
from tray_app.core.dispatch.jobs import ANY_TOOL, Attempt, Job, JobKind, JobRequest


def chunk(**delta) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def test_reasoning_counts_as_output_so_a_thinking_model_does_not_look_hung():
    assert _carries_token(chunk(reasoning_content="Let me think"))
    assert not _carries_token(chunk(role="assistant", content=None))


def test_alternatives_are_cut_to_what_the_client_asked_for():
    token = {"token": "a", "logprob": -0.1, "top_logprobs": [{"token": "a"}, {"token": "b"}, {"token": "c"}]}
    event = {"choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": {"content": [token]}}]}
    _trim_logprobs(event, 1)
    assert [t["token"] for t in token["top_logprobs"]] == ["a"]
    _trim_logprobs(event, 0)
    assert token["top_logprobs"] == []


def test_the_worker_is_asked_for_at_least_one_alternative():
    job = Job(JobRequest(id="r", kind=JobKind.CHAT, body={"messages": [], "logprobs": True, "top_logprobs": 0},
                         stream=False, top_logprobs=0))
    assert worker_body(job)["top_logprobs"] == 1
    completion = Job(JobRequest(id="c", kind=JobKind.COMPLETION, body={"prompt": "x", "logprobs": 0}, stream=False,
                                top_logprobs=0))
    assert worker_body(completion)["logprobs"] == 1


def test_a_forced_tool_answer_streams_as_one_call_named_once():
    job = Job(JobRequest(id="req-9", kind=JobKind.CHAT, body={}, stream=True, forced_tool="refund_order"))
    named = AttemptShaping()
    first = chunk(content='{"order')
    shape_event(first, job, named, model="m", fingerprint="f")
    second = chunk(content='_id": "A"}')
    shape_event(second, job, named, model="m", fingerprint="f")
    last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    shape_event(last, job, named, model="m", fingerprint="f")
    (call,) = first["choices"][0]["delta"]["tool_calls"]
    assert call == {"index": 0, "id": "call_req-9", "type": "function",
                    "function": {"name": "refund_order", "arguments": '{"order'}}
    assert second["choices"][0]["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": '_id": "A"}'}}]}
    assert last["choices"][0]["finish_reason"] == "tool_calls"


async def test_sse_lines_split_only_on_line_feeds_not_on_unicode_line_separators():
    import json

    from tray_app.core.dispatch.upstream import sse_lines

    # llama-server leaves U+0085, U+2028 and U+2029 raw inside JSON strings.
    text = "a\u0085b\u2028c\u2029d\x1ce"
    wire = f'data: {json.dumps({"content": text}, ensure_ascii=False)}\r\n\r\ndata: [DONE]\n\n'.encode()

    class Chunked:
        async def aiter_bytes(self):
            for start in range(0, len(wire), 3):  # cuts through multi-byte characters too
                yield wire[start:start + 3]

    lines = [line async for line in sse_lines(Chunked())]
    assert lines == [f'data: {json.dumps({"content": text}, ensure_ascii=False)}', "", "data: [DONE]", ""]
    assert json.loads(lines[0][len("data: "):])["content"] == text


def test_the_worker_gets_only_forwarded_fields_and_the_services_own_settings():
    body = {"messages": [], "model": "m", "user": "u", "stream_options": {"include_usage": True},
            "grammar_triggers": [{"type": 9}], "metadata": {"a": "b"}, "temperature": 0.5, "mirostat": 2}
    sent = worker_body(Job(JobRequest(id="r", kind=JobKind.CHAT, body=body, stream=False, max_tokens=7)))
    # timings_per_token: a plain answer that may be continued is counted token by token.
    assert sent == {"messages": [], "temperature": 0.5, "mirostat": 2, "max_tokens": 7, "stream": True,
                    "return_progress": True, "timings_per_token": True}


def test_a_key_without_prompt_cache_has_its_worker_read_the_prompt_afresh():
    request = JobRequest(id="r", kind=JobKind.CHAT, body={"messages": []}, stream=False)
    assert "cache_prompt" not in worker_body(Job(request))
    isolated = Job(JobRequest(id="r2", kind=JobKind.CHAT, body={"messages": []}, stream=False, prompt_cache=False))
    assert worker_body(isolated)["cache_prompt"] is False


def test_a_required_tool_answer_becomes_the_call_it_names_once_whole():
    job = Job(JobRequest(id="req-7", kind=JobKind.CHAT, body={}, stream=True, forced_tool=ANY_TOOL))
    shaping = AttemptShaping()
    parts = [chunk(content='{"name": "get_'), chunk(content='weather", "arguments": {"city": '),
             chunk(content='"Oslo"}}')]
    carried = [shape_event(part, job, shaping, model="m", fingerprint="f") for part in parts]
    # Held back, but counted as output: the hang deadlines see the tokens.
    assert carried == [True, True, True] and all(p["choices"][0]["delta"] == {} for p in parts)
    last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    shape_event(last, job, shaping, model="m", fingerprint="f")
    assert last["choices"][0]["delta"]["tool_calls"] == [{"index": 0, "id": "call_req-7", "type": "function",
                                                           "function": {"name": "get_weather",
                                                                        "arguments": '{"city": "Oslo"}'}}]
    assert last["choices"][0]["finish_reason"] == "tool_calls"


def test_a_required_tool_answer_cut_by_the_limit_goes_out_as_text():
    job = Job(JobRequest(id="req-8", kind=JobKind.CHAT, body={}, stream=True, forced_tool=ANY_TOOL))
    shaping = AttemptShaping()
    shape_event(chunk(content='{"name": "get_wea'), job, shaping, model="m", fingerprint="f")
    last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    shape_event(last, job, shaping, model="m", fingerprint="f")
    assert last["choices"][0] == {"index": 0, "delta": {"content": '{"name": "get_wea'}, "finish_reason": "length"}


def test_the_prompts_progress_moves_the_first_token_deadline():
    attempt = Attempt(path="gpu", started_at=0.0)
    assert attempt.wait_limit_s(first_deadline=20.0, between_tokens_s=5.0, now=15.0, progress_gap_s=20.0) == 5.0
    attempt.last_progress_at = 30.0  # llama-server read another batch of the prompt
    assert attempt.wait_limit_s(first_deadline=20.0, between_tokens_s=5.0, now=35.0, progress_gap_s=20.0) == 15.0
    attempt.first_token_at = attempt.last_token_at = 40.0
    assert attempt.wait_limit_s(first_deadline=20.0, between_tokens_s=5.0, now=41.0, progress_gap_s=20.0) == 4.0


def test_a_progress_event_is_liveness_never_output():
    attempt = Attempt(path="gpu", started_at=0.0)
    progress = {"choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}],
                "prompt_progress": {"total": 4088, "cache": 0, "processed": 512, "time_ms": 8000}}
    assert _progress_only(progress, attempt, lambda: 12.5) and attempt.last_progress_at == 12.5
    last = {"choices": [{"finish_reason": "stop", "index": 0, "delta": {}}],
            "timings": {"prompt_n": 3000, "prompt_ms": 1500.0, "cache_n": 1088}}
    assert not _progress_only(last, attempt, lambda: 13.0)
    # What the worker read, not the cached part: 2000 tokens a second.
    assert (attempt.prompt_read, attempt.prompt_read_s) == (3000, 1.5)
