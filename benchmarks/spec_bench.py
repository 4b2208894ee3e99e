"""Benchmark of speculative decoding. Prints numbers; asserts nothing.

    .venv/bin/python benchmarks/spec_bench.py [--rounds 2] [--types ngram-mod,ngram-simple] [--threads 2]

The same llama-server binary and model (the bundled ones, or --model),
started once per speculation setting: off (the anchor) and each --types.
Settings alternate inside every round, so a slow moment of the machine
falls on all of them alike. Each workload is sent --repeats times in a row
to the same server, temperature 0: llama-server's n-gram tables learn from
what it has seen, so the first request and the later ones are reported
apart. Reported per workload and setting: decode tokens/s as a ratio to the
anchor in the same round (the median, and the range over rounds), and the
share of drafted tokens accepted (llama-server's timings: draft_n,
draft_n_accepted).

Workloads people have:
- code: rewrite a file with one change (what aider and Continue do);
- extract: JSON extracted from a given text;
- summarise: a summary of a given text;
- chat: free chat;
- conversation: a long multi-turn conversation, answered at its end.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.anchors import llama_server  # noqa: E402

# A real file of this repository, with one change asked for.
CODE = (ROOT / "tray_app" / "core" / "dispatch" / "backlog.py").read_text(encoding="utf-8")
TEXT = (ROOT / "resources" / "config.example.toml").read_text(encoding="utf-8")[:2500]

WORKLOADS: dict[str, list[dict[str, str]]] = {
    "code": [{"role": "user", "content": "Rewrite this Python file exactly as it is, but rename the function "
                                         f"backlog_s to queue_seconds. Output only the file.\n\n{CODE}"}],
    "extract": [{"role": "user", "content": "From this configuration file, list every [section] and its keys "
                                            f"as JSON: {{\"section\": [\"key\", ...]}}.\n\n{TEXT}"}],
    "summarise": [{"role": "user", "content": f"Summarise this text in a few sentences.\n\n{TEXT}"}],
    "chat": [{"role": "user", "content": "What should I cook tonight? Give me three ideas and say why."}],
    "conversation": [
        {"role": "user", "content": "I want to plan a garden."},
        {"role": "assistant", "content": "Happy to help. How big is it, and how much sun does it get?"},
        {"role": "user", "content": "About 20 square metres, sun in the morning only."},
        {"role": "assistant", "content": "Morning sun suits leafy greens, herbs such as parsley and mint, "
                                         "peas and beans. Fruiting plants like tomatoes want more."},
        {"role": "user", "content": "I like tomatoes though. What can I do?"},
        {"role": "assistant", "content": "Put them where the sun lasts longest, choose cherry varieties, "
                                         "and use a reflective surface behind them."},
        {"role": "user", "content": "Now write the whole plan out, bed by bed, with what we said."},
    ],
}


@dataclass
class Cell:
    """One workload under one setting: per round, the tokens/s of each request in a row."""

    speeds: list[list[float]] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0


def ask(url: str, messages: list[dict[str, str]], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "cache_prompt": True}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    return response.json()["timings"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="requests in a row per workload")
    parser.add_argument("--types", default="ngram-mod,ngram-simple", help="llama-server --spec-type values")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--model", type=Path, default=None)
    args = parser.parse_args()
    settings = ["off", *[t for t in args.types.split(",") if t]]
    workloads = [w for w in args.workloads.split(",") if w]
    cells = {(w, s): Cell() for w in workloads for s in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for setting in settings:
                extra = () if setting == "off" else ("--spec-type", setting)
                # A fresh server per round and setting: the n-gram tables start empty each time.
                server = llama_server(Path(tmp) / f"{setting}-{round_}.log", n_ctx=4096, parallel=1,
                                      threads=args.threads, model=args.model, extra_args=extra)
                try:
                    for workload in workloads:
                        cell = cells[(workload, setting)]
                        row = []
                        for _ in range(args.repeats):
                            timings = ask(server.url, WORKLOADS[workload], args.max_tokens)
                            row.append(timings["predicted_per_second"])
                            cell.drafted += int(timings.get("draft_n") or 0)
                            cell.accepted += int(timings.get("draft_n_accepted") or 0)
                        cell.speeds.append(row)
                finally:
                    server.stop()
                time.sleep(0.5)
    print(f"speculative decoding, llama-server, {args.threads} threads, {args.max_tokens} tokens, temperature 0, "
          f"{args.rounds} rounds; ratio to 'off' in the same round (median, range)\n")
    header = f"{'workload':<13} {'setting':<13} {'tok/s 1st':>9} {'ratio 1st':>17} {'ratio later':>17} {'accepted':>9}"
    print(header)
    for workload in workloads:
        anchor = cells[(workload, "off")]
        for setting in settings:
            cell = cells[(workload, setting)]
            first = [row[0] / base[0] for row, base in zip(cell.speeds, anchor.speeds)]
            later = [statistics.mean(row[1:]) / statistics.mean(base[1:])
                     for row, base in zip(cell.speeds, anchor.speeds) if len(row) > 1]
            accepted = f"{cell.accepted / cell.drafted:.0%}" if cell.drafted else "-"
            print(f"{workload:<13} {setting:<13} {statistics.median(r[0] for r in cell.speeds):>9.1f} "
                  f"{_ratio(first):>17} {_ratio(later):>17} {accepted:>9}")


def _ratio(values: list[float]) -> str:
    if not values:
        return "-"
    return f"x{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


if __name__ == "__main__":
    main()
