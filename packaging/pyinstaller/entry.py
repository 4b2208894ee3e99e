"""Entry point of the standalone app folder built by packaging/build-app.sh.

It is `tray-app` (tray_app.cli), plus a small stand-in for `python -m`: the
supervisor starts each llama.cpp worker as
`sys.executable -m tray_app.core.engine.worker_main ...` (core/runtime.py), and in
a frozen app sys.executable is this binary, not a Python interpreter.
"""

from __future__ import annotations

import runpy
import sys

# Only these modules may be run with `-m`: the worker wrapper the supervisor
# starts, and the desktop-integration helper the README points users at.
RUNNABLE_MODULES = ("tray_app.core.engine.worker_main", "tray_app.core.grammar.child", "tray_app.desktop.autostart")


def main() -> int:
    if len(sys.argv) >= 3 and sys.argv[1] == "-m":
        module = sys.argv[2]
        if module not in RUNNABLE_MODULES:
            print(f"tray-app: error: -m runs only {', '.join(RUNNABLE_MODULES)}, not {module}", file=sys.stderr)
            return 2
        # What `python -m` does: argv[0] names the module, the rest are its arguments.
        sys.argv = [module, *sys.argv[3:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    from tray_app.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
