"""The real Service and HTTP app, in-process: FakeWorkers instead of llama.cpp
processes, a FakeUpstream behind the service's HTTP client, and a client
that calls the app through httpx.ASGITransport. Everything above the
workers is the production code: admission, replay, idempotency, sinks,
every protocol's shapes, residency.

The prompt is still counted with the bundled model's own tokenizer (read
in-process, vocab only), and the model files' headers are read with the
product's own reader, as at a real start; each file once a test session
(see reading_each_model_file_once)."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Iterator
from unittest import mock

import httpx
import pytest
from starlette.applications import Starlette

from tests.harness import BASE_CONFIG
from tray_app.core import model_host as host_module
from tray_app.core.api.app import create_app
from tray_app.core.config import parse_config_text
from tray_app.core.memory.gguf_info import ModelInfo, read_model_info
from tray_app.core.memory.telemetry import GpuReader
from tray_app.core.service import Service
from tray_app.core.catalog.tokens import PromptCounter

from .upstream import FakeUpstream
from .worker import FakeRuntime, FakeWorkers

READY_TIMEOUT_S = 30.0


@dataclass
class InProcess:
    service: Service
    app: Starlette
    client: httpx.AsyncClient  # calls the app, in-process
    workers: FakeWorkers
    upstream: FakeUpstream


def isolate_user_folders(monkeypatch: pytest.MonkeyPatch, tmp: Path) -> None:
    """The service reads and writes under the XDG folders (models, logs, the
    simulated device): all of them in tmp, as the subprocess harness does."""
    for name in ("CONFIG", "STATE", "DATA", "CACHE"):
        monkeypatch.setenv(f"XDG_{name}_HOME", str(tmp / name.lower()))


@contextlib.asynccontextmanager
async def in_process_service(tmp: Path, config_text: str = BASE_CONFIG, *, upstream: FakeUpstream | None = None,
                             gpu_reader: GpuReader | None = None) -> AsyncIterator[InProcess]:
    """A started service (its resident workers ready) and a client for its app;
    stopped after. Call isolate_user_folders first. `gpu_reader` stands for
    the device when the config simulates none."""
    workers, upstream = FakeWorkers(), upstream or FakeUpstream()
    with reading_each_model_file_once():
        service = Service(parse_config_text(config_text), runtime=FakeRuntime(), log_dir=tmp / "logs",
                          worker_factory=workers, http_transport=upstream.transport(), gpu_reader=gpu_reader)
        app = create_app(service)
        # ASGITransport sends no lifespan events: run the app's own lifespan (it starts and stops the service).
        async with app.router.lifespan_context(app):
            assert await service.wait_ready(READY_TIMEOUT_S)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router",
                                         timeout=READY_TIMEOUT_S) as client:
                yield InProcess(service, app, client, workers, upstream)


# Reading a model's header and loading its tokenizer are most of an in-process
# service's start (about a second of the two cores): every in-process test's
# service reads the same files, and none changes them, so the test session
# reads each once. Keyed by the file's identity, so a file rewritten in place
# is read again.
def _identity(path: Path) -> tuple[str, int, int]:
    stat = Path(path).stat()
    return str(path), stat.st_mtime_ns, stat.st_size


@functools.cache
def _model_info(identity: tuple[str, int, int]) -> ModelInfo:
    return read_model_info(Path(identity[0]))


@functools.cache
def _tokenizer(identity: tuple[str, int, int]) -> PromptCounter:
    return PromptCounter(Path(identity[0]))


class _SessionTokenizer:
    """The session's tokenizer for one file, which a service's stop leaves open for the next test."""

    def __init__(self, path: Path) -> None:
        self._counter = _tokenizer(_identity(path))

    def __getattr__(self, name: str):
        return getattr(self._counter, name)

    def close(self) -> None:
        pass


@contextlib.contextmanager
def reading_each_model_file_once() -> Iterator[None]:
    with mock.patch.object(host_module, "read_model_info", lambda path: _model_info(_identity(path))), \
            mock.patch.object(host_module, "PromptCounter", _SessionTokenizer):
        yield
