"""The model library in the tray (issue 14): the Models menu with Load and
Unload, the panel's Models list and the chat's model picker, against a real
service with two models (the default SmolLM2 and "tiny", the same file with
a smaller profile, loaded on demand)."""

from __future__ import annotations

import pytest
from PySide6.QtWidgets import QMenu

from tests.harness import BASE_CONFIG, running
from tray_app.core.config import bundled_model_path
from tests.status_sample import conforming
from tray_app.ui import viewmodel as vm
from tray_app.ui.chat import ChatWindow
from tray_app.ui.client import ServiceClient

from .conftest import wait_status

WAIT_MS = 120_000


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """Replaces the suite's one-model service for this module."""
    config = BASE_CONFIG + f"""
[[models]]
name = "tiny"
path = "{bundled_model_path()}"
n_ctx = 256
max_concurrency = 1
"""
    with running(tmp_path_factory.mktemp("models-ui"), config) as service:
        yield service


def tiny_gpu(status) -> str:
    return next(m["gpu"] for m in status["models"] if m["name"] == "tiny")


def model_submenu(controller, name: str) -> QMenu:
    for action in controller.tray_menu.models_menu.actions():
        if action.menu() is not None and action.text().startswith(f"{name}:"):
            return action.menu()
    shown = [a.text() for a in controller.tray_menu.models_menu.actions()]
    raise AssertionError(f"no {name} in the Models menu: {shown}")


def action(menu: QMenu, text: str):
    return next(a for a in menu.actions() if a.text().replace("&", "") == text)


@pytest.mark.integration
def test_the_models_menu_loads_and_unloads_a_model(qtbot, controller, live) -> None:
    qtbot.waitUntil(lambda: controller.tray_menu.models_menu_action.isVisible(), timeout=WAIT_MS)
    tiny = model_submenu(controller, "tiny")
    assert tiny.menuAction().text().startswith("tiny: unloaded, ")
    assert action(tiny, "Unload").isEnabled() is False
    action(tiny, "Load on the GPU").trigger()
    wait_status(qtbot, live, lambda s: tiny_gpu(s) == "loaded", what="tiny loaded from the menu")
    qtbot.waitUntil(lambda: model_submenu(controller, "tiny").menuAction().text().startswith("tiny: on the GPU, "),
                    timeout=WAIT_MS)
    tiny = model_submenu(controller, "tiny")
    assert "VRAM" in tiny.menuAction().text() and action(tiny, "Load on the GPU").isEnabled() is False
    action(tiny, "Unload").trigger()
    wait_status(qtbot, live, lambda s: tiny_gpu(s) == "unloaded_idle", what="tiny unloaded from the menu")


@pytest.mark.integration
def test_the_panel_lists_the_models(qtbot, controller, live) -> None:
    controller.windows.show_panel()
    panel = controller.windows.panel()
    qtbot.waitUntil(lambda: panel.models_box.isVisible(), timeout=WAIT_MS)
    names = [cells[0].full_text for cells in panel.model_cells if cells[0].isVisible()]
    assert names[0].endswith("(default)") and names[1] == "tiny"
    assert [cells[1].text() for cells in panel.model_cells][0] == "on the GPU"


@pytest.mark.integration
def test_the_chat_picks_the_model_that_answers(qtbot, live) -> None:
    client = ServiceClient(live.url)
    client.start()
    window = ChatWindow(client, max_tokens=8, temperature=0)
    qtbot.addWidget(window)
    window.show()
    try:
        qtbot.waitUntil(lambda: window.model_picker.count() == 2, timeout=WAIT_MS)
        assert window.model_picker.isVisible() and window.chosen_model() == vm.model_names(live.status())[0]
        window.model_picker.setCurrentText("tiny")
        before = next(m for m in live.status()["models"] if m["name"] == "tiny")["requests"]
        with qtbot.waitSignal(window.answer_finished, timeout=WAIT_MS) as finished:
            assert window.send("Say hello.")
        assert finished.args == ["ok"], window.turns[-1]
        after = next(m for m in live.status()["models"] if m["name"] == "tiny")["requests"]
        assert sum(after.values()) == sum(before.values()) + 1
    finally:
        client.stop()


def test_model_views_in_words() -> None:
    status = conforming({"models": [
        {"name": "smol", "source": "default", "location": "gpu+cpu", "gpu": "loaded", "vram_mib": 806.0,
         "size_bytes": 98 * 2**20, "in_flight": 1},
        {"name": "gemma", "source": "config", "location": "cpu", "gpu": "unloaded_idle", "estimated_ram_mib": 526.0,
         "size_bytes": 253 * 2**20, "aliases": ["g3"], "degraded": "the GPU worker is loading"},
        {"name": "big", "source": "folder", "location": "unloaded", "gpu": "unloaded_idle", "size_bytes": 4 * 2**30},
        {"name": "game", "source": "folder", "location": "unloaded", "gpu": "given_away", "size_bytes": 2**30},
    ]})
    smol, gemma, big, game = vm.model_views(status)
    assert smol.label == "smol (default): on the GPU, 806 MiB VRAM" and not smol.can_unload and smol.busy == 1
    assert gemma.label == "gemma: on the CPU, 526 MiB RAM" and gemma.can_load and gemma.can_unload
    assert "also called: g3" in gemma.tooltip and "degraded" in gemma.tooltip
    assert big.label == "big: unloaded, 4,096 MiB on disk" and big.can_load and not big.can_unload
    assert game.where == "GPU given away" and not game.can_load
    assert vm.model_names(status) == ["smol", "gemma", "big", "game"] and vm.model_views(None) == []
    long = vm.model_views(conforming({"models": [{
        "name": "SmolLM2-135M-Instruct-abliterated-imatrix-with-a-long-name.Q4_1", "source": "folder",
        "location": "unloaded", "gpu": "unloaded_idle", "size_bytes": 2**20}]}))[0]
    assert long.label.startswith("SmolLM2-135M-Instruc…th-a-long-name.Q4_1: unloaded")
    assert len(long.label.split(":")[0]) == vm.MENU_NAME_CHARS and long.name in long.tooltip


@pytest.mark.integration
def test_the_download_dialog_checks_fit_downloads_and_the_model_is_served(qtbot, live) -> None:
    import hashlib

    from tests.fake_hub import FakeHub, HubFile, serve_hub
    from tray_app.ui.download import DownloadDialog

    data = bundled_model_path().read_bytes()
    hub = FakeHub(files={("test-org/SmolLM2-GGUF", "smol-downloaded.gguf"):
                         HubFile(data, hashlib.sha256(data).hexdigest())})
    client = ServiceClient(live.url)
    client.start()
    with serve_hub(hub):
        dialog = DownloadDialog(client, live.tmp / "data" / "tray-app" / "models", ram_floor_mib=256,
                                reserve_mib=256, hub=hub.url)
        qtbot.addWidget(dialog)
        dialog.show()
        try:
            assert not dialog.download_button.isEnabled()
            dialog.ref_edit.setText("not a reference")
            dialog.start()
            assert "OWNER/NAME" in dialog.progress_label.text() or "FILE" in dialog.progress_label.text()
            dialog.ref_edit.setText("test-org/SmolLM2-GGUF/smol-downloaded.gguf")
            qtbot.waitUntil(lambda: client.last_status is not None, timeout=WAIT_MS)
            dialog.check_fit()
            qtbot.waitUntil(lambda: "fits" in dialog.progress_label.text(), timeout=WAIT_MS)
            with qtbot.waitSignal(dialog.finished_download, timeout=WAIT_MS):
                dialog.download_button.click()
            qtbot.waitUntil(lambda: "served now as the model 'smol-downloaded'" in dialog.progress_label.text(),
                            timeout=WAIT_MS)
            assert dialog.bar.value() == dialog.bar.maximum() > 0
            assert "smol-downloaded" in {m["name"] for m in live.status()["models"]}
        finally:
            client.stop()


def test_a_model_unloaded_for_another_says_for_which() -> None:
    status = conforming({"service": {"healthy": True}, "gpu": {"available": True, "residency": {
        "state": "unloaded_idle", "text": "GPU unloaded for coder", "app": "coder", "since": None}},
        "degraded": {"active": False}, "workers": [{"role": "gpu", "state": "stopped"}, {"role": "cpu", "state": "ready"}]})
    assert vm.residency_text(status) == "GPU: unloaded for coder"
    idle = conforming({**status, "gpu": {"available": True, "residency": {
        "state": "unloaded_idle", "text": "GPU unloaded (idle)", "app": None, "since": None}}})
    assert vm.residency_text(idle) == "GPU: unloaded (idle)"
    assert vm.state_title(status) == "The GPU model is unloaded for coder"
    assert vm.state_title(idle) == vm.IDLE_TITLE
