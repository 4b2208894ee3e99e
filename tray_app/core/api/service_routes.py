"""Routes about the service itself: /health (for monitors, no key),
/status (with the usage per key), /metrics and /openapi.json."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_CONTENT_TYPE
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..service import Service
from ..usage import UsageStore
from .openapi import build_openapi
from .requests import MAX_MESSAGES


class ServiceRoutes:
    def __init__(self, service: Service, usage: UsageStore) -> None:
        self.service = service
        self.usage = usage

    async def health(self, request: Request) -> Response:
        ok, reason = self.service.health()
        return JSONResponse({"status": "ok" if ok else "unavailable", "reason": reason}, status_code=200 if ok else 503)

    async def status(self, request: Request) -> Response:
        # The usage is the HTTP app's (it counts requests as they end), so it
        # joins the service's snapshot here.
        return JSONResponse({**self.service.status(), "usage": self.usage.snapshot()})

    async def metrics(self, request: Request) -> Response:
        return Response(self.service.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    async def openapi(self, request: Request) -> Response:
        config = self.service.config
        return JSONResponse(build_openapi(max(config.gpu.n_ctx, config.cpu.n_ctx), MAX_MESSAGES))
