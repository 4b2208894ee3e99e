"""The drill's numbers in words: a value never measured must not crash the
report (a None in a phase's note once took down the whole drill in CI)."""

from tray_app.drill.units import mib, percent, quantity, seconds


def test_measured_values_keep_their_digits_and_unit():
    assert seconds(1.234) == "1.23 s"
    assert seconds(1.25, 1) == "1.2 s"
    assert mib(12345.6) == "12,346 MiB"
    assert percent(0.9876) == "98.8%"
    assert quantity(71.94, "", 1) == "71.9"


def test_a_value_never_measured_reads_n_a():
    assert seconds(None) == "n/a"
    assert mib(None) == "n/a"
    assert percent(None) == "n/a"
    assert quantity(None, "tokens/s") == "n/a"
