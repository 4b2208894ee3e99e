"""`tray-app models`, run as a user runs it: `python -m tray_app models` in a
subprocess, with every XDG folder in a temporary directory so the models
folder is one the test controls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tray_app.core.config import Config, bundled_model_path
from tray_app.core.engine.worker import free_loopback_port

# Every test runs `tray-app models`, which asks the real llama-server for its
# devices here (no NVML, no DRM card): a llama.cpp process.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
def home(tmp_path):
    models = tmp_path / "data" / "tray-app" / "models"
    models.mkdir(parents=True)
    (models / "junk.gguf").write_text("this is not a model")
    (models / "downloads").mkdir()
    (models / "downloads" / "empty.gguf").write_bytes(b"")
    return tmp_path


def run_models(home: Path, *args: str, url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "XDG_CONFIG_HOME": str(home / "config"),
        "XDG_DATA_HOME": str(home / "data"),
        "XDG_STATE_HOME": str(home / "state"),
        "XDG_CACHE_HOME": str(home / "cache"),
    }
    # A port nobody listens on, unless a test starts a service: a developer's
    # own running service must not change what the test sees.
    url = url or f"http://127.0.0.1:{free_loopback_port()}"
    return subprocess.run([sys.executable, "-m", "tray_app", "models", "--url", url, *args],
                          capture_output=True, text=True, env=env, timeout=90, check=False)


def model_block(output: str, name_fragment: str) -> list[str]:
    """The table row whose FILE ends with name_fragment, and its profile lines."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.rstrip().endswith(name_fragment))
    block = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith("    "):
            break
        block.append(line)
    return block


def test_lists_the_bundled_model_and_explains_the_bad_files(home):
    extra = home / "more"
    extra.mkdir()
    (extra / "other.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")  # right magic, then nothing
    empty_folder = home / "nothing-here"
    empty_folder.mkdir()
    result = run_models(home, str(extra), str(empty_folder), str(home / "missing.gguf"))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    row, *profiles = model_block(out, bundled_model_path().name)
    cells = row.split()
    assert "135M" in cells and "Q4_1" in cells and "8192" in cells and "configured" in cells
    assert "94 MiB" in row  # 98,362,432 bytes
    assert [line.split()[0] for line in profiles] == ["GPU", "split", "CPU"]
    cpu_line = profiles[2]
    # A context sized from memory is judged at its 4096 floor; "max" says how far it can go.
    assert "CPU only" in cpu_line and ("fits at 4096 (max " in cpu_line or "does not fit" in cpu_line)
    # Each bad file is one line and the listing goes on past it.
    assert f"junk.gguf: skipped: model file {home}/data/tray-app/models/junk.gguf is not a GGUF file (bad magic" in out
    assert "empty.gguf: skipped: model file" in out and "is empty" in out
    assert "other.gguf: skipped: model file" in out and "truncated or corrupt" in out
    assert "missing.gguf: skipped: model file" in out and "does not exist" in out
    assert f"{empty_folder}: no .gguf files in this folder" in out
    assert "Traceback" not in result.stderr
    # No service at --url: the numbers come from this machine, and the output says so.
    assert "(no service answered at http://127.0.0.1:" in out


def test_a_simulated_gpu_gives_gpu_verdicts_for_the_real_model(home):
    roomy = run_models(home, "--simulate-gpu-mib", "8192")
    assert roomy.returncode == 0, roomy.stderr
    _, resident, split, _ = model_block(roomy.stdout, bundled_model_path().name)
    assert resident.split(None, 2)[2] == "fits at 4096 (max 8192)"
    assert split.split(None, 1)[1] == "not needed: the whole model fits on the GPU"
    assert "Headroom from a simulated GPU of 8192 MiB" in roomy.stdout

    # The default reserve plus ~0.75 GiB: SmolLM2 needs ~0.8 GiB fully offloaded
    # at 4096, so only a split fits.
    tight_mib = Config().gpu.reserve_mib + 776
    tight = run_models(home, "--simulate-gpu-mib", str(tight_mib))
    _, resident, split, _ = model_block(tight.stdout, bundled_model_path().name)
    assert "does not fit at 4096: needs" in resident and "776 MiB free above the" in resident
    assert split.split(None, 1)[1].startswith("fits at 4096 with") and "(--gpu-layers" in split


def test_json_output(home):
    result = run_models(home, "--json", "--simulate-gpu-mib", "8192")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["headroom"]["source"] == "simulated" and data["headroom"]["vram_free_mib"] == 8192
    assert data["models_dir"] == str(home / "data" / "tray-app" / "models")
    good = [m for m in data["models"] if m["ok"]]
    bad = {Path(m["path"]).name: m["error"] for m in data["models"] if not m["ok"]}
    assert len(good) == 1
    model = good[0]
    assert (model["parameters_text"], model["quant"], model["n_ctx_train"]) == ("135M", "Q4_1", 8192)
    assert model["parameters"] == 134_515_008 and model["file_size"] == bundled_model_path().stat().st_size
    assert [p["profile"] for p in model["profiles"]] == ["gpu_resident", "split", "cpu_only"]
    assert model["profiles"][0]["verdict"] == "fits" and model["profiles"][0]["max_n_ctx"] == 8192
    assert "not a GGUF file" in bad["junk.gguf"] and "is empty" in bad["empty.gguf"]


def test_no_usable_model_exits_1(home):
    config = home / "config" / "tray-app" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f'[model]\npath = "{home}/data/tray-app/models/junk.gguf"\n')
    result = run_models(home)
    assert result.returncode == 1
    assert "junk.gguf: skipped" in result.stdout and "No usable model found" in result.stdout


def test_a_bad_config_exits_2_with_one_line(home):
    config = home / "broken.toml"
    config.write_text("[gpu]\nn_ctx = 'big'\n")
    result = run_models(home, "--config", str(config))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["tray-app: error: [gpu] n_ctx must be a whole number, got 'big'"]


def test_live_headroom_comes_from_a_running_service(home, fresh):
    fresh.http.post("/admin/gpu", json={"simulated_pressure_mib": 300})
    status = fresh.status()
    result = run_models(home, url=fresh.url)
    assert result.returncode == 0, result.stderr
    assert f"Headroom from the running service at {fresh.url} (its workers' own memory counts as used)" \
        in result.stdout
    data = json.loads(run_models(home, "--json", url=fresh.url).stdout)
    assert data["headroom"]["source"] == "service"
    assert data["headroom"]["vram_free_mib"] == pytest.approx(status["gpu"]["free_mib"], abs=1)
    assert data["headroom"]["vram_reserve_mib"] == status["gpu"]["reserve_mib"]


def test_an_explicit_simulated_gpu_overrides_a_running_service(home, fresh):
    data = json.loads(run_models(home, "--json", "--simulate-gpu-mib", "2048", url=fresh.url).stdout)
    assert data["headroom"]["source"] == "simulated" and data["headroom"]["vram_free_mib"] == 2048
