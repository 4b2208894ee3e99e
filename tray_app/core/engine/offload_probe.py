"""Whether llama.cpp can offload to a GPU, asked of a short-lived child.

The router hides the GPUs from its own llama.cpp (gpu_env), so asking there
would always say "no GPU"; and asking a GPU backend for its devices creates
the context the router must not hold. The child runs the same check with
the user's GPU variables, holds the context for as long as it takes, and
exits.

    python -m tray_app.core.engine.offload_probe   # prints {"supported": ..., "message": ...}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping

from ..memory.telemetry import OffloadSupport, detect_gpu_offload_support
from .gpu_env import USER_GPU_ENV, user_environment

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


def workers_gpu_offload_support(environ: Mapping[str, str] | None = None,
                                timeout_s: float = PROBE_TIMEOUT_S) -> OffloadSupport:
    """detect_gpu_offload_support() as the workers would answer it: in a
    child that sees the user's GPUs when this process hid them from itself
    (the router), else here, where the answer is the same."""
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
