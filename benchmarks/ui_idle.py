"""Idle cost of the tray app: CPU and RSS over a minute with nothing to do.

    .venv/bin/python benchmarks/ui_idle.py [--seconds 60]

Runs the real app three times on a simulated 2 GiB GPU, with both workers
loaded and no requests, and measures the app's own process (the UI and the
in-process service; the llama.cpp workers are separate processes, listed
apart):

  serve               `tray-app serve`, no UI: the baseline
  tray, panel closed  `tray-app` with a tray icon (Xvfb + trayer as the tray host)
  tray, panel open    the same with the headroom panel open (live bars, chart)

CPU % is CPU time over wall time (100 % = one core). Needs Xvfb and trayer
for the tray runs (apt-get install xvfb trayer x11-utils); without them only
the baseline and an offscreen "panel open" run are measured.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
# The GPU model must fit with room to spare: with the default 1 GiB reserve
# its worker no longer leaves that much free on 2 GiB, and the service gives
# the GPU away at once (nothing would be measured with it loaded).
CONFIG = """
[gpu]
simulate_mib = 2048
reserve_mib = 256
[worker]
stop_timeout_s = 3
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the app exited with {process.returncode}")
        try:
            status = httpx.get(f"{url}/status", timeout=5).json()
            if status["workers"] and all(w["state"] == "ready" for w in status["workers"]):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the app did not get ready")


def measure(pid: int, seconds: float) -> dict[str, float]:
    main = psutil.Process(pid)
    workers = main.children(recursive=True)

    def cpu(procs) -> float:
        total = 0.0
        for proc in procs:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:
                pass
        return total

    main_start, workers_start, wall_start = cpu([main]), cpu(workers), time.monotonic()
    rss: list[float] = []
    while time.monotonic() - wall_start < seconds:
        rss.append(main.memory_info().rss / 2**20)
        time.sleep(1.0)
    wall = time.monotonic() - wall_start
    return {
        "cpu_pct": 100 * (cpu([main]) - main_start) / wall,
        "rss_mean": statistics.fmean(rss),
        "rss_max": max(rss),
        "workers_cpu_pct": 100 * (cpu(workers) - workers_start) / wall,
        "workers_rss": sum(w.memory_info().rss for w in workers if w.is_running()) / 2**20,
    }


def run(name: str, args: list[str], env: dict[str, str], work: Path, seconds: float, settle: float) -> dict:
    port = free_port()
    config = work / "config.toml"
    config.write_text(CONFIG)
    exe = ROOT / ".venv" / "bin" / "tray-app"
    command = ([str(exe)] if exe.exists() else [sys.executable, "-m", "tray_app"]) + \
        args + ["--config", str(config), "--port", str(port)]
    log = open(work / f"{name.replace(' ', '_').replace(',', '')}.log", "wb")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"http://127.0.0.1:{port}", process)
        time.sleep(settle)
        result = measure(process.pid, seconds)
    finally:
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
    result["stop_s"] = time.monotonic() - started
    result["exit"] = process.returncode
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="idle time measured per run")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds to wait after ready before measuring")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tray-app-idle-"))
    env = {k: v for k, v in os.environ.items() if k not in ("WAYLAND_DISPLAY", "DBUS_SESSION_BUS_ADDRESS")}
    env.update({f"XDG_{n}_HOME": str(work / n.lower()) for n in ("CONFIG", "STATE", "DATA", "CACHE")})
    env["PYTHONUNBUFFERED"] = "1"
    have_x = shutil.which("Xvfb") and shutil.which("trayer")
    xvfb = trayer = None
    results: list[tuple[str, dict]] = []
    try:
        results.append(("serve (no UI)", run("serve", ["serve"], env, work, args.seconds, args.settle)))
        if have_x:
            display = next(f":{n}" for n in range(150, 200) if not Path(f"/tmp/.X11-unix/X{n}").exists())
            xvfb = subprocess.Popen(["Xvfb", display, "-screen", "0", "1280x800x24", "-nolisten", "tcp", "-noreset"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.5)
            x_env = {**env, "DISPLAY": display, "QT_QPA_PLATFORM": "xcb"}
            trayer = subprocess.Popen(["trayer", "--edge", "top", "--align", "right", "--widthtype", "request",
                                       "--height", "24"], env=x_env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
            time.sleep(1.5)
            results.append(("tray, panel closed", run("tray closed", ["tray"], x_env, work, args.seconds, args.settle)))
            results.append(("tray, panel open", run("tray open", ["tray"], {**x_env, "TRAY_APP_OPEN": "panel"},
                                                    work, args.seconds, args.settle)))
        else:
            print("no Xvfb/trayer: measuring only the offscreen window (no tray, so the panel is open)")
            off_env = {**env, "QT_QPA_PLATFORM": "offscreen"}
            results.append(("window (offscreen)", run("offscreen", ["tray"], off_env, work, args.seconds, args.settle)))
    finally:
        for process in (trayer, xvfb):
            if process is not None:
                process.terminate()
                process.wait(10)
    print(f"\nidle for {args.seconds:.0f} s: simulated 2 GiB GPU, both workers loaded, no requests; "
          f"{psutil.cpu_count()} CPUs, CPU % of one core\n")
    print(f"{'run':<20} {'app CPU %':>9} {'app RSS mean':>13} {'app RSS max':>12} "
          f"{'workers CPU %':>14} {'workers RSS':>12} {'quit (s)':>9} {'exit':>5}")
    for name, r in results:
        print(f"{name:<20} {r['cpu_pct']:>9.2f} {r['rss_mean']:>9.0f} MiB {r['rss_max']:>8.0f} MiB "
              f"{r['workers_cpu_pct']:>14.2f} {r['workers_rss']:>8.0f} MiB {r['stop_s']:>9.1f} {r['exit']:>5}")
    shutil.rmtree(work, ignore_errors=True)
    # `serve` re-raises SIGTERM after its clean shutdown (uvicorn), so -15 is clean there.
    return 0 if all(r["exit"] in (0, -signal.SIGTERM) for _, r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
