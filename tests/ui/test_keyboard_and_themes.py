"""Keyboard use (Esc, Alt+letters, Tab order, tooltips in the tray menu) and
the colours under a dark theme: no bright boxes, status text readable.
No service needed: the windows are fed snapshots."""

from __future__ import annotations

from collections import Counter

import pytest
from PySide6.QtCore import QPoint, Qt
from PySide6.QtGui import QAction, QImage
from PySide6.QtWidgets import QApplication, QLabel, QPushButton, QToolButton, QToolTip, QWidget

from tray_app.core.config import Config
from tray_app.ui import colors, theme
from tray_app.ui import viewmodel as vm
from tray_app.ui.app import NO_TRAY_NOTE, TrayController
from tray_app.ui.chat import ChatWindow, Turn
from tray_app.ui.client import ServiceClient
from tray_app.ui.panel import HeadroomPanel

from .test_panel_rendering import degraded_with_cpu_requests, two_gpus_one_worker_down

DEAD_URL = "http://127.0.0.1:9"  # never started: the tests feed snapshots


def activate(qtbot, window: QWidget) -> None:
    """Shown and the active window: what a shortcut needs to fire."""
    window.show()
    window.activateWindow()
    qtbot.waitUntil(window.isActiveWindow, timeout=5000)


def fed_panel(qtbot, status: dict, actions=()) -> HeadroomPanel:
    client = ServiceClient(DEAD_URL)
    panel = HeadroomPanel(client, vm.History(), floor_mib=1024, actions=actions)
    qtbot.addWidget(panel)
    panel.show()
    client.last_status = status
    panel.refresh()
    return panel


def tab_sequence(window: QWidget) -> list[QWidget]:
    """The widgets Tab visits, in order, starting from the window."""
    sequence: list[QWidget] = []
    widget = window.nextInFocusChain()
    while widget is not window:
        if widget.focusPolicy() & Qt.FocusPolicy.TabFocus and widget.isVisible() and widget.isEnabled():
            sequence.append(widget)
        widget = widget.nextInFocusChain()
    return sequence


# ----- shortcuts and mnemonics ----------------------------------------------------------------

def test_esc_hides_the_panel(qtbot) -> None:
    panel = fed_panel(qtbot, degraded_with_cpu_requests(1))
    activate(qtbot, panel)
    qtbot.keyClick(panel, Qt.Key.Key_Escape)
    assert not panel.isVisible()


def test_esc_does_not_quit_the_no_tray_window(qtbot) -> None:
    # Without a tray, closing the panel quits the app: Esc must not do that.
    panel = fed_panel(qtbot, degraded_with_cpu_requests(1))
    panel.close_quits = True
    closed: list[bool] = []
    panel.closed.connect(lambda: closed.append(True))
    activate(qtbot, panel)
    qtbot.keyClick(panel, Qt.Key.Key_Escape)
    assert panel.isVisible() and closed == []


class FakeStream:
    """Stands in for a ChatStream that is mid-answer."""

    request_id = "chat-test"
    status_code = 200

    def __init__(self) -> None:
        self.stopped = 0

    def stop(self) -> None:
        self.stopped += 1


def test_esc_in_the_chat_stops_a_running_answer_and_is_harmless_otherwise(qtbot) -> None:
    chat = ChatWindow(ServiceClient(DEAD_URL))
    qtbot.addWidget(chat)
    activate(qtbot, chat)
    chat.turns = [Turn("user", "hello"), Turn("assistant", "partial answer")]
    chat.input.setPlainText("a draft")
    # Idle: Esc keeps the window, the conversation and the draft.
    qtbot.keyClick(chat.input, Qt.Key.Key_Escape)
    assert chat.isVisible() and len(chat.turns) == 2 and chat.input.toPlainText() == "a draft"
    # Answering: Esc stops it, as the Stop button does.
    stream = FakeStream()
    chat.stream = stream
    qtbot.keyClick(chat.input, Qt.Key.Key_Escape)
    assert stream.stopped == 1
    assert chat.state_label.text() == "Stopping…"
    chat.stream = None


@pytest.mark.parametrize("key", [Qt.Key.Key_Return, Qt.Key.Key_Enter])
def test_ctrl_enter_sends_from_anywhere_in_the_chat(qtbot, monkeypatch, key) -> None:
    chat = ChatWindow(ServiceClient(DEAD_URL))
    qtbot.addWidget(chat)
    activate(qtbot, chat)
    sent: list[str] = []
    monkeypatch.setattr(chat, "send", lambda text=None: sent.append(chat.input.toPlainText()) or True)
    chat.input.setPlainText("What is a lighthouse?")
    # Reading the transcript, not typing: Ctrl+Enter still sends the draft.
    chat.transcript.setFocus()
    qtbot.keyClick(chat.transcript, key, Qt.KeyboardModifier.ControlModifier)
    assert sent == ["What is a lighthouse?"]


def test_the_main_buttons_have_alt_letters(qtbot) -> None:
    controller = TrayController(ServiceClient(DEAD_URL), Config(), tray_available=False)
    panel = controller.windows.panel()
    qtbot.addWidget(panel)
    buttons = [b for b in panel.findChildren(QToolButton)]
    assert len(buttons) == 5  # Open chat, Force CPU, Restart workers, Settings, More
    keys = [b.shortcut().toString() for b in buttons]
    assert all(k.startswith("Alt+") for k in keys), keys
    assert len(set(keys)) == len(keys)
    # Alt+C opens the chat, as its button does.
    activate(qtbot, panel)
    qtbot.keyClick(panel, Qt.Key.Key_C, Qt.KeyboardModifier.AltModifier)
    qtbot.waitUntil(lambda: controller.windows.chat_window is not None and controller.windows.chat_window.isVisible(),
                    timeout=5000)
    chat = controller.windows.chat()
    qtbot.addWidget(chat)
    chat_keys = [b.shortcut().toString() for b in (chat.clear_button, chat.stop_button, chat.send_button)]
    assert all(k.startswith("Alt+") for k in chat_keys) and len(set(chat_keys)) == 3


def test_tray_menu_actions_have_alt_letters_and_visible_tooltips(qtbot) -> None:
    controller = TrayController(ServiceClient(DEAD_URL), Config(), tray_available=False)
    for menu in (controller.tray_menu.menu, controller.tray_menu.more_menu):
        assert menu.toolTipsVisible()
    # The state, headroom and GPU residency lines are read, not chosen: no Alt-letters.
    menu = controller.tray_menu
    actions = [a for a in menu.menu.actions()
               if not a.isSeparator() and a not in (menu.state_action, menu.headroom_action, menu.residency_action)]
    letters = []
    for action in actions:
        text = action.text()
        assert "&" in text, text
        letters.append(text.lower().split("&")[1][0])
        # A tooltip of its own, not Qt's default (the text without the '&').
        assert action.toolTip() and action.toolTip() != text.replace("&", ""), text
    assert len(set(letters)) == len(letters), letters
    assert controller.tray_menu.state_action.toolTip() == "Open the headroom panel"


# ----- Tab order ------------------------------------------------------------------------------

def test_the_panels_cancel_buttons_come_right_after_their_rows_in_tab_order(qtbot) -> None:
    actions = [QAction(f"Action &{n}") for n in range(3)]
    panel = fed_panel(qtbot, degraded_with_cpu_requests(1), actions=actions)
    # A second request arrives later: its row (and button) is made after everything else.
    panel.client.last_status = degraded_with_cpu_requests(2)
    panel.refresh()
    cancels = [panel.banner.cancel_button("queued-1"), panel.banner.cancel_button("queued-2")]
    qtbot.waitUntil(cancels[1].isVisible, timeout=5000)  # a new row shows on the next event loop pass
    sequence = tab_sequence(panel)
    action_buttons = [w for w in sequence if isinstance(w, QToolButton)]
    assert len(action_buttons) == 3
    assert all(c in sequence for c in cancels)
    # The Cancels, in their rows' order, before the panel's own buttons.
    positions = [sequence.index(c) for c in cancels]
    assert positions == sorted(positions)
    assert positions[-1] < sequence.index(action_buttons[0])
    # ...and each straight after its own row's text in the focus chain.
    for request_id in ("queued-1", "queued-2"):
        _, label, button = panel.banner._rows[request_id]
        assert label.nextInFocusChain() is button


def test_the_chats_cancel_buttons_come_before_the_transcript_in_tab_order(qtbot) -> None:
    chat = ChatWindow(ServiceClient(DEAD_URL))
    qtbot.addWidget(chat)
    chat.show()
    chat.banner.set_banner(vm.degraded_banner(degraded_with_cpu_requests(2)))
    cancels = [chat.banner.cancel_button("queued-1"), chat.banner.cancel_button("queued-2")]
    qtbot.waitUntil(lambda: all(c.isVisible() for c in cancels), timeout=5000)
    sequence = tab_sequence(chat)
    assert [sequence.index(c) for c in cancels] == [0, 1]
    assert sequence.index(chat.input) > 1 and sequence.index(chat.send_button) > 1


# ----- themes ---------------------------------------------------------------------------------

@pytest.fixture
def dark_palette(qapp):
    """The app under a dark Fusion palette, as a dark desktop would start it."""
    style, palette, tooltips = qapp.style().name(), qapp.palette(), QToolTip.palette()
    theme.use_dark_fusion(qapp)
    yield theme.current_palette()
    qapp.setStyle(style)
    qapp.setPalette(palette)
    QToolTip.setPalette(tooltips)


def dominant(image: QImage, widget: QWidget, window: QWidget) -> colors.RGB:
    """The most common colour of `widget`'s area in a grab of `window`: its background."""
    corner = widget.mapTo(window, QPoint(0, 0))
    ratio = image.devicePixelRatio()
    counts: Counter = Counter()
    width, height = widget.width(), widget.height()
    step = max(1, min(width, height) // 12)
    for x in range(0, width, step):
        for y in range(0, height, step):
            at = QPoint(int((corner.x() + x) * ratio), int((corner.y() + y) * ratio))
            if image.valid(at):  # a scrolled-away part is not in the grab
                pixel = image.pixelColor(at)
                counts[(pixel.red(), pixel.green(), pixel.blue())] += 1
    return counts.most_common(1)[0][0] if counts else theme.current_palette().window


def bright_widgets(window: QWidget) -> list[str]:
    """Every visible widget whose background is light (luminance over 0.3)."""
    image = window.grab().toImage()
    found = []
    for widget in [window, *window.findChildren(QWidget)]:
        if not widget.isVisible() or widget.width() < 4 or widget.height() < 4 or not widget.isVisibleTo(window):
            continue
        if isinstance(widget, (QPushButton, QToolButton)) or widget.window() is not window:
            continue  # the style draws buttons; the palette's Button colour is the style's business
        if isinstance(widget, QLabel) and not widget.pixmap().isNull():
            continue  # an icon, not a box
        color = dominant(image, widget, window)
        if colors.relative_luminance(color) > 0.3:
            found.append(f"{type(widget).__name__} {widget.objectName()!r} {colors.to_hex(color)}")
    return found


def poor_status_text(window: QWidget) -> list[str]:
    """Labels in a status colour (red, green, amber, blue) with less than 4.5:1
    contrast against what is drawn behind them."""
    image = window.grab().toImage()
    found = []
    for label in window.findChildren(QLabel):
        if not label.isVisibleTo(window) or not label.text():
            continue
        text = theme.rgb(label.palette().color(label.foregroundRole()))
        background = dominant(image, label, window)
        if colors.contrast_ratio(text, background) < colors.TEXT_CONTRAST:
            found.append(f"{label.text()[:40]!r}: {colors.to_hex(text)} on {colors.to_hex(background)} "
                         f"= {colors.contrast_ratio(text, background):.2f}")
    return found


def degraded_panel_with_every_colour(qtbot) -> HeadroomPanel:
    status = two_gpus_one_worker_down()  # a red worker state, a red warning, an amber banner
    status["requests"] = degraded_with_cpu_requests(2)["requests"]
    panel = fed_panel(qtbot, status)
    panel.set_no_tray_reason(NO_TRAY_NOTE)  # the blue note box
    panel.resize(760, panel.body.sizeHint().height())
    return panel


def test_under_a_dark_palette_the_panel_has_no_bright_boxes(qtbot, dark_palette) -> None:
    panel = degraded_panel_with_every_colour(qtbot)
    assert colors.is_dark(dark_palette.window)
    assert bright_widgets(panel) == []


def test_under_a_dark_palette_status_text_is_readable(qtbot, dark_palette) -> None:
    panel = degraded_panel_with_every_colour(qtbot)
    states = {cells[1].text() for cells in panel.worker_cells.values() if cells[1].isVisible()}
    assert {"unhealthy", "ready"} <= states  # red and green text are both there
    assert poor_status_text(panel) == []


def test_under_a_dark_palette_the_chat_has_no_bright_bubbles(qtbot, dark_palette) -> None:
    chat = ChatWindow(ServiceClient(DEAD_URL))
    qtbot.addWidget(chat)
    chat.show()
    chat.turns = [Turn("user", "hello"), Turn("assistant", "an answer", meta="served by CPU", error="Stopped.")]
    chat._render()
    chat.banner.set_banner(vm.degraded_banner(degraded_with_cpu_requests(1)))
    qtbot.waitUntil(chat.banner.cancel_button("queued-1").isVisible, timeout=5000)
    assert bright_widgets(chat) == []
    assert poor_status_text(chat) == []
    # The transcript's bubbles and the red "Stopped." are drawn from the palette.
    image = chat.transcript.viewport().grab().toImage()
    light = sum(1 for x in range(0, image.width(), 7) for y in range(0, image.height(), 7)
                if colors.relative_luminance(theme.rgb(image.pixelColor(x, y))) > 0.3)
    assert light < 30  # text glyphs only, no light bubble
    html = chat.transcript.toHtml()
    chosen = colors.chat_colors(dark_palette)
    assert colors.to_hex(chosen.error_text) in html
    assert colors.contrast_ratio(chosen.error_text, chosen.answer_bubble) >= colors.TEXT_CONTRAST


def test_the_light_theme_keeps_readable_status_text_too(qtbot) -> None:
    panel = degraded_panel_with_every_colour(qtbot)
    assert poor_status_text(panel) == []


def test_status_colours_reach_text_contrast_on_any_background() -> None:
    for background in ((0, 0, 0), (0x2D, 0x2F, 0x33), (0x80, 0x80, 0x80), (0xEF, 0xEF, 0xEF), (255, 255, 255)):
        for status in colors.STATUS_HUES:
            assert colors.contrast_ratio(colors.status_color(status, background), background) >= 4.5
    # On dark, red and green get lighter; on light they keep their hue.
    dark = (0x2D, 0x2F, 0x33)
    assert colors.relative_luminance(colors.status_color("error", dark)) > colors.relative_luminance(
        colors.STATUS_HUES["error"])
    assert colors.status_color("ok", (255, 255, 255)) != colors.status_color("ok", dark)


def test_the_app_follows_a_palette_change_while_running(qtbot, qapp) -> None:
    panel = degraded_panel_with_every_colour(qtbot)
    style, palette, tooltips = qapp.style().name(), qapp.palette(), QToolTip.palette()
    try:
        theme.use_dark_fusion(qapp)
        QApplication.processEvents()
        assert bright_widgets(panel) == []
        assert poor_status_text(panel) == []
    finally:
        qapp.setStyle(style)
        qapp.setPalette(palette)
        QToolTip.setPalette(tooltips)
