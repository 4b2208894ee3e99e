"""Whether the GPU worker should hold its VRAM: a pure state machine.

The GPU is usually someone's gaming or desktop card too. The worker lets go
of its memory in three cases, each a `Hold`:

- YIELDED: other processes took so much that the loaded worker could no
  longer keep the reserve free (a game started). It comes back once the
  memory has stayed free, with a margin, for a settle time. The settle time
  doubles with each yield in a short window, so a game whose use breathes
  around the threshold costs one reload, not a reload loop.
- IDLE: no request for `idle_unload_s`. The next request loads it again.
- USER: "Give the GPU back now", until "Use the GPU again".

A model that loads on demand (every library model but the default one)
starts IDLE, and goes back to IDLE when another model's load evicts it or
its own load finds no room.

`Residency` decides; it never touches a process, a clock of its own or a log.
Every change of its state is one of its methods, and only `residency.gpu.
GpuSharing` calls them: it feeds it readings and commands and carries out
the `Action` each returns.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Callable

# The memory must be this much above what a reload needs before the settle
# clock runs: a game sitting exactly at the threshold would otherwise
# reload the worker only to crowd it out again. On a small card, at most
# half the room the worker could ever have above the reserve, or an empty
# device could never take it back.
RELOAD_MARGIN_MIB = 512.0
# A crowded reading must last this long before the worker yields: one
# sample that catches a short-lived allocation is not a game starting.
YIELD_CONFIRM_S = 1.0
# A yield within this long of the last reload continues a flapping episode:
# its settle time doubles. A quiet spell this long after a reload ends it.
FLAP_WINDOW_S = 600.0
MAX_SETTLE_FACTOR = 16


class HoldKind(str, enum.Enum):
    YIELDED = "yielded"
    IDLE = "idle"
    USER = "user"


@dataclass(frozen=True)
class Hold:
    kind: HoldKind
    since: float                    # the residency clock's time
    app: str | None = None          # YIELDED: the biggest other user of the GPU; IDLE: the model it made room for
    app_mib: float | None = None
    # YIELDED: how long the memory must stay free before the reload, fixed
    # when the yield happened (so it can't shrink while it is waited out).
    settle_s: float = 0.0

    def describe(self) -> str:
        if self.kind is HoldKind.YIELDED:
            who = self.app or "another app"
            size = f" ({self.app_mib / 1024:.1f} GiB)" if self.app_mib else ""
            return f"GPU given to {who}{size}"
        if self.kind is HoldKind.IDLE:
            return f"GPU unloaded for {self.app}" if self.app else "GPU unloaded (idle)"
        return "GPU given back by the user"


@dataclass(frozen=True)
class SharingPolicy:
    yield_to_other_apps: bool = True
    reload_settle_s: float = 30.0
    idle_unload_s: float = 300.0  # 0 = never


@dataclass(frozen=True)
class DeviceView:
    """One reading, as residency needs it."""

    total_mib: float | None         # None: the device can't be read now
    others_mib: float | None        # held by processes that are not our workers
    need_mib: float                 # what the loaded GPU worker holds
    reserve_mib: float
    top_app: str | None = None      # the biggest other process, by name
    top_app_mib: float | None = None

    def spare_with_worker_mib(self) -> float | None:
        """What would stay free with the GPU worker loaded."""
        if self.total_mib is None or self.others_mib is None:
            return None
        return self.total_mib - self.others_mib - self.need_mib


def reload_margin_mib(view: DeviceView) -> float:
    """How far above the reserve the memory must be free for a reload."""
    if view.total_mib is None:
        return RELOAD_MARGIN_MIB
    room = view.total_mib - view.need_mib - view.reserve_mib
    return max(0.0, min(RELOAD_MARGIN_MIB, room / 2))


class Action(str, enum.Enum):
    NONE = "none"
    YIELD = "yield"       # drain the GPU path, then unload the worker
    UNLOAD = "unload"     # unload now (idle, or the user asked); nothing is running
    LOAD = "load"         # load the worker again


class Residency:
    def __init__(self, policy: SharingPolicy, clock: Callable[[], float], *, loads_on_demand: bool = False) -> None:
        self._policy = policy
        self._clock = clock
        # A model that loads on demand is loaded by its first request, not at start.
        self._loads_on_demand = loads_on_demand
        self._hold: Hold | None = Hold(HoldKind.IDLE, clock()) if loads_on_demand else None
        self._crowded_since: float | None = None
        self._roomy_since: float | None = None
        # Yields in the current flapping episode after the first, and when the
        # worker last came back from a yield.
        self._flaps = 0
        self._reloaded_at: float | None = None
        # A yield that found the worker already unloaded for idleness goes
        # back to idle when the memory frees: nobody asked for a reload.
        self._idle_under_yield = False
        # The last request's own keep-alive (Ollama's keep_alive), which
        # replaces policy.idle_unload_s until a request says otherwise:
        # None = the policy's, negative = never unload, 0 = once idle.
        self._keep_alive_s: float | None = None

    @property
    def hold(self) -> Hold | None:
        """Why the worker does not hold its memory now; None while it may."""
        return self._hold

    @property
    def policy(self) -> SharingPolicy:
        return self._policy

    @property
    def keep_alive_s(self) -> float | None:
        return self._keep_alive_s

    def idle_limit_s(self) -> float | None:
        """How long without a request before the worker unloads; None = never."""
        if self._keep_alive_s is None:
            return self._policy.idle_unload_s if self._policy.idle_unload_s > 0 else None
        return None if self._keep_alive_s < 0 else self._keep_alive_s

    # ----- reads ------------------------------------------------------------------

    def settle_s(self) -> float:
        """The settle time of the current yield; without one, the settle
        time a yield now would get: doubled for each yield that came soon
        after the reload before it (a flapping game), capped."""
        if self._hold is not None and self._hold.kind is HoldKind.YIELDED:
            return self._hold.settle_s
        return self._policy.reload_settle_s * min(MAX_SETTLE_FACTOR, 2 ** self._flaps_if_yielding_now())

    def _flaps_if_yielding_now(self) -> int:
        flapping = self._reloaded_at is not None and self._clock() - self._reloaded_at <= FLAP_WINDOW_S
        return self._flaps + 1 if flapping else 0

    @property
    def crowded_since(self) -> float | None:
        """Since when the readings have said the loaded worker can't keep the reserve."""
        return self._crowded_since

    def reload_in_s(self) -> float | None:
        """For a yielded GPU: seconds until it reloads if the memory stays
        free; None while the memory is not free (nobody can say when)."""
        if self._hold is None or self._hold.kind is not HoldKind.YIELDED or self._roomy_since is None:
            return None
        return max(0.0, self._roomy_since + self.settle_s() - self._clock())

    # ----- inputs -------------------------------------------------------------------

    def observe(self, view: DeviceView, *, loaded: bool, idle_for_s: float | None) -> Action:
        """A new reading. `loaded`: the worker holds (or is taking) its
        memory. `idle_for_s`: how long the GPU path has had no request,
        None while one is queued or running."""
        now = self._clock()
        spare = view.spare_with_worker_mib()
        crowded = spare is not None and spare < view.reserve_mib
        roomy = spare is not None and spare >= view.reserve_mib + reload_margin_mib(view)
        self._crowded_since = (self._crowded_since or now) if crowded else None
        self._roomy_since = (self._roomy_since or now) if roomy else None

        if self._hold is None or self._hold.kind is HoldKind.IDLE:
            if (crowded and self._policy.yield_to_other_apps
                    and now - self._crowded_since >= YIELD_CONFIRM_S):
                self._idle_under_yield = self._hold is not None
                settle = self.settle_s()
                self._flaps = self._flaps_if_yielding_now()
                self._hold = Hold(HoldKind.YIELDED, now, view.top_app, view.top_app_mib, settle)
                self._roomy_since = None
                # Also when the worker is restarting: it must not come back up.
                return Action.NONE if self._idle_under_yield else Action.YIELD
        if self._hold is None:
            limit = self.idle_limit_s()
            if loaded and idle_for_s is not None and limit is not None and idle_for_s >= limit:
                self._hold = Hold(HoldKind.IDLE, now)
                return Action.UNLOAD
            return Action.NONE
        if self._hold.kind is HoldKind.YIELDED:
            if crowded and view.top_app is not None:
                # Name whoever holds the memory now (another app may have taken over).
                self._hold = dataclasses.replace(self._hold, app=view.top_app, app_mib=view.top_app_mib)
            if self._roomy_since is not None and now - self._roomy_since >= self._hold.settle_s:
                self._reloaded_at = now
                if self._idle_under_yield:
                    self._hold = Hold(HoldKind.IDLE, now)
                    return Action.NONE
                self._hold = None
                return Action.LOAD
        return Action.NONE

    def request_arrived(self) -> Action:
        """A request wants the GPU: an idle-unloaded worker loads again."""
        if self._hold is not None and self._hold.kind is HoldKind.IDLE:
            self._hold = None
            return Action.LOAD
        return Action.NONE

    def give_back(self) -> Action:
        """The user's "Give the GPU back now"."""
        if self._hold is not None and self._hold.kind is HoldKind.USER:
            return Action.NONE
        was_loaded = self._hold is None
        self._hold = Hold(HoldKind.USER, self._clock())
        return Action.YIELD if was_loaded else Action.NONE

    def take_again(self) -> Action:
        """The user's "Use the GPU again": load now. A game still holding the
        memory makes the next reading yield again, as it should."""
        if self._hold is None:
            return Action.NONE
        self._hold = None
        self._crowded_since = None
        return Action.LOAD

    def evicted(self, for_model: str | None = None) -> Action:
        """Unloaded for another model's load (`for_model`, named in the
        hold), or by the user's Unload: as if idle, so the next request
        loads it again."""
        self._hold = Hold(HoldKind.IDLE, self._clock(), app=for_model)
        return Action.UNLOAD

    def load_refused(self) -> Action:
        """A load found no room, not even by evicting idle models: unloaded
        again; the next request tries again (others may have finished)."""
        self._hold = Hold(HoldKind.IDLE, self._clock())
        return Action.NONE

    def set_keep_alive(self, seconds: float | None) -> None:
        """A request's own keep-alive (Ollama's): how long the worker stays
        loaded after it; negative = until told otherwise, 0 = unload once
        idle, None = the policy's idle time."""
        self._keep_alive_s = seconds

    def set_yield_to_other_apps(self, enabled: bool) -> Action:
        """The tray's switch. Switched off while yielded, the worker comes
        back: at once (LOAD) for the model that is loaded from the start, as
        unloaded (its next request loads it) for one that loads on demand."""
        self._policy = dataclasses.replace(self._policy, yield_to_other_apps=enabled)
        if enabled or self._hold is None or self._hold.kind is not HoldKind.YIELDED:
            return Action.NONE
        if self._loads_on_demand:
            self._hold = dataclasses.replace(self._hold, kind=HoldKind.IDLE)
            return Action.NONE
        return self.take_again()
