import ast
import gc
import os
import tempfile
from pathlib import Path

import pytest

# Qt tests render offscreen: CI has no display, and a developer's desktop
# shouldn't flash windows while the suite runs. An empty value (a CI
# script's `QT_QPA_PLATFORM=`) counts as unset: Qt would abort looking for X.
if not os.environ.get("QT_QPA_PLATFORM"):
    os.environ["QT_QPA_PLATFORM"] = "offscreen"
# The app's own folders (config, logs, saved chats, models) point into a
# scratch folder: a test that opens the chat or saves settings must never
# write into the home folder of whoever runs the suite.
_SCRATCH = tempfile.mkdtemp(prefix="tray-app-tests-")
for _variable in ("XDG_CONFIG_HOME", "XDG_STATE_HOME", "XDG_DATA_HOME"):
    os.environ[_variable] = os.path.join(_SCRATCH, _variable.lower())


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """A real service (real workers, simulated GPU) shared by one test module."""
    from tests.harness import running

    with running(tmp_path_factory.mktemp("service")) as service:
        yield service


@pytest.fixture
def fresh(service):
    """The shared service, back to a healthy baseline."""
    service.reset()
    return service


def _marks_the_whole_module_integration(path: Path) -> bool:
    """Whether the module's own `pytestmark` (one mark or a list) carries
    pytest.mark.integration, read from its source without importing it."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return False
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            marks = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            return any(ast.unparse(mark) == "pytest.mark.integration" for mark in marks)
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under `-m "not integration"`, a module whose every test is integration
    is not imported at all: each of its tests would be deselected anyway, and
    importing it (its clients, playwright, its fixtures' modules) is a good
    part of what the quick run would spend on collection."""
    if (config.getoption("markexpr", "").strip() == "not integration" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_") and _marks_the_whole_module_integration(collection_path)):
        return True
    return None


@pytest.fixture(scope="session")
def bundled_gguf():
    """gguf-py's reader over the bundled model, built once a session: it parses
    every field in Python (49k tokens, 49k merges), seconds each time."""
    gguf = pytest.importorskip("gguf")
    from tray_app.core.config import bundled_model_path

    return gguf.GGUFReader(bundled_model_path())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `long_running` (a minute or more on their own: the soak,
    the drill, the GPU kit, the fuzzer) go first. The README's command runs
    the suite on two xdist workers, file by file in this order: started
    last, one of them would leave the other worker idle while it finishes."""
    items.sort(key=lambda item: item.get_closest_marker("long_running") is None)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the imports and the collection made (about a million objects:
    Qt, the HTTP clients, hypothesis, the app) lives for the whole run: out of
    the cyclic collector's sight, a full collection walks only what the tests
    made since. tests/ui collects after every test (see its conftest), which
    otherwise cost a few tenths of a second each, 158 times."""
    gc.collect()
    gc.freeze()
