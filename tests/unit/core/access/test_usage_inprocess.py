"""Usage without keys: counted per app name (X-Client-Name, else the
User-Agent's product), bounded, and saved when the service stops. The real
Service and app in-process, over tests/fakes' workers and upstream."""

from __future__ import annotations

from tests.fakes.service import in_process_service, isolate_user_folders
from tray_app.core.access.usage import MAX_NAMES, OTHER, UsageStore, default_usage_path

HI = [{"role": "user", "content": "hi"}]


async def test_without_keys_usage_is_counted_per_app_name_and_saved_at_shutdown(tmp_path, monkeypatch):
    isolate_user_folders(monkeypatch, tmp_path)
    async with in_process_service(tmp_path) as rig:
        for headers in ({"X-Client-Name": "notes-app"}, {"X-Client-Name": "notes-app"},
                        {"User-Agent": "MyTool/1.0 (Linux)"}):
            answer = await rig.client.post("/v1/chat/completions", headers=headers,
                                           json={"messages": HI, "max_tokens": 4})
            assert answer.status_code == 200
        forced = await rig.client.post("/v1/chat/completions", headers={"X-Client-Name": "notes-app",
                                                                        "X-Force-Path": "cpu"},
                                       json={"messages": HI, "max_tokens": 4})
        assert forced.headers["x-served-by"] == "cpu"
        usage = (await rig.client.get("/status")).json()["usage"]["by_name"]
        notes = usage["notes-app"]["today"]
        assert notes["requests"] == 3 and notes["paths"]["gpu"]["requests"] == 2
        assert notes["paths"]["cpu"]["requests"] == 1 and notes["degraded"] == 0  # the app chose the CPU
        assert notes["tokens_out"] == 3 * 3  # the fake upstream's answer is three tokens
        assert usage["MyTool/1.0"]["today"]["requests"] == 1
        metrics = (await rig.client.get("/metrics")).text
        assert 'tray_app_usage_requests_total{key="notes-app",path="gpu"} 2.0' in metrics
    # Stopped within the 10 s debounce: the shutdown saved it.
    saved = UsageStore(default_usage_path()).snapshot()["by_name"]
    assert saved["notes-app"]["today"]["requests"] == 3


async def test_made_up_app_names_end_in_one_other_bucket(tmp_path, monkeypatch):
    extra = 6
    isolate_user_folders(monkeypatch, tmp_path)
    async with in_process_service(tmp_path) as rig:
        for n in range(MAX_NAMES + extra):
            answer = await rig.client.post("/v1/chat/completions", headers={"X-Client-Name": f"app-{n}"},
                                           json={"messages": HI, "max_tokens": 1})
            assert answer.status_code == 200
        usage = (await rig.client.get("/status")).json()["usage"]["by_name"]
        metrics = (await rig.client.get("/metrics")).text
    assert len(usage) == MAX_NAMES and usage[OTHER]["today"]["requests"] == extra + 1
    assert metrics.count("tray_app_usage_requests_total{key=") == MAX_NAMES * 3  # names x paths
