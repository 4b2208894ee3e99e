"""Which speculative decoding a worker is started with (llama-server's
--spec-type), from the config's [gpu]/[cpu] speculative. Pure.

"auto" is what benchmarks/spec_bench.py measured to pay on that path; see
AUTO_BY_PATH for the numbers behind it. On a real GPU the trade changes
(decode is memory-bound there, and a draft is cheap to verify in one
batch): benchmarks/gpu_check runs the same A/B, and its report is where the
GPU's entry should come from.
"""

from __future__ import annotations

# What "auto" means per path. Measured on this project's 2-core machine with
# SmolLM2 (benchmarks/spec_bench.py; the numbers are in docs/performance.md).
AUTO_BY_PATH: dict[str, str] = {"gpu": "off", "cpu": "off"}


def speculation_for(path: str, configured: str, supported: tuple[str, ...]) -> str | None:
    """The --spec-type for the worker on `path`, or None for none: "off",
    or a type this runtime can't run (llama-cpp-python's server has none)."""
    choice = AUTO_BY_PATH.get(path, "off") if configured == "auto" else configured
    return choice if choice in supported else None
