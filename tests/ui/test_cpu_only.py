"""A machine with no usable GPU is calm, not alarmed (issue 28): no device, or
a CPU-only llama.cpp build, is the CPU serving as it should, with the reason
and the one step that would enable the GPU. Degraded mode (the orange icon,
the banner, the notice) is for a GPU path that exists and can't serve. The
icon, the menu, the panel, the notices and `tray-app status` agree, and
/status and the headers still say the CPU serves, and why."""

from __future__ import annotations

import copy

import httpx
import pytest

from tests.status_sample import conforming
from tray_app.cli.status_text import render_status
from tray_app.core.config import Config
from tray_app.ui import viewmodel as vm
from tray_app.ui.app import TrayController
from tray_app.ui.client import ServiceClient
from tray_app.ui.icons import state_icon

from .test_chat_and_tray_fed import dead_url, fed_controller, feed  # noqa: F401 - fixtures, shared
from .test_viewmodel import READY

NVML_MISSING = ("NVIDIA management library (libnvidia-ml / nvml.dll) not found (NVML: NVML Shared Library "
                "Not Found); running CPU-only")

# /status of `tray-app serve` on a machine without an NVIDIA GPU and with the
# CPU-only build, as this repository's own test machine answers it (trimmed,
# and completed from the sample /status).
NO_GPU = conforming({
    "service": {"model": "SmolLM2-135M-Instruct.Q4_1", "healthy": True, "gpu_paused": False,
                "health_reason": f"the CPU path can serve (degraded: no usable GPU: {NVML_MISSING}; serving CPU-only)"},
    "workers": [{"role": "cpu", "state": "ready", "pid": 28155, "n_ctx": 2048, "rss_mib": 219.1, "restarts": 0,
                 "last_exit": None, "estimated_vram_mib": 0.0, "estimated_ram_mib": 343.0}],
    "engine": {"runtime": "llama-server", "version": "llama-server (built with llama-cpp-python 0.3.36)",
               "configured": "llama-server", "fallback_reason": None, "slots": {"gpu": 4, "cpu": 2}},
    "gpu": {"available": False, "simulated": False, "total_mib": None, "free_mib": None, "used_mib": None,
            "reason": NVML_MISSING, "devices": [], "path": "none", "reserve_mib": 1024,
            "path_out_reason": f"no usable GPU: {NVML_MISSING}; serving CPU-only",
            "offload_supported": False,
            "offload_message": "llama-cpp-python was built without GPU offload (CPU-only); reinstall with "
                               'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir llama-cpp-python',
            "residency": None, "rpc_servers": [], "rpc_split": None},
    "ram": {"total_mib": 24105.6, "available_mib": 22671.0, "rss_mib_by_pid": {"28155": 219.1}, "floor_mib": 1024},
    "breaker": {"state": "closed"},
    "queues": {"gpu": {"running": 0, "concurrency": 0, "depth": 0, "limit": 0, "oldest_age_s": 0.0},
               "cpu": {"running": 0, "concurrency": 2, "depth": 0, "limit": 16, "oldest_age_s": 0.0}},
    "degraded": {"active": True, "reason": f"no usable GPU: {NVML_MISSING}; serving CPU-only", "since": 1.0,
                 "model": "SmolLM2-135M-Instruct.Q4_1", "fallback_model": "SmolLM2-135M-Instruct.Q4_1",
                 "fallback_equivalent": True, "estimated_latency_s": 25.92, "cpu_context_cap": 2048,
                 "cpu_queue_depth": 0, "peers": [], "peer_latency_s": {}},
    "speeds": {"cpu": {"tokens_per_s": 10.0, "samples": 0}},
    "requests": [],
})
REBUILD = "bash packaging/install.sh --backend vulkan"


def no_gpu(**gpu) -> dict:
    status = copy.deepcopy(NO_GPU)
    status["gpu"].update(gpu)
    return conforming(status)


def gpu_worker_failed() -> dict:
    """A GPU path that exists and can't serve: degraded mode, as before."""
    status = copy.deepcopy(READY)
    status["workers"][0].update(state="failed", last_exit={"kind": "crash", "description": "SIGSEGV"})
    status["gpu"]["path_out_reason"] = "the GPU worker is failed"
    status["degraded"].update(active=True, reason="the GPU worker is failed", since=1.0)
    return status


def test_the_view_model_calls_no_gpu_path_serving_on_the_cpu_with_the_reason_and_the_step() -> None:
    assert vm.icon_kind(NO_GPU) == vm.CPU and vm.state_title(NO_GPU) == "Serving on the CPU"
    reason, step = vm.state_detail(NO_GPU).split("\n")
    # The reason once, without the service's own "running/serving CPU-only" said twice.
    assert reason == f"No usable GPU: {NVML_MISSING.removesuffix('; running CPU-only')}."
    assert "CPU-only" not in reason and step == f"If this machine has a GPU, rebuild for it with {REBUILD}"
    assert vm.degraded_banner(NO_GPU) is None and vm.degraded_banner(NO_GPU, own_request_id="x", only_own=True) is None
    assert vm.vram_bars(NO_GPU) == []  # no bar with a driver's error text cut off inside it
    tooltip = vm.tooltip_text(NO_GPU).split("\n")
    assert tooltip[:3] == ["tray-app: serving on the CPU", reason, step]
    assert not any("degraded" in line.lower() for line in tooltip)
    notifier = vm.DegradedNotifier(settle_s=5, quiet_s=60)
    assert all(notifier.update(NO_GPU, now=t) is None for t in range(0, 600, 5))
    # A peer that takes this machine's requests is named, calmly.
    lent = copy.deepcopy(NO_GPU)
    lent["degraded"]["peers"] = ["desk"]
    lent["requests"] = [{"id": "a", "state": "running", "path": "peer", "peer": "desk", "reason": "peer"}]
    lent = conforming(lent)
    assert vm.icon_kind(lent) == vm.CPU and vm.state_title(lent) == "No GPU here: peer desk is serving"
    # Still degraded where a GPU path exists and fails.
    assert vm.icon_kind(gpu_worker_failed()) == vm.DEGRADED and vm.degraded_banner(gpu_worker_failed()) is not None


def test_the_step_that_would_enable_the_gpu_fits_why_there_is_none() -> None:
    nvidia = no_gpu(available=True, path_out_reason="GPU found, but llama-cpp-python was built without GPU offload "
                    "(CPU-only); reinstall with CMAKE_ARGS=...; serving CPU-only",
                    devices=[{"index": 0, "name": "NVIDIA GeForce RTX 4070", "total_mib": 12282.0,
                              "used_mib": 500.0, "free_mib": 11782.0}], total_mib=12282.0, free_mib=11782.0)
    assert vm.cpu_only(nvidia) == vm.CpuOnly(
        "GPU found, but llama-cpp-python was built without GPU offload (CPU-only)",
        "To use it: rebuild for CUDA with bash packaging/install.sh --backend cuda")
    # The GPU is seen, so its memory is shown: what it would have free.
    (bar,) = vm.vram_bars(nvidia)
    assert bar.caption == "11.5 GiB free of 12.0 GiB"
    radeon = copy.deepcopy(nvidia)
    radeon["gpu"]["devices"][0]["name"] = "AMD Radeon RX 7800 XT"
    assert vm.cpu_only(radeon).step == f"To use it: rebuild for it with {REBUILD}"
    off = no_gpu(path_out_reason="the GPU path is disabled in the config ([gpu] enabled = false)")
    assert vm.cpu_only(off).step == "To use the GPU: set [gpu] enabled = true in the config, then restart tray-app"
    driver = no_gpu(offload_supported=True)
    assert vm.cpu_only(driver).step == "To use a GPU: install its driver, then restart tray-app"


def test_the_icon_menu_panel_and_notices_agree(qtbot, fed_controller) -> None:  # noqa: F811
    # Every notice that would come is announced at once, and none does.
    fed_controller.notifications.degraded_notifier = vm.DegradedNotifier(settle_s=0, quiet_s=0)
    for _ in range(3):
        feed(fed_controller, NO_GPU)
    assert fed_controller.kind == vm.CPU and fed_controller.notifications.notices == []
    assert fed_controller.tray.icon().cacheKey() == state_icon(vm.CPU).cacheKey() != state_icon(vm.DEGRADED).cacheKey()
    assert fed_controller.tray_menu.state_action.text() == "Serving on the CPU"
    assert fed_controller.tray.toolTip().startswith("tray-app: serving on the CPU\nNo usable GPU: ")
    assert fed_controller.tray_menu.headroom_action.text().startswith("VRAM: no GPU · RAM ")
    assert not fed_controller.tray_menu.force_cpu_action.isEnabled()  # no GPU path to pause
    panel = fed_controller.windows.panel()
    fed_controller.windows.show_panel()
    assert panel.header.title.text() == "Serving on the CPU" and REBUILD in panel.header.detail.text()
    assert not panel.banner.isVisible() and panel.vram_blocks == [] and not panel.vram_chart.isVisible()
    # A GPU path that breaks is still announced.
    feed(fed_controller, gpu_worker_failed())
    notices = fed_controller.notifications.notices
    assert fed_controller.kind == vm.DEGRADED and [n[0] for n in notices] == ["degraded_start"]
    assert fed_controller.tray_menu.force_cpu_action.isEnabled()


def test_tray_app_status_says_the_same() -> None:
    text = render_status(conforming(NO_GPU))
    assert "healthy: True (serving on the CPU)" in text
    assert f"GPU:       none: No usable GPU: {NVML_MISSING.removesuffix('; running CPU-only')}" in text
    assert f"           If this machine has a GPU, rebuild for it with {REBUILD}" in text
    assert "DEGRADED" not in text and "degraded" not in text and "GPU path:  out" not in text
    failed = render_status(conforming(gpu_worker_failed()))
    assert "DEGRADED:  CPU serving SmolLM2" in failed and "GPU path:  out: the GPU worker is failed" in failed


@pytest.mark.integration
def test_a_real_service_without_a_gpu_is_calm_and_its_headers_stay_truthful(qtbot, tmp_path) -> None:
    from tests.harness import BASE_CONFIG, running
    from tray_app.core.memory.telemetry import detect_gpu_offload_support

    if detect_gpu_offload_support().supported:
        pytest.skip("this llama.cpp build offloads to a GPU: the machine may have a GPU path")
    # The suite's config without its simulated GPU: the machine as a new user's is.
    config = BASE_CONFIG.replace("simulate_mib = 2048\n", "")
    with running(tmp_path, config, roles=("cpu",)) as service:
        status = service.status()
        if any(w["role"] == "gpu" for w in status["workers"]):
            pytest.skip("this machine has a GPU path")
        # /status says the CPU serves, and why (once: "CPU-only" is not said twice); so does each answer.
        assert status["gpu"]["path"] == "none" and status["gpu"]["path_out_reason"].count("CPU-only") == 1
        # The CPU is how this machine serves, not a fallback: no degraded mode,
        # before or after an answer (path_out_reason above says why).
        assert status["degraded"]["active"] is False
        answer = service.http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4})
        assert answer.status_code == 200 and answer.headers["x-served-by"] == "cpu"
        assert service.status()["degraded"]["active"] is False
        client = ServiceClient(service.url)  # polled by the test, fed to the tray as the client would
        controller = TrayController(client, Config(), tray_available=False)
        controller.exit_app = lambda: None
        controller.notifications.degraded_notifier = vm.DegradedNotifier(settle_s=0, quiet_s=0)
        for _ in range(3):
            client.last_status = httpx.get(f"{service.url}/status", timeout=10).json()
            client.status_changed.emit(client.last_status)
        assert controller.kind == vm.CPU and controller.notifications.notices == []
        assert controller.tray_menu.state_action.text() == "Serving on the CPU"
        assert "GPU:       none: " in render_status(client.last_status)
