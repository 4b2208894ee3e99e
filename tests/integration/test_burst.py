"""A burst of 64 short requests is answered in full, none shed (issue 32,
part 3): the real service on the tiny model, with the default queue limits,
which are only a memory guard now; earliest expected finish spreads the
burst over the GPU's and the CPU's slots."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.harness import running

pytestmark = pytest.mark.integration

BURST = 64
# The shipped slots (GPU 4, CPU 2) and no queue_limit: the defaults decide.
CONFIG = """
[gpu]
simulate_mib = 4096
n_ctx = 512
reserve_mib = 256
max_concurrency = 4
yield_to_other_apps = false
idle_unload_s = 0
[cpu]
n_ctx = 512
max_concurrency = 2
ram_floor_mib = 256
"""
SHORT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}


async def send_burst(url: str) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=BURST)
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as client:
        return await asyncio.gather(*(
            client.post("/v1/chat/completions", json=SHORT, headers={"X-Request-Id": f"burst-{index}"})
            for index in range(BURST)))


def test_a_burst_of_64_short_requests_is_answered_in_full_each_once(tmp_path):
    with running(tmp_path, CONFIG) as service:
        before = service.status()["accounting"]
        answers = asyncio.run(send_burst(service.url))
        refused = [(answer.status_code, answer.text[:200]) for answer in answers if answer.status_code != 200]
        assert refused == [], f"{len(refused)} of {BURST} not answered: {refused[:3]}"
        assert all(answer.json()["choices"][0]["message"]["content"] is not None for answer in answers)
        after = service.status()["accounting"]
        assert after["completed_executions"] - before["completed_executions"] == BURST
        assert after["duplicate_executions"] == before["duplicate_executions"] == 0
