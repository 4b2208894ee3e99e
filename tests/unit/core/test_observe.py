"""How often the tray polls and the service samples, with plain values:
full rate while someone looks or something is in flight, seldom otherwise
(issue 32, part 6)."""

from tray_app.core.observe import IDLE_SAMPLE_INTERVAL_S, SAMPLE_INTERVAL_S, sample_interval_s
from tray_app.ui.poll_rate import ACTIVE_POLL_MS, IDLE_POLL_MS, is_quiet, poll_interval_ms

QUIET = {"service": {"healthy": True}, "degraded": {"active": False}, "requests": [],
         "workers": [{"role": "gpu", "state": "ready"}, {"role": "cpu", "state": "stopped"}]}


def test_the_tray_polls_seldom_only_when_no_window_is_open_and_nothing_moves():
    assert poll_interval_ms(window_open=False, status=QUIET) == IDLE_POLL_MS == 5000
    assert poll_interval_ms(window_open=True, status=QUIET) == ACTIVE_POLL_MS == 1000
    assert poll_interval_ms(window_open=False, status=None) == ACTIVE_POLL_MS  # no answer yet


def test_anything_in_flight_or_about_to_change_is_not_quiet():
    assert is_quiet(QUIET)
    assert not is_quiet({**QUIET, "requests": [{"id": "r", "state": "queued"}]})
    assert not is_quiet({**QUIET, "degraded": {"active": True}})
    assert not is_quiet({**QUIET, "service": {"healthy": False}})
    assert not is_quiet({**QUIET, "workers": [{"role": "gpu", "state": "starting"}]})
    assert not is_quiet(None)


def test_the_service_samples_every_second_while_read_at_that_rate_or_serving():
    assert sample_interval_s(needs_full_rate=False, last_look_age_s=None) == IDLE_SAMPLE_INTERVAL_S == 5.0
    assert sample_interval_s(needs_full_rate=False, last_look_age_s=1.0) == SAMPLE_INTERVAL_S == 1.0
    # The tray alone, its panel closed, reads every 5 s: that is nobody looking.
    assert sample_interval_s(needs_full_rate=False, last_look_age_s=4.9) == IDLE_SAMPLE_INTERVAL_S
    assert sample_interval_s(needs_full_rate=True, last_look_age_s=None) == SAMPLE_INTERVAL_S


async def test_vram_another_app_may_want_back_keeps_the_service_sampling_every_second(tmp_path, monkeypatch):
    """A game starting takes VRAM with nothing in flight and nobody looking:
    the service must notice within a second, not five, to give the GPU back."""
    from tests.fakes.service import in_process_service, isolate_user_folders

    isolate_user_folders(monkeypatch, tmp_path)
    async with in_process_service(tmp_path) as rig:
        service = rig.service
        assert service.default_model_host.gpu_loaded()
        # The test config pins yielding off: nothing would be given back, idle rate is fine.
        assert not service._needs_full_rate()
        service.set_yield_to_other_apps(True)
        assert service._needs_full_rate()  # loaded and yielding: a game may want it back
        service.set_yield_to_other_apps(False)
        assert not service._needs_full_rate()


async def test_building_a_status_is_not_someone_looking_and_get_status_is(tmp_path, monkeypatch):
    """The sampler's full rate follows people reading /status; /metrics and
    the service's own reads build a status too and must leave it idle."""
    from tests.fakes.service import in_process_service, isolate_user_folders

    isolate_user_folders(monkeypatch, tmp_path)
    async with in_process_service(tmp_path) as rig:
        observer = rig.service.observer
        rig.service.status()
        assert (await rig.client.get("/metrics")).status_code == 200
        assert observer.last_looked_at is None
        assert (await rig.client.get("/status")).status_code == 200
        assert observer.last_looked_at is not None
