"""The panel's failover line: hidden until a replay has answered, then the
last fault-to-first-token time and the median (issue 32, part 5)."""

from __future__ import annotations

from tray_app.ui import viewmodel as vm

from .test_panel_rendering import fed_panel
from .test_viewmodel import READY

FAILED_OVER = {**READY, "failover": {"count": 3, "last_s": 0.42, "last_fault": "crash", "p50_s": 0.4,
                                     "by_fault": {"crash": {"count": 3, "last_s": 0.42, "p50_s": 0.4}}}}


def test_the_failover_text_says_the_last_time_its_fault_and_the_median():
    assert vm.failover_text(READY) is None
    assert vm.failover_text({**READY, "failover": {**FAILED_OVER["failover"], "count": 0, "last_s": None}}) is None
    assert vm.failover_text(FAILED_OVER) == \
        "Last failover: first token on the CPU 0.4 s after a crash (median 0.4 s over 3)"
    one_hang = {"count": 1, "last_s": 21.5, "last_fault": "hang", "p50_s": 21.5, "by_fault": {}}
    assert vm.failover_text({**READY, "failover": one_hang}) == "Last failover: first token on the CPU 22 s after a hang"


def test_the_panel_shows_the_line_only_once_a_replay_has_answered(qtbot):
    panel = fed_panel(qtbot, READY)
    assert not panel.failover_line.isVisible()
    panel.client.status_changed.emit(FAILED_OVER)
    assert panel.failover_line.isVisible() and panel.failover_line.text().startswith("Last failover: ")
