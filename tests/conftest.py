import os
import tempfile

import pytest

# Qt tests render offscreen: CI has no display, and a developer's desktop
# shouldn't flash windows while the suite runs.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
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
