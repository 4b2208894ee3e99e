"""How much context a worker serves when the config leaves it to the app.

Pure: the caller passes the memory the worker may have and a function that
prices a context (the estimator, ``estimate.estimate_worker``), and gets back
the context of one request (one slot) and the KV cache type that gives it.

Why not a fixed 4096: the apps people point at a home server are agents
(Claude Code, Codex, IDE assistants) whose first request alone is 5k to 20k
tokens. A model should get the largest context its memory budget allows, up
to what it was trained for and what agents use, and no more: KV cache that no
request fills is VRAM a game can't have, and it makes the GPU worker give the
card back at a smaller game.

The budget is the caller's: on the GPU, the card minus the reserve kept free
for other apps minus what they hold at start (so the worker loads now and the
give-back rule, not a smaller context, answers a game that starts later); on
the CPU, a share of the available RAM above the floor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .estimate import KV_CELL_PADDING

# The config value that means "size it from memory".
AUTO = 0
# The most an automatic context goes to, per request: Ollama's docs recommend
# 64k tokens for Claude Code, the most demanding app measured (its first
# request was over 20k tokens). Past it the KV cache is memory almost no
# request uses; a person who wants more sets n_ctx.
AGENT_CONTEXT_TOKENS = 65536
# The smallest automatic context: the fixed default this replaced. A model
# that can't have even this much is one the GPU is too small for, and the
# too-small rule says so; it is not served with a context no app can use.
FLOOR_CONTEXT_TOKENS = 4096
# KV cache types tried, in order: full precision first; q8_0 halves the cache
# at a quality cost llama.cpp's own measurements put within noise, and is
# chosen only where it is what lets a larger context fit.
KV_TYPES = ("f16", "q8_0")


@dataclass(frozen=True)
class ContextChoice:
    n_ctx: int  # the context of one request (one slot)
    kv_type: str  # llama.cpp's --cache-type-k/-v
    automatic: bool  # False: the config set n_ctx
    why: str  # for a person: how the number came about

    def to_status(self) -> dict[str, object]:
        return {"n_ctx": self.n_ctx, "kv_cache": self.kv_type, "automatic": self.automatic, "why": self.why}


def choose_context(*, configured: int, trained: int, room_mib: float | None, need_mib: Callable[[int, str], float],
                   kv_types: tuple[str, ...] = KV_TYPES, where: str = "the GPU") -> ContextChoice:
    """The context of one request.

    configured: the config's n_ctx (AUTO = size it here).
    trained: the model's n_ctx_train (0 when the file doesn't say).
    room_mib: the memory the worker may hold in all; None = unknown.
    need_mib(n_ctx, kv_type): what the worker holds at that context per slot.
    """
    if configured != AUTO:
        return ContextChoice(configured, "f16", False, "set in the config")
    floor = min(FLOOR_CONTEXT_TOKENS, trained) if trained > 0 else FLOOR_CONTEXT_TOKENS
    if trained <= 0:
        # Past the configured context, a larger one would be a guess about a
        # model whose file states no trained length.
        return ContextChoice(floor, "f16", True, "the model's file states no trained context")
    ceiling = min(trained, AGENT_CONTEXT_TOKENS)
    if room_mib is None:
        return ContextChoice(floor, "f16", True, f"no memory reading for {where}")
    best: tuple[int, str] | None = None
    for kv_type in kv_types:
        fits = largest_fitting(ceiling, room_mib, lambda n_ctx: need_mib(n_ctx, kv_type))
        if fits is not None and (best is None or fits > best[0]):
            best = (fits, kv_type)
        if best is not None and best[0] >= ceiling:
            break
    if best is None or best[0] < floor:
        return ContextChoice(floor, "f16", True, f"{where} has no room for more than the smallest context")
    n_ctx, kv_type = best
    limit = ("the model's trained context" if n_ctx >= trained else
             "the most agents use" if n_ctx >= AGENT_CONTEXT_TOKENS else
             f"what {where}'s memory budget holds")
    cache = "" if kv_type == "f16" else f", with a {kv_type} KV cache (f16 would hold less)"
    return ContextChoice(n_ctx, kv_type, True, f"{limit}{cache}")


def largest_fitting(ceiling: int, room_mib: float, need_mib: Callable[[int], float]) -> int | None:
    """The largest context up to ceiling, in llama.cpp's KV cell padding
    (a context between two multiples costs what the larger one does), whose
    need is within room_mib; None when none is. Binary search: memory never
    shrinks as the context grows."""
    steps = ceiling // KV_CELL_PADDING
    if steps == 0:
        return ceiling if need_mib(ceiling) <= room_mib else None
    low, high, best = 1, steps, None
    while low <= high:
        middle = (low + high) // 2
        if need_mib(middle * KV_CELL_PADDING) <= room_mib:
            best = middle * KV_CELL_PADDING
            low = middle + 1
        else:
            high = middle - 1
    return best
