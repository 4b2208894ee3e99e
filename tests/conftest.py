import os

import pytest

# Qt tests render offscreen: CI has no display, and a developer's desktop
# shouldn't flash windows while the suite runs.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


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
