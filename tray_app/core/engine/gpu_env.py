"""Which processes may see the GPUs: the GPU worker only.

The service loads libllama in its own process for the tokenizer, and its
grammar checker child does too. With a CUDA, ROCm or Vulkan build, llama.cpp
initialises every backend it was built with on first use, so without this
the service would hold a GPU context (hundreds of MiB of VRAM per device in
llama.cpp's own router mode, fixed upstream in PR #23137) while running no
model. So the service hides the devices from itself, in its own environment,
before llama.cpp is loaded, and keeps the user's values in one variable; the
GPU worker is started with the user's values again, and the CPU worker hides
the devices as the service does.

Pure functions over an environment mapping; `hide_gpus_from_this_process`
is the one that touches os.environ.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, MutableMapping

# The values that show no device to each backend:
# - CUDA, HIP and ROCr take an invalid index (-1) as "no device"; Ollama
#   documents the same values to force the CPU.
# - ggml-vulkan reads GGML_VK_VISIBLE_DEVICES as a list of indices: an empty
#   one selects none (a present but empty variable is not "unset" there).
#   It still creates a Vulkan instance and enumerates the physical devices
#   first, which loads every installed driver (ICD) and opens the render
#   nodes, so the Vulkan loader is also pointed at a folder with no driver:
#   then there is no instance at all. Implicit layers (overlays, capture
#   tools) would be loaded into the process by the loader as well.
NO_VULKAN_DRIVER_DIR = "/nonexistent/tray-app-no-vulkan-driver"
HIDDEN_GPU_VALUES: Mapping[str, str] = {
    "CUDA_VISIBLE_DEVICES": "-1",
    "HIP_VISIBLE_DEVICES": "-1",
    "ROCR_VISIBLE_DEVICES": "-1",
    "GGML_VK_VISIBLE_DEVICES": "",
    "VK_DRIVER_FILES": NO_VULKAN_DRIVER_DIR,
    "VK_ICD_FILENAMES": NO_VULKAN_DRIVER_DIR,  # the loader's older name, before 1.3.207
    "VK_LOADER_LAYERS_DISABLE": "~all~",
}

# The user's own values of HIDDEN_GPU_VALUES' names, as JSON (null = unset),
# saved by the process that hid them. Children inherit it, so a process
# started by a hidden one (the tray starting a service, a test starting a
# service) keeps the user's values rather than saving the hidden ones.
USER_GPU_ENV = "TRAY_APP_USER_GPU_ENV"


def hidden_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` with every GPU hidden and the user's values saved in USER_GPU_ENV."""
    saved = environ.get(USER_GPU_ENV)
    if saved is None or _parse_saved(saved) is None:
        saved = json.dumps({name: environ.get(name) for name in HIDDEN_GPU_VALUES}, sort_keys=True)
    return {**environ, **HIDDEN_GPU_VALUES, USER_GPU_ENV: saved}


def user_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` as the user had it before a hidden_environment: what a GPU worker starts from."""
    saved = _parse_saved(environ.get(USER_GPU_ENV, ""))
    if saved is None:
        return dict(environ)
    restored = {name: value for name, value in environ.items() if name not in HIDDEN_GPU_VALUES and name != USER_GPU_ENV}
    restored.update({name: value for name, value in saved.items() if value is not None})
    return restored


def hide_gpus_from_this_process(environ: MutableMapping[str, str] | None = None) -> None:
    """Hide the GPUs from this process's own llama.cpp. Call it before
    llama_cpp is imported: CUDA and ggml read these once, at initialisation."""
    environ = os.environ if environ is None else environ
    hidden = hidden_environment(environ)
    for name in (*HIDDEN_GPU_VALUES, USER_GPU_ENV):
        environ[name] = hidden[name]


def _parse_saved(text: str) -> dict[str, str | None] | None:
    try:
        saved = json.loads(text)
    except ValueError:
        return None
    if not isinstance(saved, dict):
        return None
    return {name: value if isinstance(value, str) else None
            for name, value in saved.items() if name in HIDDEN_GPU_VALUES}
