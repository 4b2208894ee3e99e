from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tray_app.desktop import autostart
from tray_app.desktop.autostart import (
    autostart_path,
    current_launch_command,
    desktop_entry,
    disable,
    enable,
    exec_line,
    install_menu_entry,
    is_enabled,
    menu_entry_path,
)

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def xdg(tmp_path, monkeypatch):
    """Every XDG location inside tmp_path, and no system autostart folder unless a test makes one."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CONFIG_DIRS", str(tmp_path / "etc-xdg"))
    return tmp_path


def entry_keys(text: str) -> dict[str, str]:
    keys = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            keys[key] = value
    return keys


def parse_exec(value: str) -> list[str]:
    """The reading side of the Desktop Entry spec, written from the spec's text,
    and strict: what a lenient reader would guess at is an error here.

    First the string escapes (\\s \\n \\t \\r \\\\), then the Exec quoting: an
    argument with a reserved character must be double-quoted, and inside the
    quotes only \\" \\` \\$ \\\\ are escapes; a literal % is written %%.
    """
    string_escapes = {"s": " ", "n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
    unescaped, i = "", 0
    while i < len(value):
        if value[i] == "\\":
            assert i + 1 < len(value) and value[i + 1] in string_escapes, f"bad string escape in {value!r}"
            unescaped += string_escapes[value[i + 1]]
            i += 2
        else:
            unescaped += value[i]
            i += 1
    reserved = set(" \t\n\"'\\><~|&;$*?#()`")
    argv, current, quoted, started, i = [], "", False, False, 0
    while i < len(unescaped):
        char = unescaped[i]
        if char == "%":
            assert unescaped[i + 1 : i + 2] == "%", f"a lone % (field code?) in {value!r}"
            current, started, i = current + "%", True, i + 2
            continue
        if quoted:
            if char == "\\":
                assert unescaped[i + 1 : i + 2] in ('"', "`", "$", "\\"), f"bad escape in quotes in {value!r}"
                current, i = current + unescaped[i + 1], i + 2
                continue
            if char == '"':
                quoted = False
            else:
                assert char not in "`$", f"unescaped {char} inside quotes in {value!r}"
                current += char
        elif char == '"':
            assert not started, f"a quote in the middle of an argument in {value!r}"
            quoted, started = True, True
        elif char == " ":
            if started:
                argv.append(current)
            current, started = "", False
        else:
            assert char not in reserved, f"reserved {char!r} outside quotes in {value!r}"
            current, started = current + char, True
        i += 1
    assert not quoted, f"unterminated quote in {value!r}"
    if started:
        argv.append(current)
    return argv


# --- the template -------------------------------------------------------------------


def test_menu_and_autostart_entries_differ_only_by_the_session_keys():
    menu = desktop_entry(["tray-app"], autostart=False)
    login = desktop_entry(["tray-app"], autostart=True)
    assert login.startswith(menu)
    assert entry_keys(login)["X-GNOME-Autostart-enabled"] == "true"
    assert "X-GNOME-Autostart-enabled" not in entry_keys(menu)
    keys = entry_keys(menu)
    assert keys["Type"] == "Application" and keys["Exec"] == "tray-app" and keys["Icon"] == "tray-app"
    assert keys["Terminal"] == "false"


@pytest.mark.parametrize("command", [
    ["/opt/tray-app/.venv/bin/tray-app"],
    ["/home/jo smith/my apps/tray-app", "tray"],
    ["/home/x/100%/tray-app"],
    ['/home/x/"quoted"/$HOME/`tick`/back\\slash/tray-app'],
    ["/home/x/semi;colon&amp/(paren)/tray-app", "--config", "/home/x/a b.toml"],
    ["/usr/bin/python3", "-m", "tray_app"],
])
def test_exec_line_round_trips_through_the_spec(command):
    assert parse_exec(exec_line(command)) == command


def test_simple_arguments_are_left_unquoted():
    assert exec_line(["/usr/bin/tray-app", "serve"]) == "/usr/bin/tray-app serve"


def test_a_line_break_in_the_command_is_refused():
    with pytest.raises(ValueError, match="line break"):
        exec_line(["/tmp/a\nb/tray-app"])
    with pytest.raises(ValueError):
        exec_line([])


# --- start on login ------------------------------------------------------------------


def test_autostart_path_follows_xdg_config_home(xdg):
    assert autostart_path() == xdg / "config" / "autostart" / "tray-app.desktop"


def test_a_relative_xdg_config_home_is_ignored(monkeypatch, xdg):
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative/config")
    assert autostart_path() == xdg / "home" / ".config" / "autostart" / "tray-app.desktop"


def test_enable_then_disable(xdg):
    assert not is_enabled()
    written = enable(["/home/jo smith/tray-app/.venv/bin/tray-app"])
    assert written == autostart_path() and is_enabled()
    keys = entry_keys(written.read_text())
    assert parse_exec(keys["Exec"]) == ["/home/jo smith/tray-app/.venv/bin/tray-app"]
    assert keys["X-GNOME-Autostart-enabled"] == "true"
    # Atomic write: nothing but the entry is left in the folder.
    assert [p.name for p in written.parent.iterdir()] == ["tray-app.desktop"]
    assert disable() is None
    assert not written.exists() and not is_enabled()
    disable()  # already off: still fine


def test_enable_accepts_a_single_path_and_defaults_to_this_install(xdg):
    enable(Path("/opt/app/tray-app"))
    assert parse_exec(entry_keys(autostart_path().read_text())["Exec"]) == ["/opt/app/tray-app"]
    enable()
    assert parse_exec(entry_keys(autostart_path().read_text())["Exec"]) == current_launch_command()


def test_enable_overwrites_a_stale_entry(xdg):
    enable(["/old/place/tray-app"])
    enable(["/new/place/tray-app"])
    assert parse_exec(entry_keys(autostart_path().read_text())["Exec"]) == ["/new/place/tray-app"]


def test_an_entry_switched_off_by_the_desktop_counts_as_off(xdg):
    enable(["/opt/app/tray-app"])
    path = autostart_path()
    path.write_text(path.read_text().replace("X-GNOME-Autostart-enabled=true", "X-GNOME-Autostart-enabled=false"))
    assert not is_enabled()
    path.write_text(desktop_entry(["tray-app"], autostart=True) + "Hidden=true\n")
    assert not is_enabled()


def test_a_system_wide_entry_is_masked_not_deleted(xdg):
    system_entry = xdg / "etc-xdg" / "autostart" / "tray-app.desktop"
    system_entry.parent.mkdir(parents=True)
    system_entry.write_text(desktop_entry(["tray-app"], autostart=True))
    assert is_enabled()  # from the system entry alone
    masked = disable()
    assert masked == autostart_path()
    assert entry_keys(masked.read_text())["Hidden"] == "true"
    assert system_entry.exists() and not is_enabled()
    enable(["/opt/app/tray-app"])
    assert is_enabled()


# --- the running install ------------------------------------------------------------------


def test_current_launch_command_is_absolute_and_runnable():
    command = current_launch_command()
    assert Path(command[0]).is_absolute()
    assert os.access(command[0], os.X_OK)
    if Path(sys.executable).with_name("tray-app").exists():  # installed with packaging/install.sh or pip
        assert command == [str(Path(sys.executable).absolute().with_name("tray-app"))]


# --- the application menu ------------------------------------------------------------------


def test_install_menu_entry_writes_the_entry_and_the_icon(xdg):
    path = install_menu_entry(["/opt/app/tray-app"])
    assert path == menu_entry_path() == xdg / "data" / "applications" / "tray-app.desktop"
    assert path.read_text() == desktop_entry(["/opt/app/tray-app"], autostart=False)
    icons = REPO / "resources" / "icons"
    if not (icons / "tray-gpu.svg").exists():
        pytest.skip("resources/icons has no tray-gpu.svg in this checkout")
    theme = xdg / "data" / "icons" / "hicolor"
    assert (theme / "scalable" / "apps" / "tray-app.svg").read_bytes() == (icons / "tray-gpu.svg").read_bytes()
    assert (theme / "48x48" / "apps" / "tray-app.png").read_bytes() == (icons / "tray-gpu-48.png").read_bytes()


def test_the_module_command_line(xdg, capsys):
    assert autostart.main(["enable", "/opt/app/tray-app"]) == 0
    assert is_enabled()
    assert autostart.main(["status"]) == 0
    assert "start on login: on" in capsys.readouterr().out
    assert autostart.main(["disable"]) == 0
    assert not is_enabled()
