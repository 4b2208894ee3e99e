"""The one table of route reasons (X-Route-Reason, /status requests, degraded
reasons) in words. The tray's banner and the note inside a degraded answer
(api/degraded_note.py) both say them, so a person reads the same words in
both places."""

from __future__ import annotations

ROUTE_REASONS = {
    "admitted": "admitted",
    "forced_cpu": "GPU paused (force CPU)",
    "gpu_unavailable": "GPU unavailable",
    "gpu_context_cap": "over the GPU context cap",
    "gpu_vram_headroom": "not enough VRAM headroom",
    "gpu_busy": "GPU busy",
    "gpu_failed_replayed": "GPU failed, re-run on the CPU",
    "gpu_yielded": "GPU given to another app",
    "gpu_loading": "GPU model loading",
    "peer": "sent to a peer",
    "peer_failed_replayed": "peer failed, re-run on the CPU",
    "gpu_failed_resumed": "GPU failed, answer continued on the CPU",
    "peer_failed_resumed": "peer failed, answer continued on the CPU",
    "cpu_cannot_read_images": "images need the GPU (the CPU has no projector)",
    # Not degraded: a machine with no GPU path serves on its CPU.
    "cpu_only": "CPU only (no GPU path)",
}


def route_reason_text(code: str | None) -> str:
    """A route reason code in words; an unknown code without its underscores."""
    if not code:
        return ""
    return ROUTE_REASONS.get(code, code.replace("_", " "))
