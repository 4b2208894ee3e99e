"""The router hides the GPUs from its own llama.cpp and keeps the user's
values for the GPU worker (engine/gpu_env.py)."""

from __future__ import annotations

import json

from tray_app.core.engine.gpu_env import (
    HIDDEN_GPU_VALUES, USER_GPU_ENV, hidden_environment, hide_gpus_from_this_process, user_environment,
)


def test_hiding_sets_every_backend_to_no_device_and_keeps_the_rest():
    user = {"PATH": "/bin", "HOME": "/home/u", "CUDA_VISIBLE_DEVICES": "0,1"}
    hidden = hidden_environment(user)
    assert {name: hidden[name] for name in HIDDEN_GPU_VALUES} == HIDDEN_GPU_VALUES
    assert hidden["PATH"] == "/bin" and hidden["HOME"] == "/home/u"
    # ggml-vulkan takes an empty list as "no device"; an unset variable would mean "every GPU".
    assert hidden["GGML_VK_VISIBLE_DEVICES"] == ""
    # The Vulkan loader finds no driver, so no driver is loaded into the router at all.
    assert hidden["VK_DRIVER_FILES"] == hidden["VK_ICD_FILENAMES"] != ""


def test_the_users_values_come_back_exactly_set_and_unset():
    user = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "1", "GGML_VK_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": ""}
    assert user_environment(hidden_environment(user)) == user


def test_hiding_twice_keeps_the_users_values_not_the_hidden_ones():
    # A router started by a hidden process (the tray's service, a test's) inherits the hidden values.
    user = {"CUDA_VISIBLE_DEVICES": "1"}
    twice = hidden_environment(hidden_environment(user))
    assert user_environment(twice) == user


def test_an_environment_nobody_hid_is_the_users_own():
    user = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "-1"}
    assert user_environment(user) == user


def test_a_garbled_saved_value_is_replaced_not_trusted():
    environ = {"CUDA_VISIBLE_DEVICES": "2", USER_GPU_ENV: "not json"}
    hidden = hidden_environment(environ)
    assert json.loads(hidden[USER_GPU_ENV])["CUDA_VISIBLE_DEVICES"] == "2"
    assert user_environment(hidden)["CUDA_VISIBLE_DEVICES"] == "2"


def test_this_process_is_hidden_in_place():
    environ = {"PATH": "/bin", "GGML_VK_VISIBLE_DEVICES": "0"}
    hide_gpus_from_this_process(environ)
    assert environ["GGML_VK_VISIBLE_DEVICES"] == "" and environ["PATH"] == "/bin"
    assert user_environment(environ) == {"PATH": "/bin", "GGML_VK_VISIBLE_DEVICES": "0"}
