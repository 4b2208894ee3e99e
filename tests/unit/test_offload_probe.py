"""Whether the workers can offload is asked of a child that sees the user's
GPUs, when the router hid them from itself (engine/offload_probe.py)."""

from __future__ import annotations

import os

from tray_app.core.engine.gpu_env import hidden_environment
from tray_app.core.engine.offload_probe import read_probe_answer, workers_gpu_offload_support
from tray_app.core.memory.telemetry import detect_gpu_offload_support


def test_a_hidden_router_gets_the_answer_its_workers_would_get():
    # The child runs the same check with the user's variables: on any build,
    # the answer equals the one an unhidden process gets.
    hidden = hidden_environment(dict(os.environ))
    assert workers_gpu_offload_support(hidden) == detect_gpu_offload_support()


def test_the_childs_answer_is_read_and_a_failed_child_says_why():
    good = read_probe_answer('noise from a backend\n{"supported": true, "message": "built with GPU offload"}\n', 0, "")
    assert good.supported is True and good.message == "built with GPU offload"
    failed = read_probe_answer("", -11, "ggml_cuda_init: something\nSegmentation fault\n")
    assert failed.supported is None and "exit -11" in failed.message and "Segmentation fault" in failed.message
