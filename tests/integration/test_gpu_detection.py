"""Which GPU reader the product picks, seen from outside: the real service and `tray-app models`
ask llama.cpp's own device list when neither NVML nor the kernel's DRM files show a card
(this machine has neither)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import BASE_CONFIG, RunningService
from tray_app.core.engine.worker import free_loopback_port

# The product run end to end: `tray-app models` and the service, in subprocesses.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

# A Vulkan build's answer on a 16 GiB AMD card; this machine's llama-server is a CPU build.
VULKAN_DEVICES = ("ggml_vulkan: Found 1 Vulkan devices:\nAvailable devices:\n"
                  "  Vulkan0: AMD Radeon RX 7800 XT (RADV NAVI32) (16368 MiB, 15360 MiB free)\n")


def test_models_cli_reads_the_gpu_through_llama_cpps_device_list(tmp_path: Path) -> None:
    """With no NVIDIA driver and no DRM card, the headroom comes from the llama-server the GPU
    worker would run, asked in a probe process. Here that binary stands in for a Vulkan build."""
    server = tmp_path / "llama-server"
    server.write_text(f"#!{sys.executable}\nimport sys\nassert sys.argv[1:] == ['--list-devices']\n"
                      f"print({VULKAN_DEVICES!r})\n")
    server.chmod(server.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "TRAY_APP_LLAMA_SERVER": str(server),
           **{name: str(tmp_path / name.lower()) for name in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME")}}
    done = subprocess.run([sys.executable, "-m", "tray_app", "models", "--json",
                           "--url", f"http://127.0.0.1:{free_loopback_port()}"],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    headroom = json.loads(done.stdout)["headroom"]
    assert headroom["source"] == "direct", done.stderr
    assert headroom["vram_free_mib"] == 15360


def test_the_service_says_what_each_reader_was_missing(tmp_path: Path) -> None:
    """No simulated device: the real service picks its reader at start. On this machine every
    reader comes up empty, and /status says why for each, llama.cpp's own list included."""
    config = BASE_CONFIG.replace("simulate_mib = 2048\n", "")
    service = RunningService(tmp_path, config)
    try:
        status = service.wait_ready(roles=())  # up and answering; no worker needed
        gpu = status["gpu"]
        assert gpu["available"] is False and gpu["free_mib"] is None
        assert "no AMD or Intel card in /sys/class/drm" in gpu["reason"]
        assert "llama.cpp sees no GPU device" in gpu["reason"]
    finally:
        service.stop()
