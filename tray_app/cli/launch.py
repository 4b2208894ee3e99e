"""`tray-app launch claude|codex`: an agent CLI started against this server,
its setup done (as `ollama launch claude` does).

Claude Code reads its server, key and models from the environment; Codex
takes a model provider through `-c` overrides, so neither CLI's own config
file is touched. The server must be running: its model list says which
model to name and how much context it serves, and a context below what the
CLI's first request needs is warned about before the CLI starts, rather
than met as a 400 from inside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass

import httpx

from ..core.config import DEFAULT_PORT

# The API key variable Codex reads for the provider it is given here.
CODEX_KEY_ENV = "TRAY_APP_API_KEY"


@dataclass(frozen=True)
class Agent:
    command: str
    package: str  # npm's, for the install hint
    # The context its first request needs, measured through a logging proxy
    # (Claude Code 2.1: over 20,000 tokens; Codex 0.171: 4,500), and what
    # its users are told to give it (Ollama's docs: 64k for Claude Code).
    first_request_tokens: int
    recommended_context: int


AGENTS = {
    "claude": Agent("claude", "@anthropic-ai/claude-code", 22_000, 65_536),
    "codex": Agent("codex", "@openai/codex", 5_000, 16_384),
}


def add_launch_parser(sub) -> None:
    launch = sub.add_parser("launch", help="start Claude Code or Codex against this server, set up",
                            description="Start an agent CLI (Claude Code or Codex) with its base URL, key and "
                                        "model set for this server; arguments after -- go to the CLI: "
                                        "tray-app launch codex -- exec 'fix the tests'.")
    launch.add_argument("agent", choices=sorted(AGENTS))
    launch.add_argument("--url", default=f"http://127.0.0.1:{DEFAULT_PORT}", help="the service's base URL")
    launch.add_argument("--model", help="the model to use (default: the server's default model)")
    launch.add_argument("--key", help=f"the API key to use (default: {CODEX_KEY_ENV}, or [server] api_key)")
    launch.add_argument("--print-env", action="store_true",
                        help="print the setup as shell lines instead of starting the CLI")


def agent_setup(agent: str, url: str, model: str, key: str) -> tuple[dict[str, str], list[str]]:
    """(environment variables, arguments before the user's) that point the CLI here."""
    url = url.rstrip("/")
    if agent == "claude":
        return ({"ANTHROPIC_BASE_URL": url, "ANTHROPIC_AUTH_TOKEN": key, "ANTHROPIC_API_KEY": "",
                 "ANTHROPIC_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
                 "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
                 "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
                 # No calls to Anthropic's own services (telemetry, updates): they'd fail offline.
                 "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}, [])
    provider = (f'model_providers.tray={{name="tray-app", base_url="{url}/v1", wire_api="responses", '
                f'env_key="{CODEX_KEY_ENV}"}}')
    return {CODEX_KEY_ENV: key}, ["-c", provider, "-c", "model_provider=tray", "-c", f"model={json.dumps(model)}"]


def context_warning(agent: Agent, model: str, context: int | None) -> str | None:
    """What to tell the user when the model's served context is short for the CLI."""
    if context is None or context >= agent.recommended_context:
        return None
    need = (f"its first request alone is about {agent.first_request_tokens:,} tokens, which won't fit"
            if context < agent.first_request_tokens else "long sessions will be cut short")
    return (f"tray-app: warning: {model} is served with a {context:,}-token context; {agent.command} is best "
            f"with {agent.recommended_context:,} or more ({need}). Each slot has its own context: "
            "[gpu] max_concurrency = 1 gives one request the whole budget; or set [gpu]/[cpu] n_ctx if memory "
            "allows.")


def run_launch(args: argparse.Namespace, configured_key: str) -> int:
    agent = AGENTS[args.agent]
    key = args.key or configured_key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        listed = httpx.get(f"{args.url.rstrip('/')}/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as error:
        print(f"tray-app: error: the service at {args.url} did not answer ({error}); start it first "
              "(tray-app, or tray-app serve)", file=sys.stderr)
        return 2
    if listed.status_code == 401:
        print("tray-app: error: the service needs an API key: pass --key, or set TRAY_APP_API_KEY "
              "(make one with tray-app keys add NAME)", file=sys.stderr)
        return 2
    models = {entry["id"]: entry for entry in listed.json().get("data", [])}
    model = args.model or next(iter(models), None)
    if model is None or model not in models:
        print(f"tray-app: error: no model {model!r} here; the server serves: {', '.join(models) or 'none'}",
              file=sys.stderr)
        return 2
    warning = context_warning(agent, model, (models[model].get("capabilities") or {}).get("context_length"))
    if warning:
        print(warning, file=sys.stderr)
    # A placeholder when the server needs none: both CLIs insist on a key.
    env, before = agent_setup(args.agent, args.url, model, key or "tray-app")
    user_args = list(args.args)
    if args.print_env:
        for name, value in env.items():
            print(f"export {name}={_quoted(value)}")
        print(" ".join([agent.command, *map(_quoted, before), *map(_quoted, user_args)]))
        return 0
    executable = shutil.which(agent.command)
    if executable is None:
        print(f"tray-app: error: {agent.command} is not on PATH; install it with: npm install -g {agent.package}",
              file=sys.stderr)
        return 2
    os.execve(executable, [executable, *before, *user_args], {**os.environ, **env})
    return 0  # not reached


def _quoted(value: str) -> str:
    import shlex

    return shlex.quote(value)
