"""GET /v1/models' capabilities.max_choices is what a request can get: the
larger path's slots, within bounds.MAX_N; a machine with no GPU path has only
the CPU's. The real Service and app in-process (tests/fakes/)."""

from __future__ import annotations

from tests.fakes.service import in_process_service, isolate_user_folders
from tests.harness import BASE_CONFIG

HI = [{"role": "user", "content": "hi"}]
GPU_OFF = BASE_CONFIG.replace("simulate_mib = 2048", "simulate_mib = 0").replace("[gpu]\n", "[gpu]\nenabled = false\n", 1)


async def listed_max_choices(rig) -> int:
    models = (await rig.client.get("/v1/models")).json()["data"]
    return next(m for m in models if m["id"] == rig.service.model_id)["capabilities"]["max_choices"]


async def test_with_no_gpu_path_max_choices_is_the_cpus_slots_and_one_more_is_refused(tmp_path, monkeypatch):
    isolate_user_folders(monkeypatch, tmp_path)
    config = GPU_OFF.replace("max_concurrency = 1", "max_concurrency = 2")
    async with in_process_service(tmp_path, config) as rig:
        most = await listed_max_choices(rig)
        assert most == 2
        answered = await rig.client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 4, "n": most})
        assert answered.status_code == 200 and len(answered.json()["choices"]) == most
        refused = await rig.client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 4, "n": most + 1})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "too_many_choices"


async def test_with_a_gpu_path_max_choices_is_the_larger_paths_slots_within_the_bound(tmp_path, monkeypatch):
    isolate_user_folders(monkeypatch, tmp_path)
    for gpu_slots, most in ((3, 3), (6, 4)):
        config = BASE_CONFIG.replace("[gpu]\n", f"[gpu]\nmax_concurrency = {gpu_slots}\n", 1)
        async with in_process_service(tmp_path, config) as rig:
            assert await listed_max_choices(rig) == most, gpu_slots
