"""Whether the GPU worker can offload is asked outside the router, which
hides the GPUs from its own llama.cpp (engine/offload_probe.py)."""

from __future__ import annotations

import os
import stat
import sys

from tray_app.core.engine.gpu_env import hidden_environment
from tray_app.core.engine.offload_probe import (
    llama_cpp_python_offload_support, offload_support_of_devices, read_probe_answer, workers_gpu_offload_support,
)
from tray_app.core.engine.runtime import choose_runtime
from tray_app.core.memory.llama_devices import DeviceReport, LlamaDevice
from tray_app.core.memory.telemetry import detect_gpu_offload_support

LAVAPIPE = LlamaDevice("Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)", 2048.0, 2048.0)


def test_llama_servers_device_list_decides_and_is_named():
    seen = offload_support_of_devices(DeviceReport((LAVAPIPE,)), "/opt/vk/llama-server")
    assert seen.supported is True and "Vulkan0 (llvmpipe (LLVM 15.0.6, 256 bits))" in seen.message
    none = offload_support_of_devices(DeviceReport(()), "/opt/cpu/llama-server")
    assert none.supported is False and "/opt/cpu/llama-server" in none.message
    failed = offload_support_of_devices(DeviceReport((), "llama-server exited with 1: boom"), "/x/llama-server")
    assert failed.supported is None and "boom" in failed.message


def test_a_cuda_build_that_sees_no_device_names_the_driver_and_how_to_check_it(tmp_path):
    # install.sh's CUDA build puts ggml's CUDA module beside llama-server; here,
    # with no NVIDIA driver, it loads and finds no device.
    (tmp_path / "libggml-cuda.so").write_text("")
    (tmp_path / "libggml-cpu.so").write_text("")
    none = offload_support_of_devices(DeviceReport(()), str(tmp_path / "llama-server"))
    assert none.supported is False
    assert "CUDA module sees no device: the NVIDIA driver or its libcuda.so.1 is missing" in none.message
    assert "nvidia-smi checks it" in none.message and "built for the CPU only" not in none.message


def test_a_hidden_router_asks_llama_server_with_the_users_gpus(tmp_path):
    # A stand-in llama-server that lists a device only when the user's variable reaches it.
    fake = tmp_path / "llama-server"
    fake.write_text(f"#!{sys.executable}\nimport os\nprint('Available devices:')\n"
                    "if os.environ.get('GGML_VK_VISIBLE_DEVICES') == '0':\n"
                    "    print('  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)')\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    router = hidden_environment({"PATH": os.environ.get("PATH", ""), "GGML_VK_VISIBLE_DEVICES": "0"})
    runtime = choose_runtime("llama-server", str(fake)).runtime
    assert workers_gpu_offload_support(runtime, str(fake), router).supported is True


def test_a_hidden_router_gets_the_answer_llama_cpp_pythons_worker_would_get():
    # The child runs the same check with the user's variables: on any build,
    # the answer equals the one an unhidden process gets.
    hidden = hidden_environment(dict(os.environ))
    assert llama_cpp_python_offload_support(hidden) == detect_gpu_offload_support()


def test_the_childs_answer_is_read_and_a_failed_child_says_why():
    good = read_probe_answer('noise from a backend\n{"supported": true, "message": "built with GPU offload"}\n', 0, "")
    assert good.supported is True and good.message == "built with GPU offload"
    failed = read_probe_answer("", -11, "ggml_cuda_init: something\nSegmentation fault\n")
    assert failed.supported is None and "exit -11" in failed.message and "Segmentation fault" in failed.message
