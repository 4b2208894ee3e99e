"""Peers without a network: the pure offer (admission.offer_to_peer), the
[[peers]] config, and a real Peer and Dispatcher whose HTTP goes to an
httpx.MockTransport that plays the peer server (answers, refusals, a
connection that breaks before or after the first byte)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Callable

import httpx
import pytest

from tray_app.core.config import ConfigError, PeerEntry, parse_config_text, peer_base_url
from tray_app.core.dispatch.admission import (
    Decision, PeerRole, PeerView, Reason, RequestShape, Route, offer_to_peer,
)
from tray_app.core.dispatch.breaker import BreakerPolicy, BreakerState
from tray_app.core.dispatch.jobs import JobFailed, PathSpeed
from tray_app.core.dispatch import peer as peer_module
from tray_app.core.dispatch.peer import (
    ANSWER_EVENT_MARGIN, ERROR_BODY_MAX_BYTES, HOP_HEADER, MODELS_MAX_BYTES, Peer, PeerFailure, Peers,
)
from tests.unit.core.dispatch.test_dispatcher import Sink, make_job, make_rig, run_job

SHAPE = RequestShape(prompt_tokens=10, max_tokens=10)
GPU_OUT = Decision(Route.CPU, Reason.GPU_VRAM_HEADROOM, "needs 900 MiB but only 100 MiB is free",
                   estimated_latency_s=12.0)
CPU_FULL = Decision(Route.REJECT, Reason.CPU_QUEUE_FULL, "the CPU queue is full (2/2)", status=503)
FALLBACK = PeerView("desk", PeerRole.FALLBACK, 2.0)
OVERFLOW = PeerView("attic", PeerRole.OVERFLOW, 1.0)


# ----- the pure offer ---------------------------------------------------------------------


def test_a_fallback_peer_comes_before_the_local_cpu():
    decision, peer = offer_to_peer(GPU_OUT, SHAPE, [FALLBACK])
    assert peer == "desk" and decision.route is Route.PEER and decision.reason is Reason.PEER
    assert "peer desk takes it before the local CPU" in decision.detail
    assert decision.estimated_latency_s == 2.0


def test_an_overflow_peer_takes_only_what_the_local_cpu_cant():
    assert offer_to_peer(GPU_OUT, SHAPE, [OVERFLOW]) == (GPU_OUT, None)
    decision, peer = offer_to_peer(CPU_FULL, SHAPE, [OVERFLOW])
    assert peer == "attic" and decision.route is Route.PEER and decision.status == 200


def test_the_fastest_measured_peer_wins_and_an_unmeasured_one_comes_after():
    slow = PeerView("slow", PeerRole.FALLBACK, 9.0)
    unmeasured = PeerView("new", PeerRole.FALLBACK, None)
    assert offer_to_peer(GPU_OUT, SHAPE, [unmeasured, slow, FALLBACK])[1] == "desk"
    assert offer_to_peer(GPU_OUT, SHAPE, [unmeasured])[1] == "new"


@pytest.mark.parametrize("decision", [
    Decision(Route.GPU, Reason.ADMITTED, "fits on the GPU"),
    Decision(Route.GPU_QUEUE, Reason.ADMITTED, "waiting for a GPU slot"),
    Decision(Route.REJECT, Reason.CONTEXT_LENGTH_EXCEEDED, "too long", status=400),
])
def test_what_the_local_gpu_takes_or_nobody_can_take_stays_local(decision):
    assert offer_to_peer(decision, SHAPE, [FALLBACK, OVERFLOW]) == (decision, None)


def test_a_replay_stays_local_and_a_peer_slower_than_the_deadline_is_not_offered():
    replay = RequestShape(prompt_tokens=10, max_tokens=10, is_replay=True)
    assert offer_to_peer(GPU_OUT, replay, [FALLBACK]) == (GPU_OUT, None)
    hurried = RequestShape(prompt_tokens=10, max_tokens=10, deadline_s=1.0)
    assert offer_to_peer(GPU_OUT, hurried, [FALLBACK]) == (GPU_OUT, None)


# ----- the config -----------------------------------------------------------------------------


def test_peers_parse_and_round_trip():
    config = parse_config_text('[[peers]]\nname = "desk"\nurl = "http://desk.lan:8642/v1/"\nrole = "overflow"\n'
                               'models = ["qwen"]\n')
    (peer,) = config.peers
    assert peer == PeerEntry(name="desk", url="http://desk.lan:8642/v1/", role="overflow", models=("qwen",))
    assert peer_base_url(peer.url) == "http://desk.lan:8642"


@pytest.mark.parametrize("table, message", [
    ('name = "a"\nurl = "desk.lan:8642"', "is not an http:// or https:// URL"),
    ('name = "a"\nurl = "http://user:pw@desk.lan"', "must not carry"),
    ('name = " a"\nurl = "http://desk.lan"', "needs a name"),
    ('name = "a"\nurl = "http://desk.lan"\nrole = "primary"', "must be one of 'fallback', 'overflow'"),
    ('name = "a"\nurl = "http://desk.lan"\nmax_concurrency = 0', "must be at least 1"),
    ('name = "a"\nurl = "http://127.0.0.1:8642"', "is this server itself"),
    ('name = "a"\nurl = "http://127.0.0.2:8642"', "is this server itself"),
    ('name = "a"\nurl = "http://desk.lan:0"', "a number from 1 to 65535"),
    ('name = "a"\nurl = "http://desk.lan"\napi_key = "s3cret "', "printable ASCII without spaces"),
    ('name = "a"\nurl = "http://desk.lan"\napi_key = "sécret"', "printable ASCII without spaces"),
])
def test_a_bad_peer_entry_is_a_config_error_that_says_why(table, message):
    with pytest.raises(ConfigError, match=message):
        parse_config_text(f"[[peers]]\n{table}\n")


def test_two_peers_may_not_share_a_name():
    with pytest.raises(ConfigError, match="already named 'a'"):
        parse_config_text('[[peers]]\nname = "a"\nurl = "http://x"\n[[peers]]\nname = "a"\nurl = "http://y"\n')


# ----- a Peer over a mock transport ---------------------------------------------------------------


def sse(*events, done: bool = True) -> bytes:
    body = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events)
    return body + (b"data: [DONE]\n\n" if done else b"")


TOKEN = {"id": "theirs", "model": "their-name", "choices": [{"index": 0, "delta": {"content": "hi"}}],
         "timings": {"x": 1}}
MODELS = {"object": "list", "data": [{"id": "smol"}, {"id": "other"}]}


class FakePeerServer:
    """The peer's HTTP side: /v1/models and a scripted chat answer."""

    def __init__(self) -> None:
        self.models_status = 200
        self.chat: httpx.Response | Exception = httpx.Response(200, content=sse(TOKEN, TOKEN))
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.url.path == "/v1/models":
            return httpx.Response(self.models_status, json=MODELS if self.models_status == 200 else {})
        if isinstance(self.chat, Exception):
            raise self.chat
        return self.chat


def make_peer(server: FakePeerServer, role: str = "fallback", threshold: int = 2, clock: Callable[[], float] = time.monotonic,
              **settings) -> Peer:
    entry = PeerEntry(name="desk", url="http://desk.lan:8642", api_key="k", role=role, **settings)
    http = httpx.AsyncClient(transport=httpx.MockTransport(server))
    return Peer(entry, peer_base_url(entry.url), http, BreakerPolicy(failure_threshold=threshold, cooldown_s=5.0),
                clock)


async def test_a_health_check_reads_the_models_and_the_round_trip():
    server = FakePeerServer()
    peer = make_peer(server)
    assert peer.unavailable(("smol",)) == "not checked yet"
    await peer.check()
    assert peer.unavailable(("smol",)) is None and peer.remote_model(("x", "other")) == "other"
    assert peer.unavailable(("missing",)) == "it does not serve missing"
    assert peer.status()["healthy"] and peer.status()["latency_ms"] >= 0
    assert server.requests[0].headers["authorization"] == "Bearer k"


async def test_a_wrong_key_and_an_unreachable_peer_say_why():
    server = FakePeerServer()
    server.models_status = 401
    peer = make_peer(server)
    await peer.check()
    assert "refused our API key (HTTP 401)" in peer.unavailable(("smol",))
    server.models_status = 200
    peer._http = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: (_ for _ in ()).throw(
        httpx.ConnectError("connection refused"))))
    await peer.check()
    assert peer.status()["reachable"] is False and peer.unavailable(("smol",)).startswith("unreachable: ConnectError")


async def test_the_answer_carries_this_servers_identity_and_the_forwarding_headers():
    server = FakePeerServer()
    peer = make_peer(server)
    await peer.check()
    job = make_job("req-id-7", idempotency_key="key-1")
    sink = Sink(job)
    attempt = await peer.run(job, sink, ("smol",), "Local-Name", "fp_peer_desk")
    assert attempt.tokens == 2 and attempt.outcome == "completed"
    assert [e["id"] for e in sink.events] == ["chatcmpl-req-id-7"] * 2
    assert {e["model"] for e in sink.events} == {"Local-Name"} and "timings" not in sink.events[0]
    sent = server.requests[-1]
    assert sent.headers[HOP_HEADER] == "1" and sent.headers["x-request-id"] == "req-id-7"
    assert sent.headers["idempotency-key"] == "key-1" and sent.headers["x-fallback"] == "never"
    body = json.loads(sent.content)
    assert body["model"] == "smol" and body["stream"] is True and body["max_tokens"] == 10
    assert peer.in_flight == 0 and peer.served == 1


async def test_an_overflow_peer_may_use_its_own_cpu():
    server = FakePeerServer()
    peer = make_peer(server, role="overflow")
    await peer.check()
    await peer.run(make_job(), Sink(), ("smol",), "m", "fp")
    assert "x-fallback" not in server.requests[-1].headers


@pytest.mark.parametrize("answer, counts, ran", [
    (httpx.Response(503, json={"error": {"message": "busy"}}), False, False),
    (httpx.Response(429, json={"error": {"message": "slow down"}}), False, False),
    # A 5xx other than 503 may come after it began (a tray-app peer's 502).
    (httpx.Response(500, json={"error": {"message": "boom"}}), True, True),
    (httpx.Response(502, json={"error": {"message": "its worker failed"}}), True, True),
    (httpx.Response(400, json={"error": {"message": "context too long"}}), False, False),
    (httpx.ConnectError("refused"), True, False),
    (httpx.ConnectTimeout("powered off"), True, False),
    (httpx.DecodingError("bad gzip"), True, True),
    (httpx.Response(200, content=sse({"choices": ["x"]})), True, True),
    (httpx.Response(200, content=sse({"choices": [{"delta": "x"}]})), True, True),
    (httpx.Response(200, content=sse([1, 2])), True, True),
    (httpx.ReadError("reset by peer"), True, True),
    (httpx.Response(200, content=sse(TOKEN, done=False)), True, True),
    (httpx.Response(200, content=b"data: {not json\n\n"), True, True),
])
async def test_how_each_failure_counts(answer, counts, ran):
    server = FakePeerServer()
    server.chat = answer
    peer = make_peer(server)
    await peer.check()
    with pytest.raises(PeerFailure) as caught:
        await peer.run(make_job(), Sink(), ("smol",), "m", "fp")
    assert (caught.value.counts, caught.value.ran) == (counts, ran)
    assert peer.in_flight == 0


async def test_a_refused_key_at_request_time_opens_the_breaker_at_once():
    server = FakePeerServer()
    peer = make_peer(server)
    await peer.check()
    server.chat = httpx.Response(401, json={"error": {"message": "bad key"}})
    with pytest.raises(PeerFailure) as caught:
        await peer.run(make_job(), Sink(), ("smol",), "m", "fp")
    peer.record_failure(caught.value)
    assert peer.breaker.state is BreakerState.OPEN
    assert "refused our API key" in peer.unavailable(("smol",))


async def test_failures_open_the_breaker_and_after_the_cooldown_one_request_probes_it():
    server = FakePeerServer()
    rig, peer = await peer_rig(server)
    clock = [0.0]
    peer.breaker._clock = lambda: clock[0]
    for _ in range(2):
        peer.record_failure(PeerFailure("connection broke"))
    assert peer.breaker.state is BreakerState.OPEN and "breaker is open" in peer.unavailable(("smol",))
    rig.memory.free_mib = 100.0
    job = make_job("while-open")
    await run_job(rig, job)
    assert job.path == "cpu"
    # A health check alone does not close it: only a request that the peer answers.
    clock[0] = 6.0
    await peer.check()
    assert peer.breaker.state is BreakerState.HALF_OPEN and peer.unavailable(("smol",)) is None
    release = asyncio.Event()
    server.chat = httpx.Response(200, content=held_stream(release))
    probe = make_job("probe")
    task = await start_streaming(rig, probe)
    assert probe.path == "peer" and probe.peer_probe
    # One probe at a time: the next request stays here.
    assert "a probe request is testing it" in peer.unavailable(("smol",))
    other = make_job("other")
    await run_job(rig, other)
    assert other.path == "cpu"
    release.set()
    await task
    assert peer.breaker.state is BreakerState.CLOSED and not probe.peer_probe


async def test_a_failed_probe_opens_the_breaker_again():
    server = FakePeerServer()
    server.chat = httpx.ReadError("reset")
    rig, peer = await peer_rig(server)
    clock = [0.0]
    peer.breaker._clock = lambda: clock[0]
    peer.breaker.trip("earlier failures")
    clock[0] = 6.0
    rig.memory.free_mib = 100.0
    job = make_job()
    await run_job(rig, job)
    assert job.reason is Reason.PEER_FAILED_REPLAYED
    assert peer.breaker.state is BreakerState.OPEN and not peer.breaker.probe_in_flight


async def test_a_full_peer_takes_no_more():
    server = FakePeerServer()
    release = asyncio.Event()
    server.chat = httpx.Response(200, content=held_stream(release))
    rig, peer = await peer_rig(server, max_concurrency=1)
    rig.dispatcher.set_gpu_paused(True)
    task = await start_streaming(rig, make_job())
    assert peer.in_flight == 1 and "max_concurrency" in peer.unavailable(("smol",))
    release.set()
    await task
    assert peer.in_flight == 0 and peer.unavailable(("smol",)) is None


async def test_the_estimate_counts_this_servers_requests_already_running_on_the_peer():
    server = FakePeerServer()
    release = asyncio.Event()
    server.chat = httpx.Response(200, content=held_stream(release))
    rig, peer = await peer_rig(server)
    peer.speed = PathSpeed(tokens_per_s=10.0, prompt_tokens_per_s=100.0, samples=1)
    peer.health.smoothed_ms = 100.0
    alone = peer.estimate_s(0, 10)
    assert alone == pytest.approx(0.1 + 1.0)
    rig.dispatcher.set_gpu_paused(True)
    task = await start_streaming(rig, make_job(max_tokens=10))  # one token in, 9 to go
    # The two share the peer's 10 tokens/s: 9 tokens each at 5/s, then the last at 10/s.
    assert peer.estimate_s(0, 10) == pytest.approx(0.1 + 1.8 + 0.1)
    release.set()
    await task
    assert peer.estimate_s(0, 10) == alone


async def test_what_is_left_of_the_deadline_is_measured_on_the_peers_clock():
    server = FakePeerServer()
    rig = make_rig()
    peer = make_peer(server, clock=rig.clock)
    await peer.check()
    job = make_job(deadline_s=30.0)
    assert rig.dispatcher.register(job)  # it arrived
    rig.clock.advance(12.0)  # and waited here 12 s (a GPU queue it was redirected from, say)
    await peer.run(job, Sink(job), ("smol",), "m", "fp")
    assert server.requests[-1].headers["x-request-timeout"] == "18.000"


# ----- the dispatcher with a peer ---------------------------------------------------------------


async def peer_rig(server: FakePeerServer, role: str = "fallback", **settings):
    rig = make_rig()
    peer = make_peer(server, role=role, **settings)
    await peer.check()
    rig.dispatcher.peers = Peers([peer])
    rig.dispatcher.model_names = ("Local-Name", "smol")
    return rig, peer


def held_stream(release: asyncio.Event):
    """A peer answer that sends one token, then waits for `release`."""
    async def stream():
        yield f"data: {json.dumps(TOKEN)}\n\n".encode()
        await release.wait()
        yield b"data: [DONE]\n\n"
    return stream()


async def start_streaming(rig, job) -> asyncio.Task:
    """Run the job on the rig until its first token has arrived."""
    assert rig.dispatcher.register(job)
    task = asyncio.create_task(rig.dispatcher.run(job, Sink(job)))
    for _ in range(200):
        if job.attempts and job.attempts[-1].tokens:
            return task
        await asyncio.sleep(0)
    raise AssertionError("no token arrived")


async def test_the_gpu_cant_take_it_so_the_peer_answers_before_the_local_cpu():
    rig, peer = await peer_rig(FakePeerServer())
    rig.memory.free_mib = 100.0  # under the reserve: the GPU can't admit
    job = make_job()
    sink = await run_job(rig, job)
    assert job.path == "peer" and job.peer == "desk" and job.reason is Reason.PEER
    assert rig.cpu.calls == [] and rig.gpu.calls == []
    assert rig.events.completions == [(job.id, "peer")] and rig.dispatcher.duplicate_executions == 0
    assert sink.events[0]["model"] == "Local-Name"


async def test_the_peer_breaking_before_any_output_replays_once_on_the_local_cpu():
    server = FakePeerServer()
    server.chat = httpx.ReadError("reset")
    rig, peer = await peer_rig(server)
    rig.memory.free_mib = 100.0
    job = make_job()
    await run_job(rig, job)
    assert job.path == "cpu" and job.reason is Reason.PEER_FAILED_REPLAYED and job.replayed
    assert rig.cpu.calls == [job.id] and peer.failures == 1
    assert "replay" in rig.events.kinds() and rig.events.completions == [(job.id, "cpu")]


async def test_a_peer_that_declines_sends_the_request_to_the_local_cpu_without_a_replay():
    server = FakePeerServer()
    server.chat = httpx.Response(503, json={"error": {"message": "my GPU is busy"}})
    rig, peer = await peer_rig(server)
    rig.memory.free_mib = 100.0
    job = make_job()
    await run_job(rig, job)
    assert job.path == "cpu" and job.reason is Reason.GPU_VRAM_HEADROOM and not job.replayed
    assert peer.breaker.snapshot()["recent_failures"] == 0 and "replay" not in rig.events.kinds()


async def test_the_peer_breaking_after_output_reached_the_client_is_a_502_and_nothing_reruns():
    server = FakePeerServer()
    server.chat = httpx.Response(200, content=sse(TOKEN, done=False))
    rig, _ = await peer_rig(server)
    rig.memory.free_mib = 100.0
    job = make_job()
    with pytest.raises(JobFailed) as caught:
        await run_job(rig, job, Sink(job, streaming=True))
    assert caught.value.status == 502 and caught.value.code == "peer_failed"
    assert "nothing was re-run" in str(caught.value.message)
    assert rig.cpu.calls == [] and rig.dispatcher.completed_total == 0


async def test_no_peer_for_a_forwarded_request_a_forced_cpu_one_or_one_that_may_not_leave_the_gpu():
    rig, _ = await peer_rig(FakePeerServer())
    rig.memory.free_mib = 100.0
    hopped, forced = make_job("hop", from_peer=True), make_job("forced", force_cpu=True)
    kept = make_job("kept", no_fallback=True)
    await run_job(rig, hopped)
    await run_job(rig, forced)
    assert (hopped.path, forced.path) == ("cpu", "cpu")
    with pytest.raises(JobFailed) as caught:
        await run_job(rig, kept)
    assert caught.value.status == 503


async def test_the_paused_gpu_sends_work_to_the_peer_and_degraded_mode_names_it():
    server = FakePeerServer()
    release = asyncio.Event()
    server.chat = httpx.Response(200, content=held_stream(release))
    rig, _ = await peer_rig(server)
    rig.dispatcher.set_gpu_paused(True)
    job = make_job()
    task = await start_streaming(rig, job)
    assert job.path == "peer" and rig.dispatcher.request_status()[0]["peer"] == "desk"
    assert "paused" in rig.dispatcher.degraded_cause()
    release.set()
    await task
    assert job.attempts[-1].outcome == "completed"


async def test_degraded_mode_says_a_peer_serves_when_the_gpu_path_is_up_but_short_of_room():
    server = FakePeerServer()
    release = asyncio.Event()
    server.chat = httpx.Response(200, content=held_stream(release))
    rig, _ = await peer_rig(server)
    rig.memory.free_mib = 600.0  # above the 500 MiB reserve, but not 600 MiB above it
    job = make_job(prompt=500, max_tokens=100)
    task = await start_streaming(rig, job)
    cause = rig.dispatcher.degraded_cause()
    assert cause.startswith("peer: needs 600 MiB") and cause.endswith("peer desk takes it before the local CPU")
    release.set()
    await task


async def test_an_overflow_peer_takes_what_the_full_local_cpu_would_refuse():
    rig, _ = await peer_rig(FakePeerServer(), role="overflow")
    rig.memory.free_mib = 100.0
    rig.memory.host_mib = 500.0  # under the RAM floor: the CPU would refuse
    job = make_job()
    await run_job(rig, job)
    assert job.path == "peer" and "instead" in job.reason_detail


async def test_an_odd_models_answer_is_the_peers_problem_and_the_checks_go_on():
    server = FakePeerServer()
    peer = make_peer(server)
    peer._http = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200, json={"data": 5})))
    await peer.check()
    assert peer.health.problem == "its /v1/models is not an OpenAI model list"
    broken = make_peer(server)

    async def explode():
        raise RuntimeError("not an httpx error")

    broken.check = explode
    healthy = make_peer(FakePeerServer())
    peers = Peers([broken, healthy], interval_s=0.01)
    peers.start()
    try:
        await eventually(lambda: healthy.health.checked_at is not None, "the healthy peer checked")
    finally:
        await peers.stop()
    assert healthy.unavailable(("smol",)) is None


async def test_a_request_redirected_from_the_gpu_queue_goes_to_the_peer_not_the_cpu():
    from tests.unit.core.dispatch.test_dispatcher import Gate

    rig, peer = await peer_rig(FakePeerServer())
    gate = Gate()
    rig.gpu.scripts["first"] = gate
    first, waiting = make_job("first"), make_job("waiting")
    assert rig.dispatcher.register(first) and rig.dispatcher.register(waiting)
    running = asyncio.create_task(rig.dispatcher.run(first, Sink(first)))
    await asyncio.sleep(0)
    queued = asyncio.create_task(rig.dispatcher.run(waiting, Sink(waiting)))
    for _ in range(50):
        await asyncio.sleep(0)
    assert waiting.path == "gpu"
    rig.dispatcher.set_gpu_paused(True)  # the waiter is redirected, and decided again
    await queued
    assert waiting.path == "peer" and waiting.reason is Reason.PEER and rig.cpu.calls == []
    assert peer.served == 1
    gate.release.set()
    await running


async def test_the_clients_deadline_goes_with_the_request_and_bounds_the_wait():
    server = FakePeerServer()
    peer = make_peer(server)
    await peer.check()
    job = make_job(deadline_s=30.0)
    await peer.run(job, Sink(), ("smol",), "m", "fp")
    assert 29.0 < float(server.requests[-1].headers["x-request-timeout"]) <= 30.0


async def test_a_failed_overflow_peer_is_named_in_the_capacity_error():
    server = FakePeerServer()
    server.chat = httpx.Response(503, json={"error": {"message": "full too"}})
    rig, _ = await peer_rig(server, role="overflow")
    rig.memory.free_mib = 100.0
    rig.memory.host_mib = 500.0
    job = make_job()
    with pytest.raises(JobFailed) as caught:
        await run_job(rig, job)
    assert caught.value.status == 503 and caught.value.code == "ram_floor"
    assert caught.value.message.startswith("peer desk failed (it answered HTTP 503")
    assert job.path is None


async def test_a_constrained_request_stays_local():
    rig, peer = await peer_rig(FakePeerServer())
    rig.memory.free_mib = 100.0
    job = make_job()
    job.body["grammar"] = 'root ::= "yes"'
    await run_job(rig, job)
    assert job.path == "cpu" and peer.served == 0


async def test_a_peer_line_without_end_is_cut_off():
    from tray_app.core.dispatch.upstream import MAX_SSE_LINE_BYTES

    async def endless():
        chunk = b"x" * 65536
        for _ in range(MAX_SSE_LINE_BYTES // len(chunk) + 2):
            yield chunk

    server = FakePeerServer()
    server.chat = httpx.Response(200, content=endless())
    peer = make_peer(server)
    await peer.check()
    with pytest.raises(PeerFailure, match="SSE line longer"):
        await peer.run(make_job(), Sink(), ("smol",), "m", "fp")


async def test_a_client_cancel_mid_peer_stream_is_a_499_and_frees_the_peer_slot():
    server = FakePeerServer()
    server.chat = httpx.Response(200, content=held_stream(asyncio.Event()))
    rig, peer = await peer_rig(server)
    rig.memory.free_mib = 100.0
    job = make_job()
    task = await start_streaming(rig, job)
    job.cancel("the client went away")
    with pytest.raises(JobFailed) as caught:
        await task
    assert caught.value.status == 499 and peer.in_flight == 0 and peer.failures == 0


# ----- a hostile peer: every read has a deadline and a byte cap ------------------------------------

# How long a test waits for what must happen at once; only a hang (the old
# code's) ever reaches it.
HANG_S = 10.0


async def eventually(predicate, what: str) -> None:
    for _ in range(int(HANG_S / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within {HANG_S} s: {what}")


class Body:
    """A body a peer sends chunk by chunk, counting what was pulled from
    it; after `limit` bytes it stalls (until `release`) or, with
    `then_end`, ends there."""

    def __init__(self, chunks, limit: int = 64 * 1024 * 1024, then_end: bool = False) -> None:
        self.chunks = chunks
        self.limit = limit
        self.then_end = then_end
        self.sent = 0
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def __aiter__(self):
        for chunk in self.chunks:
            if self.sent >= self.limit:
                break
            self.sent += len(chunk)
            self.started.set()
            yield chunk
            await asyncio.sleep(0)
        if not self.then_end:
            await self.release.wait()


def forever(chunk: bytes):
    while True:
        yield chunk


async def run_on_peer(peer: Peer, job=None, sink=None):
    """peer.run, failing the test (instead of hanging it) if it never ends."""
    return await asyncio.wait_for(peer.run(job or make_job(), sink or Sink(), ("smol",), "m", "fp"), HANG_S)


async def test_a_stalled_error_body_ends_at_the_first_token_deadline_and_blames_the_peer():
    server = FakePeerServer()
    body = Body([b'{"error": {"mess'], limit=1)
    server.chat = httpx.Response(500, headers={"Content-Length": "1000"}, content=body)
    peer = make_peer(server, first_token_timeout_s=0.2)
    await peer.check()
    with pytest.raises(PeerFailure, match="answered HTTP 500 but sent no more of its body for 0.2 s") as caught:
        await run_on_peer(peer)
    assert (caught.value.counts, caught.value.ran) == (True, True)
    assert peer.in_flight == 0


async def test_a_client_cancel_frees_a_request_whose_error_body_stalls():
    server = FakePeerServer()
    body = Body([b'{"error": {"mess'], limit=1)
    server.chat = httpx.Response(503, headers={"Content-Length": "1000"}, content=body)
    peer = make_peer(server)  # the default 60 s deadline: only the cancel can end it
    await peer.check()
    job = make_job()
    task = asyncio.create_task(peer.run(job, Sink(), ("smol",), "m", "fp"))
    await asyncio.wait_for(body.started.wait(), HANG_S)
    job.cancel("the client disconnected")
    with pytest.raises(JobFailed) as caught:
        await asyncio.wait_for(task, HANG_S)
    assert caught.value.status == 499 and peer.in_flight == 0


async def test_an_endless_error_body_is_read_no_further_than_its_cap():
    server = FakePeerServer()
    chunk = b"x" * 65536
    body = Body(forever(chunk), limit=32 * 1024 * 1024, then_end=True)
    server.chat = httpx.Response(500, content=body)
    peer = make_peer(server)
    await peer.check()
    with pytest.raises(PeerFailure, match="it answered HTTP 500: x") as caught:
        await run_on_peer(peer)
    assert caught.value.counts and body.sent <= ERROR_BODY_MAX_BYTES + len(chunk)


async def test_an_endless_token_stream_is_cut_past_max_tokens_and_replayed_on_the_cpu():
    server = FakePeerServer()
    body = Body(forever(sse(TOKEN, done=False)), limit=8 * 1024 * 1024, then_end=True)
    server.chat = httpx.Response(200, content=body)
    rig, peer = await peer_rig(server)
    rig.memory.free_mib = 100.0
    job = make_job(max_tokens=10)
    sink = await asyncio.wait_for(run_job(rig, job), HANG_S)
    # Nothing had reached the client: the one re-run, on the CPU.
    assert job.path == "cpu" and job.reason is Reason.PEER_FAILED_REPLAYED and rig.cpu.calls == [job.id]
    assert sink.resets == 1 and peer.failures == 1 and peer.breaker.snapshot()["recent_failures"] == 1
    failure = next(data for kind, data in rig.events.notes if kind == "peer_failure")
    limit = 10 + ANSWER_EVENT_MARGIN
    assert failure["reason"] == f"it sent more than {limit} events for max_tokens 10: its answer was cut"
    # Read no further than the cut.
    assert body.sent <= (limit + 1) * len(sse(TOKEN, done=False)) + 65536


async def test_an_endless_token_stream_to_a_streaming_client_is_a_502_after_max_tokens():
    server = FakePeerServer()
    server.chat = httpx.Response(200, content=Body(forever(sse(TOKEN, done=False)), limit=8 * 1024 * 1024,
                                                   then_end=True))
    rig, _ = await peer_rig(server)
    rig.memory.free_mib = 100.0
    job = make_job(max_tokens=10)
    sink = Sink(job, streaming=True)
    with pytest.raises(JobFailed) as caught:
        await asyncio.wait_for(run_job(rig, job, sink), HANG_S)
    assert caught.value.status == 502 and caught.value.code == "peer_failed"
    assert "events for max_tokens 10" in caught.value.message and "nothing was re-run" in caught.value.message
    assert len(sink.events) == 10 + ANSWER_EVENT_MARGIN and rig.cpu.calls == []


async def test_a_flood_of_events_without_tokens_is_cut_at_max_tokens_too():
    server = FakePeerServer()
    empty = sse({"choices": [{"index": 0, "delta": {}}]}, done=False)
    body = Body(forever(empty), limit=16 * 1024 * 1024, then_end=True)
    server.chat = httpx.Response(200, content=body)
    peer = make_peer(server)
    await peer.check()
    sink = Sink()
    limit = 10 + ANSWER_EVENT_MARGIN
    with pytest.raises(PeerFailure, match=f"more than {limit} events for max_tokens 10: its answer was cut") as caught:
        await run_on_peer(peer, make_job(max_tokens=10), sink)
    assert caught.value.counts and len(sink.events) == limit


async def test_a_few_huge_events_are_cut_by_their_bytes():
    server = FakePeerServer()
    huge = sse({**TOKEN, "padding": "x" * 1024 * 1024}, done=False)
    body = Body(forever(huge), limit=64 * 1024 * 1024, then_end=True)
    server.chat = httpx.Response(200, content=body)
    peer = make_peer(server)
    await peer.check()
    sink = Sink()
    with pytest.raises(PeerFailure, match="bytes for max_tokens 10: its answer was cut") as caught:
        await run_on_peer(peer, make_job(max_tokens=10), sink)
    assert caught.value.counts and len(sink.events) < 10 and body.sent < 8 * 1024 * 1024


async def test_a_dripping_models_answer_ends_at_the_health_deadline(monkeypatch):
    monkeypatch.setattr(peer_module, "HEALTH_TIMEOUT_S", 0.2)
    peer = make_peer(FakePeerServer())
    drip = Body(forever(b" "))
    peer._http = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200, content=drip)))
    await asyncio.wait_for(peer.check(), HANG_S)
    assert peer.status()["reachable"] is False
    assert peer.unavailable(("smol",)) == "its /v1/models did not answer in full within 0.2 s"


async def test_a_peer_whose_models_answer_never_ends_does_not_hold_the_others_checks():
    stuck = make_peer(FakePeerServer())
    stuck._http = httpx.AsyncClient(transport=httpx.MockTransport(
        lambda r: httpx.Response(200, content=Body(forever(b" ")))))
    server = FakePeerServer()
    healthy = make_peer(server)
    peers = Peers([stuck, healthy], interval_s=0.01)
    peers.start()
    try:
        await eventually(lambda: len(server.requests) >= 3, "three checks of the healthy peer")
    finally:
        await peers.stop()
    assert healthy.unavailable(("smol",)) is None


async def test_a_models_answer_over_its_cap_is_the_peers_problem():
    peer = make_peer(FakePeerServer())
    chunk = b"[" * 65536
    body = Body(forever(chunk), limit=4 * MODELS_MAX_BYTES, then_end=True)
    peer._http = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200, content=body)))
    await peer.check()
    assert peer.unavailable(("smol",)) == f"its /v1/models is larger than {MODELS_MAX_BYTES} bytes"
    assert body.sent <= MODELS_MAX_BYTES + len(chunk)


async def test_a_models_answer_nested_too_deep_for_the_parser_is_the_peers_problem():
    peer = make_peer(FakePeerServer())
    nested = b"[" * 100_000 + b"]" * 100_000
    peer._http = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200, content=nested)))
    await peer.check()
    assert peer.unavailable(("smol",)) == "its /v1/models is not an OpenAI model list"


@pytest.mark.parametrize("url, api_key, cleartext", [
    ("http://desk.lan:8642", "k", True),
    ("http://192.168.1.20:8642/v1", "k", True),
    ("https://desk.lan:8642", "k", False),
    ("http://desk.lan:8642", "", False),
    ("http://127.0.0.1:9000", "k", False),
    ("http://[::1]:9000", "k", False),
])
def test_status_warns_when_the_peers_key_travels_in_cleartext(url, api_key, cleartext):
    entry = PeerEntry(name="desk", url=url, api_key=api_key)
    peer = Peer(entry, peer_base_url(entry.url), httpx.AsyncClient(), BreakerPolicy())
    row = peer.status()
    assert row["key_in_cleartext"] is cleartext
    assert (row["warning"] is not None) is cleartext
    if cleartext:
        assert row["warning"].startswith("its api_key is sent over plain http")


async def test_a_request_id_or_key_that_cant_be_a_header_stays_local_and_blames_no_peer():
    rig, peer = await peer_rig(FakePeerServer())
    rig.memory.free_mib = 100.0
    accented, keyed = make_job("réquest"), make_job("plain", idempotency_key="clé")
    await run_job(rig, accented)
    await run_job(rig, keyed)
    assert (accented.path, keyed.path) == ("cpu", "cpu") and rig.cpu.calls == [accented.id, keyed.id]
    assert peer.failures == 0 and peer.breaker.snapshot()["recent_failures"] == 0


async def test_a_request_the_peer_path_cant_encode_is_not_the_peers_failure():
    server = FakePeerServer()
    peer = make_peer(server)
    await peer.check()
    job = make_job(idempotency_key="clé")
    with pytest.raises(PeerFailure, match="could not be sent") as caught:
        await run_on_peer(peer, job)
    assert (caught.value.counts, caught.value.ran) == (False, False)
    assert server.requests[-1].url.path == "/v1/models" and peer.in_flight == 0
