"""/status against its contract (core/status_contract.py): the real Service,
in-process (tests/fakes/), builds it in several states, and each conforms,
as the service builds it and as JSON carries it. A renamed, dropped or
retyped key is caught."""

from __future__ import annotations

import asyncio
import copy
import sys

import pytest

from tests.fakes.service import InProcess, in_process_service, isolate_user_folders
from tests.fakes.upstream import FakeUpstream
from tests.harness import BASE_CONFIG
from tests.status_sample import sample_status
from tray_app.core.config import bundled_model_path
from tray_app.core.engine.worker import WorkerState
from tray_app.core.memory.telemetry import NvmlGpuReader
from tray_app.core.status_contract import validate_status

HI = [{"role": "user", "content": "hi"}]
NO_SIMULATED_GPU = BASE_CONFIG.replace("simulate_mib = 2048", "simulate_mib = 0")


async def conforms(rig: InProcess) -> dict:
    """The status, built in-process and fetched over HTTP, with no violation in either."""
    assert validate_status(rig.service.status()) == []
    fetched = (await rig.client.get("/status")).json()
    assert validate_status(fetched) == []
    return fetched


async def test_a_loaded_gpu_and_cpu_status_conforms(tmp_path, monkeypatch):
    isolate_user_folders(monkeypatch, tmp_path)
    async with in_process_service(tmp_path) as rig:
        status = await conforms(rig)
    assert status["gpu"]["path"] == "local" and status["gpu"]["residency"]["state"] == "loaded"


async def test_a_service_with_the_gpu_off_says_its_gpu_path_is_none(tmp_path, monkeypatch):
    isolate_user_folders(monkeypatch, tmp_path)
    config = NO_SIMULATED_GPU.replace("[gpu]\n", "[gpu]\nenabled = false\n", 1)
    async with in_process_service(tmp_path, config) as rig:
        status = await conforms(rig)
    gpu = status["gpu"]
    assert gpu["path"] == "none" and gpu["residency"] is None and "gpu" not in status["speeds"]
    assert [w["role"] for w in status["workers"]] == ["cpu"]


async def test_no_usable_gpu_says_serving_cpu_only_once(tmp_path, monkeypatch):
    isolate_user_folders(monkeypatch, tmp_path)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` fails: no NVIDIA library
    async with in_process_service(tmp_path, NO_SIMULATED_GPU, gpu_reader=NvmlGpuReader()) as rig:
        status = await conforms(rig)
    reason = status["gpu"]["path_out_reason"]
    assert status["gpu"]["path"] == "none" and reason.startswith("no usable GPU: pynvml is not installed")
    # The device reading says what it saw; the service says once what it makes of it.
    assert reason.count("CPU-only") == 1 and "CPU-only" not in (status["gpu"]["reason"] or "")


async def test_paused_and_given_back_gpu_status_conforms(tmp_path, monkeypatch):
    isolate_user_folders(monkeypatch, tmp_path)
    async with in_process_service(tmp_path) as rig:
        assert (await rig.client.post("/admin/gpu", json={"paused": True})).status_code == 200
        assert (await conforms(rig))["service"]["gpu_paused"] is True
        assert (await rig.client.post("/admin/gpu", json={"given_back": True})).status_code == 200
        await rig.workers["gpu"].wait_for_state(WorkerState.STOPPED, timeout=30)
        status = await conforms(rig)
    assert status["gpu"]["residency"]["state"] == "given_back_by_user"


async def test_status_with_queued_and_running_requests_conforms(tmp_path, monkeypatch):
    isolate_user_folders(monkeypatch, tmp_path)
    async with in_process_service(tmp_path) as rig:
        held = asyncio.Event()
        rig.upstream.script("gpu").hold = held
        rig.upstream.script("cpu").hold = held
        lanes = [backend.lane for backend in (rig.service.dispatcher.gpu, rig.service.dispatcher.cpu)]
        body = {"model": rig.service.model_id, "messages": HI, "max_tokens": 8}
        pending = []
        # Requests until one waits in a queue (every slot of a path is taken).
        while not any(lane.waiting_ids for lane in lanes):
            pending.append(asyncio.ensure_future(rig.client.post("/v1/chat/completions", json=body)))
            while sum(len(lane.running_ids) + len(lane.waiting_ids) for lane in lanes) < len(pending):
                await asyncio.sleep(0.01)
        status = await conforms(rig)
        held.set()
        assert all(answer.status_code == 200 for answer in await asyncio.gather(*pending))
    assert any(request["queue_position"] is not None for request in status["requests"])
    assert status["recent_decisions"] and len(status["requests"]) == len(pending)


async def test_status_with_a_peer_serving_conforms(tmp_path, monkeypatch):
    isolate_user_folders(monkeypatch, tmp_path)
    upstream = FakeUpstream()
    upstream.script("desk").models = [bundled_model_path().stem]
    config = BASE_CONFIG + '\n[[peers]]\nname = "desk"\nurl = "http://desk.worker:8642"\n'
    async with in_process_service(tmp_path, config, upstream=upstream) as rig:
        while rig.service.peers.get("desk").health.reachable is not True:
            await asyncio.sleep(0.01)
        assert (await rig.client.post("/admin/gpu", json={"paused": True})).status_code == 200
        answer = await rig.client.post("/v1/chat/completions", json={"model": rig.service.model_id,
                                                                      "messages": HI, "max_tokens": 8})
        assert answer.headers["x-served-by"] == "peer"
        status = await conforms(rig)
    (peer,) = status["peers"]
    assert peer["name"] == "desk" and peer["served"] == 1


# ----- what the check catches -------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_status(tmp_path_factory) -> dict:
    """One real status, to break in each test below."""
    tmp = tmp_path_factory.mktemp("status")
    with pytest.MonkeyPatch.context() as monkeypatch:
        isolate_user_folders(monkeypatch, tmp)

        async def build() -> dict:
            async with in_process_service(tmp) as rig:
                return (await rig.client.get("/status")).json()

        status = asyncio.run(build())
    assert validate_status(status) == []
    return status


def test_a_renamed_key_is_caught_where_it_is(real_status):
    status = copy.deepcopy(real_status)
    status["gpu"]["residency"]["reloads_done"] = status["gpu"]["residency"].pop("reloads")
    assert validate_status(status) == ["status.gpu.residency.reloads: missing",
                                       "status.gpu.residency.reloads_done: not in the contract (ResidencyStatus)"]


def test_a_dropped_key_and_a_wrong_type_are_caught(real_status):
    status = copy.deepcopy(real_status)
    del status["models"][0]["location"]
    status["workers"][0]["restarts"] = "0"
    status["service"]["healthy"] = 1
    assert validate_status(status) == ["status.service.healthy: int 1, expected bool",
                                       "status.workers[0].restarts: str '0', expected int",
                                       "status.models[0].location: missing"]


def test_optional_keys_may_be_absent_and_open_events_may_carry_their_own(real_status):
    status = copy.deepcopy(real_status)
    status["gpu"].pop("pressure_mib")
    status["events"].append({"t": 1.0, "kind": "anything", "its_own": [1, 2]})
    assert validate_status(status) == []
    status["gpu"]["path"] = "remote"
    assert validate_status(status) == ["status.gpu.path: 'remote' is not one of ['local', 'none']"]


def test_the_sample_that_reader_tests_start_from_conforms():
    assert validate_status(sample_status()) == []


async def test_recent_decisions_name_the_client_and_model_of_every_model_newest_last(tmp_path, monkeypatch):
    isolate_user_folders(monkeypatch, tmp_path)
    model_file = bundled_model_path()
    second = tmp_path / "second.gguf"
    second.symlink_to(model_file)
    config = BASE_CONFIG + f'\n[[models]]\nname = "second"\npath = "{second}"\nidle_unload_s = 0\n'
    async with in_process_service(tmp_path, config) as rig:
        default = rig.service.model_id
        for model, app_name in ((default, "notes-app"), ("second", "editor"), (default, None)):
            headers = {"X-Client-Name": app_name} if app_name else {"User-Agent": "curl/8.5"}
            body = {"model": model, "messages": HI, "max_tokens": 4}
            answer = await rig.client.post("/v1/chat/completions", json=body, headers=headers)
            assert answer.status_code == 200, answer.text
        status = await conforms(rig)
    seen = [(d["model"], d["client"]) for d in status["recent_decisions"]]
    # Chronological like the event log (the web page and the drill read it so),
    # the second model's decision among the default's.
    assert seen == [(default, "notes-app"), ("second", "editor"), (default, "curl/8.5")]
    times = [d["t"] for d in status["recent_decisions"]]
    assert times == sorted(times)


async def test_a_machine_with_no_gpu_path_is_not_in_degraded_mode_even_while_serving(tmp_path, monkeypatch):
    """The CPU is how such a machine serves, not a fallback: /status, /health
    and the answer's path say so without degraded mode (the tray and the web
    page already show it calmly; /status used to say degraded forever)."""
    isolate_user_folders(monkeypatch, tmp_path)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    async with in_process_service(tmp_path, NO_SIMULATED_GPU, gpu_reader=NvmlGpuReader()) as rig:
        status = await conforms(rig)
        assert status["gpu"]["path"] == "none" and status["degraded"]["active"] is False
        healthy, reason = rig.service.health()
        assert healthy and "degraded" not in reason and "CPU-only" in reason
        answer = await rig.client.post("/v1/chat/completions", json={
            "model": rig.service.model_id, "messages": HI, "max_tokens": 4})
        assert answer.status_code == 200 and answer.headers["x-served-by"] == "cpu"
        rig.service.observer.advance()
        assert rig.service.status()["degraded"]["active"] is False
