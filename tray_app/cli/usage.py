"""`tray-app usage`: who used what, today and over the last 7 days.

From a running service's /status (live); when none answers, from the usage
file it saves (core/access/usage.py), which is at most a few seconds behind.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..core.config import DEFAULT_PORT
from ..core.access.usage import PATHS, UsageStore
from .keys import table


def add_usage_parser(sub) -> None:
    usage = sub.add_parser("usage", help="requests and tokens per key (or app), today and the last 7 days",
                           description="Requests and tokens per key (per app name, from X-Client-Name or the "
                                       "User-Agent, when no keys are set), by path (GPU, CPU, peer), with how "
                                       "many were degraded, refused or cancelled.")
    usage.add_argument("--url", default=f"http://127.0.0.1:{DEFAULT_PORT}", help="the service's base URL")
    usage.add_argument("--json", action="store_true", help="print the raw JSON (/status's \"usage\")")
    usage.add_argument("--config", metavar="PATH", help="TOML config file whose [server] api_key to send")


def run_usage(args: argparse.Namespace, api_key: str = "") -> int:
    import httpx

    from ..core.api.security import bearer_header

    source = f"the service at {args.url}"
    try:
        response = httpx.get(f"{args.url.rstrip('/')}/status", headers=bearer_header(api_key), timeout=5.0)
    except httpx.HTTPError:
        store = UsageStore()
        usage, source = store.snapshot(), f"{store.path} (no service answers at {args.url})"
    else:
        if response.status_code != 200:
            print(f"tray-app: error: {args.url}/status answered HTTP {response.status_code}; "
                  "send a key with TRAY_APP_API_KEY or [server] api_key", file=sys.stderr)
            return 2
        usage = response.json().get("usage")
        if usage is None:
            print(f"tray-app: error: the service at {args.url} reports no usage (an older version?)",
                  file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(usage, indent=2))
        return 0
    print(f"usage from {source}, today {usage['today']}:")
    print(render_usage(usage))
    return 0


def render_usage(usage: dict[str, Any]) -> str:
    by_name = usage.get("by_name") or {}
    if not by_name:
        return "no requests yet"
    header = ("KEY/APP", "PERIOD", "REQUESTS", *(path.upper() for path in PATHS), "TOKENS IN", "TOKENS OUT",
              "DEGRADED", "REFUSED", "CANCELLED")
    rows = [header]
    for name, periods in sorted(by_name.items()):
        for period in ("today", "last_7_days"):
            counts = periods[period]
            rows.append((name, period.replace("_", " "), str(counts["requests"]),
                         *(str(counts["paths"][path]["requests"]) for path in PATHS),
                         str(counts["tokens_in"]), str(counts["tokens_out"]), str(counts["degraded"]),
                         str(counts["refused"]), str(counts["cancelled"])))
    return table(rows)
