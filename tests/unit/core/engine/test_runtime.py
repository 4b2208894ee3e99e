"""The runtimes behind the seam: what they launch, how the secret travels,
and which one the config gets. No model server is started here; the
integration tests run both engines for real."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tray_app.core.engine.runtime import (
    WORKER_KEY_VARIABLE, LaunchRequest, LlamaCppPythonRuntime, LlamaServerRuntime, choose_runtime,
    parent_pid_environment,
)

LAUNCH = LaunchRequest(model_path=Path("/models/a model.gguf"), port=4321, n_ctx=1024, n_gpu_layers=-1,
                       n_batch=256, n_threads=3, api_key="-secret-that-looks-like-a-flag", parallel=4)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_llama_server_gets_one_kv_cache_per_slot_and_no_secret_in_argv(tmp_path):
    runtime = LlamaServerRuntime(tmp_path / "llama-server")
    argv = runtime.argv(LAUNCH)
    server_args = argv[argv.index("--") + 1:]
    assert _flag(server_args, "--parallel") == "4"
    assert _flag(server_args, "--ctx-size") == str(1024 * 4)
    assert "--no-kv-unified" in server_args
    assert _flag(server_args, "--host") == "127.0.0.1" and _flag(server_args, "--port") == "4321"
    assert _flag(server_args, "--model") == "/models/a model.gguf"
    assert _flag(server_args, "--threads") == "3" and _flag(server_args, "--fit") == "off"
    assert not any(LAUNCH.api_key in arg for arg in argv)
    env = runtime.environment(LAUNCH)
    assert env[WORKER_KEY_VARIABLE] == LAUNCH.api_key
    assert "CUDA_VISIBLE_DEVICES" not in env


def test_a_cpu_worker_cannot_see_the_gpu_on_either_engine(tmp_path):
    from tray_app.core.engine.gpu_env import HIDDEN_GPU_VALUES

    cpu = LaunchRequest(**{**LAUNCH.__dict__, "n_gpu_layers": 0})
    for runtime in (LlamaServerRuntime(tmp_path / "llama-server"), LlamaCppPythonRuntime()):
        env = runtime.environment(cpu)
        # Every backend's devices, Vulkan's included: a Vulkan build at -ngl 0
        # still offloads big batches to the device.
        assert {name: env.get(name) for name in HIDDEN_GPU_VALUES} == HIDDEN_GPU_VALUES


def test_the_gpu_worker_sees_the_gpus_the_user_gave_and_the_cpu_worker_none(tmp_path):
    from tray_app.core.engine.gpu_env import HIDDEN_GPU_VALUES, hidden_environment
    from tray_app.core.engine.worker import worker_environment

    user = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "1", "GGML_VK_VISIBLE_DEVICES": "0",
            "VK_ICD_FILENAMES": "/usr/share/vulkan/icd.d/radeon_icd.x86_64.json"}
    router = hidden_environment(user)  # what the router runs with
    runtime = LlamaServerRuntime(tmp_path / "llama-server")
    gpu = worker_environment(router, runtime.environment(LAUNCH))
    assert {name: gpu.get(name) for name in HIDDEN_GPU_VALUES} == {
        name: user.get(name) for name in HIDDEN_GPU_VALUES}
    cpu = worker_environment(router, runtime.environment(LaunchRequest(**{**LAUNCH.__dict__, "n_gpu_layers": 0})))
    assert {name: cpu.get(name) for name in HIDDEN_GPU_VALUES} == HIDDEN_GPU_VALUES


def test_llama_server_finds_its_libraries_beside_it_and_in_the_wheel(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    env = LlamaServerRuntime(tmp_path / "bin" / "llama-server").environment(LAUNCH)
    dirs = env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert dirs[:2] == [str(tmp_path / "bin"), str(tmp_path / "lib")]
    assert any(d.endswith(os.path.join("llama_cpp", "lib")) for d in dirs)


def test_another_llama_server_is_not_handed_the_bundled_libraries(tmp_path):
    env = LlamaServerRuntime(tmp_path / "llama-server", bundled=False).environment(LAUNCH)
    assert not any(d.endswith(os.path.join("llama_cpp", "lib")) for d in env["LD_LIBRARY_PATH"].split(os.pathsep))


def test_the_config_can_choose_llama_cpp_python():
    choice = choose_runtime("llama-cpp-python")
    assert choice.runtime.name == "llama-cpp-python" and choice.fallback_reason is None


def test_a_missing_llama_server_falls_back_and_says_why(tmp_path):
    choice = choose_runtime("llama-server", str(tmp_path / "nowhere" / "llama-server"))
    assert choice.runtime.name == "llama-cpp-python"
    assert "is not an executable file" in choice.fallback_reason
    assert "llama-cpp-python" in choice.fallback_reason


def test_a_configured_llama_server_is_used(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    choice = choose_runtime("llama-server", str(binary))
    assert choice.runtime.name == "llama-server" and choice.fallback_reason is None


def test_the_environment_names_a_llama_server_when_the_config_names_none(tmp_path, monkeypatch):
    binary = tmp_path / "cuda-build" / "llama-server"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o700)
    monkeypatch.setenv("TRAY_APP_LLAMA_SERVER", str(binary))
    choice = choose_runtime("llama-server")
    assert choice.runtime.binary == binary and not choice.runtime.bundled
    # The config's own path still wins.
    assert choose_runtime("llama-server", str(tmp_path / "missing")).fallback_reason is not None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="exec and PR_SET_PDEATHSIG are Linux-only")
def test_the_wrapper_execs_llama_server_with_the_secret_only_in_its_environment(tmp_path):
    # A stand-in binary that reports what it was given.
    report = tmp_path / "report.json"
    fake = tmp_path / "llama-server"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"json.dump({{'argv': sys.argv[1:], 'key': os.environ.get('LLAMA_API_KEY'),"
                    f" 'leftover': os.environ.get({WORKER_KEY_VARIABLE!r}), 'pid': os.getpid()}},"
                    f" open({str(report)!r}, 'w'))\n")
    fake.chmod(0o700)
    runtime = LlamaServerRuntime(fake)
    env = {**os.environ, **runtime.environment(LAUNCH), **parent_pid_environment()}
    process = subprocess.Popen(runtime.argv(LAUNCH), env=env)
    assert process.wait(timeout=60) == 0
    seen = json.loads(report.read_text())
    assert seen["key"] == LAUNCH.api_key and seen["leftover"] is None
    assert seen["pid"] == process.pid  # exec'd: the pid we watch is llama-server's
    assert "--parallel" in seen["argv"] and LAUNCH.api_key not in " ".join(seen["argv"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="exec and PR_SET_PDEATHSIG are Linux-only")
@pytest.mark.parametrize("n_gpu_layers", [99, 0])
def test_the_wrapper_names_a_gpu_workers_devices_in_its_log(tmp_path, n_gpu_layers):
    from tray_app.core.engine.worker_main import parse_device_line

    # A stand-in llama-server that lists what llama.cpp lists on lavapipe, without the key.
    fake = tmp_path / "llama-server"
    fake.write_text(f"#!{sys.executable}\nimport os, sys\n"
                    "if sys.argv[1:] == ['--list-devices']:\n"
                    f"    assert {WORKER_KEY_VARIABLE!r} not in os.environ and 'LLAMA_API_KEY' not in os.environ\n"
                    "    print('ggml_vulkan: some log line\\nAvailable devices:\\n"
                    "  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)')\n")
    fake.chmod(0o700)
    runtime = LlamaServerRuntime(fake)
    launch = LaunchRequest(**{**LAUNCH.__dict__, "n_gpu_layers": n_gpu_layers})
    env = {**os.environ, **runtime.environment(launch), **parent_pid_environment()}
    done = subprocess.run(runtime.argv(launch), env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    devices = [d for line in done.stdout.splitlines() if (d := parse_device_line(line))]
    if n_gpu_layers:
        assert devices == [{"name": "Vulkan0", "description": "llvmpipe (LLVM 15.0.6, 256 bits)",
                            "total_mib": 2048, "free_mib": 2048}]
    else:
        assert devices == []  # a CPU worker is not made to open a device
