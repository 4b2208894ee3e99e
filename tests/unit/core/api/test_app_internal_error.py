"""A server error's answer is a sentence: the exception's text (which can
name files and internals) goes to the log, never to the client."""

from __future__ import annotations

import json

from starlette.requests import Request

from tray_app.core.api.app import _internal_error


async def test_a_500_names_no_file_and_no_exception_text():
    request = Request({"type": "http", "method": "GET", "path": "/api/tags", "headers": [], "query_string": b""})
    failure = FileNotFoundError(2, "No such file or directory", "/home/someone/models/secret-project.gguf")
    response = await _internal_error(request, failure)
    body = json.loads(response.body)
    assert response.status_code == 500
    text = json.dumps(body)
    assert "secret-project" not in text and "/home/someone" not in text and "No such file" not in text
    assert "log" in text
