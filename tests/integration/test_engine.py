"""The llama-server engine (issue 12): slots, batching, queues sized by time,
and a canceled request's slot freed, against the real service and real
llama-server workers on SmolLM2."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.harness import RunningService, running

pytestmark = pytest.mark.integration

CONFIG = """
[gpu]
simulate_mib = 4096
n_ctx = 1024
max_concurrency = 4
queue_limit = 8
reserve_mib = 256
first_token_timeout_s = 60
token_timeout_s = 20
[cpu]
n_ctx = 1024
max_concurrency = 2
queue_limit = 4
ram_floor_mib = 256
[worker]
backoff_base_s = 0.2
backoff_cap_s = 2
"""
LONG = {"messages": [{"role": "user", "content": "Tell me a very long story."}], "max_tokens": 900,
        "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with running(tmp_path_factory.mktemp("engine"), CONFIG) as service:
        yield service


@pytest.fixture
def fresh_engine(engine):
    engine.reset()
    return engine


def worker_secret(pid: int) -> str:
    """The per-run key from the worker's own environment, readable by its user
    only: how a test reaches the worker port directly, as the service does."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(item.split(b"=", 1)[1].decode() for item in environ if item.startswith(b"LLAMA_API_KEY="))


def busy_slots(service: RunningService, role: str) -> int:
    worker = service.worker(role)
    slots = httpx.get(f"http://127.0.0.1:{worker['port']}/slots", timeout=5,
                      headers={"Authorization": f"Bearer {worker_secret(worker['pid'])}"}).json()
    return sum(1 for slot in slots if slot["is_processing"])


def wait_busy(service: RunningService, role: str, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while busy_slots(service, role) != count:
        assert time.monotonic() < deadline, f"{role} never had {count} busy slot(s)"
        time.sleep(0.05)


def seconds_until_free(service: RunningService, role: str, timeout: float = 10.0) -> float:
    started = time.monotonic()
    while busy_slots(service, role) > 0:
        assert time.monotonic() - started < timeout, "the slot was never freed"
        time.sleep(0.02)
    return time.monotonic() - started


def test_the_default_engine_is_llama_server_with_the_configured_slots(fresh_engine):
    engine = fresh_engine.status()["engine"]
    assert engine["runtime"] == "llama-server" and engine["fallback_reason"] is None
    assert engine["slots"] == {"gpu": 4, "cpu": 2}
    # Every slot's KV cache is in the estimate: 4 x 1024 cells on the GPU path.
    assert fresh_engine.worker("gpu")["estimated_vram_mib"] > fresh_engine.worker("cpu")["estimated_vram_mib"]


def test_the_worker_port_refuses_a_request_without_the_per_run_key(fresh_engine):
    worker = fresh_engine.worker("gpu")
    response = httpx.post(f"http://127.0.0.1:{worker['port']}/v1/chat/completions", timeout=10,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert response.status_code == 401


def test_four_concurrent_requests_decode_together_on_the_gpu(fresh_engine):
    def ask(index: int) -> httpx.Response:
        # A generous client timeout: on a busy 2-core CI machine four slots
        # can decode slowly; what is checked is where they ran, not how fast.
        return fresh_engine.http.post("/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": f"Count to {index + 3}."}], "max_tokens": 48,
            "ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ask, index) for index in range(4)]
        # All four inside llama-server at once, as its own /slots shows.
        most_busy = 0
        while not all(f.done() for f in futures) and most_busy < 4:
            most_busy = max(most_busy, busy_slots(fresh_engine, "gpu"))
            time.sleep(0.05)
        answers = [f.result() for f in futures]
    assert most_busy == 4
    assert all(a.status_code == 200 for a in answers)
    assert {a.headers["x-served-by"] for a in answers} == {"gpu"}
    assert {a.headers["x-route-reason"] for a in answers} == {"admitted"}


def test_a_burst_past_the_slots_waits_and_every_request_is_answered(fresh_engine):
    def ask(index: int) -> httpx.Response:
        return fresh_engine.http.post("/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": f"Say {index}."}], "max_tokens": 8})

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(ask, range(12)))
    assert [a.status_code for a in answers] == [200] * 12
    # None shed: each waited for a GPU slot or, where the CPU was expected to
    # finish it first (earliest expected finish, issue 32), ran there at once.
    assert {(a.headers["x-served-by"], a.headers["x-route-reason"]) for a in answers} <= {
        ("gpu", "admitted"), ("cpu", "gpu_busy")}


def test_closing_the_stream_frees_the_slot_within_a_second(fresh_engine):
    with fresh_engine.http.stream("POST", "/v1/chat/completions", json=LONG) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        while '"content"' not in next(lines):
            pass
        assert busy_slots(fresh_engine, "gpu") == 1
    # The client hung up: the service closes its upstream stream, llama-server stops the slot.
    assert seconds_until_free(fresh_engine, "gpu") < 1.0


def test_cancel_by_id_frees_the_slot_within_a_second(fresh_engine):
    result: dict = {}

    def run() -> None:
        result["response"] = fresh_engine.http.post(
            "/v1/chat/completions", headers={"X-Request-Id": "long-one", "X-Client-Name": "Open WebUI"},
            json={**LONG, "stream": False})

    thread = threading.Thread(target=run)
    thread.start()
    wait_busy(fresh_engine, "gpu", 1)
    # The tray names the row by its sender.
    assert next(r for r in fresh_engine.status()["requests"] if r["id"] == "long-one")["client"] == "Open WebUI"
    assert fresh_engine.http.delete("/v1/requests/long-one").status_code == 200
    assert seconds_until_free(fresh_engine, "gpu") < 1.0
    thread.join(30)
    assert result["response"].json()["error"]["code"] == "request_canceled"


def test_a_wait_over_the_clients_budget_goes_to_the_cpu_at_once(fresh_engine):
    # Fill every GPU slot with long work, so a new request would wait minutes.
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        holders = [pool.submit(fresh_engine.http.post, "/v1/chat/completions", json={**LONG, "stream": False})
                   for _ in range(4)]
        wait_busy(fresh_engine, "gpu", 4)
        started = time.monotonic()
        # A budget the GPU's wait (about 30 s here) is over and the CPU's measured
        # time for 4 tokens fits, on a busy 2-core machine too (there it
        # measured about 1.6 s once the CPU had served part of a burst).
        quick = fresh_engine.http.post("/v1/chat/completions", headers={"X-Request-Timeout": "4"}, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        waited = time.monotonic() - started
        for request_id in [r["id"] for r in fresh_engine.status()["requests"] if r["path"] == "gpu"]:
            fresh_engine.http.delete(f"/v1/requests/{request_id}")
        for holder in holders:
            holder.result(60)
    assert quick.status_code == 200 and quick.headers["x-served-by"] == "cpu", quick.text
    assert quick.headers["x-route-reason"] == "gpu_busy"
    assert waited < 30
