"""Desktop notices: degraded mode entered and left, the GPU given away and taken again."""

from __future__ import annotations

import time
from dataclasses import dataclass
from ...core.status_contract import Status
from .formatting import fmt_seconds, humanize_reason
from .state import DEGRADED, GIVEN_STATES, GPU, icon_kind, is_busy_overflow, residency_of, residency_state
from .banner import new_request_wait_text


class ResidencyNotifier:
    """Notices for the GPU given to another app and taken again; the
    degraded-mode notice stays quiet for these (DegradedNotifier), since
    this one says more. The GPU passes through "loading" on its way back:
    what counts is that it was given, and is loaded again."""

    def __init__(self) -> None:
        self._state: str | None = None
        self._given = False

    def update(self, status: Status | None) -> Notice | None:
        residency = residency_of(status)
        if status is None or residency is None:
            return None
        state = residency["state"]
        first, self._state = self._state is None, state
        fallback = status["degraded"]["fallback_model"] or "the fallback model"
        if state in GIVEN_STATES:
            was_given, self._given = self._given, True
            if first or was_given:
                return None
            if state == "given_away":
                return Notice("GPU given back", f"{residency['text'] or 'Another app needs the VRAM'}: the GPU "
                              f"model was unloaded. The CPU answers with {fallback} until the memory is free again.",
                              "gpu_given_back")
            return Notice("GPU given back", f"The GPU model was unloaded. The CPU answers with {fallback} until "
                          "you choose \"Use the GPU again\".", "gpu_given_back")
        if state == "loaded" and self._given:
            self._given = False
            load = residency["last_load_s"]
            took = f" (loading took {fmt_seconds(load)})" if load else ""
            return Notice("GPU taken again", f"The GPU model is loaded again{took}; the GPU serves.", "gpu_taken_again")
        if state != "loading":
            self._given = False
        return None


@dataclass(frozen=True)
class Notice:
    title: str
    message: str
    kind: str  # "degraded_start" | "degraded_end" | "gpu_given_back" | "gpu_taken_again"


class DegradedNotifier:
    """Turns a stream of snapshots into 'degraded mode started/ended' notices.

    Debounced: degraded mode is announced only once it has lasted
    `settle_s`, and not again within `quiet_s` of the last announcement, so a
    flapping path doesn't post pairs of notices. A busy GPU overflowing to the
    CPU is not announced at all (see is_busy_overflow).
    """

    def __init__(self, settle_s: float = 5.0, quiet_s: float = 60.0, clock=time.monotonic) -> None:
        self.settle_s = settle_s
        self.quiet_s = quiet_s
        self._clock = clock
        self.notified_start = False
        self._degraded_since: float | None = None
        self._last_start_notice: float | None = None

    def update(self, status: Status | None, service_starting: bool = False,
               now: float | None = None) -> Notice | None:
        now = self._clock() if now is None else now
        kind = icon_kind(status, service_starting=service_starting)
        # ResidencyNotifier speaks for a GPU given away, and a load is over in seconds.
        degraded = (kind == DEGRADED and not is_busy_overflow(status)
                    and residency_state(status) not in GIVEN_STATES + ("loading",))
        if not degraded:
            self._degraded_since = None
        elif self._degraded_since is None:
            self._degraded_since = now
        if degraded and not self.notified_start:
            settled = now - self._degraded_since >= self.settle_s
            quiet = self._last_start_notice is None or now - self._last_start_notice >= self.quiet_s
            if not (settled and quiet):
                return None
            self.notified_start = True
            self._last_start_notice = now
            assert status is not None  # degraded is a state of a status
            info = status["degraded"]
            reason = humanize_reason(info["reason"] or "the GPU path is out")
            wait = new_request_wait_text(status)
            message = f"{reason}.\nThe CPU serves {info['fallback_model']}" + (f"; {wait}" if wait else "")
            return Notice("Degraded mode: the CPU is serving", message + ".", "degraded_start")
        if kind == GPU and self.notified_start:
            self.notified_start = False
            return Notice("Back on the GPU", "Degraded mode ended: the GPU path is serving again.", "degraded_end")
        return None


class TimedNote:
    """A message that stays for `hold_s` before what the polls say takes over
    again, so an error isn't overwritten by the next poll a second later."""

    def __init__(self, hold_s: float = 6.0, clock=time.monotonic) -> None:
        self.hold_s = hold_s
        self._clock = clock
        self._text = ""
        self._until = 0.0

    def show(self, text: str) -> None:
        self._text = text
        self._until = self._clock() + self.hold_s

    def text(self) -> str:
        """The message while it holds, else ''."""
        return self._text if self._text and self._clock() < self._until else ""
