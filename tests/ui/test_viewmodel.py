"""The Qt-free view model: plain dicts in, what the UI shows out."""

from __future__ import annotations

import copy
import sys
import time

import pytest

from tests.status_sample import conforming
from tray_app.core.config import Config, bundled_model_path
from tray_app.ui import viewmodel as vm

# A whole /status (tests/status_sample.py's) with what these tests are about written out.
READY = conforming({
    "service": {"model": "SmolLM2", "healthy": True, "health_reason": "the GPU path can serve", "gpu_paused": False},
    "workers": [
        {"role": "gpu", "state": "ready", "pid": 11, "n_ctx": 4096, "rss_mib": 280.5, "estimated_vram_mib": 832.9,
         "estimated_ram_mib": 1246.9, "restarts": 0, "last_exit": None},
        {"role": "cpu", "state": "ready", "pid": 12, "n_ctx": 2048, "rss_mib": 235.4, "estimated_vram_mib": 0.0,
         "estimated_ram_mib": 833.9, "restarts": 0, "last_exit": None},
    ],
    "gpu": {"available": True, "simulated": True, "total_mib": 2048.0, "free_mib": 1215.1, "used_mib": 832.9,
            "reason": None, "reserve_mib": 512, "path_out_reason": None, "pressure_mib": 0.0,
            "devices": [{"index": 0, "name": "Simulated GPU", "total_mib": 2048.0, "used_mib": 832.9,
                         "free_mib": 1215.1}]},
    "ram": {"total_mib": 24105.6, "available_mib": 22045.3, "swap_total_mib": 0.0, "swap_used_mib": 0.0,
            "rss_mib_by_pid": {"11": 280.6, "12": 235.5}, "floor_mib": 1024.0},
    "breaker": {"state": "closed"},
    "queues": {"gpu": {"running": 0, "concurrency": 1, "depth": 0, "limit": 2, "oldest_age_s": 0.0},
               "cpu": {"running": 0, "concurrency": 1, "depth": 0, "limit": 8, "oldest_age_s": 0.0}},
    "degraded": {"active": False, "reason": None, "since": None, "fallback_model": "SmolLM2",
                 "fallback_equivalent": True, "fallback_detail": "same model file on both paths",
                 "estimated_latency_s": 25.92, "cpu_context_cap": 2048, "cpu_queue_depth": 0},
    "requests": [],
})


def status(**changes) -> dict:
    data = copy.deepcopy(READY)
    for path, value in changes.items():
        node = data
        keys = path.split("__")
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
    return conforming(data)


def whole_requests(rows: list[dict]) -> list[dict]:
    """/status requests a test writes in part, each completed from a whole one."""
    return conforming({"requests": rows})["requests"]


def whole_request(row: dict) -> dict:
    return whole_requests([row])[0]


def paused() -> dict:
    data = status(service__gpu_paused=True, gpu__path_out_reason="the GPU path is paused (force CPU)")
    data["degraded"].update(active=True, reason="the GPU path is paused (force CPU)", since=1.0)
    return data


# ----- icon state ---------------------------------------------------------------------------

def test_icon_kind_for_each_state() -> None:
    assert vm.icon_kind(READY) == vm.GPU
    assert vm.icon_kind(paused()) == vm.DEGRADED
    assert vm.icon_kind(None) == vm.DOWN
    assert vm.icon_kind(None, service_starting=True) == vm.STARTING


def test_first_start_of_the_gpu_worker_is_starting_not_degraded() -> None:
    data = status(gpu__path_out_reason="the GPU worker is starting")
    data["degraded"].update(active=True, reason="the GPU worker is starting")
    data["workers"][0]["state"] = "starting"
    assert vm.icon_kind(data) == vm.STARTING
    # ...but a GPU worker coming back after a crash is degraded mode.
    data["workers"][0].update(restarts=1, last_exit={"kind": "crash", "description": "killed by SIGKILL"})
    assert vm.icon_kind(data) == vm.DEGRADED


def test_unhealthy_is_starting_while_workers_start_and_down_otherwise() -> None:
    data = status(service__healthy=False)
    data["workers"][1]["state"] = "starting"
    assert vm.icon_kind(data) == vm.STARTING
    data["workers"][1]["state"] = "unhealthy"
    data["workers"][0]["state"] = "stopped"
    assert vm.icon_kind(data) == vm.DOWN


def test_a_cpu_request_for_lack_of_vram_is_degraded_even_if_the_gpu_path_is_up() -> None:
    data = status()
    data["degraded"].update(active=True, reason="gpu_vram_headroom: needs 72 MiB but only 0 MiB is free")
    assert vm.icon_kind(data) == vm.DEGRADED


# ----- numbers, bars, tooltip ------------------------------------------------------------------

def test_fmt_mib() -> None:
    assert vm.fmt_mib(None) == "unknown"
    assert vm.fmt_mib(1215.1) == "1,215 MiB"
    assert vm.fmt_mib(22045.3) == "21.5 GiB"
    assert vm.fmt_mib(2100, 24564) == "2.1 GiB"  # the unit of what it is a part of


def test_vram_bar_splits_used_reserve_and_headroom() -> None:
    (bar,) = vm.vram_bars(READY)
    assert bar.note == "simulated"
    assert bar.total_mib == 2048.0
    parts = {s.key: round(s.mib, 1) for s in bar.segments}
    assert parts == {"worker": 832.9, "used": 0.0, "reserve": 512.0, "free": 703.1}
    assert round(sum(s.mib for s in bar.segments), 1) == 2048.0
    assert bar.caption == "1,215 MiB free of 2,048 MiB"
    assert not bar.warning


def test_vram_bar_shows_a_reserve_shortfall() -> None:
    data = status(gpu__free_mib=315.1, gpu__used_mib=1732.9)
    data["gpu"]["devices"][0].update(free_mib=315.1, used_mib=1732.9)
    (bar,) = vm.vram_bars(data)
    parts = {s.key: round(s.mib, 1) for s in bar.segments}
    assert parts["reserve"] == 315.1 and parts["free"] == 0.0 and parts["used"] == 900.0
    assert "197 MiB below the 512 MiB reserve" in bar.warning


def test_a_reserve_shortfall_still_names_the_configured_reserve() -> None:
    data = status(gpu__free_mib=315.1, gpu__used_mib=1732.9)
    data["gpu"]["devices"][0].update(free_mib=315.1, used_mib=1732.9)
    (bar,) = vm.vram_bars(data)
    (reserve,) = [s for s in bar.segments if s.key == "reserve"]
    assert reserve.figure == data["gpu"]["reserve_mib"] == 512  # what the legend says
    assert round(reserve.mib, 1) == 315.1                        # how much of the bar it takes
    text = vm.tooltip_text(data)
    assert "VRAM (simulated): 0 MiB headroom (197 MiB short of the reserve)" in text
    assert "-197" not in text


def test_ram_headroom_is_never_negative_in_the_tooltip() -> None:
    data = status(ram__available_mib=800.0)
    assert "RAM: 0 MiB headroom (224 MiB short of the floor)" in vm.tooltip_text(data, floor_mib=1024)


def test_a_gpu_reporting_zero_total_is_unknown_not_full() -> None:
    data = status(gpu__total_mib=0.0, gpu__free_mib=0.0, gpu__used_mib=0.0)
    data["gpu"]["devices"][0].update(total_mib=0.0, free_mib=0.0, used_mib=0.0)
    (bar,) = vm.vram_bars(data)
    assert bar.segments == () and not bar.warning
    assert bar.caption == "free VRAM unknown" and "0 MiB" not in bar.caption
    assert "VRAM (simulated): unknown" in vm.tooltip_text(data)
    assert vm.History().add(data, now=0).vram_total_mib is None


def test_vram_bar_without_a_gpu_reading() -> None:
    # The GPU worker is there, its memory can't be read: the bar says so in a
    # few words, and the driver's error text wraps on the line below it.
    (bar,) = vm.vram_bars(status(gpu__available=False, gpu__reason="NVML not found"))
    assert bar.segments == () and bar.caption == "no GPU reading" and "NVML not found" in bar.warning


def test_one_bar_per_device() -> None:
    data = status()
    data = conforming({**data, "gpu": {**data["gpu"], "devices": [*data["gpu"]["devices"], {
        "index": 1, "name": "Second", "total_mib": 8192.0, "used_mib": 192.0, "free_mib": 8000.0}]}})
    bars = vm.vram_bars(data)
    assert [b.title for b in bars] == ["VRAM · Simulated GPU (GPU 0)", "VRAM · Second (GPU 1)"]
    assert [s.key for s in bars[1].segments] == ["used", "free"]


def test_ram_bar_with_floor_from_config() -> None:
    bar = vm.ram_bar(READY, floor_mib=1024)
    parts = {s.key: round(s.mib, 1) for s in bar.segments}
    assert parts["worker"] == 516.1
    assert parts["reserve"] == 1024
    assert round(parts["free"], 1) == 21021.3
    assert bar.caption == "21.5 GiB available of 23.5 GiB"


def test_ram_floor_prefers_the_service_value() -> None:
    data = status()
    data["ram"]["floor_mib"] = 2048
    assert vm.ram_floor_mib(data, 1024) == 2048
    # The config's value stands in only while there is no status to read.
    assert vm.ram_floor_mib(None, 512) == 512


def test_tooltip_gives_headroom_numbers() -> None:
    text = vm.tooltip_text(READY, floor_mib=1024)
    assert text.splitlines()[0] == "tray-app: serving on the GPU"
    assert "VRAM (simulated): 703 MiB headroom (1,215 MiB free of 2,048 MiB, 512 MiB reserved)" in text
    assert "RAM: 20.5 GiB headroom (21.5 GiB available of 23.5 GiB, 1,024 MiB floor)" in text
    degraded = vm.tooltip_text(paused(), floor_mib=1024)
    assert "degraded" in degraded.splitlines()[0]
    assert "Why: the GPU path is paused (force CPU)" in degraded
    assert "not answering" in vm.tooltip_text(None)
    assert "starting" in vm.tooltip_text(None, service_starting=True)


# ----- banner ---------------------------------------------------------------------------------

def test_no_banner_when_serving_on_the_gpu() -> None:
    assert vm.degraded_banner(READY) is None
    assert vm.degraded_banner(None) is None


def test_panel_banner_lists_the_running_cpu_request_before_the_queue() -> None:
    data = paused()
    data["requests"] = whole_requests([
        {"id": "long", "state": "running", "path": "cpu", "reason": "forced_cpu", "age_s": 3.0,
         "estimated_latency_s": 30.2, "queue_position": None},
        {"id": "short", "state": "queued", "path": "cpu", "reason": "forced_cpu", "age_s": 1.0,
         "estimated_latency_s": 31.9, "queue_position": 1},
        {"id": "gpu-one", "state": "running", "path": "gpu", "reason": "admitted", "age_s": 1.0},
    ])
    data["degraded"]["cpu_queue_depth"] = 1
    banner = vm.degraded_banner(data)
    assert banner is not None
    assert banner.reason == "The GPU path is paused (force CPU)"
    assert banner.model == "SmolLM2"
    assert banner.limits == "context up to 2,048 tokens · 1 waiting (limit 8)"
    assert banner.latency == "a new request would be answered in about 26 s, queue included"
    # As a queue reads: what is being served, then who waits, in order.
    assert [r.id for r in banner.requests] == ["long", "short"]
    assert banner.requests[0].text.startswith("long · running on the CPU")
    assert banner.requests[1].text == "short · 1st in the CPU queue · about 31 s left · 1.0 s old"


def test_chat_banner_is_about_its_own_request() -> None:
    data = paused()
    data["requests"] = whole_requests([
        {"id": "other", "state": "running", "path": "cpu", "reason": "forced_cpu", "estimated_latency_s": 30.0},
        {"id": "mine", "state": "queued", "path": "cpu", "reason": "forced_cpu", "detail": "paused",
         "estimated_latency_s": 12.6, "queue_position": 2},
    ])
    banner = vm.degraded_banner(data, own_request_id="mine")
    assert banner is not None
    assert [r.id for r in banner.requests] == ["mine"]
    assert banner.requests[0].text == "Your request · 2nd in the CPU queue · about 13 s left"
    assert "you are 2nd in the queue" in banner.limits
    assert banner.latency == "a new request would be answered in about 26 s, queue included"


def test_chat_banner_shows_for_a_cpu_answer_outside_degraded_mode() -> None:
    data = status()
    data["requests"] = whole_requests([{"id": "mine", "state": "running", "path": "cpu", "reason": "gpu_context_cap",
                         "detail": "prompt is over the GPU context cap", "estimated_latency_s": 5.0}])
    banner = vm.degraded_banner(data, own_request_id="mine")
    assert banner is not None and banner.reason.startswith("Over the GPU context cap")
    assert vm.degraded_banner(data) is None  # the panel only shows degraded mode


def test_idle_chat_banner_lists_no_other_clients_requests() -> None:
    data = paused()
    data["requests"] = whole_requests([{"id": "other", "state": "running", "path": "cpu", "reason": "forced_cpu",
                         "age_s": 2.0, "estimated_latency_s": 30.0}])
    idle_chat = vm.degraded_banner(data, own_request_id=None, only_own=True)
    assert idle_chat is not None and idle_chat.requests == () and idle_chat.more == 0
    just_sent = vm.degraded_banner(data, own_request_id="mine-not-in-status-yet", only_own=True)
    assert just_sent is not None and just_sent.requests == ()
    assert [r.id for r in vm.degraded_banner(data).requests] == ["other"]  # the panel lists them all


def test_rows_say_time_left_or_overdue_from_the_latest_poll() -> None:
    request = {"id": "r", "state": "running", "path": "cpu", "estimated_latency_s": 30.0, "age_s": 8.0}
    assert vm.time_left_text(request) == "about 22 s left"
    assert vm.time_left_text({**request, "age_s": 29.8}) == "due now"
    assert vm.time_left_text({**request, "age_s": 42.0}) == "overdue by 12 s"
    assert vm.time_left_text({**request, "estimated_latency_s": None}) == ""
    data = paused()
    data["requests"] = whole_requests([request])
    first = vm.degraded_banner(data).requests[0].text
    data["requests"] = whole_requests([{**request, "age_s": 42.0}])
    later = vm.degraded_banner(data).requests[0].text
    assert "about 22 s left" in first and "overdue by 12 s" in later


def test_banner_lists_three_requests_then_a_count() -> None:
    data = paused()
    data["requests"] = whole_requests([{"id": f"q{n}", "state": "queued", "path": "cpu", "reason": "forced_cpu",
                         "queue_position": n, "age_s": 1.0, "estimated_latency_s": 20.0} for n in range(1, 9)])
    banner = vm.degraded_banner(data)
    assert [r.id for r in banner.requests] == ["q1", "q2", "q3"]
    assert banner.more == 5
    data["requests"] = data["requests"][:3]
    assert vm.degraded_banner(data).more == 0


def test_banner_warns_about_a_different_fallback_model() -> None:
    data = paused()
    data["degraded"].update(fallback_equivalent=False, fallback_detail="chat template differs")
    banner = vm.degraded_banner(data)
    assert banner is not None and "different model" in banner.model and "chat template differs" in banner.warning


def test_humanize_reason() -> None:
    assert vm.humanize_reason("gpu_vram_headroom: needs 72 MiB") == "Not enough VRAM headroom: needs 72 MiB"
    assert vm.humanize_reason("the GPU worker is starting") == "The GPU worker is starting"


# ----- chat helpers ---------------------------------------------------------------------------

def test_route_line_says_reasons_in_words() -> None:
    assert vm.route_line("gpu", "admitted") == "served by GPU · admitted"
    assert vm.route_line("cpu", "gpu_vram_headroom", progress="about 3.2 s left") == \
        "served by CPU · not enough VRAM headroom · about 3.2 s left"
    assert vm.route_line("cpu", "forced_cpu", "Small", took_s=4.0) == \
        "served by CPU · GPU paused (force CPU) · Small · took 4.0 s"
    assert vm.route_line("cpu", "some_new_reason") == "served by CPU · some new reason"


def test_sse_parser_handles_split_chunks_and_done() -> None:
    parser = vm.SseParser()
    first = b'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\ndata: {"choices":[{"delta":'
    assert [vm.delta_text(e) for e in parser.feed(first)] == ["Hel"]
    events = parser.feed(b'{"content":"lo"}}]}\r\n\r\n: keep-alive\n\ndata: [DONE]\n\n')
    assert vm.delta_text(events[0]) == "lo"
    assert events[1] == vm.DONE


def test_sse_parser_error_event_and_unterminated_end() -> None:
    parser = vm.SseParser()
    assert parser.feed(b'data: {"error": {"message": "canceled", "code": "request_canceled"}}') == []
    (event,) = parser.close()
    assert vm.error_message(event) == ("canceled", "request_canceled")
    assert vm.error_message(b"not json", 502) == ("HTTP 502", "")


# ----- history and notifications ---------------------------------------------------------------

def test_history_keeps_the_window() -> None:
    history = vm.History(window_s=10)
    for t in range(30):
        history.add(READY, now=float(t))
    assert len(history.samples) == 11
    assert history.latest().vram_free_mib == 1215.1
    assert history.latest().ram_available_mib == 22045.3


def test_notifier_says_when_degraded_mode_starts_and_ends_once() -> None:
    notifier = vm.DegradedNotifier(settle_s=5, quiet_s=60)
    assert notifier.update(None, service_starting=True, now=0) is None
    assert notifier.update(READY, now=1) is None
    assert notifier.update(paused(), now=2) is None  # not yet: it may be a blip
    start = notifier.update(paused(), now=7)
    assert start is not None and start.kind == "degraded_start"
    assert "The GPU path is paused (force CPU)." in start.message and "SmolLM2" in start.message
    assert "a new request starts at once" in start.message
    assert notifier.update(paused(), now=8) is None
    end = notifier.update(READY, now=9)
    assert end is not None and end.kind == "degraded_end"
    assert notifier.update(READY, now=10) is None


def test_notifier_ignores_blips_and_stays_quiet_for_a_minute() -> None:
    notifier = vm.DegradedNotifier(settle_s=5, quiet_s=60)
    notices = []
    for t in range(0, 20, 2):  # degraded for 1 s out of every 2: never settles
        notices.append(notifier.update(paused(), now=t))
        notices.append(notifier.update(READY, now=t + 1))
    assert [n for n in notices if n] == []
    assert notifier.update(paused(), now=100) is None
    assert notifier.update(paused(), now=105).kind == "degraded_start"
    assert notifier.update(READY, now=106).kind == "degraded_end"
    # Back within the minute: no second pair of notices, however long it lasts.
    assert all(notifier.update(paused(), now=t) is None for t in range(107, 165))
    assert notifier.update(paused(), now=166).kind == "degraded_start"


def busy_overflow() -> dict:
    data = status()
    data["degraded"].update(active=True, reason="gpu_busy: the GPU queue is full", since=1.0)
    data["requests"] = whole_requests([{"id": "overflow", "state": "running", "path": "cpu", "reason": "gpu_busy",
                         "detail": "the GPU queue is full", "age_s": 1.0, "estimated_latency_s": 9.0}])
    return data


def test_a_busy_gpu_overflowing_to_the_cpu_is_not_announced_as_degraded() -> None:
    notifier = vm.DegradedNotifier(settle_s=5, quiet_s=60)
    assert vm.is_busy_overflow(busy_overflow()) and not vm.is_busy_overflow(paused())
    assert all(notifier.update(busy_overflow(), now=t) is None for t in range(30))
    assert notifier.update(READY, now=31) is None
    assert vm.state_detail(busy_overflow()) == "The GPU is busy; the CPU takes the overflow."
    assert vm.state_title(busy_overflow()) == vm.degraded_banner(busy_overflow()).title == vm.BUSY_TITLE
    tooltip = vm.tooltip_text(busy_overflow())
    assert tooltip.splitlines()[0] == "tray-app: busy: the CPU takes the GPU's overflow"
    assert "Why: GPU busy: the GPU queue is full" in tooltip  # in words, not gpu_busy


def test_timed_note_holds_for_a_few_seconds() -> None:
    now = [100.0]
    note = vm.TimedNote(hold_s=6, clock=lambda: now[0])
    assert note.text() == ""
    note.show("Cancel failed: gone")
    now[0] += 5.9
    assert note.text() == "Cancel failed: gone"
    now[0] += 0.2
    assert note.text() == ""


# ----- settings -------------------------------------------------------------------------------

def test_settings_values_round_trip() -> None:
    values = vm.settings_values(Config())
    assert values["gpu_ctx"] == "0" and values["port"] == "8642" and values["model_path"] == ""
    overrides, errors = vm.validate_settings(Config(), values)
    assert errors == {}
    assert vm.changed_overrides(Config(), overrides) == {}


@pytest.mark.parametrize(("field", "value", "message"), [
    ("gpu_ctx", "10", "[gpu] n_ctx must be 0 (sized from memory) or at least 64, got 10"),
    ("cpu_ctx", "lots", "must be a whole number, got 'lots'"),
    ("reserve", "-5", "[gpu] reserve_mib must be at least 0, got -5"),
    ("gpu_layers", "-2", "[gpu] n_gpu_layers must be at least -1, got -2"),
    ("port", "0", "must be from 1 to 65535, got 0"),
    ("port", "70000", "must be from 1 to 65535, got 70000"),
    ("port", "", "must not be empty"),
    ("model_path", "/nonexistent/model.gguf", "does not exist"),
    ("fallback_path", sys.executable, "is not a GGUF file"),
])
def test_settings_reject_bad_values_next_to_their_field(field: str, value: str, message: str) -> None:
    values = vm.settings_values(Config())
    values[field] = value
    overrides, errors = vm.validate_settings(Config(), values)
    assert list(errors) == [field]
    assert message in errors[field]


def test_settings_accept_a_real_model_and_report_only_changes() -> None:
    values = vm.settings_values(Config())
    values.update(model_path=str(bundled_model_path()), cpu_ctx=" 1024 ")
    overrides, errors = vm.validate_settings(Config(), values)
    assert errors == {}
    assert vm.changed_overrides(Config(), overrides) == {
        "model": {"path": str(bundled_model_path())}, "cpu": {"n_ctx": 1024}}


def test_worker_rows() -> None:
    rows = vm.worker_rows(READY)
    assert [(r.role, r.state, r.rss, r.vram, r.ctx) for r in rows] == [
        ("GPU", "ready", "280 MiB", "833 MiB", "4,096"), ("CPU", "ready", "235 MiB", "-", "2,048")]


def test_worker_rows_say_how_speculative_decoding_fares() -> None:
    drafting = {"speculative": "ngram-mod", "drafts": {"answers": 3, "drafted": 200, "accepted": 124,
                                                       "acceptance": 0.62, "window_s": 300.0}}
    assert vm.drafts_text({"speculative": None, "drafts": None}) == "-"
    assert vm.drafts_text({**drafting, "drafts": {**drafting["drafts"], "acceptance": None}}) == "ngram-mod"
    assert vm.drafts_text(drafting) == "ngram-mod 62%"
    assert [r.drafts for r in vm.worker_rows(READY)] == ["-", "-"]


# ----- asking before a restart stops requests -----------------------------------------------

def test_interruption_warning_counts_what_a_restart_would_stop() -> None:
    assert vm.interruption_warning(READY, "Restarting the workers") is None
    assert vm.interruption_warning(None, "Restarting the workers") is None
    one = status(requests=[{"id": "a", "state": "queued", "path": "cpu"}])
    assert vm.interruption_warning(one, "Switching the model") == (
        "1 queued request is in the service. Switching the model now will stop it; the clients get an error. "
        "Continue?")
    two = status(requests=[{"id": "a", "state": "running", "path": "gpu"}, {"id": "b", "state": "running"}])
    assert vm.interruption_warning(two, "Restarting the workers").startswith("2 running requests are")


def test_an_engine_fallback_is_said_in_the_panel_and_the_tooltip():
    status = conforming({
        "service": {"healthy": True, "health_reason": "the GPU path can serve"},
        "workers": [{"role": "gpu", "state": "ready"}, {"role": "cpu", "state": "ready"}],
        "gpu": {"available": True}, "degraded": {"active": False},
        "engine": {"runtime": "llama-cpp-python", "configured": "llama-server",
                   "fallback_reason": "llama-server is not installed beside llama-cpp-python"}})
    assert "Engine: llama-cpp-python instead of llama-server" in vm.state_detail(status)
    assert "not installed" in vm.tooltip_text(status)
    status["engine"]["fallback_reason"] = None
    assert "Engine" not in vm.state_detail(status) and "Engine" not in vm.tooltip_text(status)


def test_the_tray_menu_says_the_headroom_in_one_line():
    status = conforming({"gpu": {"available": True, "free_mib": 945.0, "reserve_mib": 512.0},
                         "ram": {"available_mib": 23040.0, "floor_mib": 1024.0}})
    assert vm.menu_headroom_text(status) == "VRAM 433 MiB headroom · RAM 21.5 GiB headroom"
    status["gpu"].update(available=False, reason="no NVIDIA driver")
    assert vm.menu_headroom_text(status).startswith("VRAM: no GPU · RAM")
    assert vm.menu_headroom_text(None) == "Memory: no reading yet"


def test_a_banner_row_names_the_client_that_sent_the_request():
    row = whole_request({"id": "req-1", "client": "Open WebUI", "state": "running", "path": "cpu", "age_s": 3.0})
    assert vm.request_line(row).startswith("Open WebUI · running on the CPU")
    assert vm.request_line({**row, "client": None}).startswith("req-1 · ")


def test_the_vram_bar_names_the_other_apps_largest_first_without_our_workers():
    processes: list = [{"pid": 11, "used_mib": 300.0, "name": "steam"}, {"pid": 12, "used_mib": 412.0, "name": "firefox"},
                 {"pid": 99, "used_mib": 1103.0, "name": "llama-server"}, {"pid": 13, "used_mib": None, "name": None},
                 *({"pid": 20 + i, "used_mib": 10.0, "name": f"app{i}"} for i in range(3))]
    assert vm.other_apps_text(processes, {99}) == \
        "Other apps: firefox 412 MiB · steam 300 MiB · app0 10 MiB · app1 10 MiB · 2 more"
    assert vm.other_apps_text([{"pid": 99, "used_mib": 5.0, "name": None}], {99}) == ""
    status = conforming({"gpu": {"available": True, "reserve_mib": 512.0, "devices": [
        {"index": 0, "name": "RTX", "total_mib": 8192.0, "used_mib": 2000.0, "free_mib": 6192.0,
         "processes": processes[:3]}]}, "workers": [{"role": "gpu", "pid": 99, "estimated_vram_mib": 1103.0}],
        "peers": []})
    assert vm.vram_bars(status)[0].apps == "Other apps: firefox 412 MiB · steam 300 MiB"



# ----- sharing the GPU --------------------------------------------------------------------

def with_residency(state: str, **fields) -> dict:
    data = status()
    residency = {"state": state, "text": None, "since": 1_700_000_000.0, "load_eta_s": 3.0, "last_load_s": None,
                 **fields}
    data["gpu"]["residency"] = {**data["gpu"]["residency"], **residency}  # the sample's, changed
    if state in ("given_away", "given_back_by_user", "loading"):
        reason = fields.get("text") or state
        data["gpu"]["path_out_reason"] = reason
        data["degraded"].update(active=True, reason=reason, since=1.0)
    elif state == "unloaded_idle":
        data["gpu"]["path_out_reason"] = "the GPU worker is unloaded (idle) and loads on the next request"
    return data


def test_an_idle_unloaded_gpu_is_not_an_outage() -> None:
    idle = with_residency("unloaded_idle", text="GPU unloaded (idle)")
    assert vm.icon_kind(idle) == vm.GPU
    assert vm.state_title(idle) == vm.IDLE_TITLE
    since = time.strftime("%H:%M", time.localtime(1_700_000_000.0))
    assert vm.residency_text(idle) == f"GPU: unloaded (idle) since {since}"
    assert vm.give_back_label(idle) == "Give the GPU &back now"


def test_a_gpu_given_to_a_game_names_the_game_and_offers_it_back() -> None:
    given = with_residency("given_away", text="GPU given to steam (9.1 GiB)", app="steam")
    assert vm.icon_kind(given) == vm.DEGRADED
    assert vm.residency_text(given).startswith("GPU: given to steam (9.1 GiB) since ")
    assert vm.give_back_label(given) == "Use the GPU &again"
    assert vm.give_back_label(with_residency("given_back_by_user")) == "Use the GPU &again"
    assert vm.residency_text(with_residency("loaded")) is None
    assert vm.residency_text(READY) is None and vm.residency_state(READY) == "loaded"
    assert vm.residency_text(with_residency("loading")) == "GPU: loading the model (about 3.0 s)"


def test_residency_notices_say_when_the_gpu_was_given_back_and_taken_again() -> None:
    notifier = vm.ResidencyNotifier()
    degraded = vm.DegradedNotifier(settle_s=0, quiet_s=0)
    given = with_residency("given_away", text="GPU given to steam (9.1 GiB)")
    assert notifier.update(with_residency("loaded")) is None  # the first snapshot is the baseline
    notice = notifier.update(given)
    assert notice is not None and notice.kind == "gpu_given_back"
    assert "GPU given to steam (9.1 GiB)" in notice.message and "SmolLM2" in notice.message
    assert notifier.update(given) is None
    # The degraded notice stays quiet: this one said it.
    assert degraded.update(given, now=100.0) is None
    back = notifier.update(with_residency("loaded", last_load_s=2.4))
    assert back is not None and back.kind == "gpu_taken_again" and "2.4 s" in back.message
    # Idle unloading and loading are no news.
    assert notifier.update(with_residency("unloaded_idle")) is None
    assert notifier.update(with_residency("loading")) is None
    assert notifier.update(with_residency("loaded")) is None


def test_the_gpu_taken_again_notice_survives_the_loading_in_between() -> None:
    notifier = vm.ResidencyNotifier()
    degraded = vm.DegradedNotifier(settle_s=0, quiet_s=0)
    notifier.update(with_residency("loaded"))
    assert notifier.update(with_residency("given_away", text="GPU given to steam (9.1 GiB)")).kind == "gpu_given_back"
    loading = with_residency("loading")
    assert notifier.update(loading) is None
    assert degraded.update(loading, now=50.0) is None  # a load is no outage worth a notice
    back = notifier.update(with_residency("loaded", last_load_s=6.0))
    assert back is not None and back.kind == "gpu_taken_again"
    # A load that follows an idle unload is no news either way.
    notifier.update(with_residency("unloaded_idle"))
    notifier.update(with_residency("loading"))
    assert notifier.update(with_residency("loaded")) is None


# ----- peers ------------------------------------------------------------------------------------

def test_the_banner_names_the_peer_that_serves_and_lists_its_request() -> None:
    data = paused()
    data["degraded"]["model"] = "SmolLM2"
    data["degraded"]["peers"] = ["desk"]
    data["requests"] = whole_requests([{"id": "away", "state": "running", "path": "peer", "peer": "desk", "reason": "peer",
                         "age_s": 2.0, "estimated_latency_s": 3.0}])
    banner = vm.degraded_banner(data)
    assert banner.title == "Degraded mode: peer desk is serving"
    assert banner.model == "SmolLM2 on peer desk"
    assert banner.latency == "a new request starts at once"  # the CPU has nothing to do
    data["degraded"]["peer_latency_s"] = {"desk": 2.4}
    assert vm.degraded_banner(data).latency == "a new request starts at once · on peer desk about 2.4 s"
    assert banner.requests[0].text.startswith("away · running on peer desk")
    data["requests"].append(whole_request({"id": "here", "state": "running", "path": "cpu", "reason": "forced_cpu", "age_s": 1.0}))
    banner = vm.degraded_banner(data)
    assert banner.title == "Degraded mode: the CPU and peer desk are serving"
    assert banner.model == "SmolLM2 on peer desk · SmolLM2 on the CPU"


def test_the_chat_banner_shows_its_own_request_on_a_peer() -> None:
    data = status()
    data["requests"] = whole_requests([{"id": "mine", "state": "running", "path": "peer", "peer": "desk", "reason": "peer",
                         "detail": "GPU busy; peer desk takes it before the local CPU"}])
    banner = vm.degraded_banner(data, own_request_id="mine", only_own=True)
    assert banner is not None and banner.requests[0].text.startswith("Your request · running on peer desk")


def test_peers_text_says_each_peers_health() -> None:
    peers = conforming({"peers": [
        {"name": "desk", "healthy": True, "latency_ms": 2.1, "served": 3},
        {"name": "attic", "healthy": False, "problem": "it refused our API key (HTTP 401)"},
        {"name": "old", "healthy": False, "problem": None, "breaker": {"state": "open"}}]})["peers"]
    assert vm.peers_text(peers) == ("Peers: desk healthy, 2.1 ms, 3 served · attic: it refused our API key "
                                    "(HTTP 401) · old: breaker open")
    assert vm.peers_text([]) == ""
    data = status(peers=peers[:1])
    assert "Peers: desk healthy" in vm.vram_bars(data)[0].apps


def test_route_reasons_for_peers_are_in_words() -> None:
    assert vm.route_reason_text("peer") == "sent to a peer"
    assert vm.humanize_reason("peer_failed_replayed: the peer failed") == "Peer failed, re-run on the CPU: the peer failed"
    assert vm.route_line("peer", "peer", peer="desk") == "served by peer desk · sent to a peer"


def test_the_header_says_a_peer_serves_and_not_the_cpu() -> None:
    data = paused()
    data["degraded"]["peers"] = ["desk"]
    data["requests"] = whole_requests([{"id": "away", "state": "running", "path": "peer", "peer": "desk", "reason": "peer"}])
    assert vm.state_title(data) == "Degraded: peer desk is serving"
    assert vm.state_detail(data).startswith("Peer desk (another machine) answers since")
    data["requests"].append(whole_request({"id": "here", "state": "running", "path": "cpu", "reason": "forced_cpu"}))
    assert vm.state_title(data) == "Degraded: the CPU and peer desk are serving"
    assert vm.state_detail(data).startswith("The CPU worker and peer desk (another machine) answer since")
    assert vm.state_title(paused()) == vm.STATE_TITLES[vm.DEGRADED]
