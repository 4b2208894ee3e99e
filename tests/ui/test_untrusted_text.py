"""Text from the service, a peer, another app or a model file is shown as
written, never as HTML (issue 27): a QLabel, a tooltip and a message box all
guess, and take text that looks like HTML for HTML. With a name such as
"<b>x</b><img src=...>", a guessing label draws "x" in bold and loads an image."""

from __future__ import annotations

from PySide6 import QtGui
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QWidget

from tray_app.ui.chat import ChatWindow
from tray_app.ui.client import ServiceClient

from tests.status_sample import conforming

from .test_chat_and_tray_fed import dead_url, fed_controller, feed  # noqa: F401 - fixtures, shared
from .test_panel_rendering import fed_panel
from .test_viewmodel import paused

HOSTILE = "<b>x</b><img src=http://127.0.0.1:9/pixel.png>"


def hostile_status() -> dict:
    """Degraded, with every name that comes from elsewhere set to HOSTILE."""
    status = paused()
    status["service"]["model"] = f"model {HOSTILE}"
    status["degraded"].update(fallback_model=f"fallback {HOSTILE}", reason=f"reason {HOSTILE}",
                              peers=[f"peer {HOSTILE}"], model=f"model {HOSTILE}")
    status["gpu"]["devices"][0]["name"] = f"device {HOSTILE}"
    status["gpu"]["devices"][0]["processes"] = [{"pid": 99, "name": f"app {HOSTILE}", "used_mib": 10.0}]
    status["workers"][0].update(state="unhealthy", last_exit={"kind": "crash", "description": f"exit {HOSTILE}"})
    status["requests"] = [{"id": "r1", "client": f"client {HOSTILE}", "state": "running", "path": "cpu",
                           "reason": "forced_cpu", "age_s": 1.0}]
    second = {"name": f"second {HOSTILE}", "aliases": [], "source": "folder", "location": "unloaded", "gpu": "unloaded",
              "cpu": "unloaded", "in_flight": 0, "estimated_vram_mib": 10.0, "estimated_ram_mib": 10.0}
    status["models"] = [{**second, "name": f"model {HOSTILE}", "source": "default"}, second]
    return conforming(status)


def labels_showing(root: QWidget, text: str) -> list[QLabel]:
    return [label for label in root.findChildren(QLabel) if text in label.text()]


def assert_shown_as_written(root: QWidget, at_least: int) -> None:
    shown = labels_showing(root, "<b>x</b><img")  # whole, or elided after the tag
    assert len(shown) >= at_least, [label.text() for label in root.findChildren(QLabel)]
    for label in shown:
        assert label.textFormat() == Qt.TextFormat.PlainText, f"drawn as HTML: {label.text()!r}"


def assert_tooltip_shows_it_as_written(tooltip: str) -> None:
    # A tooltip can't be told its format. Qt draws it as HTML when a tag comes
    # before its first line break: then it must be HTML that shows the text.
    assert "<b>x</b>" in tooltip or "&lt;b&gt;x&lt;/b&gt;&lt;img" in tooltip, tooltip
    if QtGui.Qt.mightBeRichText(tooltip):
        assert "<b>x</b>" not in tooltip and "<img" not in tooltip, tooltip


def test_the_panel_shows_names_and_reasons_as_written(qtbot) -> None:
    panel = fed_panel(qtbot, hostile_status())
    # The banner's title, reason, models and client row; a device's name, the
    # other app on it, a worker's last exit, the models table, the footer.
    assert_shown_as_written(panel, at_least=10)
    assert_tooltip_shows_it_as_written(panel.banner.values["model"].toolTip())
    assert_tooltip_shows_it_as_written(panel.model_cells[1][0].toolTip())


def test_the_chat_shows_the_model_names_and_the_service_state_as_written(qtbot, dead_url) -> None:  # noqa: F811
    window = ChatWindow(ServiceClient(dead_url))
    qtbot.addWidget(window)
    window.show()
    window.client.last_status = hostile_status()
    window.client.status_changed.emit(window.client.last_status)
    window._set_state(f"the service said {HOSTILE}")
    assert_shown_as_written(window, at_least=1)
    assert_tooltip_shows_it_as_written(window.model_picker.toolTip())  # the model picked
    window.model_picker.setCurrentIndex(1)
    assert_tooltip_shows_it_as_written(window.model_picker.toolTip())


def test_the_tray_shows_names_as_written(qtbot, fed_controller) -> None:  # noqa: F811
    feed(fed_controller, hostile_status())
    assert_tooltip_shows_it_as_written(fed_controller.tray.toolTip())
    submenu_tips = [action.toolTip() for action in fed_controller.tray_menu.models_menu.actions()]
    assert submenu_tips and all("&lt;img" in tip for tip in submenu_tips if "img" in tip)
    fed_controller.windows.show_panel()
    assert_shown_as_written(fed_controller.windows.panel(), at_least=10)


def test_a_menu_shows_an_ampersand_in_a_name_as_written(qtbot, fed_controller) -> None:  # noqa: F811
    status = hostile_status()
    status["degraded"]["peers"] = ["Q&A box"]
    status["models"][1]["name"] = "R&D-model"
    feed(fed_controller, status)
    # '&&' is how a menu shows one '&' (a single one marks the Alt+letter and is hidden).
    assert "peer Q&&A box" in fed_controller.tray_menu.state_action.text()
    assert any(action.text().startswith("R&&D-model") for action in fed_controller.tray_menu.models_menu.actions())


def test_text_without_a_tag_is_left_alone() -> None:
    from tray_app.ui.widgets import as_written

    assert as_written("SmolLM2 · Q4_K_M") == "SmolLM2 · Q4_K_M"
    assert as_written("2 < 3") == "<qt>2 &lt; 3</qt>"  # drawn the same as the plain text


def test_a_notification_body_shows_names_as_written_where_the_server_reads_markup() -> None:
    from tray_app.ui.notifications import notification_body

    body = notification_body('GPU failed; peer <img src="file:///etc/passwd"> & <b>box</b> serves', "linux")
    assert "<" not in body and "&lt;img" in body and "&amp;" in body
    assert notification_body("a <b>", "win32") == "a <b>"  # Windows and macOS show the body as text
