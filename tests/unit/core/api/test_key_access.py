"""What an inference key may see of others (/status, /metrics) and when a
key at its limit is told to come back: key_access.py's pure parts."""

from __future__ import annotations

from tray_app.core.api.key_access import CONCURRENCY_RETRY_AFTER_S, retry_after_s, visible_metrics, visible_status


def counts(requests: int) -> dict:
    return {"requests": requests}


STATUS = {
    "requests": [{"id": "a-1", "client": "notes"}, {"id": "b-1", "client": "mail"}],
    "recent_decisions": [{"id": "a-0", "route": "gpu"}, {"id": "b-0", "route": "cpu"}],
    "events": [{"kind": "replay", "id": "b-0", "reason": "gpu crashed"}, {"kind": "gpu_paused"},
               {"kind": "canceled", "id": "a-0"}],
    "queues": {"gpu": {"running": 2}},
    "usage": {"today": "2026-12-01", "by_name": {"a": counts(2), "b": counts(5)},
              "days": [{"day": "2026-11-30", "by_name": {"b": counts(1)}},
                       {"day": "2026-12-01", "by_name": {"a": counts(2), "b": counts(4)}}]},
}


def test_an_inference_key_sees_its_own_requests_and_usage_and_only_counts_of_others():
    seen = visible_status(STATUS, "a", lambda request_id: request_id.startswith("a-"))
    assert seen["requests"] == [{"id": "a-1", "client": "notes"}]
    assert seen["recent_decisions"] == [{"id": "a-0", "route": "gpu"}]
    # The events stay (the GPU's trouble is everyone's), without another key's ids.
    assert seen["events"] == [{"kind": "replay", "reason": "gpu crashed"}, {"kind": "gpu_paused"},
                              {"kind": "canceled", "id": "a-0"}]
    assert seen["queues"] == {"gpu": {"running": 2}}
    assert seen["usage"] == {"today": "2026-12-01", "by_name": {"a": counts(2)},
                             "days": [{"day": "2026-11-30", "by_name": {}},
                                      {"day": "2026-12-01", "by_name": {"a": counts(2)}}]}
    assert len(STATUS["requests"]) == 2  # the snapshot itself is left as it was


def test_an_inference_key_reads_only_its_own_usage_series_in_metrics():
    text = ('# HELP tray_app_usage_requests_total Requests per key\n'
            'tray_app_usage_requests_total{key="a",path="gpu"} 2.0\n'
            'tray_app_usage_requests_total{key="b",path="gpu"} 5.0\n'
            'tray_app_usage_requests_total{key="ab",path="gpu"} 1.0\n'
            'tray_app_gpu_free_mib 100.0\n')
    assert visible_metrics(text, "a") == ('# HELP tray_app_usage_requests_total Requests per key\n'
                                          'tray_app_usage_requests_total{key="a",path="gpu"} 2.0\n'
                                          'tray_app_gpu_free_mib 100.0\n')


def test_retry_after_is_the_soonest_expected_end_of_the_keys_requests_else_one_second():
    assert retry_after_s([100.0 + 7.2, 100.0 + 30.0, None], now=100.0) == 8
    assert retry_after_s([None], now=100.0) == CONCURRENCY_RETRY_AFTER_S
    # Overdue: its estimate was wrong, so no better guess than a second.
    assert retry_after_s([99.0], now=100.0) == CONCURRENCY_RETRY_AFTER_S
    assert retry_after_s([100.2], now=100.0) == 1
    assert retry_after_s([], now=100.0) == CONCURRENCY_RETRY_AFTER_S
