"""`tray-app keys add|list|revoke`: a key per app, each with a scope and limits.

The keys file (core/access/keys.py) is changed here directly; a running service
reads it again on its next request, so a revoked key stops working at once,
without a restart.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

from ..core.access.keys import SCOPES, KeyProblem, KeyStore, default_keys_path


def add_keys_parser(sub) -> None:
    keys = sub.add_parser("keys", help="API keys, one per app: add, list, revoke",
                          description="Named API keys, one per app. An 'inference' key uses the API; an "
                                      "'admin' key may also use /admin/* (restart the workers, give the GPU "
                                      "back, load models), the web page's controls, and cancel any app's "
                                      f"requests. Stored hashed in {default_keys_path()} (only you can read "
                                      "it); a running service picks up changes at once.")
    actions = keys.add_subparsers(dest="keys_command", required=True)
    add = actions.add_parser("add", help="make a key; it is printed once, here, and never again")
    add.add_argument("name", help="the app's name: letters, digits, '.', '_' or '-' (at most 64)")
    add.add_argument("--scope", choices=SCOPES, default="inference",
                     help="inference (the default): the API only; admin: also /admin/* and other apps' cancels")
    add.add_argument("--models", metavar="M1,M2", default="",
                     help="the library models this key may use, comma-separated (default: all)")
    add.add_argument("--max-concurrency", type=int, metavar="N",
                     help="at most N of this key's requests at once; more get HTTP 429 with Retry-After "
                          "(default: no limit)")
    add.add_argument("--no-prompt-cache", action="store_true",
                     help="this key's requests never reuse the workers' prompt cache, so it can't tell by timing "
                          "whether another key sent the same prompt (its long prompts are slower)")
    listing = actions.add_parser("list", help="the keys, without their secrets")
    listing.add_argument("--json", action="store_true", help="print JSON")
    revoke = actions.add_parser("revoke", help="delete a key; the running service refuses it from now on")
    revoke.add_argument("name")


def run_keys(args: argparse.Namespace, store: KeyStore | None = None, legacy_key_set: bool = False) -> int:
    store = store or KeyStore()
    try:
        if args.keys_command == "add":
            models = tuple(m.strip() for m in args.models.split(",") if m.strip())
            raw = store.add(args.name, args.scope, models, args.max_concurrency, prompt_cache=not args.no_prompt_cache)
            print(raw)
            print(f"tray-app: key {args.name!r} ({args.scope}) added. This is the only time it is shown: give it "
                  "to the app as its API key ('Authorization: Bearer <key>' or 'x-api-key').", file=sys.stderr)
            return 0
        if args.keys_command == "revoke":
            store.revoke(args.name, other_admin=legacy_key_set)
            print(f"tray-app: key {args.name!r} revoked; the service refuses it from its next request on",
                  file=sys.stderr)
            return 0
        keys = [key.public() for key in store.keys().values()]
    except KeyProblem as exc:
        print(f"tray-app: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(keys, indent=2))
    elif not keys:
        print("no keys; add one with: tray-app keys add NAME")
    else:
        print(render_keys(keys))
    return 0


def render_keys(keys: list[dict]) -> str:
    rows = [("NAME", "SCOPE", "MODELS", "MAX CONCURRENCY", "CREATED")]
    for key in keys:
        created = datetime.datetime.fromtimestamp(key["created"]).strftime("%Y-%m-%d %H:%M")
        rows.append((key["name"], key["scope"], ",".join(key["models"]) or "all",
                     str(key["max_concurrency"]) if key["max_concurrency"] is not None else "no limit", created))
    return table(rows)


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)
