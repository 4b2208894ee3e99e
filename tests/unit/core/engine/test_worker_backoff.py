import pytest

from tray_app.core.engine.worker import backoff_delay


def test_doubles_from_base_until_the_cap():
    assert [backoff_delay(i, 0.5, 5.0) for i in range(6)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]


def test_huge_attempt_numbers_stay_at_the_cap():
    assert backoff_delay(10_000, 0.5, 30.0) == 30.0


def test_negative_attempt_is_a_bug():
    with pytest.raises(ValueError):
        backoff_delay(-1, 0.5, 30.0)
