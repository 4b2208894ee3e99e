"""The OpenAI error envelope, for every error the service answers with.

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


# Anthropic's error types by HTTP status; any other 4xx is invalid_request_error.
_ANTHROPIC_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                          413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                          529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    kind = _ANTHROPIC_ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# llama-server's error types by HTTP status (format_error_response in its server).
_LLAMACPP_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 501: "not_supported_error", 503: "unavailable_error"}
# llama-server's own routes here (api/llamacpp.py), whose errors are in its envelope.
LLAMACPP_PATHS = frozenset({"/completion", "/tokenize", "/detokenize", "/apply-template", "/props"})


def llamacpp_error_body(status: int, message: str, param: str | None = None) -> dict:
    """llama-server's envelope, {"error": {"code": the HTTP status, "message",
    "type"}}; `param` added when a field is to blame."""
    kind = _LLAMACPP_ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "server_error")
    error: dict = {"code": status, "message": message, "type": kind}
    if param is not None:
        error["param"] = param
    return {"error": error}


def error_body_for_path(path: str, status: int, message: str, code: str) -> dict:
    """An error in the shape of the protocol whose route `path` is, for the
    layers that answer before a route runs (the access guard, a 404): each
    client then reads the message where it looks for one."""
    if path.startswith("/api/"):
        return {"error": message}  # Ollama's
    if path.startswith("/v1/messages"):
        return anthropic_error_body(status, message)
    if path in LLAMACPP_PATHS:
        return llamacpp_error_body(status, message)
    return error_body(status, message, code)


def error_response_for_path(path: str, status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(error_body_for_path(path, status, message, code), status_code=status)


def error_response(status: int, message: str, code: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


def failure_body(failure: JobFailed) -> dict:
    return _envelope(failure.message, failure.code, failure.err_type, failure.param)
