"""The report as people read it: a terminal summary table, report.md and the
latency plot (PNG). Everything is computed already; this only lays it out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .units import mib, percent, seconds

PLOT_FILE = "latency.png"

# One colour per way a request was routed, so the plot reads like the route table.
ROUTE_COLOURS = {
    "gpu/admitted": "#2b7bba",
    "cpu/gpu_context_cap": "#e6862a",
    "cpu/forced_cpu": "#9c6ade",
    "cpu/gpu_busy": "#d4b106",
    "cpu/gpu_vram_headroom": "#d9480f",
    "cpu/gpu_unavailable": "#c2255c",
    "cpu/gpu_failed_replayed": "#2f9e44",
    "cpu/gpu_failed_resumed": "#37b24d",
    "rejected": "#868e96",
    "canceled": "#343a40",
    "error": "#e03131",
    "lost": "#000000",
}


def route_of(record: Mapping[str, Any]) -> str:
    if record["outcome"] in ("rejected", "canceled", "error", "lost"):
        return record["outcome"]
    return f"{record.get('served_by')}/{record.get('route_reason')}"


def summary_rows(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(metric, value) lines shared by the terminal table and report.md."""
    n = report["numbers"]
    success = n["success"]
    agreement = n["token_agreement"]
    rows = [
        ("success rate", f"{success['answered']}/{success['accepted']} accepted requests answered "
                         f"({percent(success['success_rate'])}); {success['rejected']} rejected at admission, "
                         f"{success['canceled']} canceled, clean errors: {success['clean_errors']}"),
        ("lost requests", str(n["lost_requests"])),
        ("duplicated side effects", f"{n['duplicated_side_effects']} (tool calls run twice: "
                                    f"{len(n['tool_calls_ran_twice'])} of {len(n['tool_executions'])} actions)"),
        ("token agreement GPU vs CPU", f"{agreement['identical_pairs']}/{agreement['pairs']} pairs identical; "
                                       f"{percent(agreement['token_agreement'])} of {agreement['tokens_compared']} "
                                       f"tokens ({agreement['prefix_pairs']} cut-short streams, "
                                       f"{agreement['text_pairs']} JSON pairs by text)"),
    ]
    for path, summary in n["latency_by_path"].items():
        rows.append((f"latency {path} p50 / p95", f"{seconds(summary['p50_s'])} / {seconds(summary['p95_s'])} (n={summary['n']})"))
    for path, summary in n["ttft_by_path"].items():
        rows.append((f"first token {path} p50 / p95", f"{seconds(summary['p50_s'])} / {seconds(summary['p95_s'])} "
                                                     f"(n={summary['n']} streams)"))
    oldest = [(lane, value) for lane, value in n["oldest_queue_age_s"].items() if value]
    if oldest:
        lane, value = max(oldest, key=lambda pair: pair[1]["value"])
        rows.append(("oldest request age in queue", f"{seconds(value['value'])} ({lane} queue, at t={value['at_s']:.1f} s)"))
    else:
        rows.append(("oldest request age in queue", "n/a"))
    ram = n["min_available_ram_mib"]
    rows.append(("minimum available host RAM", f"{mib(ram['value'])} (at t={ram['at_s']:.1f} s)" if ram else "n/a"))
    recoveries = [r for r in n["gpu_recovery"] if r["recovery_s"] is not None]
    if n["gpu_recovery"]:
        worst = max((r["recovery_s"] for r in recoveries), default=None)
        service = [r["service_gpu_recovery_s"] for r in recoveries if r.get("service_gpu_recovery_s") is not None]
        rows.append(("GPU recovery time", f"max {seconds(worst)} over {len(recoveries)}/{len(n['gpu_recovery'])} faults "
                                          f"(each: {', '.join(seconds(r['recovery_s'], 1) for r in n['gpu_recovery'])})"
                                          + (f"; service's gpu_recovery_s: {service[-1]} s" if service else "")))
    else:
        rows.append(("GPU recovery time", "n/a (no fault injected)"))
    for fault, failover in (n.get("failover_by_fault") or {}).items():
        rows.append((f"failover after a {fault.replace('_', '-')}",
                     f"first CPU token p50 {seconds(failover['p50_s'])}, max {seconds(failover['max_s'])} (n={failover['n']})"))
    degraded = n["degraded"]
    rows.append(("degraded status visible", f"{degraded['visible_intervals']}/{len(degraded['intervals'])} intervals, "
                                            f"{degraded['samples_in_intervals']} samples; "
                                            f"{degraded['cpu_answers_for_gpu_out_reasons'] - len(degraded['cpu_answers_without_fallback_headers'])}"
                                            f"/{degraded['cpu_answers_for_gpu_out_reasons']} CPU answers with fallback headers"))
    return rows


def phase_rows(report: Mapping[str, Any]) -> list[list[str]]:
    rows = []
    for phase in report["phases"]:
        if phase["number"] == 0:
            continue
        checks = [c for c in phase["checks"] if c["severity"] != "finding"]
        passed = sum(1 for c in checks if c["passed"])
        o = phase["outcomes"]
        rows.append([
            f"{phase['number']} {phase['title']}",
            "skipped" if phase["skipped"] else str(phase["requests"]),
            str(o["ok"]), str(o["rejected"]), str(o["canceled"]), str(o["error"]), str(o["lost"]),
            f"{phase['served_by']['gpu']}/{phase['served_by']['cpu']}",
            "-" if phase["skipped"] else f"{passed}/{len(checks)}",
            f"{phase['duration_s']:.1f}",
        ])
    return rows


PHASE_HEADER = ["phase", "requests", "ok", "rejected", "canceled", "errors", "lost", "gpu/cpu", "checks", "s"]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))
    out = [line, "-" * len(line)]
    for row in rows:
        out.append("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    return out


def terminal_summary(report: Mapping[str, Any], out_dir: Path | None) -> str:
    run = report["run"]
    lines = [
        f"tray-app drill ({run['plan']}): {report['verdict']} (exit {report['exit_code']})  "
        f"{run['target']}  run time {run['duration_s']:.1f} s",
        "",
        *_table(PHASE_HEADER, phase_rows(report)),
        "",
    ]
    width = max(len(name) for name, _ in summary_rows(report))
    lines += [f"{name.ljust(width)}  {value}" for name, value in summary_rows(report)]
    failed = [c for c in _all_checks(report) if not c["passed"]]
    if failed:
        lines.append("")
        for c in failed:
            detail = c["detail"] if len(c["detail"]) <= 400 else c["detail"][:400] + " ..."
            lines.append(f"{'FINDING' if c['severity'] == 'finding' else 'FAILED'} [{c['severity']}] {c['name']}: {detail}")
    if out_dir is not None:
        logs = f", service logs in {out_dir / 'logs'}" if report["verdict"] != "PASS" and not run["live"] else ""
        lines += ["", f"report: {out_dir / 'report.md'}  (report.json, {PLOT_FILE}{logs})"]
    return "\n".join(lines)


def _all_checks(report: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    checks = list(report["checks"])
    for phase in report["phases"]:
        checks += [dict(c, name=f"phase {phase['number']}: {c['name']}") for c in phase["checks"]]
    return checks


def markdown(report: Mapping[str, Any], plot_written: bool, plot_note: str | None = None) -> str:
    run = report["run"]
    out = [
        f"# Failover drill: {report['verdict']}",
        "",
        f"`tray-app drill` ({run['plan']} plan) against the {run['target']}, started {run['started_at']}, "
        f"ran {run['duration_s']:.1f} s. Exit code {report['exit_code']}"
        " (0 pass; 1 a request lost or duplicated, or a tool run twice; 3 another check failed).",
        "",
    ]
    if run.get("notes"):
        out += [f"- {note}" for note in run["notes"]] + [""]
    out += ["## Summary", "", "| metric | value |", "|---|---|"]
    out += [f"| {name} | {value} |" for name, value in summary_rows(report)]
    out += ["", "## Phases", "", "| " + " | ".join(PHASE_HEADER) + " |", "|" + "---|" * len(PHASE_HEADER)]
    out += ["| " + " | ".join(row) + " |" for row in phase_rows(report)]
    out += ["", "## Latency over time", ""]
    if plot_written:
        out += [f"![Latency of every request over the drill, coloured by route]({PLOT_FILE})", "",
                "Each dot is one request: when it was sent (x) and how long it took (y), coloured by the path "
                "and route reason it got. Shaded bands are the phases; the lower panel is free VRAM "
                "as /status reported it, with the degraded intervals in red.", ""]
    else:
        out += [f"(no plot: {plot_note})", ""]
    out += ["## Checks", "", "| | severity | check | detail |", "|---|---|---|---|"]
    for c in _all_checks(report):
        mark = "pass" if c["passed"] else ("note" if c["severity"] == "finding" else "FAIL")
        out.append(f"| {mark} | {c['severity']} | {c['name']} | {_md(c['detail'])} |")
    for phase in report["phases"]:
        extra = [n for n in phase.get("notes") or ()]
        if phase.get("skipped"):
            extra.insert(0, f"skipped: {phase['skipped']}")
        if phase["key"] == "shrinking_vram" and phase["data"].get("steps"):
            out += ["", f"### Phase {phase['number']}: free VRAM steps", "",
                    "| step | spare above reserve | free VRAM | short | long | parallel |", "|---|---|---|---|---|---|"]
            for step in phase["data"]["steps"]:
                spare = "none taken" if step["spare_mib"] is None else f"{step['spare_mib']:g} MiB"
                out.append(f"| {step['step']} | {spare} | {mib(step['free_mib'])} | {step['short']} | {step['long']} "
                           f"| {', '.join(step['parallel'])} |")
        if extra:
            out += ["", f"### Phase {phase['number']} notes", ""] + [f"- {_md(n)}" for n in extra]
    faults = report["numbers"]["gpu_recovery"]
    if faults:
        out += ["", "## Faults and GPU recovery", "", "| phase | fault | at | over at | GPU serving again | recovery |",
                "|---|---|---|---|---|---|"]
        for f in faults:
            back = "not seen" if f["recovered_at_s"] is None else f"{f['recovered_at_s']:.1f} s"
            signal_name = f" ({f['signal']})" if f.get("signal") else ""
            out.append(f"| {f['phase']} | {f['kind']}{signal_name} | {f['at_s']:.1f} s | {f['cleared_s']:.1f} s | "
                       f"{back} | {seconds(f['recovery_s'])} |")
    out += ["", "## Requests", "",
            "Every request: route, outcome, the first failure, the retry decision, when the CPU started on it "
            "(after the request was sent; from the /status samples, so to within ~0.15 s), whether the client's "
            "connection survived, and the start of its output. report.json has all fields.", "",
            "| id | phase | label | route | outcome | latency | first failure | retry decision | CPU started | conn. | output |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["requests"]:
        output = r["output_text"] or (f"tool call {r['tool_calls'][0]['name'][:24]}({r['tool_calls'][0]['arguments'][:40]})"
                                      if r["tool_calls"] else (r.get("error_code") or ""))
        cpu = "" if r["cpu_started_s"] is None else f"+{max(0.0, r['cpu_started_s'] - r['started_s']):.2f} s"
        out.append(f"| {r['id'].split('-', 2)[-1]} | {r['phase']} | {_md(r['label'])} | {route_of(r)} | {r['outcome']} | "
                   f"{seconds(r['latency_s'])} | {_md((r['first_failure'] or '')[:80])} | {_md(r['retry_decision'][:90])} | "
                   f"{cpu} | {'yes' if r['connection_survived'] else 'NO'} | {_md(output[:50])} |")
    return "\n".join(out) + "\n"


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def write_plot(report: Mapping[str, Any], path: Path) -> str | None:
    """Write the PNG; returns None, or why there is no plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed, and never a Qt backend
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"matplotlib is not installed ({exc})"
    records = [r for r in report["requests"] if r["latency_s"] is not None]
    from .report import sample_dicts

    samples = [s for s in sample_dicts(report) if s.get("error") is None]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for i, phase in enumerate(p for p in report["phases"] if not p.get("skipped")):
        if phase["number"] == 0:
            continue
        for axis in (top, bottom):
            axis.axvspan(phase["started_s"], phase["ended_s"], color="#f1f3f5" if i % 2 else "#e9ecef", zorder=0)
        top.text((phase["started_s"] + phase["ended_s"]) / 2, 1.0, str(phase["number"]), transform=top.get_xaxis_transform(),
                 ha="center", va="bottom", fontsize=9, color="#495057")
    routes: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        routes.setdefault(route_of(r), []).append(r)
    for route, group in sorted(routes.items()):
        colour = ROUTE_COLOURS.get(route, "#adb5bd")
        streams = [r for r in group if r["stream"]]
        plain = [r for r in group if not r["stream"]]
        if plain:
            top.scatter([r["started_s"] for r in plain], [r["latency_s"] for r in plain], s=22, color=colour,
                        label=f"{route} ({len(group)})", zorder=3)
        if streams:
            top.scatter([r["started_s"] for r in streams], [r["latency_s"] for r in streams], s=26, color=colour,
                        marker="^", label=None if plain else f"{route} ({len(group)})", zorder=3)
    for fault in report["faults"]:
        top.axvline(fault["at_s"], color="#e03131", linewidth=0.8, linestyle="--", zorder=2)
    top.set_ylabel("latency (s)")
    top.set_title(f"tray-app drill ({report['run']['plan']}) on a {report['run'].get('device', 'service')}: "
                  "latency of every request by route (circles JSON, triangles streaming; dashed lines: faults)",
                  fontsize=10, pad=14)
    top.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.9, title="route (requests)",
               title_fontsize=8)
    top.grid(True, alpha=0.3)
    free = [(s["t"], s["gpu_free_mib"]) for s in samples if s.get("gpu_free_mib") is not None]
    if free:
        bottom.plot([t for t, _ in free], [v for _, v in free], color="#2b7bba", linewidth=1.2, label="free VRAM")
    for interval in report["numbers"]["degraded"]["intervals"]:
        bottom.axvspan(interval["start_s"], max(interval["end_s"], interval["start_s"] + 0.1), color="#ffa8a8",
                       alpha=0.6, zorder=1)
    from matplotlib.patches import Patch

    handles = bottom.get_legend_handles_labels()[0] + [
        Patch(color="#ffa8a8", alpha=0.6, label="degraded: CPU serving for a GPU-out reason")]
    bottom.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    bottom.set_ylabel("free VRAM (MiB)")
    bottom.set_xlabel("seconds since the drill started")
    bottom.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def report_json(report: Mapping[str, Any]) -> str:
    """report.json: indented, except one line per request and per /status
    sample, so a long drill stays a file you can grep and diff."""
    import json

    parts = []
    for key, value in report.items():
        if key == "requests":
            text = "[\n" + ",\n".join("  " + json.dumps(r, default=str) for r in value) + "\n ]"
        elif key == "samples":
            text = ('{"fields": ' + json.dumps(value["fields"]) + ', "rows": [\n'
                    + ",\n".join("  " + json.dumps(row) for row in value["rows"]) + "\n ]}")
        else:
            text = json.dumps(value, indent=1, default=str).replace("\n", "\n ")
        parts.append(f" {json.dumps(key)}: {text}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_files(report: Mapping[str, Any], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "report.json", "md": out_dir / "report.md", "png": out_dir / PLOT_FILE}
    paths["json"].write_text(report_json(report))
    why_not = write_plot(report, paths["png"])
    paths["md"].write_text(markdown(report, plot_written=why_not is None, plot_note=why_not))
    if why_not is not None:
        del paths["png"]
    return paths
