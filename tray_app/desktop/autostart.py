"""Desktop integration on Linux: the XDG desktop entry and start-on-login.

The desktop entry template lives here, once.  The checked-in files
packaging/tray-app.desktop and packaging/tray-app-autostart.desktop are its
renderings with ``Exec=tray-app`` (tests/integration/test_packaging.py fails
if they drift); the autostart file the tray menu writes is the same
rendering with the absolute command of the running install, because a
session started at login has no virtualenv on its PATH.

Start-on-login follows the XDG Autostart spec: a user entry in
$XDG_CONFIG_HOME/autostart overrides a system one of the same name in
$XDG_CONFIG_DIRS/autostart, and ``Hidden=true`` turns an entry off.

Run as ``python -m tray_app.desktop.autostart {status,enable,disable,install-menu}``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from ..core.config import APP_NAME
from ..core.base.files import write_atomically

DESKTOP_FILE_NAME = f"{APP_NAME}.desktop"
ICON_NAME = APP_NAME
# The tray's "serving from the GPU" state doubles as the application icon.
APP_ICON_SOURCE = "tray-gpu"

_ENTRY = """\
[Desktop Entry]
Type=Application
Version=1.4
Name=Home AI Server
GenericName=Local AI Server
Comment=Run local language models on the GPU with a safe CPU fallback, behind one OpenAI-compatible port
Exec={exec_line}
Icon={icon}
Terminal=false
Categories=Utility;
Keywords=AI;LLM;llama;GGUF;OpenAI;server;
StartupNotify=false
"""

_AUTOSTART_EXTRA = """\
X-GNOME-Autostart-enabled=true
# The tray icon needs the panel's tray host, which may start after us.
X-GNOME-Autostart-Delay=5
"""

# Characters the Desktop Entry spec reserves in Exec: an argument holding any
# of them must be double-quoted.
_EXEC_RESERVED = set(" \t\n\"'\\><~|&;$*?#()`")
# Inside double quotes these four still need a backslash.
_EXEC_QUOTE_ESCAPED = set('"`$\\')


def quote_exec_argument(argument: str) -> str:
    """One argument as the Exec key wants it, before the key's string escaping."""
    if "\n" in argument or "\r" in argument:
        raise ValueError(f"a desktop entry cannot run a command containing a line break: {argument!r}")
    # A literal % starts a field code (%f, %u, ...) unless doubled.
    argument = argument.replace("%", "%%")
    if argument and not _EXEC_RESERVED & set(argument):
        return argument
    escaped = "".join("\\" + char if char in _EXEC_QUOTE_ESCAPED else char for char in argument)
    return f'"{escaped}"'


def exec_line(command: Sequence[str]) -> str:
    if not command:
        raise ValueError("the command to run is empty")
    quoted = " ".join(quote_exec_argument(argument) for argument in command)
    # Exec is a string value, so its backslashes are escaped once more on top of the quoting.
    return quoted.replace("\\", "\\\\")


def desktop_entry(command: Sequence[str], *, autostart: bool) -> str:
    """The entry that runs `command`; the autostart variant adds the session keys."""
    text = _ENTRY.format(exec_line=exec_line(command), icon=ICON_NAME)
    return text + _AUTOSTART_EXTRA if autostart else text


# ----- where things live --------------------------------------------------------------


def _config_home() -> Path:
    # The spec says a relative value is invalid and must be ignored.
    value = os.environ.get("XDG_CONFIG_HOME", "")
    return Path(value) if os.path.isabs(value) else Path.home() / ".config"


def _data_home() -> Path:
    value = os.environ.get("XDG_DATA_HOME", "")
    return Path(value) if os.path.isabs(value) else Path.home() / ".local" / "share"


def _config_dirs() -> list[Path]:
    value = os.environ.get("XDG_CONFIG_DIRS", "") or "/etc/xdg"
    return [Path(part) for part in value.split(":") if os.path.isabs(part)]


def autostart_path() -> Path:
    return _config_home() / "autostart" / DESKTOP_FILE_NAME


def menu_entry_path() -> Path:
    return _data_home() / "applications" / DESKTOP_FILE_NAME


def _system_autostart_entry() -> Path | None:
    for folder in _config_dirs():
        candidate = folder / "autostart" / DESKTOP_FILE_NAME
        if candidate.is_file():
            return candidate
    return None


def current_launch_command() -> list[str]:
    """The absolute command that starts this install's tray, for an entry run outside any shell."""
    if getattr(sys, "frozen", False):  # a PyInstaller folder: the app binary itself
        return [str(Path(sys.executable).resolve())]
    # A virtualenv or pipx install puts the console script next to its python.
    # Not resolve()d: a venv's python is a symlink to the base interpreter.
    script = Path(sys.executable).absolute().parent / APP_NAME
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    on_path = shutil.which(APP_NAME)
    if on_path:
        return [str(Path(on_path).absolute())]
    return [str(Path(sys.executable).absolute()), "-m", "tray_app"]


# ----- start on login -----------------------------------------------------------------


def _entry_enabled(path: Path) -> bool:
    """False when the entry turns itself off (Hidden=true, or GNOME's own switch)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    keys: dict[str, str] = {}
    in_main_group = False
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("["):
            in_main_group = line == "[Desktop Entry]"
        elif in_main_group and "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            keys[key.strip()] = value.strip()
    return keys.get("Hidden", "false") != "true" and keys.get("X-GNOME-Autostart-enabled", "true") != "false"


def is_enabled() -> bool:
    user_entry = autostart_path()
    if user_entry.exists():
        return _entry_enabled(user_entry)  # the user's entry overrides any system one
    system_entry = _system_autostart_entry()
    return system_entry is not None and _entry_enabled(system_entry)


def enable(command: Sequence[str] | str | os.PathLike[str] | None = None) -> Path:
    """Start the tray on login with `command` (default: this install's own launcher)."""
    if command is None:
        argv = current_launch_command()
    elif isinstance(command, (str, os.PathLike)):
        argv = [os.fspath(command)]
    else:
        argv = [os.fspath(part) for part in command]
    path = autostart_path()
    _write_atomically(path, desktop_entry(argv, autostart=True))
    return path


def disable() -> Path | None:
    """Stop starting on login; returns the file written, or None if only a removal was needed."""
    path = autostart_path()
    if _system_autostart_entry() is None:
        path.unlink(missing_ok=True)
        return None
    # A system-wide entry (from a distribution package) can only be masked:
    # the spec's way is a user entry of the same name with Hidden=true.
    _write_atomically(path, "[Desktop Entry]\nType=Application\nName=Home AI Server\nHidden=true\n")
    return path


# ----- application menu ---------------------------------------------------------------


def _bundled_icons_dir() -> Path | None:
    # resources/icons sits two levels above this package both in a source
    # checkout and inside the PyInstaller folder (the spec puts it there).
    candidate = Path(__file__).resolve().parents[2] / "resources" / "icons"
    return candidate if candidate.is_dir() else None


def install_icons(icons_dir: Path | None = None) -> list[Path]:
    """Copy the app icon into the user's hicolor theme as `tray-app`; returns the files written."""
    source = icons_dir or _bundled_icons_dir()
    if source is None:
        return []
    theme = _data_home() / "icons" / "hicolor"
    written: list[Path] = []
    svg = source / f"{APP_ICON_SOURCE}.svg"
    if svg.is_file():
        target = theme / "scalable" / "apps" / f"{ICON_NAME}.svg"
        _write_atomically(target, svg.read_text(encoding="utf-8"))
        written.append(target)
    for png in sorted(source.glob(f"{APP_ICON_SOURCE}-*.png")):
        size = png.stem.rsplit("-", 1)[1]
        if size.isdigit():
            target = theme / f"{size}x{size}" / "apps" / f"{ICON_NAME}.png"
            _write_atomically(target, png.read_bytes())
            written.append(target)
    return written


def install_menu_entry(command: Sequence[str] | None = None) -> Path:
    """Add the app to the desktop's application menu, with this install's absolute command."""
    path = menu_entry_path()
    _write_atomically(path, desktop_entry(command or current_launch_command(), autostart=False))
    install_icons()
    return path


def _write_atomically(path: Path, content: str | bytes) -> None:
    # A half-written entry read by the session at login would be skipped, or
    # worse, run a truncated Exec line.
    write_atomically(path, content.encode("utf-8") if isinstance(content, str) else content)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tray_app.desktop.autostart",
                                     description="Start-on-login and the application menu entry (XDG desktops).")
    parser.add_argument("action", choices=["status", "enable", "disable", "install-menu"])
    parser.add_argument("command", nargs="*", help="the command the entry runs (default: this install's tray-app)")
    args = parser.parse_args(argv)
    if args.action == "status":
        print(f"start on login: {'on' if is_enabled() else 'off'} ({autostart_path()})")
    elif args.action == "enable":
        print(f"start on login: on ({enable(args.command or None)})")
    elif args.action == "disable":
        disable()
        print(f"start on login: off ({autostart_path()})")
    else:
        print(f"menu entry: {install_menu_entry(args.command or None)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
