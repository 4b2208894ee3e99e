"""llama.cpp's RPC backend on loopback: `tray-app rpc-worker` lends this
machine's CPU device to the GPU worker, which spreads the model over it;
/status shows the device's memory, read with the RPC protocol, and the local
GPU's share admission charges; the RPC server killed mid-request fails the
GPU path over to the CPU worker under the usual rules (replayed once, nothing
lost, nothing duplicated)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.harness import BASE_CONFIG, running
from tray_app.core.engine.runtime import bundled_rpc_server
from tray_app.core.engine.worker import free_loopback_port

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(bundled_rpc_server() is None, reason="llama.cpp was built without GGML_RPC"),
]


def wait_listening(port: int, process: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"rpc-worker exited with {process.returncode}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"rpc-worker not listening on {port}")


@pytest.fixture
def rpc_worker(tmp_path):
    port = free_loopback_port()
    log = open(tmp_path / "rpc-worker.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "tray_app", "rpc-worker", "--port", str(port), "--threads", "1"],
                               stdout=log, stderr=subprocess.STDOUT)
    wait_listening(port, process)
    yield port, process, tmp_path / "rpc-worker.log"
    if process.poll() is None:
        process.kill()
    process.wait()
    log.close()


def test_the_gpu_worker_spreads_the_model_over_an_rpc_worker_and_fails_over_when_it_dies(tmp_path, rpc_worker):
    port, rpc, rpc_log = rpc_worker
    config = BASE_CONFIG.replace("[gpu]\n", f'[gpu]\nrpc_servers = ["127.0.0.1:{port}"]\n', 1)
    with running(tmp_path / "service", config) as service:
        status = service.wait_for(lambda s: s["gpu"]["rpc_servers"][0]["reachable"] is True, timeout=15,
                                  what="the RPC server seen")
        # Its memory, read with the RPC protocol at start, before the GPU worker
        # took the server's one client slot: a CPU rpc-server reports the
        # machine's RAM (ggml's sysconf figure) as its device's free and total.
        server = status["gpu"]["rpc_servers"][0]
        ram_mib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20
        assert server["protocol"] == "7.0.0" and len(server["devices"]) == 1, server
        assert server["total_mib"] == pytest.approx(ram_mib, abs=0.1) and server["free_mib"] == server["total_mib"]
        assert server["memory_read_at"] <= time.time() and server["query_ms"] < 1000
        # Admission charges the simulated local GPU only its share of the layers.
        split = status["gpu"]["rpc_split"]
        assert 0 <= split["local_layers"] < split["offloaded_layers"], split
        assert split["local_gpu_mib"] < split["all_local_gpu_mib"], split
        # The loaded GPU worker holds the server: in use, still reachable, the reading kept.
        status = service.wait_for(lambda s: s["gpu"]["rpc_servers"][0]["state"] == "in_use", timeout=15,
                                  what="the RPC server in use")
        assert status["gpu"]["rpc_servers"][0]["reachable"] is True
        assert status["gpu"]["rpc_servers"][0]["free_mib"] == server["free_mib"]
        gpu = next(w for w in status["workers"] if w["role"] == "gpu")
        worker_log = open(gpu["log"], errors="replace").read()
        assert f"--rpc 127.0.0.1:{port}" in worker_log
        answer = service.http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0})
        assert answer.status_code == 200 and answer.headers["x-served-by"] == "gpu"

        def long_request():
            return service.http.post("/v1/chat/completions", headers={"X-Request-Id": "rpc-replay"}, timeout=120,
                                     json={"messages": [{"role": "user", "content": "Tell a long story."}],
                                           "max_tokens": 300, "temperature": 0, "logit_bias": {"2": -100}})

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(long_request)
            service.wait_for(lambda s: any(r["id"] == "rpc-replay" and r["state"] == "running" and r["path"] == "gpu"
                                           for r in s["requests"]), interval=0.01, what="running on the GPU")
            rpc.send_signal(signal.SIGKILL)
            response = future.result()
        if response.headers["x-served-by"] == "gpu":
            pytest.skip("the GPU answered before the RPC server's death reached it")
        assert response.status_code == 200
        assert response.headers["x-route-reason"] in ("gpu_failed_replayed", "gpu_failed_resumed")
        status = service.wait_for(lambda s: s["gpu"]["rpc_servers"][0]["reachable"] is False, timeout=15,
                                  what="the RPC server seen gone")
        assert status["accounting"]["duplicate_executions"] == 0
        assert status["gpu"]["rpc_servers"][0]["error"]
        # The GPU worker went down with its remote device: llama.cpp aborts on a broken RPC link.
        gpu = next(w for w in status["workers"] if w["role"] == "gpu")
        assert gpu["last_exit"]["kind"] in ("crash", "error"), gpu["last_exit"]
        assert "RPC" in (gpu["last_exit"]["evidence"] or "") or gpu["last_exit"]["signal"] == "SIGABRT", gpu["last_exit"]



def test_the_llama_cpp_python_engine_is_refused_with_rpc_servers(tmp_path, rpc_worker):
    """llama-cpp-python 0.3.36's server takes --rpc_servers and drops it: every
    layer stays local (its load log says "assigned to device CPU" for all of
    them), while admission would charge the local GPU only a share. So the
    service refuses to start, and says what to do."""
    port, _, _ = rpc_worker
    config = tmp_path / "config.toml"
    config.write_text(f'[engine]\nruntime = "llama-cpp-python"\n[gpu]\nrpc_servers = ["127.0.0.1:{port}"]\n')
    done = subprocess.run([sys.executable, "-m", "tray_app", "serve", "--config", str(config), "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "[gpu] rpc_servers needs the llama-server engine" in done.stderr, done.stderr
