"""What the dispatcher tells the rest of the service, and what it asks of
GPU residency: the two seams its tests replace with fakes."""

from __future__ import annotations

from typing import Any, Protocol

from .admission import Decision, GpuOut
from .jobs import Attempt, Job


class DispatchEvents(Protocol):
    """What the dispatcher tells the rest of the service. Never asks anything."""

    def note(self, kind: str, **data: Any) -> None:
        """Something worth the event log (/status events, the tray's notifications)."""

    def changed(self) -> None:
        """Requests moved between states: degraded mode may have begun or ended."""

    def decided(self, job: Job, decision: Decision) -> None: ...

    def completed(self, job: Job, attempt: Attempt) -> None: ...

    def gpu_failed(self, job: Job, reason: str) -> None: ...


class GpuResidency(Protocol):
    """Whether the GPU worker holds its memory (see residency.gpu.GpuSharing)."""

    def gpu_out(self) -> GpuOut | None:
        """Given away, unloaded or loading: why the GPU can't serve now, or None."""

    def request_arrived(self) -> None:
        """A request is being admitted: an unloaded GPU starts loading."""


class AlwaysResident:
    """A GPU that never gives its memory away (no GpuSharing attached)."""

    def gpu_out(self) -> GpuOut | None:
        return None

    def request_arrived(self) -> None:
        pass
