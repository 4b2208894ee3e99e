"""How big the drill is, and the service configuration it starts.

The short plan (a few requests per phase) is what the test suite runs; the
full plan is what `tray-app drill` runs by default. Both exercise every
phase; the full one sends more requests and injects more faults.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# The drill's own service has small context caps on purpose: a request that
# "exceeds the GPU profile but fits in RAM" then needs ~150 tokens instead of
# thousands. Reading a prompt costs about as much as writing an answer on a
# busy 2-core machine (20-35 ms a token), so this is what keeps the drill short.
GPU_CTX = 128
CPU_CTX = 512
SIMULATED_GPU_MIB = 2048


@dataclass(frozen=True)
class DrillPlan:
    name: str
    over_cap_requests: int          # phases 1 and 2, each
    agreement_pairs: int            # phases 1 and 2, each: same prompt on the GPU and forced to the CPU
    queued_cancels: int             # phase 3
    concurrent_clients: int         # phase 4
    requests_per_client: int        # phase 4
    agents: int                     # phase 5
    vram_steps_spare_mib: tuple[float, ...]  # phase 6, simulated device: spare VRAM above the reserve per step
    parallel_per_step: int          # phase 6
    requests_while_open: int        # phase 7
    resets: tuple[str, ...]         # phase 8: one entry per GPU worker kill
    answer_tokens: int = 16         # max_tokens of an ordinary request

    @property
    def planned_requests(self) -> int:
        """About how many requests the plan sends (for the progress bar)."""
        per_step = 2 + self.parallel_per_step
        return (
            2 * (self.over_cap_requests + 2 * self.agreement_pairs)
            + 2 * self.queued_cancels + 1
            + self.concurrent_clients * self.requests_per_client + 1
            + self.agents * 3
            + len(self.vram_steps_spare_mib) * per_step
            + self.requests_while_open + 3
            + 3 * len(self.resets) + 2
        )


SHORT = DrillPlan(
    name="short",
    over_cap_requests=1,
    agreement_pairs=1,
    queued_cancels=1,
    concurrent_clients=8,
    requests_per_client=1,
    agents=2,
    vram_steps_spare_mib=(15.0, 2.0),
    parallel_per_step=2,
    requests_while_open=1,
    resets=("SIGKILL:json", "SIGKILL:stream"),
)

FULL = DrillPlan(
    name="full",
    over_cap_requests=4,
    agreement_pairs=3,
    queued_cancels=2,
    concurrent_clients=8,
    requests_per_client=4,
    agents=6,
    vram_steps_spare_mib=(400.0, 60.0, 25.0, 15.0, 8.0, 2.0),
    parallel_per_step=3,
    requests_while_open=3,
    resets=("SIGKILL:json", "SIGKILL:stream", "SIGABRT:json", "SIGKILL:stream"),
)

PLANS = {"short": SHORT, "full": FULL}

# On a real GPU the steps are spare MiB above the reserve too, but allocations
# by a second llama.cpp process can't be sized to the MiB: the steps are
# coarse, and the last one leaves nothing spare.
REAL_GPU_STEPS_SPARE_MIB = (8192.0, 1024.0, 256.0, -64.0)


SECOND_MODEL = "drill-second"


def service_config(*, simulated: bool, model_path: str) -> str:
    """The TOML the drill's own service runs with: the model under test, and
    a second library model (the same file with a smaller profile) for phase 11."""
    gpu_device = f"simulate_mib = {SIMULATED_GPU_MIB}\nreserve_mib = 256" if simulated else "reserve_mib = 512"
    # A real GPU worker must stay down for a moment after a crash, so the
    # drill's second llama.cpp process can take the freed memory first (phase 7).
    backoff = "backoff_base_s = 0.2\nbackoff_cap_s = 2" if simulated else "backoff_base_s = 5\nbackoff_cap_s = 8"
    return f"""# Written by `tray-app drill` for its own service.
[gpu]
{gpu_device}
n_ctx = {GPU_CTX}
queue_limit = 1
first_token_timeout_s = 30
token_timeout_s = 15
# Phases 6-8 squeeze VRAM to test admission and the breaker, which is what a
# user who keeps the GPU gets; the "another app" phase turns yielding on.
yield_to_other_apps = false
reload_settle_s = 3
idle_unload_s = 0
[cpu]
n_ctx = {CPU_CTX}
queue_limit = 4
ram_floor_mib = 256
[breaker]
failure_threshold = 2
window_s = 60
cooldown_s = 3
[worker]
{backoff}
stop_timeout_s = 3

[[models]]
name = "{SECOND_MODEL}"
path = {json.dumps(model_path)}
n_ctx = {GPU_CTX}
max_concurrency = 1
"""
