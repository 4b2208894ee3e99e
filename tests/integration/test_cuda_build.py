"""install.sh's CUDA build, built for real on a machine with no GPU:
`bash packaging/install.sh --backend cuda --cuda-arch 90` compiles ggml's
CUDA module with the toolkit from NVIDIA's PyPI wheels, and everything up to
the first kernel launch is checked here:

- llama-server starts, loads its backends as modules, and lists no CUDA
  device (no driver here), instead of failing to start;
- the CUDA module finds cuBLAS in the cache without LD_LIBRARY_PATH;
- the service on that build serves on the CPU in the calm CPU-only state,
  and says the driver is what is missing and how to check it;
- the router, its grammar checker and tokenizer run that build's libllama
  with the CPU module only: no process but llama-server loads the CUDA one.

The build takes over an hour on 2 cores, so CI's install doesn't make it:
these tests run where a CUDA build is in the wheel cache (install.sh leaves
it in ~/.cache/tray-app/wheels/), and skip, saying so, elsewhere.
TRAY_APP_CUDA_WHEEL names another wheel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from benchmarks.gpu_check.prepare import TRAY_APP_CACHE, cuda_wheels
from tests.harness import BASE_CONFIG, RunningService
from tray_app.core.engine.runtime import library_dirs

CUDA_WHEEL_ENV = "TRAY_APP_CUDA_WHEEL"


def find_cuda_wheel() -> tuple[Path | None, str]:
    named = os.environ.get(CUDA_WHEEL_ENV)
    if named:
        return (Path(named), "") if Path(named).is_file() else (None, f"{CUDA_WHEEL_ENV}={named} is no file")
    found = cuda_wheels(TRAY_APP_CACHE)
    if found:
        return found[-1], ""
    return None, (f"no CUDA build of llama-cpp-python in {TRAY_APP_CACHE / 'wheels'} (or {CUDA_WHEEL_ENV}): "
                  "bash packaging/install.sh --backend cuda --cuda-arch 90 makes one (over an hour on 2 cores)")


CUDA_WHEEL, WHY_NOT = find_cuda_wheel()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(CUDA_WHEEL is None, reason=WHY_NOT),
              pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    """The wheel unpacked as pip lays it out: bin/ (llama-server and ggml's
    modules), lib/ (its libraries) and llama_cpp/lib (llama-cpp-python's)."""
    root = tmp_path_factory.mktemp("cuda-build")
    with zipfile.ZipFile(CUDA_WHEEL) as wheel:
        for member in wheel.infolist():
            if member.filename.startswith(("bin/", "lib/", "llama_cpp/lib/")):
                path = Path(wheel.extract(member, root))
                path.chmod(0o755)
    return root


def library_path(build: Path) -> str:
    """llama-cpp-python's libraries: what LLAMA_CPP_LIB_PATH names."""
    return str(build / "llama_cpp" / "lib")


def server_environment(build: Path) -> dict[str, str]:
    """llama-server's libraries, found as the service finds them for a build it didn't bundle."""
    dirs = library_dirs(build / "bin" / "llama-server", bundled=False)
    return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(map(str, dirs))}


def test_llama_server_starts_with_its_modules_and_lists_no_cuda_device(build):
    assert (build / "bin" / "libggml-cuda.so").is_file() and (build / "bin" / "libggml-cpu.so").is_file()
    listed = subprocess.run([str(build / "bin" / "llama-server"), "--list-devices"], capture_output=True, text=True,
                            timeout=60, env=server_environment(build))
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "Available devices:" in listed.stdout and "CUDA0" not in listed.stdout, listed.stdout


def test_the_cuda_module_finds_cublas_in_the_cache_without_ld_library_path(build):
    linked = subprocess.run(["ldd", str(build / "bin" / "libggml-cuda.so")], capture_output=True, text=True,
                            timeout=60, env=server_environment(build)).stdout
    cublas = next(line for line in linked.splitlines() if "libcublas.so" in line)
    assert "not found" not in linked, linked
    assert "=> /" in cublas, cublas  # resolved through the rpath the build recorded, not the environment


@pytest.fixture(scope="module")
def service(build, tmp_path_factory):
    # No simulated device: the service finds what this machine has (no GPU).
    config = BASE_CONFIG.replace("simulate_mib = 2048\n", "")
    running = RunningService(tmp_path_factory.mktemp("cuda-service"), config, env={
        "TRAY_APP_LLAMA_SERVER": str(build / "bin" / "llama-server"),
        "LLAMA_CPP_LIB_PATH": library_path(build)})
    try:
        running.wait_ready(roles=())
        yield running
    finally:
        running.stop()


def test_the_service_serves_on_the_cpu_and_says_the_driver_is_missing(service):
    answer = service.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-served-by"] == "cpu"
    gpu = service.status()["gpu"]
    assert gpu["available"] is False
    assert "CUDA module sees no device" in gpu["reason"] and "nvidia-smi" in gpu["reason"], gpu


def test_only_llama_server_loads_the_cuda_module(service):
    import psutil

    # A grammar starts the grammar checker: the router's other llama.cpp.
    answer = service.http.post("/v1/chat/completions", headers={"X-Force-Path": "cpu"}, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}})
    assert answer.status_code == 200, answer.text
    router = psutil.Process(service.status()["service"]["pid"])
    python_processes = [router, *(p for p in router.children(recursive=True) if p.name().startswith("python"))]
    assert len(python_processes) >= 2, "no grammar checker or tokenizer process"
    for process in python_processes:
        maps = Path(f"/proc/{process.pid}/maps").read_text()
        assert "libggml-cuda" not in maps and "libcuda.so" not in maps, " ".join(process.cmdline())
    # The CUDA build's own libllama, with its CPU module, did the router's work.
    cpu_module = f"{service.env['LLAMA_CPP_LIB_PATH']}/libggml-cpu.so"
    assert any(cpu_module in Path(f"/proc/{p.pid}/maps").read_text() for p in python_processes)
