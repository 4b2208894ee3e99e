"""Whether the GPU worker's llama.cpp can offload to a GPU, asked outside the service.

The service hides the GPUs from its own llama.cpp (gpu_env), so asking there
would always say "no GPU"; asking a GPU backend for its devices creates the
context the service must not hold; and the GPU worker may be another build
than the service's libllama (a Vulkan or CUDA llama-server beside a CPU-only
llama-cpp-python). So:
- llama-server: its own device list (`--list-devices`), from the probe the
  GPU memory reader shares (memory/llama_devices), with the user's GPUs;
- llama-cpp-python's server: the same check as before, in a child that sees
  the user's GPUs:

    python -m tray_app.core.engine.offload_probe   # prints {"supported": ..., "message": ...}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from ..memory.gpu_readers import llama_server_probe
from ..memory.llama_devices import DeviceReport, gpu_modules_beside, no_device_reason
from ..memory.telemetry import OffloadSupport, detect_gpu_offload_support
from .gpu_env import USER_GPU_ENV, user_environment
from .runtime import LlamaServerRuntime, WorkerRuntime

PROBE_TIMEOUT_S = 60.0


def read_probe_answer(stdout: str, returncode: int, stderr: str) -> OffloadSupport:
    """The child's last line, or why there is none."""
    lines = stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1])
        return OffloadSupport(supported=answer["supported"], message=str(answer["message"]))
    except (IndexError, ValueError, KeyError, TypeError):
        clue = (stderr.strip().splitlines() or ["no output"])[-1][:200]
        return OffloadSupport(supported=None, message=f"the GPU offload check failed (exit {returncode}: {clue})")


def offload_support_of_devices(report: DeviceReport, binary: str) -> OffloadSupport:
    """What a llama-server's device list says about offloading."""
    name = Path(binary).name
    if report.error is not None:
        return OffloadSupport(supported=None, message=f"{name} could not list its devices: {report.error}")
    if not report.devices:
        if gpu_modules_beside(binary):
            return OffloadSupport(supported=False, message=f"{name} ({binary}): {no_device_reason(binary)}")
        return OffloadSupport(supported=False, message=f"{name} ({binary}) sees no GPU device: it was built for "
                                                       "the CPU only, or the GPU's driver is missing")
    seen = ", ".join(f"{d.name} ({d.description})" for d in report.devices)
    return OffloadSupport(supported=True, message=f"llama.cpp was built with GPU offload; {name} sees {seen}")


def workers_gpu_offload_support(runtime: WorkerRuntime | None = None, llama_server_path: str = "",
                                environ: Mapping[str, str] | None = None) -> OffloadSupport:
    """Whether the GPU worker can offload: llama-server's own device list,
    or for llama-cpp-python detect_gpu_offload_support() as its worker would
    answer it."""
    if runtime is None or isinstance(runtime, LlamaServerRuntime):
        probe = llama_server_probe(llama_server_path, environ)
        if probe is not None:
            return offload_support_of_devices(probe.report(), probe.argv[0])
    return llama_cpp_python_offload_support(environ)


def llama_cpp_python_offload_support(environ: Mapping[str, str] | None = None,
                                     timeout_s: float = PROBE_TIMEOUT_S) -> OffloadSupport:
    """detect_gpu_offload_support() as the workers would answer it: in a
    child that sees the user's GPUs when this process hid them from itself
    (the service), else here, where the answer is the same."""
    environ = os.environ if environ is None else environ
    if USER_GPU_ENV not in environ:
        return detect_gpu_offload_support()
    env = user_environment(environ)
    try:
        done = subprocess.run([sys.executable, "-m", __name__], env=env, capture_output=True, text=True,
                              errors="replace", timeout=timeout_s, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return OffloadSupport(supported=None, message=f"the GPU offload check could not run ({exc})")
    return read_probe_answer(done.stdout, done.returncode, done.stderr)


if __name__ == "__main__":
    support = detect_gpu_offload_support()
    print(json.dumps({"supported": support.supported, "message": support.message}), flush=True)
