"""Benchmark of sharing the GPU. Prints numbers; asserts nothing.

    .venv/bin/python benchmarks/gpu_sharing_bench.py [--rounds 3]

On the simulated device, with real workers and a real second process as
"the other app" (tray_app.drill.vram_hog):

1. Release: from the other app's allocation to the GPU worker's memory shown
   free again (the worker drained and unloaded), measured by the client and
   by the service (gpu.residency.last_release_s).
2. Reload: from the other app letting go to the GPU serving again, and the
   part of it that is the load itself (the rest is the settle time).
3. The first CPU byte while the GPU loads: after an idle unload, a streamed
   request's time to first byte (served by the CPU as gpu_loading), against
   the same request on the loaded GPU in the same run (the anchor), as a ratio.
4. How the CPU fallback is kept, warm against on demand: the RAM the CPU
   worker holds while idle, and the time to the first CPU byte when the GPU
   worker dies (SIGKILL) and a request comes in.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import RunningService, running, sharing_config, wait_gone  # noqa: E402
from tray_app.drill.vram_hog import OtherApp, crowding_mib  # noqa: E402

SETTLE_S = 2.0
PROMPT = "Write a short poem about autumn leaves."


def config(tmp: Path, *, idle_unload_s: float = 0, cpu_keep: str = "warm") -> str:
    # An on-demand CPU worker unloads a second after each answer, so every round starts cold.
    return sharing_config(tmp, cpu={"keep": cpu_keep, "idle_unload_s": 1}, reload_settle_s=SETTLE_S,
                          idle_unload_s=idle_unload_s)


def first_byte_s(service: RunningService, headers: dict | None = None) -> tuple[float, httpx.Headers]:
    started = time.perf_counter()
    with service.http.stream("POST", "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "temperature": 0, "stream": True,
    }, headers=headers or {}) as response:
        response.raise_for_status()
        first = None
        for line in response.iter_lines():
            if first is None and line.startswith("data:"):
                first = time.perf_counter() - started
        return first if first is not None else float("nan"), response.headers


def residency(service: RunningService) -> dict:
    return service.status()["gpu"]["residency"]


def gpu_state(status: dict) -> str:
    return next(w for w in status["workers"] if w["role"] == "gpu")["state"]


def release_and_reload(service: RunningService, rounds: int) -> None:
    print("1-2. another app takes the VRAM, then lets go")
    releases, service_releases, reloads, loads = [], [], [], []
    for _ in range(rounds):
        service.wait_for(lambda s: s["gpu"]["residency"]["state"] == "loaded", timeout=120, what="loaded")
        status = service.status()
        app = OtherApp(crowding_mib(status), "game", simulated_dir=status["gpu"]["simulated_device_dir"])
        allocated = time.perf_counter()
        done = service.wait_for(lambda s: s["gpu"]["residency"]["last_release_s"] is not None
                                and s["gpu"]["residency"]["state"] == "given_away" and gpu_state(s) == "stopped",
                                timeout=60, interval=0.02, what="released")
        releases.append(time.perf_counter() - allocated)
        service_releases.append(done["gpu"]["residency"]["last_release_s"])
        app.quit()
        let_go = time.perf_counter()
        back = service.wait_for(lambda s: s["gpu"]["residency"]["state"] == "loaded" and gpu_state(s) == "ready",
                                timeout=120, interval=0.02, what="reloaded")
        reloads.append(time.perf_counter() - let_go)
        loads.append(back["gpu"]["residency"]["last_load_s"])
        time.sleep(0.5)
    print(f"   release, client-measured: median {statistics.median(releases):.2f} s "
          f"(all: {', '.join(f'{r:.2f}' for r in releases)})")
    print(f"   release, service-measured: median {statistics.median(service_releases):.2f} s")
    print(f"   reload after let-go: {', '.join(f'{r:.2f}' for r in reloads)} s (each give-back within 10 min "
          f"doubles the {SETTLE_S:g} s settle time); the load itself: median {statistics.median(loads):.2f} s")


def cpu_while_loading(tmp: Path, rounds: int) -> None:
    print("3. the first CPU byte while the GPU loads (after an idle unload)")
    with running(tmp / "idle", config(tmp / "idle", idle_unload_s=2)) as service:
        loaded, loading, etas = [], [], []
        for _ in range(rounds):
            service.wait_for(lambda s: gpu_state(s) == "ready", timeout=120, what="ready")
            seconds, headers = first_byte_s(service)
            assert headers["x-served-by"] == "gpu", headers
            loaded.append(seconds)
            service.wait_for(lambda s: s["gpu"]["residency"]["state"] == "unloaded_idle" and gpu_state(s) == "stopped",
                             timeout=60, interval=0.05, what="idle unload")
            seconds, headers = first_byte_s(service)
            assert headers["x-served-by"] == "cpu" and headers["x-route-reason"] == "gpu_loading", headers
            loading.append(seconds)
            etas.append(float(headers["x-estimated-latency"]))
        anchor, measured = statistics.median(loaded), statistics.median(loading)
        print(f"   first byte on the loaded GPU (anchor): median {anchor * 1000:.0f} ms")
        print(f"   first byte from the CPU while the GPU loads: median {measured * 1000:.0f} ms "
              f"(x{measured / anchor:.2f} the anchor); X-Estimated-Latency said {statistics.median(etas):.2f} s "
              "for the whole answer")
        print(f"   GPU load time measured by the service: {residency(service)['last_load_s']:.2f} s")


def warm_against_on_demand(tmp: Path, rounds: int) -> None:
    print("4. the CPU fallback kept warm, or loaded on demand")
    for keep in ("warm", "on_demand"):
        roles = ("gpu", "cpu") if keep == "warm" else ("gpu",)
        with running(tmp / keep, config(tmp / keep, cpu_keep=keep), roles) as service:
            time.sleep(2.0)
            cpu = service.worker("cpu")
            rss = cpu["rss_mib"] or 0.0
            first = []
            for _ in range(rounds):
                service.wait_for(lambda s: gpu_state(s) == "ready", timeout=120, what="GPU ready")
                if keep == "on_demand":
                    service.wait_for(lambda s: next(w for w in s["workers"] if w["role"] == "cpu")["state"]
                                     == "stopped", timeout=30, what="CPU worker unloaded")
                gpu_pid = service.worker("gpu")["pid"]
                os.kill(gpu_pid, signal.SIGKILL)
                wait_gone([gpu_pid])
                seconds, headers = first_byte_s(service)
                assert headers["x-served-by"] == "cpu", headers
                first.append(seconds)
            print(f"   {keep:>9}: CPU worker RSS while idle {rss:.0f} MiB; first CPU byte after the GPU "
                  f"worker died: median {statistics.median(first) * 1000:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with running(tmp / "share", config(tmp / "share")) as service:
            release_and_reload(service, args.rounds)
        cpu_while_loading(tmp, args.rounds)
        warm_against_on_demand(tmp, args.rounds)


if __name__ == "__main__":
    main()
