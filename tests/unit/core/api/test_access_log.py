"""The access log's line: who, what, how it ended and why, never the prompt."""

from __future__ import annotations

import json
import logging

from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route
import httpx

from tray_app.core.access.keys import ApiKey
from tray_app.core.api.access_log import AccessLog, access_line
from tray_app.core.api.security import PRINCIPAL_SCOPE_KEY


def scope(method="POST", path="/v1/chat/completions", headers=(), principal=None) -> dict:
    return {"type": "http", "method": method, "path": path,
            "headers": [(k.encode(), v.encode()) for k, v in headers],
            "extensions": {PRINCIPAL_SCOPE_KEY: principal} if principal else {}}


def test_a_served_request_says_who_where_and_why():
    line = access_line(scope(headers=[("user-agent", "OpenAI/Python 1.99")], principal=ApiKey("phone", "inference")),
                       200, {"x-served-by": "gpu", "x-route-reason": "admitted", "x-request-id": "req-1",
                             "x-messages-dropped": "12"}, b"", 0.84)
    assert line == ("POST /v1/chat/completions 200 0.84s key=phone client=OpenAI/Python served_by=gpu route=admitted "
                    "messages_dropped=12 id=req-1")


def test_an_error_carries_its_envelopes_reason_on_one_line():
    body = json.dumps({"type": "error", "error": {"type": "invalid_request_error",
                                                  "message": "messages.1: bad\nrole\x1b[31m"}}).encode()
    line = access_line(scope(path="/v1/messages"), 400, {}, body, 0.01)
    assert line.endswith('error="messages.1: bad role [31m"') and "\n" not in line
    ollama = access_line(scope(path="/api/chat"), 404, {}, b'{"error": "model \\"x\\" not found"}', 0.0)
    assert ollama.endswith('error="model \\"x\\" not found"')


async def test_polls_are_logged_only_when_they_fail(caplog):
    async def ok(request):
        return PlainTextResponse("ok")

    async def refused(request):
        return JSONResponse({"error": {"message": "no such thing"}}, status_code=404)

    app = AccessLog(Starlette(routes=[Route("/status", ok), Route("/v1/chat/completions", refused, methods=["POST"]),
                                      Route("/health", refused)]))
    with caplog.at_level(logging.INFO, logger="tray_app.access"):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            await client.get("/status")
            await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "SECRET"}]})
            await client.get("/health")
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("POST /v1/chat/completions 404") and "SECRET" not in lines[0]
    assert lines[1].startswith("GET /health 404")
