"""A scripted tour of the real app that saves screenshots (docs/screenshots).

Only active when TRAY_APP_SCREENSHOT_DIR is set (see
docs/screenshots/take_screenshots.py, which runs the app under Xvfb with a
tray host). It drives the app the way a user would, through the controller's
actions and the service's HTTP API, and grabs:

- the tray icon as it sits in the tray host (a crop of the X root window),
  serving on the GPU and degraded, plus the notification balloon;
- the tray menu, popped up under the icon;
- the panel in normal and in degraded mode;
- the chat window mid-answer, on the GPU and in degraded mode.

TRAY_APP_SCREENSHOT_SET=no-tray grabs only the panel of the no-tray fallback;
TRAY_APP_SCREENSHOT_SET=cpu-only the tray icon, menu and panel of a machine
without a GPU path (the app run without the simulated GPU, on the CPU build).
TRAY_APP_SCREENSHOT_THEME=dark runs the app in a dark Fusion palette (set in
app.run_tray) and names the files *-dark.png; the tray icon crops are left
out there, since the tray host, not the app's palette, draws around the icon.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Generator

from PySide6.QtCore import QObject, QPoint, QRect, Qt, QTimer
from PySide6.QtGui import QFont, QGuiApplication, QImage, QPainter, QPixmap
from PySide6.QtWidgets import QApplication, QWidget

from ..drill.vram_hog import OtherApp, crowding_mib
from . import theme
from . import viewmodel as vm

log = logging.getLogger(__name__)

# CPU requests queued behind a running one for the degraded-panel shots.
QUEUED_FOR_SHOTS = 10
# Named as the apps that call a home server would name themselves (X-Client-Name).
CLIENTS_FOR_SHOTS = ("Continue (VS Code)", "Home Assistant", "Open WebUI", "nightly-summary.py")
LONG_PROMPT = "Write a long story about a lighthouse keeper and the sea."
Step = Generator[tuple, None, None]


class ScreenshotTour(QObject):
    def __init__(self, controller, folder: Path) -> None:
        super().__init__(controller)
        self.controller = controller
        self.client = controller.client
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.which = os.environ.get("TRAY_APP_SCREENSHOT_SET", "tray")
        self.dark = os.environ.get("TRAY_APP_SCREENSHOT_THEME") == "dark"
        self._steps: Step | None = None
        self._wait: Callable[[], bool] | None = None
        self._deadline = 0.0
        self._timer = QTimer(self)
        self._timer.setInterval(100)
        self._timer.timeout.connect(self._tick)
        self.saved: list[str] = []
        self.streams: list[Any] = []

    def start(self) -> None:
        tours = {"no-tray": self.tour_no_tray, "cpu-only": self.tour_cpu_only}
        self._steps = tours.get(self.which, self.tour)()
        self._timer.start()
        self._advance()

    # ----- the driver --------------------------------------------------------------------

    def _tick(self) -> None:
        if self._wait is None:
            return
        if self._wait():
            self._wait = None
            self._advance()
        elif time.monotonic() > self._deadline:
            self._fail(f"timed out: {self._what}")

    def _advance(self) -> None:
        assert self._steps is not None
        try:
            command = next(self._steps)
        except StopIteration:
            self._finish()
            return
        except Exception as exc:  # noqa: BLE001 - a broken tour must still end the app
            log.exception("screenshot tour failed")
            self._fail(repr(exc))
            return
        kind = command[0]
        if kind == "sleep":
            end = time.monotonic() + command[1]
            self._what = f"sleep {command[1]}"
            self._deadline = end + 5
            self._wait = lambda: time.monotonic() >= end
        elif kind == "until":
            _, predicate, timeout, what = command
            self._what = what
            self._deadline = time.monotonic() + timeout
            self._wait = predicate

    def _finish(self) -> None:
        self._timer.stop()
        (self.folder / "tour.json").write_text(json.dumps({"ok": True, "saved": self.saved}, indent=1))
        self.controller.quit()

    def _fail(self, message: str) -> None:
        self._timer.stop()
        self._wait = None
        log.error("screenshot tour: %s", message)
        (self.folder / "tour.json").write_text(json.dumps({"ok": False, "error": message, "saved": self.saved}, indent=1))
        self.controller.quit()

    # ----- helpers -----------------------------------------------------------------------

    def status(self) -> dict:
        return self.client.last_status or {}

    def save(self, image: QImage | QPixmap, name: str) -> None:
        if self.dark:
            name = name.replace(".png", "-dark.png")
        path = self.folder / name
        if not image.save(str(path)):
            raise RuntimeError(f"could not save {path}")
        self.saved.append(name)
        log.info("screenshot: %s", path)

    @staticmethod
    def fit(widget: QWidget, width: int = 740) -> None:
        """Width fixed, height just what the content needs (nothing cut off)."""
        widget.resize(width, 100)
        # The panel scrolls its `body` when the screen is short; a screenshot shows all of it.
        content = getattr(widget, "body", widget)
        layout = content.layout()
        height = layout.totalHeightForWidth(width) if layout is not None and layout.hasHeightForWidth() else -1
        widget.resize(width, max(height, content.minimumSizeHint().height(), content.sizeHint().height()))

    def grab_window(self, widget: QWidget, name: str) -> None:
        self.save(widget.grab(), name)

    def grab_screen(self, rect: QRect) -> QPixmap:
        screen = QGuiApplication.primaryScreen()
        return screen.grabWindow(0, rect.x(), rect.y(), rect.width(), rect.height())

    def tray_rect(self) -> QRect:
        tray = self.controller.tray
        geometry = tray.geometry() if tray is not None else QRect()
        if geometry.isEmpty():
            screen = QGuiApplication.primaryScreen().geometry()
            geometry = QRect(screen.right() - 24, 0, 24, 24)
        return geometry

    def save_tray_icon(self, name: str, caption: str) -> None:
        """The tray host's strip around our icon at 1x, and at 4x so it can be seen."""
        if self.dark:
            return  # the same pixels as in the light run: the tray host draws this strip
        icon = self.tray_rect()
        screen = QGuiApplication.primaryScreen().geometry()
        left = max(screen.left(), icon.left() - 40)
        strip = QRect(left, max(0, icon.top() - 4), min(screen.right(), icon.right() + 8) - left + 1, icon.height() + 8)
        shot = self.grab_screen(strip)
        zoom = shot.scaled(shot.width() * 4, shot.height() * 4, Qt.AspectRatioMode.KeepAspectRatio,
                           Qt.TransformationMode.FastTransformation)
        pad = 14
        font = QFont(QApplication.font())
        font.setPointSizeF(font.pointSizeF() * 0.95)
        line = 22
        width = max(zoom.width(), 360) + 2 * pad
        height = pad + line + shot.height() + 10 + line + zoom.height() + pad
        canvas = QImage(width, height, QImage.Format.Format_RGB32)
        palette = theme.current_palette()
        canvas.fill(theme.qcolor(palette.window))
        painter = QPainter(canvas)
        painter.setFont(font)
        painter.setPen(theme.qcolor(palette.window_text))
        y = pad
        painter.drawText(QRect(pad, y, width - 2 * pad, line), Qt.AlignmentFlag.AlignVCenter, f"{caption}: actual size")
        y += line
        painter.drawPixmap(pad, y, shot)
        y += shot.height() + 10
        painter.drawText(QRect(pad, y, width - 2 * pad, line), Qt.AlignmentFlag.AlignVCenter, "4x, nearest pixel")
        y += line
        painter.drawPixmap(pad, y, zoom)
        painter.end()
        self.save(canvas, name)

    def stream(self, prompt: str, max_tokens: int = 300, client_name: str = "tray-app chat"):
        from .chat import ChatStream

        # Each stream on its own client: Qt opens at most six connections per
        # host for one QNetworkAccessManager, and the tour needs eleven at once.
        from .client import ServiceClient

        client = ServiceClient(self.client.base_url, parent=self)
        stream = ChatStream(client, [{"role": "user", "content": prompt}], max_tokens=max_tokens,
                            client_name=client_name, parent=self)
        self.streams.append(stream)
        stream.start()
        return stream

    def kind_is(self, kind: str) -> Callable[[], bool]:
        return lambda: self.controller.kind == kind

    def all_ready(self) -> bool:
        status = self.status()
        return (self.controller.kind == vm.GPU and bool(status.get("workers"))
                and all(w.get("state") == "ready" for w in status["workers"]))

    def cpu_requests(self, queued: int, total: int) -> Callable[[], bool]:
        def check() -> bool:
            status = self.client.last_status
            rows = vm.cpu_requests(status) if status is not None else []
            return len(rows) >= total and sum(1 for r in rows if r.get("state") == "queued") >= queued
        return check

    # ----- the tours ---------------------------------------------------------------------

    def menu_shot(self, name: str) -> Step:
        """The tray menu popped up under the icon, as a crop of the screen."""
        menu = self.controller.tray_menu.menu
        tray = self.tray_rect()
        menu.popup(QPoint(tray.left(), tray.bottom() + 2))
        yield ("sleep", 0.8)
        area = menu.geometry().united(tray).adjusted(-16, 0, 16, 16)
        area.setTop(0)
        self.save(self.grab_screen(area.intersected(QGuiApplication.primaryScreen().geometry())), name)
        menu.hide()

    def models_menu_shot(self, name: str) -> Step:
        """The tray menu with its Models submenu open, one crop of both."""
        menu = self.controller.tray_menu.menu
        models_menu = self.controller.tray_menu.models_menu
        tray = self.tray_rect()
        menu.popup(QPoint(tray.left(), tray.bottom() + 2))
        yield ("sleep", 0.6)
        item = menu.actionGeometry(self.controller.tray_menu.models_menu_action).translated(menu.pos())
        models_menu.popup(QPoint(item.left() - models_menu.sizeHint().width(), item.top()))
        yield ("sleep", 0.8)
        area = menu.geometry().united(models_menu.geometry()).united(tray).adjusted(-16, 0, 16, 16)
        area.setTop(0)
        self.save(self.grab_screen(area.intersected(QGuiApplication.primaryScreen().geometry())), name)
        models_menu.hide()
        menu.hide()

    def tour(self) -> Step:
        c = self.controller
        yield ("until", self.all_ready, 240, "both workers ready, serving on the GPU")
        yield ("sleep", 3)

        # The tray icon and its menu.
        self.save_tray_icon("tray-icon.png", "Serving on the GPU")
        yield from self.menu_shot("tray-menu.png")
        yield ("sleep", 0.3)

        # The library: a second model loaded, the Models submenu, the download dialog.
        c.client.set_model_loaded("coder", True)
        yield ("until", lambda: any(v.name == "coder" and v.where == "on the GPU"
                                    for v in vm.model_views(self.client.last_status)), 60, "the second model loaded")
        yield ("sleep", 1.5)
        yield from self.models_menu_shot("tray-menu-models.png")
        yield ("sleep", 0.3)
        c.windows.show_download()
        dialog = c.windows.download_dialog
        dialog.ref_edit.setText("bartowski/Qwen2.5-0.5B-Instruct-GGUF/Qwen2.5-0.5B-Instruct-Q4_K_M.gguf")
        dialog.bar.setVisible(True)
        dialog.bar.setRange(0, 100)
        dialog.bar.setValue(42)
        dialog.progress_label.setText(vm_progress_example())
        yield ("sleep", 0.5)
        dialog.adjustSize()
        yield ("sleep", 0.3)
        self.grab_window(dialog, "download.png")
        dialog.bar.setVisible(False)
        dialog.progress_label.setText("")
        dialog.hide()
        # The small simulated GPU holds one of the two: the default model comes back for the rest of the tour.
        default = (self.status().get("service") or {}).get("model")
        c.client.set_model_loaded("coder", False)
        yield ("until", lambda: all(v.where != "on the GPU" for v in vm.model_views(self.client.last_status)
                                    if v.name == "coder"), 60, "the second model unloaded")
        c.client.set_model_loaded(default, True)
        yield ("until", lambda: any(v.name == default and v.where == "on the GPU"
                                    for v in vm.model_views(self.client.last_status)), 60, "the default model back")
        yield ("until", self.kind_is(vm.GPU), 60, "serving on the GPU again")

        # The chat, answered on the GPU.
        chat = c.windows.chat()
        chat.resize(660, 560)
        c.windows.show_chat()
        yield ("sleep", 0.5)
        # A finished answer is drawn as Markdown: ask for code. Then a new chat,
        # so the conversation below stays short enough for the CPU's context.
        chat.send("Write a Python function that reverses a string, in a code block.")
        yield ("until", lambda: not chat.busy, 120, "the code answer")
        yield ("sleep", 0.5)
        self.grab_window(chat, "chat-markdown.png")
        chat.clear()
        chat.send("In two sentences: what does a lighthouse keeper do?")
        yield ("until", lambda: not chat.busy, 120, "first answer")
        chat.input.setPlainText("")
        chat.send(LONG_PROMPT)
        yield ("until", lambda: len(chat.turns[-1].text) > 260, 120, "the answer to be under way")
        self.grab_window(chat, "chat-mid-answer.png")
        # Stopped here: run to its end, a rambling answer can fill the context,
        # and the conversation would then be too long for the CPU path below.
        chat.stop()
        yield ("until", lambda: not chat.busy, 30, "second answer stopped")
        chat.hide()

        # Degraded: a game (a real second process named steam) takes the VRAM;
        # the GPU model is unloaded for it and requests go to the CPU.
        panel = c.windows.panel()
        c.windows.show_panel()
        self.fit(panel)
        status = self.status()
        self.game = OtherApp(crowding_mib(status), "steam", simulated_dir=status["gpu"]["simulated_device_dir"])
        yield ("until", lambda: vm.residency_state(self.client.last_status) == "given_away", 30, "the GPU given to steam")
        yield ("sleep", 1)
        # One running and ten waiting: the banner shows three rows and counts the rest.
        self.stream(LONG_PROMPT, 300, client_name="Open WebUI")
        yield ("sleep", 0.4)
        for index in range(QUEUED_FOR_SHOTS):
            self.stream("Name three famous lighthouses.", 200, client_name=CLIENTS_FOR_SHOTS[index % len(CLIENTS_FOR_SHOTS)])
        yield ("until", self.cpu_requests(queued=QUEUED_FOR_SHOTS, total=QUEUED_FOR_SHOTS + 1), 60,
               "one running and ten queued CPU requests")
        yield ("until", self.kind_is(vm.DEGRADED), 30, "degraded mode")
        yield ("until", lambda: any(n[0] == "gpu_given_back" for n in c.notifications.notices), 30, "the GPU-given-back notification")
        yield ("sleep", 1.6)
        self.fit(panel)
        yield ("sleep", 0.3)
        self.grab_window(panel, "panel-degraded.png")
        self.save_notification()
        self.hide_balloons()  # so the crop shows the icon, not the balloon's edge
        yield ("sleep", 0.4)
        self.save_tray_icon("tray-icon-degraded.png", "Degraded: the CPU is serving")
        # The menu says where the GPU went, and offers it back.
        yield from self.menu_shot("tray-menu-gpu-given.png")
        for stream in self.streams:
            stream.stop()
        yield ("until", lambda: self.client.last_status is not None and not vm.cpu_requests(self.client.last_status),
               60, "the CPU requests to be canceled")

        # Degraded, by Force CPU: the chat shows the banner for its own request.
        c.tray_menu.force_cpu_action.setChecked(True)
        self.game.quit()
        yield ("until", lambda: (self.status().get("service") or {}).get("gpu_paused") is True, 30, "force CPU")
        c.windows.show_chat()
        # A long answer: the CPU must still be writing it when the shot is taken.
        chat.send("Tell me a long story about a lighthouse keeper before electricity.")
        yield ("until", lambda: len(chat.turns[-1].text) > 200 or not chat.busy, 120,
               "the degraded answer to be under way")
        if not chat.busy:
            raise RuntimeError(f"the degraded answer ended early: {chat.turns[-1].error or chat.turns[-1].text!r}")
        yield ("sleep", 1.2)  # a status poll has put the request into the banner
        self.grab_window(chat, "chat-degraded-mid-answer.png")
        chat.stop()
        yield ("until", lambda: not chat.busy, 30, "stop")
        c.tray_menu.force_cpu_action.setChecked(False)
        chat.hide()

        # Back to normal; the chart now shows the dip.
        yield ("until", self.kind_is(vm.GPU), 60, "back on the GPU")
        yield ("sleep", float(os.environ.get("TRAY_APP_SCREENSHOT_SETTLE_S", "45")))
        self.fit(panel)
        yield ("sleep", 0.3)
        self.grab_window(panel, "panel-normal.png")

        # The log viewer: the tray app's own log, filtered to what concerns the GPU.
        c.windows.show_logs()
        logs = c.windows.logs_window
        logs.resize(820, 460)
        logs.filter_edit.setText("gpu")
        yield ("sleep", 1.0)
        self.grab_window(logs, "logs.png")
        logs.hide()

        # Settings: paths in lines, numbers in spin boxes.
        c.windows.show_settings()
        settings = c.windows.settings_dialog
        yield ("sleep", 0.5)
        settings.adjustSize()
        yield ("sleep", 0.3)
        self.grab_window(settings, "settings.png")
        settings.reject()

    def tour_no_tray(self) -> Step:
        yield ("until", self.all_ready, 240, "both workers ready")
        yield ("sleep", 4)
        panel = self.controller.windows.panel()
        self.fit(panel)
        yield ("sleep", 0.3)
        self.grab_window(panel, "panel-no-tray.png")

    def tour_cpu_only(self) -> Step:
        """What a new user on a machine without a GPU path sees first: calm,
        serving on the CPU, with the reason and the step that enables the GPU."""
        yield ("until", lambda: self.controller.kind == vm.CPU and any(
            w.get("role") == "cpu" and w.get("state") == "ready" for w in self.status().get("workers") or ()),
            240, "serving on the CPU")
        yield ("sleep", 4)
        self.save_tray_icon("tray-icon-cpu.png", "Serving on the CPU (no GPU path)")
        yield from self.menu_shot("tray-menu-cpu.png")
        yield ("sleep", 0.3)
        panel = self.controller.windows.panel()
        self.controller.windows.show_panel()
        self.fit(panel)
        yield ("sleep", 0.5)
        self.grab_window(panel, "panel-cpu-only.png")

    @staticmethod
    def hide_balloons() -> None:
        for widget in QApplication.topLevelWidgets():
            if widget.isVisible() and widget.metaObject().className() == "QBalloonTip":
                widget.hide()

    def save_notification(self) -> None:
        """The notification about the GPU given back, if the desktop shows Qt's own balloon."""
        for widget in QApplication.topLevelWidgets():
            if widget.isVisible() and widget.metaObject().className() == "QBalloonTip":
                geometry = widget.frameGeometry().united(self.tray_rect()).adjusted(-8, 0, 8, 8)
                geometry.setTop(0)
                self.save(self.grab_screen(geometry.intersected(QGuiApplication.primaryScreen().geometry())),
                          "notification-degraded.png")
                return
        log.info("no notification balloon on screen (the desktop shows notifications itself)")


def vm_progress_example() -> str:
    """What the progress row says mid-download (the shot shows the row, not a real download)."""
    from ..core.catalog.download import render_progress

    return render_progress(168 * 1024 * 1024, 398 * 1024 * 1024, 5.6)
