"""Routes about the service itself: /health (for monitors, no key),
/status (with the usage per key), /metrics and /openapi.json. An inference
key reads /status and /metrics with other keys' requests and usage left
out (key_access.visible_status): their ids would let it follow, or cancel
by guessing, another app's activity."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_CONTENT_TYPE
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..service import Service
from .key_access import KeyAccess, layout_hidden, model_allowed, model_host_named, visible_metrics, visible_status
from .openapi import build_openapi
from .requests import MAX_MESSAGES
from .security import principal_of


class ServiceRoutes:
    def __init__(self, service: Service, access: KeyAccess) -> None:
        self.service = service
        self.access = access

    async def health(self, request: Request) -> Response:
        ok, reason = self.service.health()
        return JSONResponse({"status": "ok" if ok else "unavailable", "reason": reason}, status_code=200 if ok else 503)

    async def status(self, request: Request) -> Response:
        # Someone is looking: the sampler reads memory at its full rate for them.
        self.service.observer.looked_at()
        # The usage is the HTTP app's (it counts requests as they end), so it
        # joins the service's snapshot here.
        status = {**self.service.status(), "usage": self.access.usage.snapshot()}
        principal = principal_of(request.scope)
        if principal is not None and not principal.is_admin:
            status = visible_status(status, principal.name, lambda request_id: self.access.owns(principal.identity,
                                                                                               request_id))
            status = layout_hidden(status, lambda name: model_allowed(
                principal, model_host_named(self.service, name)))
        return JSONResponse(status)

    async def metrics(self, request: Request) -> Response:
        text = self.service.metrics.render()
        principal = principal_of(request.scope)
        if principal is not None and not principal.is_admin:
            text = visible_metrics(text.decode(), principal.name).encode()
        return Response(text, media_type=PROMETHEUS_CONTENT_TYPE)

    async def openapi(self, request: Request) -> Response:
        config = self.service.config
        return JSONResponse(build_openapi(max(config.gpu.n_ctx, config.cpu.n_ctx), MAX_MESSAGES))
