"""The GPU worker failing: its restart can't allocate (7), it is killed
mid-request (8), one request crashes it among normal traffic (9)."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

from ..client import DrillTimeout
from ..prompts import OVER_CAP_QUESTIONS, SHORT_PROMPTS, STORY
from ..records import PhaseResult
from ..session import RECOVERY_WAIT_S, STATUS_WAIT_S, DrillSession, answered, chat_body
from ..target import OwnService, gpu_worker
from .traffic import OVER_CAP_MAX_TOKENS

RESET_TOKENS = 48
# Requests sent while the poison request crashes the GPU worker.
POISON_NEIGHBOURS = 4
KILL_AFTER_STREAMED_TOKENS = 3
# A resumed answer's text read back by the tokenizer may split the token at
# the seam differently than it was generated; text repeated or lost there is
# at least what was streamed before the kill (KILL_AFTER_STREAMED_TOKENS).
SEAM_TOKEN_SLACK = 1


def alloc_failure(drill: DrillSession, phase: PhaseResult) -> None:
    assert isinstance(drill.target, OwnService) and drill.target.pressure is not None and drill.sizer is not None
    pressure = drill.target.pressure
    status = drill.client.status()
    worker = gpu_worker(status)
    need = worker["estimated_vram_mib"]
    devices = status["gpu"]["devices"]
    for process in devices[0]["processes"] if devices else ():
        if process["pid"] == worker["pid"] and process["used_mib"]:
            need = max(need, process["used_mib"])
    phase.data["gpu_worker_need_mib"] = need
    # A prompt that takes a moment to read, so the worker dies before its first token.
    prompt = drill.sizer.message(drill.gpu_cap - OVER_CAP_MAX_TOKENS - 24, OVER_CAP_QUESTIONS[2])
    victim = drill.record(phase, "in flight when the GPU worker dies", max_tokens=OVER_CAP_MAX_TOKENS)
    with ThreadPoolExecutor(1) as pool:
        victim_done = drill.send_in(pool, victim, chat_body(prompt))
        status = drill.wait_running(victim.id, "gpu")
        if pressure.starve_before_kill:
            phase.data["pressure"] = pressure.starve_restart(need)
        fault = drill.kill_gpu(phase, status, signal.SIGKILL, victim.id,
                               "GPU worker killed; its restart can't allocate")
        if not pressure.starve_before_kill:
            _wait_vram_back(drill, need)
            phase.data["pressure"] = pressure.starve_restart(need)
        victim_done.result()
    # Killed before its first token it is re-run; after, the CPU goes on from what the GPU made.
    phase.check("the request in flight was replayed or continued on the CPU",
                answered(victim) and victim.served_by == "cpu"
                and victim.route_reason in ("gpu_failed_replayed", "gpu_failed_resumed"),
                f"{victim.status} {victim.served_by}/{victim.route_reason}; GPU tokens at the kill: "
                f"{fault['gpu_tokens_at_kill']}")
    status = drill.client.wait_status(
        lambda s: s["breaker"]["state"] == "open"
        and (gpu_worker(s)["last_exit"] or {}).get("kind") == "out_of_memory",
        STATUS_WAIT_S, interval=0.05, what="the GPU restart failing out of memory and the breaker open")
    last_exit = gpu_worker(status)["last_exit"] or {}
    phase.check("the restart failed with an out-of-memory exit and the breaker opened", True,
                f"last exit: {last_exit.get('description')}; evidence: {str(last_exit.get('evidence'))[:160]}")
    phase.data["oom_exit"] = last_exit
    while_open = []
    for i in range(drill.plan.requests_while_open):
        record = drill.record(phase, f"while the breaker is open #{i + 1}", stream=i % 2 == 1,
                              prompt_key=f"short-{i}-chat-{'stream' if i % 2 else 'json'}")
        while_open.append(drill.send(record, chat_body(SHORT_PROMPTS[i % len(SHORT_PROMPTS)])))
    wrong = [f"{r.id}: {r.served_by}/{r.route_reason}" for r in while_open
             if not (answered(r) and r.served_by == "cpu" and r.route_reason == "gpu_unavailable")]
    phase.check("while the GPU can't allocate, the CPU serves (gpu_unavailable)", not wrong,
                f"{len(while_open) - len(wrong)}/{len(while_open)}" + (f"; not: {', '.join(wrong)}" if wrong else ""))
    pressure.release()
    fault["cleared_s"] = round(drill.clock.now(), 3)
    status = drill.client.wait_status(
        lambda s: gpu_worker(s)["state"] == "ready" and s["breaker"]["state"] == "half_open",
        RECOVERY_WAIT_S, interval=0.05, what="GPU worker back and the breaker half-open")
    probe = drill.send(drill.record(phase, "first request after the memory came back (probe)", max_tokens=8),
                       chat_body(SHORT_PROMPTS[1]))
    status = drill.client.status()
    phase.check("the probe ran on the GPU and closed the breaker",
                probe.served_by == "gpu" and status["breaker"]["state"] == "closed",
                f"probe {probe.served_by}/{probe.route_reason}; breaker {status['breaker']['state']}; "
                f"service's gpu_recovery_s {status['gpu_recovery_s']}")


def _wait_vram_back(drill: DrillSession, need_mib: float) -> None:
    """Real GPU: the killed worker's memory shows up as free again."""
    before = drill.client.status()["gpu"]["free_mib"] or 0.0
    try:
        drill.client.wait_status(lambda s: (s["gpu"]["free_mib"] or 0.0) >= before + 0.75 * need_mib,
                                15.0, interval=0.1, what="the killed worker's VRAM to come back")
    except DrillTimeout:
        pass  # NVML lagging is not the drill's business; the holder is sized from what it reads


def gpu_worker_reset(drill: DrillSession, phase: PhaseResult) -> None:
    reference = drill.send(drill.record(phase, "reference answer on the GPU", max_tokens=RESET_TOKENS,
                                        prompt_key="reset-story-json"), chat_body(STORY))
    if reference.served_by != "gpu":
        phase.notes.append(f"the reference answer came from {reference.served_by}; "
                           "the replayed answer is compared with nothing")
    for n, reset in enumerate(drill.plan.resets, start=1):
        sig_name, mode = reset.split(":")
        sig = signal.Signals[sig_name]
        if mode == "json":
            _reset_json(drill, phase, n, sig)
        else:
            _reset_stream(drill, phase, n, sig)
        drill.settle(phase)


def _reset_json(drill: DrillSession, phase: PhaseResult, n: int, sig: signal.Signals) -> None:
    victim = drill.record(phase, f"reset {n}: JSON request, worker killed ({sig.name})", max_tokens=RESET_TOKENS,
                          prompt_key="reset-story-json")
    with ThreadPoolExecutor(1) as pool:
        done = drill.send_in(pool, victim, chat_body(STORY))
        status = drill.wait_running(victim.id, "gpu", min_tokens=1)
        fault = drill.kill_gpu(phase, status, sig, victim.id, "GPU worker killed mid-generation")
        done.result()
    phase.check(f"reset {n}: continued once on the CPU from what the GPU made, whole answer",
                answered(victim) and victim.served_by == "cpu" and victim.route_reason == "gpu_failed_resumed"
                and victim.completion_tokens == RESET_TOKENS and victim.response_request_id == victim.id,
                f"{victim.status} {victim.served_by}/{victim.route_reason}, {victim.completion_tokens} tokens "
                f"(GPU had produced {fault['gpu_tokens_at_kill']} when killed)")


def _reset_stream(drill: DrillSession, phase: PhaseResult, n: int, sig: signal.Signals) -> None:
    key = f"{drill.run_tag}-reset-{n}"
    victim = drill.record(phase, f"reset {n}: stream, worker killed after {KILL_AFTER_STREAMED_TOKENS} tokens",
                          stream=True, max_tokens=RESET_TOKENS, idempotency_key=key)
    streamed = threading.Event()

    def on_token(count: int) -> None:
        if count >= KILL_AFTER_STREAMED_TOKENS:
            streamed.set()

    with ThreadPoolExecutor(1) as pool:
        done = drill.send_in(pool, victim, chat_body(STORY), on_token)
        if not streamed.wait(STATUS_WAIT_S):
            raise DrillTimeout(f"{victim.id} streamed no tokens")
        status = drill.client.status()
        if victim.served_by != "gpu":
            phase.notes.append(f"reset {n}: the stream was served by {victim.served_by}; no worker was killed")
            done.result()
            return
        drill.kill_gpu(phase, status, sig, victim.id, "GPU worker killed mid-stream")
        done.result()
    # A plain text answer cut mid-stream goes on on the CPU from the text
    # already sent: one stream, whole, ended as any other.
    phase.check(f"reset {n}: the stream went on on the CPU from the text sent, to its end",
                victim.saw_done and victim.error_code is None and victim.transport_error is None,
                f"{len(victim.output_tokens or [])} tokens, then "
                f"{'[DONE]' if victim.saw_done else victim.error_code}; connection "
                f"{'kept' if victim.transport_error is None else 'broken: ' + victim.transport_error}")
    _check_seam(drill, phase, n, victim)
    # A careful client that retries a stream uses the same Idempotency-Key,
    # so that a retry can never run twice: it gets the recorded answer.
    same_key = drill.record(phase, f"reset {n}: retry with the same Idempotency-Key", stream=True,
                            max_tokens=RESET_TOKENS, idempotency_key=key, retry_of=victim.id)
    drill.send(same_key, chat_body(STORY))
    phase.check(f"reset {n}: a retry with the same Idempotency-Key gets an answer", answered(same_key),
                f"{same_key.status}, idempotent replay: {same_key.idempotent_replay}, "
                + ("answered" if answered(same_key) else f"got {same_key.error_code or 'no answer'}"))
    final = same_key
    if not answered(same_key):
        final = drill.record(phase, f"reset {n}: retry with a new Idempotency-Key", stream=True,
                             max_tokens=RESET_TOKENS, idempotency_key=f"{key}-new", retry_of=victim.id)
        drill.send(final, chat_body(STORY))
    if answered(final) and victim.output_tokens:
        drill.prefix_pairs.append({
            "partial_id": victim.id, "full_id": final.id, "partial": list(victim.output_tokens),
            "full": list(final.output_tokens or []), "partial_path": victim.served_by, "full_path": final.served_by,
        })


def _check_seam(drill: DrillSession, phase: PhaseResult, n: int, victim) -> None:
    """Nothing repeated or lost where the CPU took over: an answer cut at
    max_tokens holds exactly that many tokens, the GPU's and the CPU's
    together, so the tokenizer reads its text back at about that count;
    text sent twice at the seam, or skipped, moves the count by the piece's
    length. An answer that stopped early is held to its own event count."""
    if not victim.saw_done or not victim.output_text:
        return
    expected = RESET_TOKENS if victim.finish_reason == "length" else len(victim.output_tokens or [])
    counted = drill.client.count_tokens(victim.output_text)
    phase.check(f"reset {n}: no text repeated or lost at the seam",
                abs(counted - expected) <= SEAM_TOKEN_SLACK,
                f"the text reads back as {counted} tokens; {expected} were generated "
                f"(finish_reason {victim.finish_reason})")


def poison_request(drill: DrillSession, phase: PhaseResult) -> None:
    """A request that crashes the worker serving it (a segfault, which is
    what bad input does to llama.cpp) is not replayed onto the CPU, is
    refused when retried, and costs the GPU worker one restart; the
    requests around it are all answered."""
    before = drill.client.status()
    gpu_before = gpu_worker(before)
    cpu_before = next(w for w in before["workers"] if w["role"] == "cpu")
    poison_body = chat_body(STORY + " (poison)")
    poison = drill.record(phase, "poison: the GPU worker segfaults serving it", max_tokens=RESET_TOKENS,
                          expect="error")
    # The traffic around it runs on the CPU: llama-server decodes its slots
    # together, so a crash is pinned on a request only when it was alone in
    # the process; with others inside, all of them are replayed instead
    # (tests/unit/core/dispatch/test_dispatcher.py covers that case).
    normal = [drill.record(phase, f"normal traffic #{i + 1}", stream=i % 2 == 1, forced_cpu=True,
                           max_tokens=8, prompt_key=f"poison-neighbour-{i}") for i in range(POISON_NEIGHBOURS)]
    with ThreadPoolExecutor(1 + len(normal)) as pool:
        done = drill.send_in(pool, poison, poison_body)
        status = drill.wait_running(poison.id, "gpu", min_tokens=1)
        neighbours = [drill.send_in(pool, record, chat_body(SHORT_PROMPTS[i % len(SHORT_PROMPTS)]))
                      for i, record in enumerate(normal)]
        drill.kill_gpu(phase, status, signal.SIGSEGV, poison.id, "GPU worker segfaults on one request")
        done.result()
        for neighbour in neighbours:
            neighbour.result()
    phase.check("the poison request failed with request_crashed_worker and was not replayed",
                poison.error_code == "request_crashed_worker" and poison.route_reason != "gpu_failed_replayed",
                f"{poison.status} {poison.error_code}, served by {poison.served_by}/{poison.route_reason}")
    retry = drill.send(drill.record(phase, "poison retried unchanged", max_tokens=RESET_TOKENS,
                                    expect="rejected", retry_of=poison.id), poison_body)
    phase.check("its unchanged retry is refused at once, no worker touched",
                retry.error_code == "request_crashed_worker", f"{retry.status} {retry.error_code}")
    unanswered = [r.id for r in normal if not answered(r)]
    phase.check("every request around it was answered", not unanswered,
                f"{len(normal) - len(unanswered)}/{len(normal)}" + (f"; not: {unanswered}" if unanswered else ""))
    after = drill.client.wait_status(lambda s: gpu_worker(s)["state"] == "ready", RECOVERY_WAIT_S,
                                    interval=0.1, what="GPU worker back")
    cpu_after = next(w for w in after["workers"] if w["role"] == "cpu")
    restarts = gpu_worker(after)["restarts"] - gpu_before["restarts"]
    phase.check("the GPU worker restarted once and the CPU worker not at all",
                restarts == 1 and cpu_after["pid"] == cpu_before["pid"],
                f"GPU restarts: {restarts}; CPU pid {cpu_before['pid']} -> {cpu_after['pid']}")
