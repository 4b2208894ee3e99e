"""Phases that only send requests, so they run against a live service too:
calibration, over the GPU profile (1 and 2), cancel in the CPU queue (3),
concurrent clients (4)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from ..prompts import (
    COMPLETION_PROMPTS, OVER_CAP_QUESTIONS, SHORT_ANSWER_QUESTIONS, SHORT_PROMPTS, STORY, PromptSizer, sized_message,
)
from ..records import PhaseResult, RequestRecord
from ..session import STATUS_WAIT_S, DrillSession, answered, chat_body, completion_body
from ..target import TargetError

OVER_CAP_MAX_TOKENS = 16
# How far over the GPU context cap an over-profile request goes (tokens).
OVER_CAP_MARGIN = 24
AGREEMENT_TOKENS = 24
BLOCKER_TOKENS = 64


def calibrate(drill: DrillSession, phase: PhaseResult) -> None:
    """Two one-token requests: how many prompt tokens a filler word costs."""
    question = OVER_CAP_QUESTIONS[0]
    counts = []
    for words in (0, PromptSizer.CALIBRATION_WORDS):
        record = drill.record(phase, f"calibration, {words} filler words", max_tokens=1, forced_cpu=True)
        drill.send(record, chat_body(sized_message(words, question)))
        if not answered(record) or record.prompt_tokens is None:
            raise TargetError(f"the calibration request failed: {record.status} {record.error_code} "
                              f"{record.error_message or record.transport_error or ''}")
        counts.append(record.prompt_tokens)
    drill.sizer = PromptSizer(counts[0], counts[1])
    phase.data["calibration"] = {"base_tokens": counts[0], "tokens_per_word": round(drill.sizer.tokens_per_word, 3)}


def over_gpu_profile(drill: DrillSession, phase: PhaseResult, stream: bool = False) -> None:
    assert drill.sizer is not None and drill.gpu_cap is not None
    mode = "stream" if stream else "json"
    over_total = drill.gpu_cap + OVER_CAP_MARGIN
    over: list[RequestRecord] = []
    for i in range(drill.plan.over_cap_requests):
        # Alternately a long prompt and a short prompt with a big answer
        # budget: admission counts prompt + max_tokens against the cap.
        if (i + stream) % 2 == 0:
            question = OVER_CAP_QUESTIONS[i % len(OVER_CAP_QUESTIONS)]
            content = drill.sizer.message(over_total - OVER_CAP_MAX_TOKENS, question)
            max_tokens, label = OVER_CAP_MAX_TOKENS, f"over the GPU cap #{i + 1}: long prompt"
        else:
            content = SHORT_ANSWER_QUESTIONS[i % len(SHORT_ANSWER_QUESTIONS)]
            max_tokens = over_total - drill.sizer.base_tokens
            label = f"over the GPU cap #{i + 1}: max_tokens {max_tokens}"
        record = drill.record(phase, label, stream=stream, max_tokens=max_tokens, prompt_key=f"over-cap-{i}-{mode}")
        over.append(drill.send(record, chat_body(content)))
    wrong = [f"{r.id}: {r.status} {r.served_by}/{r.route_reason}" for r in over
             if not (answered(r) and r.served_by == "cpu" and r.route_reason == "gpu_context_cap")]
    phase.check("served by the CPU for gpu_context_cap", not wrong,
                f"{len(over) - len(wrong)}/{len(over)} answered by the CPU with gpu_context_cap"
                + (f"; not: {', '.join(wrong)}" if wrong else ""))
    for j in range(drill.plan.agreement_pairs):
        prompt = SHORT_PROMPTS[j % len(SHORT_PROMPTS)]
        key = f"pair-{j}-{mode}"
        on_gpu = drill.send(drill.record(phase, f"agreement pair {j + 1}: GPU", stream=stream,
                                         max_tokens=AGREEMENT_TOKENS, prompt_key=key), chat_body(prompt))
        on_cpu = drill.send(drill.record(phase, f"agreement pair {j + 1}: forced CPU", stream=stream,
                                         max_tokens=AGREEMENT_TOKENS, prompt_key=key, forced_cpu=True),
                            chat_body(prompt))
        if on_gpu.served_by != "gpu":
            phase.notes.append(f"agreement pair {j + 1}: the GPU request was served by {on_gpu.served_by} "
                               f"({on_gpu.route_reason}), so it compares nothing")
        phase.check(f"agreement pair {j + 1} routed as asked",
                    on_cpu.route_reason == "forced_cpu" and answered(on_cpu) and answered(on_gpu),
                    f"GPU request: {on_gpu.served_by}/{on_gpu.route_reason}; "
                    f"CPU request: {on_cpu.served_by}/{on_cpu.route_reason}")


def over_gpu_profile_stream(drill: DrillSession, phase: PhaseResult) -> None:
    over_gpu_profile(drill, phase, stream=True)


def cancel_in_cpu_queue(drill: DrillSession, phase: PhaseResult) -> None:
    # X-Force-Path: cpu puts them all on the CPU lane without touching the
    # service's settings, so this runs live too: one blocker per CPU slot
    # (llama-server decodes several at once), then the ones that must wait.
    slots = drill.client.status()["engine"]["slots"]["cpu"]
    with ThreadPoolExecutor(slots + drill.plan.queued_cancels) as pool:
        blockers = [drill.record(phase, f"CPU lane blocker #{n + 1}", max_tokens=BLOCKER_TOKENS, forced_cpu=True)
                    for n in range(slots)]
        blockers_done = [drill.send_in(pool, blocker, chat_body(STORY)) for blocker in blockers]
        for blocker in blockers:
            drill.wait_running(blocker.id, "cpu")
        for i in range(drill.plan.queued_cancels):
            queued = drill.record(phase, f"queued, then canceled #{i + 1}", stream=i % 2 == 1, max_tokens=40,
                                  forced_cpu=True, expect="canceled")
            queued_done = drill.send_in(pool, queued, chat_body(SHORT_PROMPTS[i % len(SHORT_PROMPTS)]))
            status = drill.client.wait_status(
                lambda s, queued_id=queued.id: drill.request_state(s, queued_id) == "queued",
                STATUS_WAIT_S,
                interval=0.05, what=f"{queued.id} waiting in the CPU queue")
            request = drill.request_in(status, queued.id)
            position = request["queue_position"] if request is not None else None
            cancel = drill.client.cancel(queued.id)
            state_was = cancel.json().get("state_was") if cancel.status_code == 200 else None
            queued_done.result()
            again = drill.client.cancel(queued.id)
            phase.check(f"queued request #{i + 1} canceled",
                        cancel.status_code == 200 and state_was == "queued" and queued.status == 499
                        and queued.error_code == "request_canceled" and again.status_code == 404,
                        f"queue position {position}; DELETE -> {cancel.status_code} (state_was {state_was}); "
                        f"client got {queued.status} {queued.error_code}; second DELETE -> {again.status_code}")
        for done in blockers_done:
            done.result()
    phase.check("the requests ahead were not affected", all(answered(b) for b in blockers),
                "; ".join(f"{b.id}: {b.status}, {b.completion_tokens} tokens" for b in blockers))


def concurrent_clients(drill: DrillSession, phase: PhaseResult) -> None:
    clients = drill.plan.concurrent_clients
    # Clients 1 and 5 send the same request under one Idempotency-Key at
    # the same moment, as a client retrying on a timeout does.
    shared_key = f"{drill.run_tag}-p4-shared"
    start = threading.Barrier(clients)

    def client(c: int) -> None:
        start.wait()
        for k in range(drill.plan.requests_per_client):
            kind = "completion" if c % 4 == 3 else "chat"
            stream = c % 2 == 1
            shared = k == 0 and c in (0, 4)
            p = 0 if shared else (c + k) % len(SHORT_PROMPTS)
            record = drill.record(
                phase, f"client {c + 1} request {k + 1}" + (" (shared Idempotency-Key)" if shared else ""),
                kind=kind, stream=stream, prompt_key=f"short-{p}-{kind}-{'stream' if stream else 'json'}",
                idempotency_key=shared_key if shared else None, expect="answer_or_rejected")
            body = chat_body(SHORT_PROMPTS[p]) if kind == "chat" else completion_body(COMPLETION_PROMPTS[p])
            drill.send(record, body)

    with ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client, c) for c in range(clients)]:
            future.result()
    mine = [r for r in drill.records if r.phase == phase.key]
    rejected = [r for r in mine if r.status and r.status >= 400]
    bad_rejections = [f"{r.id}: {r.status} {r.error_code}" for r in rejected
                      if r.error_code != "cpu_queue_full" or not r.retry_after]
    phase.check("rejections are clean 503s with Retry-After", not bad_rejections,
                f"{len(rejected)} rejected" + (f"; unexpected: {', '.join(bad_rejections)}" if bad_rejections else ""))
    shared = [r for r in mine if r.idempotency_key == shared_key and answered(r)]
    fresh = [r for r in shared if not r.idempotent_replay]
    phase.check("the shared Idempotency-Key ran once", len(shared) == 2 and len(fresh) == 1
                and len({(r.output_text, r.tool_calls_signature) for r in shared}) == 1,
                f"{len(shared)} answers, {len(fresh)} fresh, "
                f"{len({r.output_text for r in shared})} distinct outputs")
    routes: dict[str, int] = {}
    for r in mine:
        routes[f"{r.served_by}/{r.route_reason}"] = routes.get(f"{r.served_by}/{r.route_reason}", 0) + 1
    phase.data["routes"] = routes
