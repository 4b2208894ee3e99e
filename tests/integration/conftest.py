import pytest

from tests.harness import RunningService


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    running = RunningService(tmp_path_factory.mktemp("service"))
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()


@pytest.fixture
def fresh(service):
    service.reset()
    return service
