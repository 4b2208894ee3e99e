"""Benchmark of the protocol edges and the model library. Prints numbers; asserts nothing.

    .venv/bin/python benchmarks/library_bench.py [--rounds 20]

On the simulated device with real workers (SmolLM2; a second library
entry "tiny" is the same file with a smaller profile):

1. What a protocol edge costs: the same one-token chat through OpenAI's
   /v1/chat/completions (the anchor), Ollama's /api/chat and Anthropic's
   /v1/messages, interleaved in one run; medians, and each as a ratio of
   the anchor.
2. A model's first request: the time to the CPU-served answer while its
   GPU worker loads, and the load itself (from /status).
3. An eviction: a load that needs another model's VRAM, from the request
   to the loaded GPU worker, against a load that needs none.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import BASE_CONFIG, RunningService, running  # noqa: E402
from tray_app.core.config import bundled_model_path  # noqa: E402

HELLO = [{"role": "user", "content": "Say hi."}]
ROUTES = {
    "openai": ("/v1/chat/completions", lambda m: {"model": m, "messages": HELLO, "max_tokens": 1, "temperature": 0}),
    "ollama": ("/api/chat", lambda m: {"model": m, "messages": HELLO, "stream": False,
                                       "options": {"num_predict": 1, "temperature": 0}}),
    "anthropic": ("/v1/messages", lambda m: {"model": m, "messages": HELLO, "max_tokens": 1, "temperature": 0}),
}


def config(device_mib: int) -> str:
    return BASE_CONFIG.replace("simulate_mib = 2048", f"simulate_mib = {device_mib}") + f"""
[[models]]
name = "tiny"
path = "{bundled_model_path()}"
n_ctx = 256
max_concurrency = 1
"""


def model(service: RunningService, name: str) -> dict:
    return next(m for m in service.status()["models"] if m["name"] == name)


def wait_gpu(service: RunningService, name: str, state: str) -> None:
    service.wait_for(lambda s: any(m["name"] == name and m["gpu"] == state for m in s["models"]), timeout=120,
                     what=f"{name} {state}")


def protocols(service: RunningService, rounds: int) -> None:
    default = service.status()["service"]["model"]
    times: dict[str, list[float]] = {name: [] for name in ROUTES}
    for _ in range(2):  # warm-up
        for path, body in ROUTES.values():
            service.http.post(path, json=body(default)).raise_for_status()
    for _ in range(rounds):
        for name, (path, body) in ROUTES.items():
            started = time.perf_counter()
            response = service.http.post(path, json=body(default))
            times[name].append(time.perf_counter() - started)
            assert response.status_code == 200 and response.headers["x-served-by"] == "gpu", response.text
    anchor = statistics.median(times["openai"])
    print(f"1. one-token chat on the GPU path, median of {rounds} (interleaved):")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"   {name:<10} {median * 1000:7.1f} ms   x{median / anchor:.3f} of OpenAI's route"
              f"   (p90 {sorted(values)[int(0.9 * len(values))] * 1000:.1f} ms)")


def first_request(service: RunningService) -> None:
    started = time.perf_counter()
    response = service.http.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "max_tokens": 8})
    answered = time.perf_counter() - started
    wait_gpu(service, "tiny", "loaded")
    loaded = time.perf_counter() - started
    print(f"2. first request for an unloaded model: answered in {answered:.2f} s by "
          f"{response.headers['x-served-by']} ({response.headers['x-route-reason']}); its GPU worker loaded "
          f"{loaded:.2f} s after the request (the service measured {model(service, 'tiny')['last_load_s']:.2f} s)")


def eviction(service: RunningService) -> None:
    default = service.status()["service"]["model"]
    # A load with room to spare: unload tiny, load it again.
    service.http.post("/admin/models/tiny", json={"loaded": False}).raise_for_status()
    started = time.perf_counter()
    service.http.post("/admin/models/tiny", json={"loaded": True}).raise_for_status()
    wait_gpu(service, "tiny", "loaded")
    plain = time.perf_counter() - started
    print(f"3. loading tiny with room to spare: {plain:.2f} s from the request to loaded "
          f"(default model {model(service, default)['gpu']})")


def eviction_needed(rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # 1,200 MiB: the default model (~806 MiB with its reserve) and tiny (~662) can't both load.
        with running(Path(tmp) / "tight", config(1200).replace("reserve_mib = 256", "reserve_mib = 64")) as service:
            default = service.status()["service"]["model"]
            took = []
            for _ in range(rounds):
                for name, other in (("tiny", default), (default, "tiny")):
                    started = time.perf_counter()
                    service.http.post(f"/admin/models/{name}", json={"loaded": True}).raise_for_status()
                    wait_gpu(service, name, "loaded")
                    took.append(time.perf_counter() - started)
                    assert model(service, other)["gpu"] != "loaded"
            evictions = sum(m["evictions"] for m in service.status()["models"])
            print(f"   loading a model that needs the other's VRAM (evict, wait for the memory, load): median "
                  f"{statistics.median(took):.2f} s over {len(took)} swaps; {evictions} evictions")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        with running(Path(tmp) / "bench", config(4096)) as service:
            protocols(service, args.rounds)
            first_request(service)
            eviction(service)
    eviction_needed(max(2, args.rounds // 10))
    return 0


if __name__ == "__main__":
    sys.exit(main())
