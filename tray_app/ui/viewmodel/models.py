"""The model library's rows and the workers' table."""

from __future__ import annotations

from dataclasses import dataclass
from ...core.status_contract import Status
from .formatting import MENU_NAME_CHARS, elide_middle, fmt_mib


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
    drafts: str = "-"  # speculative decoding's type and acceptance, "-" without


def worker_rows(status: Status) -> list[WorkerRow]:
    rows = []
    for w in status["workers"]:
        last_exit = w["last_exit"]
        rows.append(WorkerRow(
            role=w["role"].upper(),
            state=w["state"],
            pid=str(w["pid"] or "-"),
            rss=fmt_mib(w["rss_mib"]) if w["rss_mib"] is not None else "-",
            vram=fmt_mib(w["estimated_vram_mib"]) if w["estimated_vram_mib"] else "-",
            ram=fmt_mib(w["estimated_ram_mib"]) if w["estimated_ram_mib"] else "-",
            ctx=f"{w['n_ctx']:,}",
            restarts=str(w["restarts"]),
            last_exit=(last_exit["description"] or last_exit["kind"]) if last_exit is not None else "",
            drafts=drafts_text(w),
        ))
    return rows


def drafts_text(worker) -> str:
    """"ngram-mod 62%": the speculative type and its drafts' acceptance lately."""
    kind = worker.get("speculative")
    if not kind:
        return "-"
    acceptance = (worker.get("drafts") or {}).get("acceptance")
    return kind if acceptance is None else f"{kind} {acceptance:.0%}"


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


def model_views(status: Status | None) -> list[ModelView]:
    views = []
    for model in status["models"] if status is not None else ():
        location, gpu = model["location"], model["gpu"]
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
        vram = model["vram_mib"]
        if where == "on the GPU" and vram > 0:
            memory = f"{fmt_mib(vram)} VRAM"
        elif where == "on the CPU":
            memory = f"{fmt_mib(model['estimated_ram_mib'])} RAM"
        else:
            size = model["size_bytes"]
            memory = f"{fmt_mib(size / (1024 * 1024))} on disk" if size else "size unknown"
        busy = model["in_flight"]
        aliases = ", ".join(model["aliases"])
        source = {"default": "the default model", "config": "a [[models]] entry", "folder": "from the models folder"}
        tip = [f"{model['name']} ({source[model['source']]})" if model["source"] in source else model["name"],
               model["path"]]
        if aliases:
            tip.append(f"also called: {aliases}")
        tip.append(f"loads {model['loads']}, unloaded for other models {model['evictions']} times")
        if model["degraded"]:
            tip.append(f"degraded: {model['degraded']}")
        views.append(ModelView(
            name=model["name"], where=where, memory=memory,
            can_load=gpu in ("unloaded_idle",) and where not in ("loading", "on the GPU"),
            can_unload=where in ("on the GPU", "on the CPU") and busy == 0, busy=busy,
            is_default=model["source"] == "default", tooltip="\n".join(t for t in tip if t)))
    return views


def model_names(status: Status | None) -> list[str]:
    """The names a chat may pick, the default model first."""
    return [view.name for view in model_views(status)]
