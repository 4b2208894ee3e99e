"""The model library's rows and the workers' table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .formatting import MENU_NAME_CHARS, as_number, elide_middle, fmt_mib


@dataclass
class WorkerRow:
    role: str
    state: str
    pid: str
    rss: str
    vram: str
    ram: str
    ctx: str
    restarts: str
    last_exit: str = ""


def worker_rows(status: Mapping[str, Any]) -> list[WorkerRow]:
    rows = []
    for w in status.get("workers") or ():
        last_exit = w.get("last_exit") or {}
        rows.append(WorkerRow(
            role=str(w.get("role", "?")).upper(),
            state=str(w.get("state", "?")),
            pid=str(w.get("pid") or "-"),
            rss=fmt_mib(as_number(w.get("rss_mib"))) if w.get("rss_mib") is not None else "-",
            vram=fmt_mib(as_number(w.get("estimated_vram_mib"))) if as_number(w.get("estimated_vram_mib")) else "-",
            ram=fmt_mib(as_number(w.get("estimated_ram_mib"))) if as_number(w.get("estimated_ram_mib")) else "-",
            ctx=f"{w.get('n_ctx'):,}" if isinstance(w.get("n_ctx"), int) else "-",
            restarts=str(w.get("restarts", 0)),
            last_exit=str(last_exit.get("description") or last_exit.get("kind") or "") if last_exit else "",
        ))
    return rows


@dataclass(frozen=True)
class ModelView:
    """One library model, as the tray menu and the panel show it."""

    name: str
    where: str        # "on the GPU", "on the CPU", "loading", "unloaded", "GPU given away"
    memory: str       # what it holds now, or its size on disk when unloaded
    can_load: bool    # its GPU worker is unloaded and may load now
    can_unload: bool  # it holds memory and nothing of it is queued or running
    busy: int         # requests queued or running on its GPU path
    is_default: bool
    tooltip: str

    @property
    def label(self) -> str:
        """The menu's line: a long file name shortened in the middle (the tooltip has it whole)."""
        default = " (default)" if self.is_default else ""
        return f"{elide_middle(self.name, MENU_NAME_CHARS)}{default}: {self.where}, {self.memory}"


def model_views(status: Mapping[str, Any] | None) -> list[ModelView]:
    views = []
    for model in (status or {}).get("models") or ():
        location = str(model.get("location") or "unloaded")
        gpu = str(model.get("gpu") or "")
        if gpu == "loaded":
            where = "on the GPU"
        elif "cpu" in location.split("+"):
            where = "on the CPU"
        elif gpu == "loading" or location == "loading":
            where = "loading"
        elif gpu == "given_away":
            where = "GPU given away"
        else:
            where = "unloaded"
        vram = as_number(model.get("vram_mib")) or 0.0
        if where == "on the GPU" and vram > 0:
            memory = f"{fmt_mib(vram)} VRAM"
        elif where == "on the CPU":
            memory = f"{fmt_mib(as_number(model.get('estimated_ram_mib')))} RAM"
        else:
            size = as_number(model.get("size_bytes"))
            memory = f"{fmt_mib(size / (1024 * 1024))} on disk" if size else "size unknown"
        busy = int(model.get("in_flight") or 0)
        aliases = ", ".join(model.get("aliases") or ())
        source = {"default": "the default model", "config": "a [[models]] entry", "folder": "from the models folder"}
        tip = [f"{model.get('name')} ({source[model['source']]})" if model.get("source") in source
               else str(model.get("name")), str(model.get("path") or "")]
        if aliases:
            tip.append(f"also called: {aliases}")
        tip.append(f"loads {model.get('loads', 0)}, unloaded for other models {model.get('evictions', 0)} times")
        if model.get("degraded"):
            tip.append(f"degraded: {model['degraded']}")
        views.append(ModelView(
            name=str(model.get("name")), where=where, memory=memory,
            can_load=gpu in ("unloaded_idle",) and where not in ("loading", "on the GPU"),
            can_unload=where in ("on the GPU", "on the CPU") and busy == 0, busy=busy,
            is_default=model.get("source") == "default", tooltip="\n".join(t for t in tip if t)))
    return views


def model_names(status: Mapping[str, Any] | None) -> list[str]:
    """The names a chat may pick, the default model first."""
    return [view.name for view in model_views(status)]
