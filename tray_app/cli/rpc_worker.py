"""`tray-app rpc-worker`: lend this machine's GPU (or RAM) to a tray-app on
another machine, through llama.cpp's own RPC server.

The other machine lists this one in `[gpu] rpc_servers = ["host:port"]`, and
its GPU worker spreads the model's layers over both. llama.cpp's RPC
protocol has no authentication and no encryption: anyone who reaches the
port can use the device and read what runs on it. So the command binds to
loopback unless told, in so many words, that the user understands that.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from typing import Any

from ..core.base.http_basics import is_loopback

DEFAULT_RPC_PORT = 50052  # llama.cpp's rpc-server default
UNDERSTOOD_FLAG = "--i-understand-rpc-has-no-authentication"


def add_rpc_worker_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "rpc-worker",
        help="lend this machine's GPU or RAM to a tray-app on another machine (llama.cpp's rpc-server)",
        description=__doc__.split("\n\n")[0] + " The other machine adds this one to [gpu] rpc_servers.",
    )
    parser.add_argument("--host", default="127.0.0.1",
                        help="IPv4 address to listen on (default 127.0.0.1; 0.0.0.0 for all; any but "
                             "loopback needs " + UNDERSTOOD_FLAG + ")")
    parser.add_argument("--port", type=int, default=DEFAULT_RPC_PORT, help=f"port (default {DEFAULT_RPC_PORT})")
    parser.add_argument("--device", help="llama.cpp devices to lend, comma-separated (default: all)")
    parser.add_argument("--threads", type=int, default=0, help="threads for a CPU device (default: llama.cpp's)")
    parser.add_argument("--cache", action="store_true", help="keep received tensors in a local file cache")
    parser.add_argument(UNDERSTOOD_FLAG, dest="understood", action="store_true",
                        help="listen on a non-loopback address although the protocol has no authentication "
                             "or encryption: only do this on a network where every machine is yours")
    return parser


def listen_address_problem(host: str) -> str | None:
    """Why ggml-rpc-server can't listen on `host`, or None. It takes an IPv4
    address only: given a name it says "Invalid host address" and exits 0,
    which would look like a clean stop."""
    if host == "localhost":
        return None  # we pass 127.0.0.1
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return "llama.cpp's RPC server listens on an IPv4 address only (e.g. 192.168.1.20, or 0.0.0.0 for all)"
    return None


def rpc_server_argv(binary: str, args: argparse.Namespace) -> list[str]:
    argv = [binary, "--host", args.host, "--port", str(args.port)]
    if args.device:
        argv += ["--device", args.device]
    if args.threads > 0:
        argv += ["--threads", str(args.threads)]
    if args.cache:
        argv.append("--cache")
    return argv


def run_rpc_worker(args: argparse.Namespace) -> int:
    from ..core.engine.runtime import bundled_rpc_server, library_dirs

    if not 0 < args.port < 65536:
        print(f"tray-app rpc-worker: --port {args.port} is not a port (1-65535)", file=sys.stderr)
        return 2
    problem = listen_address_problem(args.host)
    if problem:
        print(f"tray-app rpc-worker: --host {args.host}: {problem}", file=sys.stderr)
        return 2
    if args.host == "localhost":
        args.host = "127.0.0.1"
    if not is_loopback(args.host) and not args.understood:
        print(f"tray-app rpc-worker: refusing to listen on {args.host}: llama.cpp's RPC protocol has no "
              "authentication or encryption, so anyone who can reach the port can use this machine's device "
              f"and see the model's data. On a network where every machine is yours, add {UNDERSTOOD_FLAG}.",
              file=sys.stderr)
        return 2
    binary = bundled_rpc_server()
    if binary is None:
        print("tray-app rpc-worker: llama.cpp's ggml-rpc-server is not installed beside llama-server; "
              "run packaging/install.sh again (it builds llama.cpp with GGML_RPC=ON)", file=sys.stderr)
        return 2
    env = dict(os.environ)
    inherited = env.get("LD_LIBRARY_PATH", "")
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*(str(d) for d in library_dirs(binary)), *([inherited] if inherited else [])])
    sys.stdout.flush()
    # Replaced by the server itself: its pid is ours, and a service manager's
    # signals reach it directly.
    os.execve(str(binary), rpc_server_argv(str(binary), args), env)
    return 0  # not reached
