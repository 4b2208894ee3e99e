"""`tray-app serve` and the tray hide the GPUs from their own llama.cpp
before the service is built; other commands leave the environment alone."""

from __future__ import annotations

import os

import pytest

from tray_app import cli
from tray_app.core.engine.gpu_env import HIDDEN_GPU_VALUES, USER_GPU_ENV, user_environment


@pytest.fixture
def user_gpu(monkeypatch):
    # Every name the hiding writes, under monkeypatch, so the test leaves os.environ as it found it.
    for name in (*HIDDEN_GPU_VALUES, USER_GPU_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")


def test_serve_builds_its_service_with_the_gpus_hidden(user_gpu, monkeypatch):
    seen: dict[str, str] = {}
    monkeypatch.setattr(cli, "serve", lambda config, log_level="INFO": seen.update(os.environ) or 0)
    assert cli.main(["serve"]) == 0
    assert {name: seen.get(name) for name in HIDDEN_GPU_VALUES} == HIDDEN_GPU_VALUES
    assert user_environment(seen)["CUDA_VISIBLE_DEVICES"] == "1"  # what the GPU worker gets


def test_status_leaves_the_gpus_visible(user_gpu, monkeypatch):
    monkeypatch.setattr(cli, "print_status", lambda url, as_json, api_key="": 0)
    assert cli.main(["status"]) == 0
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1" and USER_GPU_ENV not in os.environ
