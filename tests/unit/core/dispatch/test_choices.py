"""OpenAI's `n` as slots: a request with n choices holds n slots of its lane
(llama-server runs each choice in its own slot), admission counts them, and
the JSON answer keeps each choice apart."""

import asyncio
import json
from dataclasses import replace

import pytest

from tray_app.core.api.llamacpp import translate_completion
from tray_app.core.api.openai_request import InvalidRequest
from tray_app.core.api.sinks import AggregatingSink
from tray_app.core.dispatch.admission import CpuView, GpuView, LaneState, RequestShape, Route, decide
from tray_app.core.dispatch.jobs import Attempt, Job, JobKind, JobRequest
from tray_app.core.dispatch.lanes import Lane
from tray_app.core.dispatch.upstream import AttemptShaping, relay_answer, shape_event


async def test_a_request_with_n_choices_holds_n_slots():
    lane = Lane("gpu", concurrency=4, queue_limit=4)
    assert await lane.acquire("three", slots=3) == 0.0
    assert lane.busy_slots == 3 and lane.state(1024).running == 3
    # One slot is left: a second request of two choices waits for it.
    two = asyncio.ensure_future(lane.acquire("two", slots=2))
    await asyncio.sleep(0)
    assert lane.waiting_ids == ["two"] and not two.done()
    lane.release("three")
    await two
    assert lane.running_ids == ["two"] and lane.busy_slots == 2


async def test_a_waiter_for_several_slots_is_not_overtaken_by_a_single_one():
    lane = Lane("gpu", concurrency=2, queue_limit=4)
    await lane.acquire("a")
    pair = asyncio.ensure_future(lane.acquire("pair", slots=2))
    await asyncio.sleep(0)
    # One slot is free, but the pair is first in line: a newcomer queues behind it.
    single = asyncio.ensure_future(lane.acquire("single"))
    await asyncio.sleep(0)
    assert lane.waiting_ids == ["pair", "single"]
    lane.release("a")
    await pair
    assert not single.done() and lane.running_ids == ["pair"]
    lane.release("pair")
    await single


async def test_more_slots_than_the_lane_has_is_refused_not_queued_forever():
    lane = Lane("cpu", concurrency=1, queue_limit=4)
    with pytest.raises(ValueError, match="2 slots"):
        lane.join("pair", slots=2)
    assert not lane.waiting_ids and lane.busy_slots == 0


GPU_LANE = LaneState(context_cap=4096, running=2, concurrency=4, queued=0, queue_limit=2)
GPU = GpuView(lane=GPU_LANE, out=None, free_vram_mib=2000, reserve_mib=512, request_vram_mib=50)
CPU = CpuView(lane=LaneState(context_cap=2048, running=0, concurrency=4, queued=0, queue_limit=4), can_serve=True,
              out_reason=None, host_available_mib=16000, ram_floor_mib=1024, request_ram_mib=40,
              tokens_per_s=50.0, prompt_tokens_per_s=500.0, backlog_s=0.0)
SHORT = RequestShape(prompt_tokens=100, max_tokens=100)


@pytest.mark.parametrize("choices, route", [(2, Route.GPU), (3, Route.GPU_QUEUE)])
def test_admission_counts_one_slot_per_choice(choices, route):
    # Two of four GPU slots are busy: two choices fit now, three wait.
    assert decide(SHORT, replace(GPU, lane=replace(GPU_LANE, slots_wanted=choices)), CPU).route is route


def _job(kind: JobKind, n: int) -> Job:
    body = {"messages": []} if kind is JobKind.CHAT else {"prompt": "x"}
    return Job(JobRequest(id="req-n", kind=kind, body={**body, "n": n}, stream=False, prompt_tokens=5))


def test_the_answer_keeps_interleaved_choices_apart_and_sums_their_tokens():
    job = _job(JobKind.CHAT, 2)
    sink = AggregatingSink()
    for index, text, finish in [(0, "A", None), (1, "x", None), (0, "B", None), (1, None, "stop"), (0, None, "length")]:
        sink.emit({"choices": [{"index": index, "delta": {"content": text} if text else {}, "finish_reason": finish}]})
    job.attempts.append(Attempt("gpu", 0.0, tokens=3))
    answer = sink.chat_response(job)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in answer["choices"]] == [
        (0, "AB", "length"), (1, "x", "stop")]
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_a_completion_answer_has_one_text_per_choice():
    job = _job(JobKind.COMPLETION, 3)
    sink = AggregatingSink()
    for index, text in [(2, "c"), (0, "a"), (1, "b"), (0, "a")]:
        sink.emit({"choices": [{"index": index, "text": text, "finish_reason": None}]})
    assert [(c["index"], c["text"]) for c in sink.completion_response(job)["choices"]] == [
        (0, "aa"), (1, "b"), (2, "c")]


async def test_a_chat_stream_opens_every_choice_in_order_before_any_output():
    # llama-server's order: the role of choice 0 only, then the choices interleaved.
    events = [{"index": 0, "delta": {"role": "assistant", "content": None}}, {"index": 1, "delta": {"content": "x"}},
              {"index": 0, "delta": {"content": "a"}}]
    wire = "".join(f'data: {json.dumps({"choices": [choice]})}\n\n' for choice in events) + "data: [DONE]\n\n"

    class Answer:
        async def aiter_bytes(self):
            yield wire.encode()

    async def wait(awaitable):
        try:
            return await awaitable
        except StopAsyncIteration:
            return None

    job = _job(JobKind.CHAT, 2)
    sink = AggregatingSink()
    assert await relay_answer(Answer(), job, Attempt("gpu", 0.0), sink, wait, fail=pytest.fail, model="m",
                              fingerprint="f", clock=lambda: 0.0)
    opening, *rest = sink.events
    assert [(c["index"], c["delta"]["role"]) for c in opening["choices"]] == [(0, "assistant"), (1, "assistant")]
    # No choice is given its role twice (the openai package would join "assistantassistant").
    assert not any("role" in c["delta"] for event in rest for c in event["choices"])
    assert [c["message"]["content"] for c in sink.chat_response(job)["choices"]] == ["a", "x"]


def test_a_forced_tool_names_each_choices_call_once_with_its_own_id():
    job = Job(JobRequest(id="req-t", kind=JobKind.CHAT, body={"messages": [], "n": 2}, stream=True,
                         forced_tool="refund"))
    named = AttemptShaping()
    calls = []
    for index, text in [(0, '{"a'), (1, '{"b'), (0, '":1}'), (1, '":2}')]:
        event = {"choices": [{"index": index, "delta": {"content": text}, "finish_reason": None}]}
        shape_event(event, job, named, model="m", fingerprint="f")
        calls.append((index, event["choices"][0]["delta"]["tool_calls"][0]))
    assert [(index, call.get("id"), call["function"].get("name")) for index, call in calls] == [
        (0, "call_req-t", "refund"), (1, "call_req-t_1", "refund"), (0, None, None), (1, None, None)]


def test_llama_cpps_own_completion_route_refuses_several_choices():
    # Its answer has one `content`: two choices would be interleaved into it.
    with pytest.raises(InvalidRequest) as refused:
        translate_completion({"prompt": "x", "n": 2}, 1024)
    assert refused.value.param == "n" and "/v1/completions" in refused.value.message
    assert "n" not in translate_completion({"prompt": "x", "n": 1}, 1024)
