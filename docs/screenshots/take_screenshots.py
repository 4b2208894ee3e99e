"""Screenshots of the real app under Xvfb, with trayer as the tray host.

    .venv/bin/python docs/screenshots/take_screenshots.py [--out docs/screenshots]

Needs: Xvfb and trayer (apt-get install xvfb trayer), the Qt xcb libraries,
and the bundled model. It starts a virtual display and a tray host, runs
`tray-app` on a simulated 2 GiB GPU with isolated config/log dirs, and lets
the app's screenshot tour (tray_app/ui/shots.py, switched on by
TRAY_APP_SCREENSHOT_DIR) drive it: the tray icon inside trayer, the menu, the
panel in normal and degraded mode, the chat mid-answer, the settings. Then
it runs the app once more with no tray host, for the no-tray fallback window.
Each tour runs once per theme (--themes): the desktop's default light
palette, and a dark Fusion palette whose files end in -dark.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# A model file name as long as real ones get, to show how the panel elides it.
LONG_MODEL_NAME = "SmolLM2-135M-Instruct-abliterated-imatrix-with-a-very-long-community-name.Q4_1.gguf"
CONFIG = """
[server]
# Ten queued CPU requests must not be turned away for their estimated wait.
queue_timeout_s = 600
[gpu]
simulate_mib = 2048
n_ctx = 4096
reserve_mib = 512
# The GPU comes back within seconds of the game's exit, and never unloads for idleness mid-tour.
reload_settle_s = 3
idle_unload_s = 0
[cpu]
n_ctx = 2048
# One slot, so the degraded shots show a running request and ten queued ones.
max_concurrency = 1
queue_limit = 12
ram_floor_mib = 1024
[worker]
stop_timeout_s = 3
"""


def free_display() -> int:
    for number in range(99, 140):
        if not Path(f"/tmp/.X11-unix/X{number}").exists() and not Path(f"/tmp/.X{number}-lock").exists():
            return number
    raise RuntimeError("no free X display number")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_display(display: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if subprocess.run(["xdpyinfo", "-display", display], capture_output=True).returncode == 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"Xvfb did not come up on {display}")


def stop(process: subprocess.Popen | None) -> None:
    if process is not None and process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_app(out: Path, work: Path, env: dict[str, str], which: str, theme: str, timeout: float) -> dict:
    config = work / "config.toml"
    model = work / LONG_MODEL_NAME
    if not model.exists():
        from tray_app.core.config import bundled_model_path

        model.symlink_to(bundled_model_path())
    # A second library model (the same file, a smaller profile) for the Models menu, panel and chat picker.
    cpu_only = which == "cpu-only"
    if cpu_only:
        # A new user's machine: no simulated GPU, the bundled model alone, no GPU path.
        config.write_text(CONFIG.replace("simulate_mib = 2048\n", ""))
    else:
        config.write_text(CONFIG + f'[model]\npath = "{model}"\n[[models]]\nname = "coder"\npath = "{model}"\n'
                          'n_ctx = 1024\nmax_concurrency = 1\n')
    tray_app = ROOT / ".venv" / "bin" / "tray-app"
    command = [str(tray_app) if tray_app.exists() else sys.executable, *([] if tray_app.exists() else ["-m", "tray_app"]), "tray",
               "--config", str(config), "--port", str(free_port()), *([] if cpu_only else ["--simulate-gpu-mib", "2048"])]
    run = f"{which}-{theme}"
    log = open(work / f"app-{run}.log", "wb")
    app_env = {**env, "TRAY_APP_SCREENSHOT_DIR": str(out), "TRAY_APP_SCREENSHOT_SET": which,
               "TRAY_APP_SCREENSHOT_THEME": theme}
    app = subprocess.Popen(command, env=app_env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        app.wait(timeout)
    except subprocess.TimeoutExpired:
        stop(app)
        raise RuntimeError(f"the app did not finish the {run} tour in {timeout} s; see {work}/app-{run}.log")
    finally:
        log.close()
    result = json.loads((out / "tour.json").read_text()) if (out / "tour.json").exists() else {"ok": False}
    (out / "tour.json").unlink(missing_ok=True)
    result["exit_code"] = app.returncode
    if not result.get("ok") or app.returncode != 0:
        tail = (work / f"app-{run}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{run} tour failed: {result}\n{tail}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "screenshots"))
    parser.add_argument("--size", default="1280x800")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--themes", default="light,dark", help="comma-separated: light, dark")
    parser.add_argument("--sets", default="tray,cpu-only,no-tray",
                        help="comma-separated tours: tray (simulated GPU), cpu-only (no GPU path), no-tray")
    args = parser.parse_args()
    themes = [t.strip() for t in args.themes.split(",") if t.strip()]
    if not themes or set(themes) - {"light", "dark"}:
        parser.error("--themes takes light, dark or both")
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    if not sets or set(sets) - {"tray", "cpu-only", "no-tray"}:
        parser.error("--sets takes tray, cpu-only, no-tray")
    for tool in ("Xvfb", "trayer", "xdpyinfo"):
        if shutil.which(tool) is None:
            print(f"missing {tool}: apt-get install xvfb trayer x11-utils", file=sys.stderr)
            return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tray-app-shots-"))
    number = free_display()
    display = f":{number}"
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("QT_QPA_PLATFORM", "WAYLAND_DISPLAY", "DBUS_SESSION_BUS_ADDRESS")},
        "DISPLAY": display,
        "QT_QPA_PLATFORM": "xcb",
        "XDG_CONFIG_HOME": str(work / "config"),
        "XDG_STATE_HOME": str(work / "state"),
        "XDG_DATA_HOME": str(work / "data"),
        "XDG_CACHE_HOME": str(work / "cache"),
        "XDG_RUNTIME_DIR": str(work / "run"),
        "PYTHONUNBUFFERED": "1",
    }
    (work / "run").mkdir(mode=0o700)
    xvfb = trayer = None
    try:
        xvfb = subprocess.Popen(["Xvfb", display, "-screen", "0", f"{args.size}x24", "-nolisten", "tcp", "-noreset"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_display(display)
        # A grey desktop, like most panels' neighbourhood, so the crops aren't black.
        if shutil.which("xsetroot"):
            subprocess.run(["xsetroot", "-display", display, "-solid", "#5b6770"], capture_output=True)
        trayer = subprocess.Popen(["trayer", "--edge", "top", "--align", "right", "--widthtype", "request",
                                   "--height", "24", "--SetDockType", "true", "--tint", "0x2b2f33",
                                   "--transparent", "true", "--alpha", "0"],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.5)
        saved: list[str] = []
        for which in ("tray", "cpu-only"):
            if which in sets:
                for theme in themes:
                    saved += run_app(out, work, env, which, theme, args.timeout)["saved"]
        stop(trayer)
        trayer = None
        if "no-tray" in sets:
            for theme in themes:
                saved += run_app(out, work, env, "no-tray", theme, args.timeout)["saved"]
    finally:
        stop(trayer)
        stop(xvfb)
    print(f"saved {len(saved)} screenshots to {out}:")
    for name in saved:
        print(f"  {name}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
