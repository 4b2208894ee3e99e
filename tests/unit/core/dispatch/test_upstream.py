"""The one upstream stream loop (dispatch/upstream.py) as a local worker's
Backend and a Peer run it: the first-token and between-tokens deadlines
are kept on the path's injected clock, so a FakeClock decides when an
upstream counts as hung, whatever the wall clock does. Real Backend and
Peer, a FakeWorker, and FakeUpstream's SSE behind httpx.MockTransport."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.fakes.clock import FakeClock
from tests.fakes.upstream import FakeUpstream
from tests.fakes.worker import FakeWorker
from tests.unit.core.dispatch.test_dispatcher import Sink, make_job
from tray_app.core.config import PeerEntry
from tray_app.core.dispatch import upstream as upstream_module
from tray_app.core.dispatch.backend import Backend, Deadlines
from tray_app.core.dispatch.breaker import BreakerPolicy
from tray_app.core.dispatch.jobs import Attempt, Job, PathSpeed, WorkerFailure
from tray_app.core.dispatch.lanes import Lane
from tray_app.core.dispatch.peer import Peer, PeerFailure
from tray_app.core.dispatch.upstream import HttpxHop

FIRST_TOKEN_S = 30.0
BETWEEN_TOKENS_S = 10.0
# Only a guard that fails a test instead of hanging it: no assert depends on it.
HANG_S = 10.0


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    # The wait loop looks at the clock this often; the FakeClock moves in between.
    monkeypatch.setattr(upstream_module, "LIVENESS_INTERVAL_S", 0.01)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def fake() -> FakeUpstream:
    return FakeUpstream()


class Path:
    """A worker's Backend or a Peer, run the same way: `name` is the
    FakeUpstream script that answers for it."""

    def __init__(self, kind: str, fake: FakeUpstream, clock: FakeClock, first_token_s: float = FIRST_TOKEN_S,
                 between_tokens_s: float = BETWEEN_TOKENS_S) -> None:
        http = httpx.AsyncClient(transport=fake.transport())
        self.kind = kind
        if kind == "worker":
            self.name = "gpu"
            deadlines = Deadlines(first_token_s=lambda job: first_token_s, between_tokens_s=between_tokens_s,
                                  ready_s=5.0)
            self.backend = Backend("gpu", FakeWorker("gpu"), Lane("gpu", 1, 2, clock), PathSpeed(10.0, 100.0), HttpxHop(http),
                                   deadlines, fingerprint="fp_test", clock=clock)
            self.failure: type[Exception] = WorkerFailure
        else:
            self.name = "desk"
            entry = PeerEntry(name="desk", url="http://desk.worker:8642", models=("smol",),
                              first_token_timeout_s=first_token_s, token_timeout_s=between_tokens_s)
            self.peer = Peer(entry, "http://desk.worker:8642", http,
                             BreakerPolicy(failure_threshold=3, cooldown_s=5.0), clock)
            self.failure = PeerFailure
        self.job: Job = make_job(max_tokens=8)
        self.sink = Sink(self.job)

    async def run(self) -> Attempt:
        if self.kind == "worker":
            running = self.backend.run(self.job, self.sink)
        else:
            running = self.peer.run(self.job, self.sink, ("smol",), "m", "fp")
        return await asyncio.wait_for(running, HANG_S)


PATHS = ["worker", "peer"]


async def once_asked(fake: FakeUpstream, name: str) -> None:
    while not fake.answered_by(name):
        await asyncio.sleep(0)


@pytest.mark.parametrize("kind", PATHS)
async def test_silence_past_the_first_token_deadline_on_the_paths_clock_is_a_hang(fake, clock, kind):
    path = Path(kind, fake, clock)
    fake.script(path.name).hold = asyncio.Event()  # never set: the upstream never answers

    async def move_the_clock() -> None:
        await once_asked(fake, path.name)
        clock.advance(FIRST_TOKEN_S + 1)

    mover = asyncio.create_task(move_the_clock())
    with pytest.raises(path.failure, match=f"no output for {FIRST_TOKEN_S:g} s"):
        await path.run()
    await mover
    assert path.job.attempts[-1].outcome == "failed: hang"


@pytest.mark.parametrize("kind", PATHS)
async def test_silence_past_the_between_tokens_deadline_on_the_paths_clock_is_a_hang(fake, clock, kind):
    path = Path(kind, fake, clock)
    script = fake.script(path.name)
    script.tokens = ["one", " two", " three"]
    script.stall_after_tokens = 2
    script.on_stall = lambda: clock.advance(BETWEEN_TOKENS_S + 1)
    with pytest.raises(path.failure, match=f"no output for {BETWEEN_TOKENS_S:g} s"):
        await path.run()
    attempt = path.job.attempts[-1]
    assert attempt.tokens == 2
    assert attempt.first_token_at == clock.now - BETWEEN_TOKENS_S - 1  # the tokens came before the clock moved


@pytest.mark.parametrize("kind", PATHS)
async def test_while_the_paths_clock_stands_still_a_slow_upstream_is_no_hang(fake, clock, kind):
    # Deadlines of a hundredth of a second on a clock that does not move:
    # the real time that passes while the upstream holds its answer doesn't count.
    path = Path(kind, fake, clock, first_token_s=0.01, between_tokens_s=0.01)
    release = fake.script(path.name).hold = asyncio.Event()
    running = asyncio.create_task(path.run())
    await once_asked(fake, path.name)
    await asyncio.sleep(0.1)  # ten times the deadline, in real time
    release.set()
    attempt = await running
    assert attempt.outcome == "completed" and attempt.tokens == 3
    assert attempt.started_at == attempt.first_token_at == attempt.ended_at == clock.now
