"""The relay's fast path (upstream.PlainDeltas): a plain content delta from
llama-server is forwarded with only its id, model and fingerprint rewritten,
byte for byte what the slow path (json.loads, shape_event, json.dumps)
sends, and everything unusual goes the slow path. The corpus is llama-server's
own stream, recorded from the bundled build (content with non-ASCII, the
role chunk, finish chunks with timings, the usage chunk, logprobs, a legacy
completion), plus lines in its exact wire form for what the tiny model
doesn't write: tool calls, reasoning_content, U+2028, quotes, backslashes,
escapes llama-server doesn't use, odd numbers, another upstream id."""

from pathlib import Path

import json

import pytest

from tray_app.core.api.sinks import AggregatingSink
from tray_app.core.dispatch.jobs import Attempt, Job, JobKind, JobRequest
from tray_app.core.dispatch.upstream import AttemptShaping, PlainDeltas, WireEvent, relay_answer, shape_event, sse_bytes

CORPUS = Path(__file__).parents[2] / "data" / "llama_server_sse.txt"
MODEL, FINGERPRINT = "smollm2", "fp-test"


def corpus_lines() -> list[str]:
    # Split on LF only: U+2028 inside a string is not a line end (see http_basics).
    return [line[5:].strip() for line in CORPUS.read_text(encoding="utf-8").split("\n")
            if line.startswith("data:") and line[5:].strip() != "[DONE]"]


def chat_job(**overrides) -> Job:
    return Job(JobRequest(id="req-fast", kind=JobKind.CHAT, body={"messages": []}, stream=True, **overrides))


def slow(line: str, job: Job) -> tuple[dict, bytes] | None:
    """The slow path's event and bytes; None where the relay drops or refuses the line."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if not event.get("choices"):
        return None
    shape_event(event, job, AttemptShaping(), model=MODEL, fingerprint=FINGERPRINT)
    return event, sse_bytes(event)


def is_plain_delta(event: dict) -> bool:
    (choice,) = event["choices"]
    return (choice.get("delta") is not None and set(choice["delta"]) == {"content"}
            and set(choice) == {"finish_reason", "index", "delta"} and choice["finish_reason"] is None)


def test_the_fast_path_sends_the_slow_paths_bytes_and_takes_only_plain_deltas():
    job = chat_job()
    fast = PlainDeltas()
    went_fast, went_slow = [], []
    for line in corpus_lines():
        reference = slow(line, job)
        made = fast.shape(line)
        if made is None:
            went_slow.append(line)
            if reference is not None:
                fast.learn(line, reference[0])
            continue
        went_fast.append(line)
        assert reference is not None, line
        event, wire = reference
        assert type(made) is WireEvent
        assert made.wire == wire, line
        # Every other reader (aggregation, Ollama, Anthropic, Responses) sees the same event.
        assert made == event and list(made) == list(event)
        assert is_plain_delta(event)
    assert len(went_fast) >= 40
    slow_texts = "\n".join(went_slow)
    for unusual in ('"role":"assistant"', '"finish_reason":"length"', '"usage":', '"tool_calls":', '"reasoning_content":',
                    '"logprobs":{"content"', '"text":', '"created":-5', '"created":1796170159.5', '"created":01796'):
        assert unusual in slow_texts, unusual
    for plain in ("\u2028", r'say \"hi\"', r"back\\slash\\", "\U0001F600", r"\u00e9 \/"):
        assert any(plain in line for line in went_fast), plain
    # Nothing that is not a plain delta of the same upstream went fast.
    assert not any(marker in line for line in went_fast for marker in (
        '"role"', '"tool_calls"', '"reasoning_content"', '"logprobs"', '"usage"', '"timings"'))


@pytest.mark.parametrize("overrides", [{"top_logprobs": 2}, {"forced_tool": "refund"}])
async def test_a_request_whose_deltas_are_rewritten_never_takes_the_fast_path(overrides):
    events = await relayed(chat_job(**overrides), one_answer())
    assert not any(type(event) is WireEvent for event in events)


def one_answer() -> list[str]:
    """One recorded answer: its role chunk to its [DONE], one event per chunk as llama-server writes them."""
    text = CORPUS.read_text(encoding="utf-8").split("\n")
    start = next(i for i, line in enumerate(text) if '"role":"assistant"' in line)
    end = text.index("data: [DONE]", start)
    return [f"{line}\n\n" for line in text[start:end + 1]]


async def relayed(job: Job, chunks: list[str] | list[bytes], waits: list[int] | None = None,
                  attempt: Attempt | None = None, done: bool = True) -> list[dict]:
    class Answer:
        async def aiter_bytes(self):
            for chunk in chunks:
                yield chunk if isinstance(chunk, bytes) else chunk.encode()

    async def wait(awaitable):
        if waits is not None:
            waits.append(1)
        try:
            return await awaitable
        except StopAsyncIteration:
            return None

    sink = AggregatingSink()
    assert await relay_answer(Answer(), job, attempt or Attempt("gpu", 0.0), sink, wait, fail=pytest.fail,
                              model=MODEL, fingerprint=FINGERPRINT, clock=lambda: 1.0) is done
    return sink.events


async def test_a_relayed_answer_is_the_slow_paths_byte_for_byte_with_its_tokens_counted():
    job, attempt, waits = chat_job(), Attempt("gpu", 0.0), []
    chunks = one_answer()
    events = await relayed(job, chunks, waits, attempt)
    references = [slow(chunk[5:].strip(), chat_job()) for chunk in chunks[:-1]]
    assert [sse_bytes(event) for event in events] == [wire for _, wire in filter(None, references)]
    assert sum(type(event) is WireEvent for event in events) >= 20
    # Every content delta is a token, fast or slow: usage and the replay rule count them.
    assert attempt.tokens == sum(bool(event["choices"][0]["delta"].get("content")) for event in events) >= 20
    assert attempt.first_token_at == attempt.last_token_at == 1.0
    # One wait per chunk of bytes (and one for the end), not one per SSE line.
    assert len(waits) <= len(chunks) + 1


async def test_events_split_across_chunks_and_several_in_one_chunk_relay_the_same():
    chunks = one_answer()
    whole = "".join(chunks)
    expected = [sse_bytes(event) for event in await relayed(chat_job(), chunks)]
    # Cut every 7 bytes: events, and the emoji's UTF-8 bytes, span chunks.
    raw = whole.encode()
    odd_cuts = [raw[i:i + 7] for i in range(0, len(raw), 7)]
    assert [sse_bytes(event) for event in await relayed(chat_job(), odd_cuts)] == expected
    waits: list[int] = []
    assert [sse_bytes(event) for event in await relayed(chat_job(), [whole], waits)] == expected
    # The whole answer in one chunk: one wait, however many events it holds.
    assert len(waits) == 1


TIMED = Path(__file__).parents[2] / "data" / "llama_server_sse_timed.txt"


def timed_answer() -> list[str]:
    """A thinking model's answer recorded with timings_per_token (the thinking
    copy of the bundled build, a reasoning budget of 6): every event carries
    predicted_n, and the tokens that close the reasoning come with none."""
    return [f"{line}\n\n" for line in TIMED.read_text(encoding="utf-8").split("\n") if line.startswith("data:")]


def untimed(chunk: str) -> str:
    if not chunk.startswith("data: {"):
        return chunk
    event = json.loads(chunk[5:])
    event.pop("timings", None)
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n"


async def test_per_token_timings_keep_the_fast_path_and_count_the_tokens_no_event_shows():
    timed, attempt = timed_answer(), Attempt("gpu", 0.0)
    events = await relayed(chat_job(), timed, attempt=attempt)
    # The client's bytes are those of the same answer without the timings.
    assert [sse_bytes(event) for event in events] == [
        sse_bytes(event) for event in await relayed(chat_job(), [untimed(chunk) for chunk in timed])]
    assert sum(type(event) is WireEvent for event in events) >= 4
    # 10 events carried text; the answer's usage is the worker's count, as llama-server's own is.
    assert attempt.predicted == attempt.tokens == 16
    # Cut after the first answer token: 5 events carried text, but the worker
    # had made 11 tokens (the reasoning's end tag and its blank line are hidden).
    first_answer = next(i for i, chunk in enumerate(timed) if '"content":"hi"' in chunk)
    cut = Attempt("gpu", 0.0)
    await relayed(chat_job(), timed[:first_answer + 1], attempt=cut, done=False)
    assert cut.tokens == 5 and cut.tokens_made() == 11


def test_timings_that_are_not_numbers_send_the_event_the_slow_path():
    fast = PlainDeltas()
    line = next(chunk for chunk in timed_answer() if '"content":"\\n"' in chunk)[5:].strip()
    fast.learn(line, slow(line, chat_job())[0])
    assert fast.shape(line) is not None and fast.predicted == 12
    for odd in (line.replace('"predicted_n":12', '"predicted_n":"12"'),
                line.replace('"predicted_n":12,', ''),
                line.replace('"cache_n":', '"cache_n":{"x":1},"y":'),
                # Not JSON's numbers, and a count given twice (json.loads would take the last).
                line.replace('"predicted_n":12', '"predicted_n":0012'),
                line.replace('"prompt_n":', '"prompt_n":--e,"x":'),
                line.replace('"predicted_n":12', '"predicted_n":12,"predicted_n":13')):
        assert fast.shape(odd) is None, odd
