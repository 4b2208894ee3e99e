"""A cut answer going on from its text: which requests can, what the worker
is sent, and the seam (the echo of the prefill dropped at awkward cut points,
never a character sent twice). llama-server's own behaviour at the seam is
checked by tests/integration/test_failover.py against the real build."""

from __future__ import annotations

import pytest

from tray_app.core.dispatch.jobs import Attempt, Job, JobKind, JobRequest
from tray_app.core.dispatch.upstream import ContinuationSeam, worker_body

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


def job(kind=JobKind.CHAT, **body) -> Job:
    base = {"messages": MESSAGES} if kind is JobKind.CHAT else {"prompt": "Once upon a time"}
    made = Job(JobRequest(id="req-c", kind=kind, body={**base, **body}, stream=True, max_tokens=50))
    made.attempts.append(Attempt("gpu", 0.0, tokens=7))
    return made


def cut(made: Job, *deltas: dict) -> Job:
    """The GPU's part: these deltas reached the client, then it failed. (A
    request that can't be continued keeps no record of them.)"""
    if made.sent is None:
        return made
    for delta in deltas:
        made.sent.take({"choices": [{"index": 0, "delta": delta}]})
    return made


@pytest.mark.parametrize("body, continuable", [
    ({}, True),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, True),  # tool_choice auto: text so far is text
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, False),
    ({"response_format": {"type": "json_object"}}, False),
    ({"response_format": {"type": "text"}}, True),
    ({"grammar": "root ::= \"a\""}, False),
    ({"n": 2}, False),
])
def test_which_answers_can_go_on_from_their_text(body, continuable):
    made = cut(job(**body), {"role": "assistant"}, {"content": "Once"})
    assert made.continuable() is continuable


def test_logprobs_a_tool_call_begun_or_nothing_made_cannot():
    assert not cut(Job(JobRequest(id="r", kind=JobKind.CHAT, body={"messages": MESSAGES}, stream=True,
                                  top_logprobs=1)), {"content": "a"}).continuable()
    assert not cut(job(), {"content": "Let me"}, {"tool_calls": [{"index": 0}]}).continuable()
    assert not cut(job(), {"reasoning_content": "Hmm"}, {"tool_calls": [{"index": 0}]}).continuable()
    assert not cut(job(), {"role": "assistant"}).continuable()
    # A completion whose prompt is token ids: the text can't be appended to it.
    assert not cut(job(JobKind.COMPLETION, prompt=[1, 2, 3]), {"content": "x"}).continuable()


def test_the_worker_gets_the_text_as_a_prefill_and_only_the_tokens_still_allowed():
    made = cut(job(), {"content": "Once upon a ti"})
    made.continue_after("gpu", 1.0)
    body = worker_body(made)
    assert body["messages"] == [*MESSAGES, {"role": "assistant", "content": "Once upon a ti"}]
    assert body["max_tokens"] == 50 - 7
    completion = cut(job(JobKind.COMPLETION), {"content": ", there"})
    completion.continue_after("gpu", 1.0)
    body = worker_body(completion)
    assert body["prompt"] == "Once upon a time, there" and body["max_tokens"] == 43
    # The job's own request is untouched: a replay or a retry resends the client's.
    assert completion.body["prompt"] == "Once upon a time"


def test_a_thinking_models_reasoning_goes_in_the_prefill_cut_inside_it_or_after_it():
    inside = cut(job(), {"reasoning_content": "The user wants"}, {"reasoning_content": " a sto"})
    assert inside.continuable()
    continuation = inside.continue_after("gpu", 1.0)
    assert continuation.in_reasoning
    # An empty answer and the reasoning: llama-server goes on with the reasoning.
    assert worker_body(inside)["messages"][-1] == {"role": "assistant", "content": "",
                                                   "reasoning_content": "The user wants a sto"}
    after = cut(job(), {"reasoning_content": "Short."}, {"content": "Once"})
    assert not after.continue_after("gpu", 1.0).in_reasoning
    assert worker_body(after)["messages"][-1] == {"role": "assistant", "content": "Once",
                                                  "reasoning_content": "Short."}


def test_the_cut_costs_the_tokens_the_worker_made_not_the_events_it_sent():
    made = cut(job(), {"reasoning_content": "Short."}, {"content": "Once"})
    # 7 events carried text; the worker's own count, hidden tags included, is 12.
    made.attempts[-1].predicted = 12
    assert made.continue_after("gpu", 1.0).tokens == 12
    assert worker_body(made)["max_tokens"] == 50 - 12
    # Every continuable request asks the worker for that count; others don't pay for it.
    assert worker_body(job())["timings_per_token"] is True
    assert "timings_per_token" not in worker_body(job(n=2))


def test_whitespace_that_ends_the_cut_is_written_again_not_prefilled():
    # SmolLM2 writes a blank line as two "\n" tokens; prefilled, "\n\n" reads
    # back as one, and from there the model writes a third. The prefill stops
    # at the last word; the next path writes the newlines in its own tokens.
    made = job()
    for made_so_far, text in enumerate(["hi", "\n", "\n"], start=11):
        made.sent.take({"choices": [{"index": 0, "delta": {"content": text}}]}, made_so_far)
    continuation = made.continue_after("gpu", 1.0)
    assert (continuation.text, continuation.held_back, continuation.tokens) == ("hi\n\n", "\n\n", 11)
    body = worker_body(made)
    assert body["messages"][-1] == {"role": "assistant", "content": "hi"} and body["max_tokens"] == 50 - 11
    # The newlines come again, after the echo of the prefill: the client gets neither twice.
    seam = ContinuationSeam(continuation, echoes=True)
    out = []
    for text in ["hi", "\n", "\n", "hi"]:
        event = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
        if seam.join(event, made, Attempt("cpu", 2.0)):
            out.append(event["choices"][0]["delta"]["content"])
    assert out == ["hi"]
    # A completion's prompt gets no echo, only the newlines again.
    completion = job(JobKind.COMPLETION)
    for made_so_far, text in enumerate([" there", "\n"], start=3):
        completion.sent.take({"choices": [{"index": 0, "text": text}]}, made_so_far)
    continuation = completion.continue_after("gpu", 1.0)
    assert worker_body(completion)["prompt"] == "Once upon a time there" and continuation.tokens == 3
    seam = ContinuationSeam(continuation, echoes=False)
    events = [{"choices": [{"index": 0, "text": text, "finish_reason": None}]} for text in ("\n", "The")]
    assert [seam.join(event, completion, Attempt("cpu", 2.0)) for event in events] == [False, True]
    assert events[1]["choices"][0]["text"] == "The"


@pytest.mark.parametrize("pieces, held_back", [
    (["Once", " upon"], ""),  # nothing to hold back
    (["\n", "\n"], ""),  # only whitespace: nothing would be left to prefill
    (["Hello \n"], ""),  # one token with its own whitespace: it is as the model split it
    (["Hello", " ", "\n"], " \n"),
])
def test_what_a_cut_holds_back(pieces, held_back):
    made = job()
    for piece in pieces:
        made.sent.take({"choices": [{"index": 0, "delta": {"content": piece}}]}, 1)
    assert made.continue_after("gpu", 1.0).held_back == held_back


def joined(echoed: str, deltas: list[str]) -> str:
    """What the client gets after the seam from the continuation's deltas."""
    made = cut(job(), {"content": echoed})
    seam = ContinuationSeam(made.continue_after("gpu", 1.0), echoes=True)
    out = []
    for text in deltas:
        event = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
        if seam.join(event, made, Attempt("cpu", 2.0)):
            out.append(event["choices"][0]["delta"].get("content", ""))
    return "".join(out)


@pytest.mark.parametrize("sent, deltas, new", [
    # llama-server's first delta is the prefill and the start of the first token
    # ("3." sent, then "3. " + "3"), as recorded from the bundled build.
    ("1. 1\n2. 2\n3.", ["1. 1\n2. 2\n3. ", "3", "\n4."], " 3\n4."),
    # Cut mid-word: the echo arrives in pieces, then the word goes on.
    ("The lightho", ["The ", "lightho", "use keeper"], "use keeper"),
    # Cut inside a multi-code-point emoji (family: man ZWJ woman ZWJ girl).
    ("Family: \U0001F468\u200d", ["Family: \U0001F468\u200d\U0001F469", "\u200d\U0001F467!"],
     "\U0001F469\u200d\U0001F467!"),
    # Right after the start of what might have been a stop sequence ("END").
    ("Done. EN", ["Done. EN", "DING"], "DING"),
    # An engine whose echo differs from what was sent (trimmed whitespace): from
    # where they part, the new text; what they share is never sent again.
    ("Hello \n", ["Hello", "!"], "!"),
])
def test_the_seam_drops_the_echo_and_sends_no_character_twice(sent, deltas, new):
    assert joined(sent, deltas) == new


def joined_reasoning(sent: list[dict], deltas: list[dict]) -> list[dict]:
    """The deltas the client gets after a thinking model's seam."""
    made = cut(job(), *sent)
    seam = ContinuationSeam(made.continue_after("gpu", 1.0), echoes=True)
    out = []
    for delta in deltas:
        event = {"choices": [{"index": 0, "delta": dict(delta), "finish_reason": None}]}
        if seam.join(event, made, Attempt("cpu", 2.0)):
            out.append(event["choices"][0]["delta"])
    return out


def test_a_cut_inside_the_reasoning_goes_on_with_the_reasoning_then_the_answer():
    # As the bundled build's thinking copy answers: the prefill's reasoning
    # echoed with the first new token, then the rest of it, then the answer.
    sent = [{"role": "assistant"}, {"reasoning_content": "\nhi"}, {"reasoning_content": "\n\nh"}]
    assert joined_reasoning(sent, [{"role": "assistant", "content": None}, {"reasoning_content": "\nhi\n\nhi\n"},
                                   {"reasoning_content": "\n"}, {"content": "hi"}]) == [
        {"reasoning_content": "i\n"}, {"reasoning_content": "\n"}, {"content": "hi"}]


def test_a_cut_in_the_answer_drops_the_whole_echoed_reasoning():
    # llama-server echoes the reasoning with the tag's newline after it, then the answer's prefill.
    sent = [{"reasoning_content": "\nhi\n\nhi"}, {"content": "Hel"}]
    assert joined_reasoning(sent, [{"reasoning_content": "\nhi\n\nhi\n"}, {"content": "Hello,"},
                                   {"content": " I"}]) == [{"content": "lo,"}, {"content": " I"}]


def test_the_seam_drops_the_second_role_and_marks_the_last_event():
    made = cut(job(), {"content": "abc"})
    seam = ContinuationSeam(made.continue_after("gpu", 1.0), echoes=True)
    attempt = Attempt("cpu", 2.0, tokens=5)
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}]}
    assert not seam.join(role, made, attempt)
    attempt.predicted = 9
    last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    assert seam.join(last, made, attempt)
    assert last["resumed"] == {"from": "gpu", "on": "cpu", "cut_at_tokens": 7, "cut_at_chars": 3, "tokens_added": 9}
    # Usage: the GPU's tokens and the CPU's, the engine's own count for the latter.
    made.attempts.append(attempt)
    assert made.tokens_out == 16


def test_an_answer_whose_worker_had_made_every_token_is_not_continued():
    from types import SimpleNamespace

    from tray_app.core.dispatch.failover import continuation_refused

    routing = SimpleNamespace(cpu=SimpleNamespace(worker=SimpleNamespace(
        runtime=SimpleNamespace(continues_prefill=True, name="llama-server"))))
    made = cut(job(), {"reasoning_content": "Short."}, {"content": "Once"})
    assert continuation_refused(routing, made) is None
    # 7 events carried text, but the worker had made all 50 (the reasoning's
    # hidden tags among them): nothing is left to allow the CPU.
    made.attempts[-1].predicted = 50
    assert continuation_refused(routing, made) == "it had made all max_tokens tokens"
