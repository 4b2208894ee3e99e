"""The real Service and HTTP app, in-process: FakeWorkers instead of llama.cpp
processes, a FakeUpstream behind the service's HTTP client, and a client
that calls the app through httpx.ASGITransport. Everything above the
workers is the production code: admission, replay, idempotency, sinks,
every protocol's shapes, residency.

The prompt is still counted with the bundled model's own tokenizer (read
in-process, vocab only), and the model files' headers are read as at a real
start: that costs a fraction of a second and no process."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette

from tests.harness import BASE_CONFIG
from tray_app.core.api.app import create_app
from tray_app.core.config import parse_config_text
from tray_app.core.memory.telemetry import GpuReader
from tray_app.core.service import Service

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
    service = Service(parse_config_text(config_text), runtime=FakeRuntime(), log_dir=tmp / "logs",
                      worker_factory=workers, http_transport=upstream.transport(), gpu_reader=gpu_reader)
    app = create_app(service)
    # ASGITransport sends no lifespan events: run the app's own lifespan (it starts and stops the service).
    async with app.router.lifespan_context(app):
        assert await service.wait_ready(READY_TIMEOUT_S)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router",
                                     timeout=READY_TIMEOUT_S) as client:
            yield InProcess(service, app, client, workers, upstream)
