"""Which speculative decoding a worker is started with (llama-server's
--spec-type), from the config's [gpu]/[cpu] speculative. Pure.

"auto" is what benchmarks/spec_bench.py measured to pay on that path; see
AUTO_BY_PATH for the numbers behind it. On a real GPU the trade changes
(decode is memory-bound there, and a draft is cheap to verify in one
batch): benchmarks/gpu_check runs the same A/B, and its report is where the
GPU's entry should come from.
"""

from __future__ import annotations

# What "auto" means per path, from benchmarks/spec_bench.py (2 rounds, each
# workload sent twice in a row, 400 tokens, temperature 0, SmolLM2 on 2
# cores; the table is in docs/performance.md). On the CPU, ngram-mod with
# llama-server's own options sped up every workload's first request (code
# x1.88, extraction x2.52, summary x2.25, chat x1.07, a long conversation
# x1.36) and broke even on repeated free chat (x1.04, 0.92-1.16). Shorter
# drafts and ngram-simple gained less; ngram-simple lost on chat (x0.86).
# The GPU path is off until a real GPU has been measured (gpu_check's
# speculation check): the simulated one is this same CPU.
AUTO_BY_PATH: dict[str, str] = {"gpu": "off", "cpu": "ngram-mod"}


def speculation_for(path: str, configured: str, supported: tuple[str, ...]) -> str | None:
    """The --spec-type for the worker on `path`, or None for none: "off",
    or a type this runtime can't run (llama-cpp-python's server has none)."""
    choice = AUTO_BY_PATH.get(path, "off") if configured == "auto" else configured
    return choice if choice in supported else None
