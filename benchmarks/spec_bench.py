"""Benchmark of speculative decoding. Prints numbers; asserts nothing.

    .venv/bin/python benchmarks/spec_bench.py [--rounds 2] [--types ngram-mod,ngram-simple] [--threads 2]
                                              [--verify-cost]

The same llama-server binary and model (the bundled ones, or --model),
started once per speculation setting: off (the anchor) and each --types.
Settings alternate inside every round, so a slow moment of the machine
falls on all of them alike. Each workload is sent --repeats times in a row
to the same server, temperature 0: llama-server's n-gram tables learn from
what it has seen, so the first request and the later ones are reported
apart. Reported per workload and setting: decode tokens/s as a ratio to the
anchor in the same round (the median, and the range over rounds), and the
share of drafted tokens accepted (llama-server's timings: draft_n,
draft_n_accepted). --verify-cost adds what checking a draft costs (see
verify_cost): with the acceptance, why a type pays where it does.

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


def answer_timings(url: str, route: str, body: dict) -> dict:
    """llama-server's timings of one answer, temperature 0, its prompt cache on."""
    response = httpx.post(f"{url}{route}", json={"temperature": 0, "cache_prompt": True, **body}, timeout=600)
    response.raise_for_status()
    return response.json()["timings"]


def ask(url: str, messages: list[dict[str, str]], max_tokens: int, extra: dict | None = None) -> dict:
    return answer_timings(url, "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens, **(extra or {})})


def setting_args(setting: str) -> tuple[str, ...]:
    """llama-server's arguments for a setting: "off", a --spec-type, or a
    type with its own options, "ngram-mod/n-match=8/n-max=16" for
    --spec-type ngram-mod --spec-ngram-mod-n-match 8 --spec-ngram-mod-n-max 16."""
    if setting == "off":
        return ()
    kind, *options = setting.split("/")
    args = ["--spec-type", kind]
    for option in options:
        key, _, value = option.partition("=")
        args += [f"--spec-{kind}-{key}", value]
    return tuple(args)


def run_ab(settings: list[str], workloads: list[str], *, rounds: int, repeats: int, max_tokens: int,
           threads: int, model: Path | None, server_args: tuple[str, ...] = (),
           body: dict | None = None) -> dict[tuple[str, str], Cell]:
    """Each setting's server, alternating inside each round; every workload
    sent `repeats` times in a row to it. `server_args` go to every server
    (the GPU check's --n-gpu-layers), `body` into every request."""
    cells = {(w, s): Cell() for w in workloads for s in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(rounds):
            for setting in settings:
                extra = (*server_args, *setting_args(setting))
                # A fresh server per round and setting: the n-gram tables start empty each time.
                server = llama_server(Path(tmp) / f"{setting.replace('/', '_')}-{round_}.log", n_ctx=4096, parallel=1,
                                      threads=threads, model=model, extra_args=extra)
                try:
                    for workload in workloads:
                        cell = cells[(workload, setting)]
                        row = []
                        for _ in range(repeats):
                            timings = ask(server.url, WORKLOADS[workload], max_tokens, body)
                            row.append(timings["predicted_per_second"])
                            cell.drafted += int(timings.get("draft_n") or 0)
                            cell.accepted += int(timings.get("draft_n_accepted") or 0)
                        cell.speeds.append(row)
                finally:
                    server.stop()
                time.sleep(0.5)
    return cells


# Token ids of plain vocabulary (past SmolLM2's specials): a prompt of an exact length.
PLAIN_IDS = range(1000, 9000)


def complete(url: str, prompt: list[int], n_predict: int) -> dict:
    return answer_timings(url, "/completion", {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True})


def verify_cost(url: str, batches: tuple[int, ...] = (1, 2, 4, 8, 16), rounds: int = 5,
                prefix_tokens: int = 256) -> dict:
    """What checking a draft costs on this server, in decode steps. A draft
    of d tokens is checked in one batch of d + 1 (the last token and the
    draft); llama-server reads n new tokens after a cached prefix the same
    way, so the time of that read over the time of one decoded token is the
    batch's cost. Speculation with d drafted tokens pays only when more than
    cost(d + 1) - 1 of them are accepted on average: a fact of the device and
    the model's shape, not of its weights."""
    ids = iter(PLAIN_IDS)
    prefix = [next(ids) for _ in range(prefix_tokens)]
    steps: list[float] = []
    costs: dict[int, list[float]] = {n: [] for n in batches}
    read: dict[int, list[int]] = {n: [] for n in batches}
    # Round by round, a decode and then each batch size read (n_predict 0),
    # so a slow moment of the machine falls on both sides of each ratio;
    # the first round is not counted (its first reads set up the graphs).
    for round_ in range(rounds + 1):
        step_ms = complete(url, prefix, 16)["predicted_per_token_ms"]
        for n in batches:
            timings = complete(url, [*prefix, *(next(ids) for _ in range(n))], 0)
            if round_:
                costs[n].append(timings["prompt_ms"] / step_ms)
                read[n].append(timings["prompt_n"])
        if round_:
            steps.append(step_ms)
    rows = []
    for n in batches:
        cost = statistics.median(costs[n])
        pays = max(0.0, cost - 1) / (n - 1) if n > 1 else None
        rows.append({"batch": n, "tokens_read": statistics.median(read[n]), "cost_in_steps": round(cost, 2),
                     "pays_above_accepted": "-" if pays is None else f"{pays:.0%}" if pays <= 1 else "never"})
    step_ms = statistics.median(steps)
    return {"decode_ms_per_token": round(step_ms, 3), "batches": rows}


def table(cells: dict[tuple[str, str], Cell], workloads: list[str], settings: list[str]) -> list[dict]:
    """One row per workload and setting: its first request's tokens/s, and
    its ratios to 'off' in the same round (the first request, the later ones)."""
    rows = []
    for workload in workloads:
        anchor = cells[(workload, "off")]
        for setting in settings:
            cell = cells[(workload, setting)]
            first = [row[0] / base[0] for row, base in zip(cell.speeds, anchor.speeds)]
            later = [statistics.mean(row[1:]) / statistics.mean(base[1:])
                     for row, base in zip(cell.speeds, anchor.speeds) if len(row) > 1]
            rows.append({"workload": workload, "setting": setting,
                         "tokens_per_s_first": round(statistics.median(r[0] for r in cell.speeds), 1),
                         "ratio_first": _ratio(first), "ratio_later": _ratio(later),
                         "accepted": f"{cell.accepted / cell.drafted:.0%}" if cell.drafted else "-"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="requests in a row per workload")
    parser.add_argument("--types", default="ngram-mod,ngram-simple",
                        help="llama-server --spec-type values, each with its options if any: "
                             "ngram-mod/n-match=8/n-min=2 (see setting_args)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--verify-cost", action="store_true",
                        help="also print what checking a draft of each size costs, in decode steps")
    args = parser.parse_args()
    settings = ["off", *[t for t in args.types.split(",") if t]]
    workloads = [w for w in args.workloads.split(",") if w]
    cells = run_ab(settings, workloads, rounds=args.rounds, repeats=args.repeats, max_tokens=args.max_tokens,
                   threads=args.threads, model=args.model)
    print(f"speculative decoding, llama-server, {args.threads} threads, {args.max_tokens} tokens, temperature 0, "
          f"{args.rounds} rounds; ratio to 'off' in the same round (median, range)\n")
    header = f"{'workload':<13} {'setting':<13} {'tok/s 1st':>9} {'ratio 1st':>17} {'ratio later':>17} {'accepted':>9}"
    print(header)
    for row in table(cells, workloads, settings):
        print(f"{row['workload']:<13} {row['setting']:<13} {row['tokens_per_s_first']:>9.1f} "
              f"{row['ratio_first']:>17} {row['ratio_later']:>17} {row['accepted']:>9}")
    if args.verify_cost:
        with tempfile.TemporaryDirectory() as tmp:
            server = llama_server(Path(tmp) / "cost.log", n_ctx=4096, parallel=1, threads=args.threads,
                                  model=args.model)
            try:
                cost = verify_cost(server.url)
            finally:
                server.stop()
        print(f"\nchecking a draft: a batch of n tokens read after a cached prefix, in decode steps "
              f"({cost['decode_ms_per_token']} ms each)\n")
        print(f"{'batch':>5} {'read':>5} {'cost':>6} {'pays above':>11}")
        for row in cost["batches"]:
            print(f"{row['batch']:>5} {row['tokens_read']:>5} {row['cost_in_steps']:>6} {row['pays_above_accepted']:>11}")


def _ratio(values: list[float]) -> str:
    if not values:
        return "-"
    return f"x{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


if __name__ == "__main__":
    main()
