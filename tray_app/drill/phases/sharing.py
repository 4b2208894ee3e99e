"""The GPU's memory shared with others: free VRAM shrinking under traffic (6),
another app taking it while requests stream (10), a second model loading on
demand and giving way under pressure (11)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...core.status_contract import ModelSummary, Status
from .. import plan as plans
from ..prompts import OVER_CAP_QUESTIONS, SHORT_PROMPTS, STORY
from ..records import PhaseResult
from ..session import RECOVERY_WAIT_S, STATUS_WAIT_S, DrillSession, answered, chat_body
from ..target import gpu_worker
from ..units import mib, seconds
from .faults import RESET_TOKENS

# Phase 10: the other app, what it is called, and how long it keeps the memory.
OTHER_APP_NAME = "game"
OTHER_APP_HOLD_S = 2.0
OTHER_APP_STREAMS = 2
REQUESTS_WHILE_HELD = 2


def shrinking_vram(drill: DrillSession, phase: PhaseResult) -> None:
    assert drill.sizer is not None and drill.gpu_cap is not None
    pressure = drill.target.pressure if drill.target.can_inject else None
    if pressure is None:
        steps: tuple[float | None, ...] = (None,)
        phase.notes.append("live service: the prompts are replayed once, at the free VRAM it has now")
    else:
        spares = drill.plan.vram_steps_spare_mib if drill.target.simulated else plans.REAL_GPU_STEPS_SPARE_MIB
        steps = (None, *spares)
    long_tokens = drill.gpu_cap - drill.plan.answer_tokens - 30
    long_prompt = drill.sizer.message(long_tokens, OVER_CAP_QUESTIONS[1])
    rows = []
    for number, spare in enumerate(steps):
        taken = pressure.squeeze_to_spare(spare, drill.reserve_mib) if (pressure and spare is not None) else {}
        if pressure is not None and pressure.kind == "real":
            time.sleep(1.2)  # the service reads NVML once a second
        free = drill.client.status()["gpu"]["free_mib"]
        label = "no pressure" if spare is None else f"{spare:g} MiB spare"
        short = drill.send(drill.record(phase, f"step {number} ({label}): short", stream=True,
                                        prompt_key="vram-short"), chat_body(SHORT_PROMPTS[3]))
        long = drill.send(drill.record(phase, f"step {number} ({label}): long", stream=True,
                                       prompt_key="vram-long"), chat_body(long_prompt))
        parallel = [drill.record(phase, f"step {number} ({label}): parallel {j + 1}", stream=True,
                                 prompt_key=f"vram-parallel-{j}", expect="answer_or_rejected")
                    for j in range(drill.plan.parallel_per_step)]
        with ThreadPoolExecutor(max(1, len(parallel))) as pool:
            for future in [drill.send_in(pool, r, chat_body(SHORT_PROMPTS[(4 + j) % len(SHORT_PROMPTS)]))
                           for j, r in enumerate(parallel)]:
                future.result()
        rows.append({
            "step": number, "spare_mib": spare, "free_mib": free, **taken,
            "short": f"{short.served_by}/{short.route_reason}", "long": f"{long.served_by}/{long.route_reason}",
            "parallel": [f"{r.served_by}/{r.route_reason}" for r in parallel],
        })
    if pressure is not None:
        pressure.release()
    phase.data["steps"] = rows
    if len(rows) < 2:
        return
    phase.check("with no pressure, short and long prompts run on the GPU",
                rows[0]["short"] == "gpu/admitted" and rows[0]["long"] == "gpu/admitted",
                f"short {rows[0]['short']}, long {rows[0]['long']}")
    last = rows[-1]
    everything = [last["short"], last["long"], *last["parallel"]]
    phase.check("with no spare VRAM, everything goes to the CPU for gpu_vram_headroom",
                all(route == "cpu/gpu_vram_headroom" for route in everything), ", ".join(everything))
    for kind in ("short", "long"):
        routes = [row[kind] for row in rows]
        first_out = next((i for i, route in enumerate(routes) if route == "cpu/gpu_vram_headroom"), len(routes))
        monotonic = all(route == "cpu/gpu_vram_headroom" for route in routes[first_out:])
        phase.check(f"{kind} prompt: once VRAM is short it stays on the CPU", monotonic, " -> ".join(routes))


def other_app_takes_vram(drill: DrillSession, phase: PhaseResult) -> None:
    """Another app (a real second process: a game starting) takes the GPU's
    memory while requests stream on it, holds it, then lets go. The GPU
    worker must finish or replay what runs, send new work to the CPU,
    unload and really release its VRAM, then reload once the memory has
    stayed free, with nothing lost or run twice."""
    from ..vram_hog import OtherApp, crowding_mib

    before = drill.client.status()
    yielding_before = before["gpu"]["residency"]["yield_to_other_apps"]
    duplicates_before = before["accounting"]["duplicate_executions"]
    drill.client.admin_gpu({"yield_to_other_apps": True})
    app: OtherApp | None = None
    result: dict[str, Any] = {"app": OTHER_APP_NAME}
    phase.data["other_app"] = result
    try:
        streams = [drill.record(phase, f"stream #{i + 1} running when the other app starts", stream=True,
                                max_tokens=RESET_TOKENS, prompt_key=f"other-app-stream-{i}")
                   for i in range(OTHER_APP_STREAMS)]
        with ThreadPoolExecutor(len(streams)) as pool:
            done = [drill.send_in(pool, record, chat_body(STORY)) for record in streams]
            drill.wait_running(streams[0].id, "gpu", min_tokens=1)
            status = drill.client.status()
            gpu = status["gpu"]
            take = crowding_mib(status)
            app = OtherApp(take, OTHER_APP_NAME,
                           simulated_dir=gpu.get("simulated_device_dir") if drill.target.simulated else None)
            allocated_at = drill.clock.now()
            result["took_mib"] = round(take, 1)
            # Its recovery runs from when the app lets go (cleared_s, set then).
            fault = {"phase": phase.number, "kind": "another app took the VRAM", "signal": None,
                     "pid": app.pid, "request_id": None, "at_s": round(allocated_at, 3),
                     "cleared_s": round(allocated_at, 3)}
            drill.faults.append(fault)
            given = drill.client.wait_status(
                lambda s: s["gpu"]["residency"]["state"] == "given_away" and gpu_worker(s)["state"] == "stopped"
                and s["gpu"]["residency"]["last_release_s"] is not None, RECOVERY_WAIT_S, interval=0.1,
                what="the GPU worker to give its VRAM back")
            result["release_s"] = round(drill.clock.now() - allocated_at, 3)
            result["service_release_s"] = given["gpu"]["residency"]["last_release_s"]
            # The settle time of this give-back (after the reload, /status
            # shows what the next one would get).
            result["settle_s"] = given["gpu"]["residency"]["settle_s"]
            for future in done:
                future.result()
        residency = given["gpu"]["residency"]
        phase.check("the GPU names the app that took it",
                    residency["app"] == OTHER_APP_NAME and OTHER_APP_NAME in (given["degraded"]["reason"] or ""),
                    f"{residency['text']}; banner: {given['degraded']['reason']}")
        unanswered = [r.id for r in streams if not answered(r)]
        phase.check("the requests running when it came finished or were replayed", not unanswered,
                    ", ".join(f"{r.served_by}/{r.route_reason}: {r.outcome}" for r in streams))
        during = [drill.send(drill.record(phase, f"while the other app holds the VRAM #{i + 1}", max_tokens=8,
                                          prompt_key=f"other-app-during-{i}"),
                             chat_body(SHORT_PROMPTS[i % len(SHORT_PROMPTS)]))
                  for i in range(REQUESTS_WHILE_HELD)]
        phase.check("new requests go to the CPU as gpu_yielded",
                    all(r.served_by == "cpu" and r.route_reason == "gpu_yielded" and answered(r)
                        for r in during),
                    ", ".join(f"{r.served_by}/{r.route_reason}" for r in during))
        time.sleep(OTHER_APP_HOLD_S)
        app.quit()
        let_go_at = drill.clock.now()
        fault["cleared_s"] = round(let_go_at, 3)
        back = drill.client.wait_status(
            lambda s: s["gpu"]["residency"]["state"] == "loaded" and gpu_worker(s)["state"] == "ready",
            RECOVERY_WAIT_S, interval=0.1, what="the GPU worker to reload")
        result["reload_s"] = round(drill.clock.now() - let_go_at, 3)
        result["service_load_s"] = back["gpu"]["residency"]["last_load_s"]
        first = drill.send(drill.record(phase, "first request after the reload", max_tokens=8,
                                        prompt_key="other-app-after"), chat_body(SHORT_PROMPTS[0]))
        result["first_gpu_answer_after_let_go_s"] = round(drill.clock.now() - let_go_at, 3)
        phase.check("the first request after the reload is served by the GPU",
                    first.served_by == "gpu" and answered(first), f"{first.served_by}/{first.route_reason}")
    finally:
        if app is not None:
            app.crash()
        drill.client.admin_gpu({"yield_to_other_apps": yielding_before})
    drill.check_nothing_lost(phase, result, duplicates_before)
    phase.notes.append(
        f"the other app took {mib(result.get('took_mib'))}; VRAM released {seconds(result.get('release_s'))} after "
        f"it allocated (the service measured {seconds(result.get('service_release_s'))}); reloaded "
        f"{seconds(result.get('reload_s'))} after it let go (settle {seconds(result.get('settle_s'))}, load "
        f"{seconds(result.get('service_load_s'))}); first GPU answer "
        f"{seconds(result.get('first_gpu_answer_after_let_go_s'))} after it let go")


def second_model(drill: DrillSession, phase: PhaseResult) -> None:
    """The library's second model loads on its first request, its CPU
    fallback answering meanwhile; then, with the default model unloaded
    and another app holding enough VRAM that both can't fit, a request
    for the default model unloads the idle second one to make room.
    Nothing is lost or run twice."""
    from ..vram_hog import OtherApp

    before = drill.client.status()
    default = before["service"]["model"]
    second = next(m["name"] for m in before["models"] if m["source"] != "default")
    duplicates_before = before["accounting"]["duplicate_executions"]
    result: dict[str, Any] = {"second_model": second}
    phase.data["second_model"] = result

    def model(status: Status, name: str) -> ModelSummary:
        return next(m for m in status["models"] if m["name"] == name)

    app: OtherApp | None = None
    try:
        drill.client.admin_model(second, False)
        first = drill.send(drill.record(phase, f"first request for {second}", max_tokens=8,
                                        prompt_key="second-model-first"),
                           chat_body(SHORT_PROMPTS[0], model=second))
        phase.check(f"the first request for {second} is answered by its CPU fallback while its GPU loads",
                    answered(first) and first.served_by == "cpu" and first.route_reason == "gpu_loading",
                    f"{first.served_by}/{first.route_reason}: {first.outcome}")
        loading_from = drill.clock.now()
        loaded = drill.client.wait_status(lambda s: model(s, second)["gpu"] == "loaded", RECOVERY_WAIT_S,
                                         interval=0.1, what=f"{second} to load on the GPU")
        result["load_s"] = model(loaded, second)["last_load_s"]
        result["loaded_after_first_answer_s"] = round(drill.clock.now() - loading_from, 3)
        with ThreadPoolExecutor(2) as pool:
            both = [drill.record(phase, f"{name} with both loaded", max_tokens=8, prompt_key=f"both-{i}")
                    for i, name in enumerate((default, second))]
            done = [drill.send_in(pool, record, chat_body(SHORT_PROMPTS[1], model=name))
                    for record, name in zip(both, (default, second))]
            for future in done:
                future.result()
        phase.check("both models answer from the GPU at once",
                    all(r.served_by == "gpu" and answered(r) for r in both),
                    ", ".join(f"{r.served_by}/{r.route_reason}" for r in both))

        # Tight memory: the default model unloaded, another app holding enough that it can
        # only come back if the idle second model goes.
        loaded_status = drill.client.status()
        held = model(loaded_status, default)["vram_mib"]
        free_loaded = loaded_status["gpu"]["free_mib"] or 0.0
        unloaded = drill.client.admin_model(default, False)
        phase.check("the idle default model unloads on request", unloaded.status_code == 200, unloaded.text[:200])
        # Until the device reading shows its memory back (a reading lags an exit).
        status = drill.client.wait_status(
            lambda s: model(s, default)["gpu"] == "unloaded_idle"
            and (s["gpu"]["free_mib"] or 0.0) >= free_loaded + 0.8 * held, STATUS_WAIT_S, interval=0.1,
            what="the default model's VRAM back")
        free = status["gpu"]["free_mib"] or 0.0
        need = model(status, default)["estimated_vram_mib"] + status["gpu"]["reserve_mib"]
        second_holds = model(status, second)["vram_mib"]
        take = max(0.0, free - need + second_holds / 2)
        app = OtherApp(take, OTHER_APP_NAME,
                       simulated_dir=status["gpu"].get("simulated_device_dir") if drill.target.simulated else None)
        result["other_app_mib"] = round(take, 1)
        evictions_before = model(status, second)["evictions"]
        asked_at = drill.clock.now()
        back = drill.send(drill.record(phase, f"{default} while memory is tight", max_tokens=8,
                                       prompt_key="second-model-tight"), chat_body(SHORT_PROMPTS[2]))
        reloaded = drill.client.wait_status(lambda s: model(s, default)["gpu"] == "loaded", RECOVERY_WAIT_S,
                                           interval=0.1, what=f"{default} to load again")
        result["default_back_s"] = round(drill.clock.now() - asked_at, 3)
        phase.check(f"{default} comes back by unloading the idle {second}, counting the other app's VRAM",
                    model(reloaded, second)["evictions"] == evictions_before + 1
                    and model(reloaded, second)["gpu"] != "loaded" and answered(back),
                    f"{second}: {model(reloaded, second)['gpu']}, evictions "
                    f"{model(reloaded, second)['evictions']}; {back.served_by}/{back.route_reason}")
        after = drill.send(drill.record(phase, f"{default} after it came back", max_tokens=8,
                                        prompt_key="second-model-after"), chat_body(SHORT_PROMPTS[0]))
        phase.check(f"{default} serves from the GPU again", after.served_by == "gpu" and answered(after),
                    f"{after.served_by}/{after.route_reason}")
    finally:
        if app is not None:
            app.quit()
    drill.check_nothing_lost(phase, result, duplicates_before)
    phase.notes.append(
        f"{second} loaded {seconds(result.get('loaded_after_first_answer_s'))} after its first (CPU) answer "
        f"(the service measured {seconds(result.get('load_s'))}); with another app holding "
        f"{mib(result.get('other_app_mib'))}, {default} was back on the GPU "
        f"{seconds(result.get('default_back_s'))} after it was asked for")
