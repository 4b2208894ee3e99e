"""The GPU path on a real GPU backend: llama.cpp's Vulkan backend on Mesa's
software Vulkan device (lavapipe), the one place in the suite where a GPU
backend's own code runs. The GPU worker really offloads its layers through a
GPU API, and the service reads the device as llama.cpp reports it (no
simulated device). lavapipe does not enforce the 2048 MiB it reports, so the
out-of-memory test makes ggml-vulkan refuse with its own buffer-size limit.

Where the Vulkan build has a shared libllama, the router is started with it
too, so its own llama.cpp (tokenizer, grammar check) could open the device:
the test that it does not fails if the router stops hiding the GPUs.

lavapipe is slow on 2 shared cores (a load in 2-8 s, and 0.6-1.5 tokens/s
here while others built and tested): few requests, a one-token prompt, a few
tokens each.

Skipped, with the reason, when `packaging/install.sh --test` built no Vulkan
llama-server (it records the binary in .venv/.vulkan-llama-server, or why not
in .venv/.vulkan-llama-server.skip); TRAY_APP_VULKAN_LLAMA_SERVER names another.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.harness import RunningService, sharing_config, wait_gone
from tray_app.core.engine.runtime import library_dirs

VULKAN_SERVER_RECORD = Path(sys.prefix) / ".vulkan-llama-server"
VULKAN_SKIP_RECORD = Path(sys.prefix) / ".vulkan-llama-server.skip"
VULKAN_SERVER_ENV = "TRAY_APP_VULKAN_LLAMA_SERVER"
# Mesa's software Vulkan driver: loaded into a process that opened a Vulkan device.
LAVAPIPE_DRIVER = "libvulkan_lvp.so"
# llama.cpp hides CPU-type Vulkan devices unless they are named.
USER_GPU_ENV = {"GGML_VK_VISIBLE_DEVICES": "0"}
# lavapipe compiles its shaders on the same 2 cores as everything else: a load
# took 2.3 s on a quiet machine and 56 s at a load average of 11.
LOAD_TIMEOUT_S = 240


def find_vulkan_llama_server() -> tuple[Path | None, str]:
    named = os.environ.get(VULKAN_SERVER_ENV) or (
        VULKAN_SERVER_RECORD.read_text().strip() if VULKAN_SERVER_RECORD.is_file() else "")
    if named:
        binary = Path(named)
        if binary.is_file() and os.access(binary, os.X_OK):
            return binary, ""
        return None, f"the recorded Vulkan llama-server {binary} is not an executable file"
    if VULKAN_SKIP_RECORD.is_file():
        return None, f"no Vulkan llama-server: {VULKAN_SKIP_RECORD.read_text().strip()}"
    return None, (f"no Vulkan llama-server: packaging/install.sh --test records one in {VULKAN_SERVER_RECORD} "
                  f"(or set {VULKAN_SERVER_ENV})")


VULKAN_SERVER, WHY_NOT = find_vulkan_llama_server()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(VULKAN_SERVER is None, reason=WHY_NOT)]


@pytest.fixture(scope="module")
def vulkan_device() -> str:
    """llama.cpp's line for the Vulkan device, or a skip that says what was there instead."""
    listed = subprocess.run([str(VULKAN_SERVER), "--list-devices"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, **USER_GPU_ENV, "LD_LIBRARY_PATH": _library_path()})
    devices = [line.strip() for line in listed.stdout.splitlines() if line.strip().startswith("Vulkan")]
    if not devices:
        pytest.skip(f"the Vulkan llama-server sees no Vulkan device (install mesa-vulkan-drivers): {listed.stdout} "
                    f"{listed.stderr[-500:]}")
    return devices[0]


def _library_path() -> str:
    return os.pathsep.join(str(d) for d in library_dirs(VULKAN_SERVER, bundled=False))


def _vulkan_libllama_dir() -> str | None:
    """Where the Vulkan build's libllama is, for the router's own llama.cpp
    (LLAMA_CPP_LIB_PATH); None for a static build, which has none."""
    return next((str(d) for d in library_dirs(VULKAN_SERVER, bundled=False) if (d / "libllama.so").exists()), None)


def vulkan_service(tmp: Path, extra_env: dict[str, str] | None = None, **gpu) -> RunningService:
    # No simulated device: the service reads the device as llama.cpp reports it.
    # A lavapipe token takes up to a second, more on a busy machine.
    config = (sharing_config(tmp, n_gpu_layers=99, yield_to_other_apps=False, **gpu)
              .replace("simulate_mib = 2048\n", "")
              .replace("first_token_timeout_s = 20\n", "first_token_timeout_s = 120\n")
              .replace("token_timeout_s = 10\n", "token_timeout_s = 60\n"))
    config += f'[engine]\nllama_server = "{VULKAN_SERVER}"\n'
    libllama = _vulkan_libllama_dir()
    return RunningService(tmp, config, env={**USER_GPU_ENV, **({"LLAMA_CPP_LIB_PATH": libllama} if libllama else {}),
                                            **(extra_env or {})})


@pytest.fixture(scope="module")
def vulkan(tmp_path_factory, vulkan_device):
    service = vulkan_service(tmp_path_factory.mktemp("vulkan"))
    try:
        service.wait_ready(timeout=LOAD_TIMEOUT_S)
        yield service
    finally:
        service.stop()


def wait_listening(service: RunningService, timeout: float = 60.0) -> None:
    """Until the router answers, whatever its workers' state (wait_ready wants the breaker closed)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            service.status()
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline or service.process.poll() is not None:
                raise
            time.sleep(0.1)


def maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def complete(service, max_tokens=2, headers=None):
    """A one-token prompt: lavapipe evaluates a prompt at about the speed it decodes."""
    return service.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": max_tokens, "temperature": 0},
                             headers=headers or {})


def gpu_worker(status: dict) -> dict:
    return next(w for w in status["workers"] if w["role"] == "gpu")


def assert_on_vulkan(worker: dict) -> None:
    """The worker opened the Vulkan device, and /status says so in llama.cpp's name for it."""
    assert LAVAPIPE_DRIVER in maps(worker["pid"])
    assert [d["name"] for d in worker["devices"]] == ["Vulkan0"]


def test_the_gpu_worker_loads_on_the_vulkan_device_and_status_names_it(vulkan, vulkan_device):
    status = vulkan.status()
    gpu = gpu_worker(status)
    assert_on_vulkan(gpu)
    # As llama.cpp lists it: "Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)".
    device = gpu["devices"][0]
    assert vulkan_device.startswith(f"{device['name']}: {device['description']} ({device['total_mib']} MiB")
    assert not status["gpu"]["simulated"] and status["gpu"]["offload_supported"]
    assert status["gpu"]["devices"][0]["name"].startswith(f"{device['name']}: {device['description']}")
    answer = complete(vulkan)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-served-by"] == "gpu"


def test_the_router_and_the_cpu_worker_hold_no_vulkan_device(vulkan):
    if _vulkan_libllama_dir() is None:
        pytest.skip(f"{VULKAN_SERVER} is a static build: there is no Vulkan libllama for the router to load")
    status = vulkan.status()
    router = status["service"]["pid"]
    # A grammar starts the grammar checker, the router's other llama.cpp.
    answer = vulkan.http.post("/v1/chat/completions", headers={"X-Force-Path": "cpu"}, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}})
    assert answer.status_code == 200, answer.text
    import psutil

    checker = [p.pid for p in psutil.Process(router).children() if "tray_app.core.grammar.child" in " ".join(p.cmdline())]
    assert checker, "no grammar checker process"
    # The router's llama.cpp can drive Vulkan (it is the Vulkan build's)...
    assert "libggml-vulkan" in maps(router)
    # ...and opened no device: no driver is loaded into it.
    for role, pid in (("router", router), ("grammar checker", checker[0]),
                      ("CPU worker", next(w["pid"] for w in status["workers"] if w["role"] == "cpu"))):
        assert LAVAPIPE_DRIVER not in maps(pid), f"the {role} opened the Vulkan device"


def test_a_sigkill_of_the_vulkan_worker_mid_request_replays_once_on_the_cpu(vulkan):
    gpu_pid = gpu_worker(vulkan.status())["pid"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(complete, vulkan, 8, {"X-Request-Id": "vulkan-replay"})
        vulkan.wait_for(lambda s: any(r["id"] == "vulkan-replay" and r["path"] == "gpu" and r["state"] == "running"
                                      and r["attempts"] and r["attempts"][-1]["tokens"] > 0 for r in s["requests"]),
                        timeout=LOAD_TIMEOUT_S, what="the request decoding on the Vulkan device")
        os.kill(gpu_pid, signal.SIGKILL)
        response = future.result()
    assert response.status_code == 200, response.text
    assert response.headers["x-served-by"] == "cpu"
    # It had made tokens on the device: the CPU went on from them, one answer of 8 tokens in all.
    assert response.headers["x-route-reason"] == "gpu_failed_resumed"
    assert response.json()["usage"]["completion_tokens"] == 8
    status = vulkan.wait_ready(timeout=LOAD_TIMEOUT_S)
    gpu = gpu_worker(status)
    assert gpu["pid"] != gpu_pid and gpu["last_exit"]["signal"] == "SIGKILL"
    assert_on_vulkan(gpu)


def test_the_give_back_stops_the_vulkan_worker_and_taking_it_again_starts_it(vulkan):
    gpu_pid = gpu_worker(vulkan.wait_ready(timeout=LOAD_TIMEOUT_S))["pid"]
    vulkan.http.post("/admin/gpu", json={"given_back": True})
    try:
        vulkan.wait_for(lambda s: gpu_worker(s)["state"] == "stopped", timeout=30, what="the GPU worker stopped")
        assert wait_gone([gpu_pid]) == []
        answer = complete(vulkan)
        assert answer.headers["x-served-by"] == "cpu" and answer.headers["x-route-reason"] == "gpu_yielded"
    finally:
        vulkan.http.post("/admin/gpu", json={"given_back": False})
    status = vulkan.wait_for(lambda s: s["gpu"]["residency"]["state"] == "loaded" and gpu_worker(s)["state"] == "ready",
                             timeout=LOAD_TIMEOUT_S, what="the GPU taken again")
    assert_on_vulkan(gpu_worker(status))


def test_idle_unload_stops_the_vulkan_worker_and_a_request_starts_it(tmp_path, vulkan_device):
    idle = vulkan_service(tmp_path, idle_unload_s=2)
    try:
        wait_listening(idle)
        # Loaded, then unloaded after 2 s without a request.
        idle.wait_for(lambda s: s["gpu"]["residency"]["state"] == "unloaded_idle" and gpu_worker(s)["state"] == "stopped",
                      timeout=LOAD_TIMEOUT_S, what="the GPU unloaded for idleness")
        assert gpu_worker(idle.status())["last_load_s"] is not None
        answer = complete(idle)
        assert answer.headers["x-served-by"] == "cpu" and answer.headers["x-route-reason"] == "gpu_loading"
        status = idle.wait_for(lambda s: s["gpu"]["residency"]["state"] == "loaded" and gpu_worker(s)["state"] == "ready",
                               timeout=LOAD_TIMEOUT_S, what="the GPU loaded again")
        assert_on_vulkan(gpu_worker(status))
    finally:
        idle.stop()


# ggml-vulkan's own limit on one buffer: lavapipe would allocate far more than
# the 2048 MiB it reports, so the device's refusal is forced this way.
ONE_MIB_BUFFERS = {"GGML_VK_FORCE_MAX_BUFFER_SIZE": str(2**20)}


def test_a_load_the_vulkan_device_cannot_hold_is_out_of_memory_and_the_cpu_answers(tmp_path, vulkan_device):
    cramped = vulkan_service(tmp_path, extra_env=ONE_MIB_BUFFERS)
    try:
        wait_listening(cramped)
        status = cramped.wait_for(lambda s: s["breaker"]["state"] == "open" and any(
            w["role"] == "cpu" and w["state"] == "ready" for w in s["workers"]), timeout=LOAD_TIMEOUT_S, what="the breaker open")
        last_exit = gpu_worker(status)["last_exit"]
        assert last_exit["kind"] == "out_of_memory", last_exit
        # ggml-vulkan's own words for the device's refusal.
        assert last_exit["evidence"].startswith("ggml_vulkan:") and "ErrorOutOfDeviceMemory" in last_exit["evidence"]
        answer = complete(cramped)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-served-by"] == "cpu"
    finally:
        cramped.stop()
