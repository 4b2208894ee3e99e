"""The OpenAI error envelope, for every error the router answers with.

{"error": {"message", "type", "param", "code"}}: `code` says what went
wrong, for programs; `type` is OpenAI's class of error and follows from the
HTTP status (dispatch.jobs.error_type, the one map; it lives there because
JobFailed needs it and dispatch must not import api). The app's routes, the
access guard in front of them and the HTTP protocol under it all build their
errors here.
"""

from __future__ import annotations

import json

from starlette.responses import JSONResponse

from ..dispatch.jobs import JobFailed, error_type


def _envelope(message: str, code: str, err_type: str, param: str | None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict:
    return _envelope(message, code, error_type(status), param)


def error_bytes(status: int, message: str, code: str) -> bytes:
    """The body as bytes, for the layers that answer before the app runs."""
    return json.dumps(error_body(status, message, code)).encode()


def error_response(status: int, message: str, code: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


def failure_body(failure: JobFailed) -> dict:
    return _envelope(failure.message, failure.code, failure.err_type, failure.param)
