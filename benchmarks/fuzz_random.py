"""Fuzz the router with a random seed, and report what it found.

CI fuzzes with one fixed seed for a short time, so it is repeatable. This
script explores: a fresh seed each run (or --seed to reproduce one), for as
long as you like, on real workers. It prints how many cases ran and how many
got a 5xx, then sends the hostile-body corpus, and exits 1 if anything got a
server error.

    .venv/bin/python benchmarks/fuzz_random.py --seconds 300
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import RunningService  # noqa: E402
from tests.hostile_bodies import HOSTILE_BODIES, acceptable  # noqa: E402
from tests.integration.test_fuzz import FUZZ_CONFIG  # noqa: E402


def run_schemathesis(url: str, seed: int, seconds: int, workdir: Path) -> tuple[Counter, list[str]]:
    """Status codes of every request schemathesis sent (from its HAR log), and its summary."""
    cli = shutil.which("schemathesis", path=os.path.dirname(sys.executable))
    if cli is None:
        raise SystemExit("schemathesis is a test dependency: bash packaging/install.sh --test")
    har = workdir / "fuzz.har"
    result = subprocess.run(
        [cli, "run", f"{url}/openapi.json", "--workers", "1", "--request-timeout", "60",
         "--max-time", str(seconds), "--seed", str(seed), "--report", "har", "--report-har-path", str(har),
         "--checks", "not_a_server_error,response_schema_conformance,status_code_conformance,"
                     "content_type_conformance"],
        capture_output=True, text=True, timeout=seconds + 300, cwd=workdir,
    )
    statuses: Counter = Counter()
    examples: list[str] = []
    if har.exists():
        for entry in json.loads(har.read_text())["log"]["entries"]:
            status = entry["response"]["status"]
            statuses[status] += 1
            if status >= 500 and os.environ.get("TRAY_APP_FUZZ_DUMP"):
                with open(os.environ["TRAY_APP_FUZZ_DUMP"], "a") as dump:
                    dump.write(json.dumps(entry) + "\n")
            if status >= 500 and len(examples) < 5:
                sent = (entry["request"].get("postData") or {}).get("text", "")
                answer = (entry["response"].get("content") or {}).get("text", "")
                examples.append(f"{entry['request']['method']} {entry['request']['url']} {sent[:400]}\n"
                                f"    -> {status} {answer[:400]}")
    summary = result.stdout.split("SUMMARY")[-1].strip().splitlines()[-12:] + examples
    return statuses, summary


def run_corpus(url: str) -> list[tuple[str, int]]:
    failures = []
    with httpx.Client(base_url=url, timeout=120) as http:
        for name, body in HOSTILE_BODIES.items():
            status = http.post("/v1/chat/completions", content=body,
                               headers={"Content-Type": "application/json"}).status_code
            if not acceptable(name, status) or http.get("/status").status_code != 200:
                failures.append((name, status))
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=120, help="how long schemathesis generates cases")
    parser.add_argument("--seed", type=int, default=None, help="reproduce an earlier run (default: random)")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)

    with tempfile.TemporaryDirectory(prefix="tray-fuzz-") as tmp:
        service = RunningService(Path(tmp) / "service", FUZZ_CONFIG)
        try:
            service.wait_ready()
            statuses, summary = run_schemathesis(service.url, seed, args.seconds, Path(tmp))
            corpus_failures = run_corpus(service.url)
            duplicates = service.status()["accounting"]["duplicate_executions"]
        finally:
            service.stop()

    cases = sum(statuses.values())
    server_errors = sum(n for code, n in statuses.items() if code >= 500)
    print(f"seed {seed}: {cases} cases in {args.seconds} s, {server_errors} got a 5xx")
    print("  status codes: " + ", ".join(f"{code}: {n}" for code, n in sorted(statuses.items())))
    print(f"hostile corpus: {len(HOSTILE_BODIES)} bodies, {len(corpus_failures)} not answered with a 4xx"
          + "".join(f"\n  {name}: {status}" for name, status in corpus_failures))
    print(f"duplicate executions by the service's ledger: {duplicates}")
    print("schemathesis summary:\n  " + "\n  ".join(summary))
    return 1 if server_errors or corpus_failures or duplicates else 0


if __name__ == "__main__":
    sys.exit(main())
