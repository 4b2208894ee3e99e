"""packaging/: the desktop entries, the systemd user unit, the PyInstaller recipe
and what `install.sh --test` leaves for the Vulkan tests.

desktop-file-validate (Debian: desktop-file-utils) and systemd-analyze
(Debian: systemd) are run when installed and skipped with the reason when
not; CI installs both.  A full PyInstaller build takes minutes, so it runs
only with TRAY_APP_BUILD_APP=1; the rest checks the recipe's parts.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tray_app.desktop.autostart import desktop_entry, enable
from tray_app.core.engine.runtime import LaunchRequest, LlamaCppPythonRuntime

REPO = Path(__file__).resolve().parents[2]
PACKAGING = REPO / "packaging"
UNIT = PACKAGING / "tray-app.service"
SPEC = PACKAGING / "pyinstaller" / "tray-app.spec"
ENTRY = PACKAGING / "pyinstaller" / "entry.py"


def tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian package {package})")
    return path


def desktop_file_validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("desktop-file-validate", "desktop-file-utils"), str(path)],
                          capture_output=True, text=True, timeout=30, check=False)


# --- desktop entries ---------------------------------------------------------------


@pytest.mark.parametrize(("name", "autostart"), [("tray-app.desktop", False), ("tray-app-autostart.desktop", True)])
def test_packaged_entries_are_renderings_of_the_one_template(name, autostart):
    expected = desktop_entry(["tray-app"], autostart=autostart)
    assert (PACKAGING / name).read_text() == expected, (
        f"packaging/{name} drifted from the template in tray_app/desktop/autostart.py; regenerate it with\n"
        f"  .venv/bin/python -c \"from tray_app.desktop.autostart import desktop_entry; "
        f"open('packaging/{name}', 'w').write(desktop_entry(['tray-app'], autostart={autostart}))\"")


@pytest.mark.parametrize("name", ["tray-app.desktop", "tray-app-autostart.desktop"])
def test_packaged_entries_validate(name):
    result = desktop_file_validate(PACKAGING / name)
    # desktop-file-validate exits 0 on warnings too; a clean file prints nothing.
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr


def test_the_entry_the_tray_writes_validates_even_for_an_awkward_install_path(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_CONFIG_DIRS", str(tmp_path / "etc-xdg"))
    written = enable(['/home/jo smith/100% "mine"/$apps/tray-app', "tray"])
    result = desktop_file_validate(written)
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr


def test_desktop_file_validate_does_catch_a_broken_entry(tmp_path):
    # The checks above mean something only if the validator rejects bad files here.
    broken = tmp_path / "broken.desktop"
    broken.write_text(desktop_entry(["tray-app"], autostart=False).replace("Exec=tray-app", 'Exec="tray-app'))
    result = desktop_file_validate(broken)
    assert result.returncode != 0 and "quote" in result.stdout + result.stderr


# --- systemd user unit -------------------------------------------------------------------


def systemd_verify(unit: Path, home: Path, runtime_dir: Path) -> subprocess.CompletedProcess[str]:
    """`systemd-analyze --user verify`, offline: no systemd needs to be running.

    It resolves %h from $HOME and checks that ExecStart's binary exists, so
    `home` must hold .local/bin/tray-app; a user manager also wants
    $XDG_RUNTIME_DIR, which containers and CI often lack.
    """
    binary = tool("systemd-analyze", "systemd")
    env = {**os.environ, "HOME": str(home), "XDG_RUNTIME_DIR": str(runtime_dir), "SYSTEMD_LOG_LEVEL": "notice"}
    result = subprocess.run([binary, "--user", "verify", str(unit)], capture_output=True, text=True, env=env,
                            timeout=60, check=False)
    if "Failed to initialize manager" in result.stderr or "Failed to lookup RuntimeDirectory" in result.stderr:
        pytest.skip(f"systemd-analyze cannot run a user manager here: {result.stderr.strip()}")
    return result


@pytest.fixture
def unit_home(tmp_path):
    home = tmp_path / "home"
    (home / ".local" / "bin").mkdir(parents=True)
    (home / ".local" / "bin" / "tray-app").symlink_to(Path(sys.executable).with_name("python"))
    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir(mode=0o700)
    return home, runtime_dir


def test_the_user_unit_verifies(unit_home):
    result = systemd_verify(UNIT, *unit_home)
    # verify exits 0 on unknown keys and bad values; it only warns. So: no output at all.
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr


def test_systemd_verify_does_catch_a_broken_unit(unit_home, tmp_path):
    broken = tmp_path / "tray-app.service"
    broken.write_text(UNIT.read_text().replace("Restart=on-failure", "Restart=on-failur"))
    result = systemd_verify(broken, *unit_home)
    assert "on-failur" in result.stdout + result.stderr


def test_the_unit_runs_serve_and_takes_its_workers_down_with_it():
    keys: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";")):
            key, value = line.split("=", 1)
            keys.setdefault(key.strip(), []).append(value.strip())
    assert keys["ExecStart"] == ["%h/.local/bin/tray-app serve"]
    assert keys["KillMode"] == ["control-group"]
    assert keys["Restart"] == ["on-failure"]
    assert keys["NoNewPrivileges"] == ["true"]
    assert keys["WantedBy"] == ["default.target"]
    # Mount-namespace options fail or misbehave in a user manager without
    # unprivileged user namespaces; see the unit's comment.
    assert not {"PrivateTmp", "ProtectSystem", "ProtectHome"} & keys.keys()


# --- PyInstaller recipe -------------------------------------------------------------------


def test_build_and_run_scripts_parse():
    for script in ("build-app.sh", "install.sh", "backend.sh", "build-vulkan-server.sh"):
        subprocess.run(["bash", "-n", str(PACKAGING / script)], check=True, timeout=30)
    subprocess.run(["sh", "-n", str(PACKAGING / "pyinstaller" / "run.sh")], check=True, timeout=30)
    assert os.access(PACKAGING / "build-app.sh", os.X_OK)
    assert os.access(PACKAGING / "build-vulkan-server.sh", os.X_OK)
    assert os.access(PACKAGING / "pyinstaller" / "run.sh", os.X_OK)


def test_the_spec_parses_and_builds_from_the_entry_script():
    tree = ast.parse(SPEC.read_text(), filename=str(SPEC))
    strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert "entry.py" in strings and ENTRY.exists()
    assert "tray-app" in strings  # the binary run.sh starts
    assert 'exec "$here/tray-app" "$@"' in (PACKAGING / "pyinstaller" / "run.sh").read_text()
    # Started by name, never imported, so PyInstaller would miss it without this.
    assert "tray_app.core.engine.worker_main" in strings


def test_the_frozen_entry_understands_how_the_supervisor_starts_workers():
    argv = LlamaCppPythonRuntime(python="APP").argv(
        LaunchRequest(model_path=Path("m.gguf"), port=1, n_ctx=512, n_gpu_layers=0, n_batch=512, n_threads=0))
    assert argv[1] == "-m"
    entry_tree = ast.parse(ENTRY.read_text())
    runnable = next(node.value for node in ast.walk(entry_tree)
                    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "RUNNABLE_MODULES")
    assert argv[2] in ast.literal_eval(runnable)


def run_entry(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ENTRY), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})}, cwd=REPO, check=False)


def test_the_entry_runs_an_allowed_module_like_python_m(tmp_path):
    result = run_entry("-m", "tray_app.desktop.autostart", "status",
                       env={"XDG_CONFIG_HOME": str(tmp_path), "XDG_CONFIG_DIRS": str(tmp_path / "none")})
    assert result.returncode == 0, result.stderr
    assert f"start on login: off ({tmp_path}/autostart/tray-app.desktop)" in result.stdout


def test_the_entry_refuses_other_modules_and_otherwise_is_the_cli():
    refused = run_entry("-m", "http.server")
    assert refused.returncode == 2 and "-m runs only" in refused.stderr
    cli = run_entry("serve", "--help")
    assert cli.returncode == 0 and "--simulate-gpu-mib" in cli.stdout


@pytest.mark.skipif(os.environ.get("TRAY_APP_BUILD_APP") != "1",
                    reason="a full PyInstaller build takes minutes; set TRAY_APP_BUILD_APP=1")
def test_build_the_app_folder():
    subprocess.run(["bash", str(PACKAGING / "build-app.sh")], check=True, cwd=REPO, timeout=1800,
                   env={**os.environ, "PYTHON": sys.executable})
    app = REPO / "dist" / "tray-app"
    result = subprocess.run([str(app / "run.sh"), "serve", "--help"], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0 and "--simulate-gpu-mib" in result.stdout


# --- the Vulkan llama-server that install.sh --test builds ------------------------------------


def test_install_test_leaves_a_vulkan_llama_server_or_says_why_not():
    """install.sh --test records exactly one of: the path of a llama-server
    built with llama.cpp's Vulkan backend, or why there is none."""
    venv = Path(sys.prefix)
    record, skip = venv / ".vulkan-llama-server", venv / ".vulkan-llama-server.skip"
    assert record.exists() != skip.exists(), f"run bash packaging/install.sh --test: neither {record} nor {skip}"
    if skip.exists():
        pytest.skip(f"no Vulkan llama-server: {skip.read_text().strip()}")
    server = Path(record.read_text().strip())
    # llama.cpp hides CPU-type Vulkan devices (Mesa's lavapipe) unless one is asked for by index.
    listed = subprocess.run([str(server), "--list-devices"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "GGML_VK_VISIBLE_DEVICES": "0"}, check=False)
    assert listed.returncode == 0 and "  Vulkan0: " in listed.stdout, listed.stdout + listed.stderr
