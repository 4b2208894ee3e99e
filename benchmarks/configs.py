"""The service config a benchmark runs, written by one builder: each
benchmark names only what it measures differently."""

from __future__ import annotations

import json
from collections.abc import Mapping

# Keys that make a slow machine's numbers mean something: two cores shared by
# several llama.cpp processes take minutes over a long queue, and a request
# timed out is a measurement lost.
PATIENT = {"gpu": {"first_token_timeout_s": 300, "token_timeout_s": 120}, "server": {"queue_timeout_s": 600}}
# The GPU worker stays loaded: no giving way to other apps, no unloading when
# idle, so what is measured is a worker that is there.
STAYS_LOADED = {"gpu": {"yield_to_other_apps": False, "idle_unload_s": 0}}


def service_config(*, simulate_mib: int, n_ctx: int | None = None, patient: bool = False,
                   stays_loaded: bool = False, **sections: Mapping[str, object]) -> str:
    """TOML for a benchmark's service. The GPU is simulated with `simulate_mib`
    of VRAM, so a run measures the same on any machine; the VRAM reserve and
    the RAM floor are small enough for the bundled model to fit there; `n_ctx`
    is both paths' context. `sections` add keys per section (`gpu={...}`,
    `breaker={...}`) and win over the ones above."""
    tables: dict[str, dict[str, object]] = {"gpu": {"simulate_mib": simulate_mib, "reserve_mib": 256},
                                            "cpu": {"ram_floor_mib": 256}}
    if n_ctx is not None:
        tables["gpu"]["n_ctx"] = tables["cpu"]["n_ctx"] = n_ctx
    for wanted, extra in ((patient, PATIENT), (stays_loaded, STAYS_LOADED), (True, sections)):
        if wanted:
            for section, values in extra.items():
                tables.setdefault(section, {}).update(values)
    return "".join(f"[{section}]\n" + "".join(f"{key} = {_toml_value(value)}\n" for key, value in values.items())
                   for section, values in tables.items())


def _toml_value(value: object) -> str:
    # A JSON bool, finite number or string is written the same in TOML.
    if not isinstance(value, (bool, int, float, str)):
        raise TypeError(f"no TOML for {value!r} in a benchmark's config")
    return json.dumps(value, ensure_ascii=False, allow_nan=False)
