"""GET /metrics in the Prometheus text format, from a real service."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration


def scrape(service) -> dict[str, list]:
    response = service.http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {family.name: family.samples for family in text_string_to_metric_families(response.text)}


def value(samples, **labels) -> float:
    return next(s.value for s in samples if all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_follow_what_happens(fresh):
    before = scrape(fresh)
    forced_before = sum(s.value for s in before.get("tray_app_requests", [])
                        if s.labels.get("reason") == "forced_cpu" and s.name.endswith("_total"))
    fresh.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    fresh.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
                    headers={"X-Force-Path": "cpu"})
    after = scrape(fresh)
    requests = after["tray_app_requests"]
    assert value(requests, path="cpu", reason="forced_cpu") == forced_before + 1
    assert value(requests, path="gpu", reason="admitted") >= 1
    assert value(after["tray_app_time_to_first_token_seconds"], path="cpu") >= 0
    assert any(s.name.endswith("_count") and s.labels.get("path") == "gpu" and s.value >= 1
               for s in after["tray_app_time_to_first_token_seconds"])
    status = fresh.status()
    assert value(after["tray_app_vram_free_mib"]) == pytest.approx(status["gpu"]["free_mib"], abs=1)
    assert value(after["tray_app_vram_headroom_mib"]) == pytest.approx(
        status["gpu"]["free_mib"] - status["gpu"]["reserve_mib"], abs=1)
    assert value(after["tray_app_breaker_state"], state="closed") == 1
    assert value(after["tray_app_queue_depth"], path="cpu") == 0
    assert value(after["tray_app_ram_available_mib"]) > 0


def test_pressure_shows_as_lost_headroom_and_degraded(fresh):
    fresh.http.post("/admin/gpu", json={"paused": True})
    assert value(scrape(fresh)["tray_app_degraded"]) == 1
    fresh.http.post("/admin/gpu", json={"paused": False, "simulated_pressure_mib": 500})
    metrics = scrape(fresh)
    assert value(metrics["tray_app_degraded"]) == 0
    assert value(metrics["tray_app_vram_free_mib"]) == pytest.approx(fresh.status()["gpu"]["free_mib"], abs=1)
