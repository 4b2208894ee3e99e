"""Runs the eleven phases against a target and keeps everything that happened.

Each phase sends ordinary OpenAI requests (every one becomes a
RequestRecord), injects its fault where the target allows it, and adds
checks of what the service did. The numbers of the report are computed
afterwards, by report.py, from the records and the /status samples.

`PHASES` is the one list of the phases, in the order they run; each is a
function in drill/phases/ of the shared `DrillSession` (session.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import httpx

from ..core.status_contract import Status
from . import plan as plans
from .client import DrillTimeout, StatusUnreadable
from .phases import agents, faults, sharing, traffic
from .pressure import PressureError
from .progress import Progress
from .records import PhaseResult
from .session import DrillSession
from .target import Target, TargetError


class Phase(NamedTuple):
    number: int
    key: str
    title: str
    run: Callable[[DrillSession, PhaseResult], None]


PHASES = (
    Phase(1, "over_gpu_profile", "Over the GPU profile, within RAM (JSON)", traffic.over_gpu_profile),
    Phase(2, "over_gpu_profile_stream", "Over the GPU profile, within RAM (streaming)", traffic.over_gpu_profile_stream),
    Phase(3, "cancel_in_cpu_queue", "Cancel while waiting in the CPU queue", traffic.cancel_in_cpu_queue),
    Phase(4, "concurrent_clients", "Concurrent traffic from 8 clients", traffic.concurrent_clients),
    Phase(5, "agent_tools", "Agents with a counted mock tool", agents.agent_tools),
    Phase(6, "shrinking_vram", "Short, long and parallel prompts as free VRAM shrinks", sharing.shrinking_vram),
    Phase(7, "alloc_failure", "Allocation failure before generation", faults.alloc_failure),
    Phase(8, "gpu_worker_reset", "GPU worker killed mid-request", faults.gpu_worker_reset),
    Phase(9, "poison_request", "A request that crashes the GPU worker, among normal traffic", faults.poison_request),
    Phase(10, "other_app_takes_vram", "Another app takes the VRAM while requests stream, holds it, lets go",
          sharing.other_app_takes_vram),
    Phase(11, "second_model", "A second model loads on demand; a tight GPU unloads the idle one for the other",
          sharing.second_model),
)

# What ends a phase early as a failed check, not the whole drill.
PHASE_ERRORS = (DrillTimeout, StatusUnreadable, PressureError, TargetError, httpx.HTTPError)


class Drill(DrillSession):
    def __init__(self, target: Target, initial_status: Status, plan: plans.DrillPlan, *,
                 progress: Progress, phases: set[int] | None = None) -> None:
        super().__init__(target, initial_status, plan, progress=progress)
        self.selected = phases or {phase.number for phase in PHASES}

    def run(self) -> None:
        self.monitor.start()
        try:
            setup = PhaseResult(0, "setup", "Prompt-size calibration")
            self.progress.phase("calibrating prompt sizes")
            setup.started_s = self.clock.now()
            traffic.calibrate(self, setup)
            setup.ended_s = self.clock.now()
            self.phases.append(setup)
            for phase in PHASES:
                if phase.number in self.selected:
                    self._run_phase(phase)
        finally:
            self.monitor.sample_now()
            self.monitor.stop()
            self.client.close()
            self.duration_s = self.clock.now()

    def _run_phase(self, phase: Phase) -> None:
        result = PhaseResult(phase.number, phase.key, phase.title)
        self.progress.phase(f"phase {result.number}/{len(PHASES)}: {result.title}")
        result.started_s = self.clock.now()
        result.skipped = self._skip_reason(result.number)
        try:
            if result.skipped is None:
                phase.run(self, result)
        except PHASE_ERRORS as exc:
            result.check("phase ran to the end", False, f"{type(exc).__name__}: {exc}")
        finally:
            if result.skipped is None:
                try:
                    self.settle(result)
                except PHASE_ERRORS as exc:
                    result.check("service healthy again after the phase", False, f"{type(exc).__name__}: {exc}")
            result.ended_s = self.clock.now()
            self.phases.append(result)
            if result.skipped:
                self.progress.note(f"phase {result.number} skipped: {result.skipped}")

    def _skip_reason(self, number: int) -> str | None:
        has_gpu_path = self.gpu_cap is not None
        if number in (1, 2):
            if not has_gpu_path:
                return "the service has no GPU worker, so no request can exceed the GPU profile"
            if self.cpu_cap is None or self.cpu_cap <= self.gpu_cap + traffic.OVER_CAP_MARGIN:
                return (f"the GPU context cap ({self.gpu_cap}) is not below the CPU's ({self.cpu_cap}): no request "
                        "exceeds the GPU profile but fits in RAM")
        if number == 6 and not has_gpu_path:
            return "the service has no GPU worker"
        if number == 10 and has_gpu_path and self.initial_status["gpu"]["residency"] is None:
            return "the service does not report GPU residency (an older version)"
        if number == 11 and len(self.initial_status["models"]) < 2:
            return "the service has one model (the drill's own service has two)"
        if number == 11 and not has_gpu_path:
            return "the service has no GPU worker"
        if number in (7, 8, 9, 10, 11):
            if not self.target.can_inject:
                return "fault injection is off against a live service (--url)"
            if not has_gpu_path:
                return "the service has no GPU worker to fail"
        return None
