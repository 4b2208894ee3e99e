"""On a machine with no GPU path (no device, a CPU-only build, [gpu]
enabled = false) the CPU is the path, not a fallback: its answers say
`X-Route-Reason: cpu_only`, carry no X-Fallback-Model, no degraded note,
and count as degraded in nobody's usage. A real failover on a machine with
a GPU path keeps the fallback headers. The real Service and app in-process
(tests/fakes/)."""

from __future__ import annotations

from tests.fakes.service import in_process_service, isolate_user_folders
from tests.harness import BASE_CONFIG

HI = [{"role": "user", "content": "hi"}]
GPU_OFF = BASE_CONFIG.replace("simulate_mib = 2048", "simulate_mib = 0").replace("[gpu]\n", "[gpu]\nenabled = false\n", 1)


async def test_with_no_gpu_path_the_cpu_answers_as_the_path_not_a_fallback(tmp_path, monkeypatch):
    isolate_user_folders(monkeypatch, tmp_path)
    async with in_process_service(tmp_path, GPU_OFF) as rig:
        assert (await rig.client.get("/status")).json()["gpu"]["path"] == "none"
        answer = await rig.client.post("/v1/chat/completions", headers={"X-Client-Name": "notes-app",
                                                                         "X-Degraded-Note": "on"},
                                       json={"messages": HI, "max_tokens": 4})
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-served-by"] == "cpu" and answer.headers["x-route-reason"] == "cpu_only"
        assert "x-fallback-model" not in answer.headers
        # No "GPU unavailable ..." note before the answer: nothing is degraded.
        assert "reasoning_content" not in answer.json()["choices"][0]["message"]
        usage = (await rig.client.get("/status")).json()["usage"]["by_name"]["notes-app"]["today"]
        assert usage["requests"] == 1 and usage["degraded"] == 0


async def test_a_real_failover_on_a_machine_with_a_gpu_keeps_the_fallback_headers(tmp_path, monkeypatch):
    isolate_user_folders(monkeypatch, tmp_path)
    async with in_process_service(tmp_path) as rig:
        rig.upstream.script("gpu").fail_before_first_byte = True
        answer = await rig.client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 4})
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-served-by"] == "cpu" and answer.headers["x-route-reason"] == "gpu_failed_replayed"
        assert answer.headers["x-fallback-model"] == rig.service.default_model_host.fallback_model_id

