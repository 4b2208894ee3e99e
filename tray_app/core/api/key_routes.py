"""/admin/keys: the named keys (core/access/keys.py) from the web page, as
`tray-app keys list|add|revoke` from a shell.

GET lists them (never a hash), POST adds one and answers its raw key, the
only time it is ever shown, and DELETE /admin/keys/{name} revokes one. The
access guard keeps inference keys off /admin/*, so only an admin manages keys.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..access.keys import SCOPES, KeyExists, KeyProblem, KeyStore, LastAdminKey
from .errors import error_response
from .openai_request import InvalidRequest
from .requests import read_json_object

ADD_FIELDS = ("name", "scope", "models", "max_concurrency", "prompt_cache")
MAX_MODELS_PER_KEY = 64


class KeyFieldError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def key_to_add(body: dict[str, Any]) -> tuple[str, str, tuple[str, ...], int | None, bool]:
    """A POST /admin/keys body's JSON types checked field by field: (name,
    scope, models, max_concurrency). Raises KeyFieldError naming the field
    that is wrong. What a name, scope or limit may be is KeyStore.add's to
    say (the CLI and the settings window add keys through it too)."""
    for field in body:
        if field not in ADD_FIELDS:
            raise KeyFieldError(field, f"unknown field {field!r}; a key has {', '.join(ADD_FIELDS)}")
    name = body.get("name")
    if not isinstance(name, str):
        raise KeyFieldError("name", "'name' must be a string: the app's name")
    scope = body.get("scope", "inference")
    if not isinstance(scope, str):
        raise KeyFieldError("scope", f"'scope' must be a string: one of {', '.join(SCOPES)}")
    models = body.get("models") or []
    if (not isinstance(models, list) or len(models) > MAX_MODELS_PER_KEY
            or not all(isinstance(m, str) and m.strip() for m in models)):
        raise KeyFieldError("models", f"'models' must be a list of up to {MAX_MODELS_PER_KEY} model names "
                                      "(empty: every model)")
    limit = body.get("max_concurrency")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
        raise KeyFieldError("max_concurrency", "'max_concurrency' must be a whole number of at least 1, "
                                               "or null for no limit")
    prompt_cache = body.get("prompt_cache", True)
    if not isinstance(prompt_cache, bool):
        raise KeyFieldError("prompt_cache", "'prompt_cache' must be true or false")
    return name, scope, tuple(m.strip() for m in models), limit, prompt_cache


class KeyRoutes:
    def __init__(self, store: KeyStore, legacy_key_set: bool = False) -> None:
        self.store = store
        # [server] api_key is an admin key of its own: with it, the last
        # named admin key may go.
        self.legacy_key_set = legacy_key_set

    async def list(self, request: Request) -> Response:
        keys = sorted(self.store.keys().values(), key=lambda key: key.name)
        return JSONResponse({"keys": [key.public() for key in keys]})

    async def add(self, request: Request) -> Response:
        try:
            body = await read_json_object(request)
        except InvalidRequest as bad:
            return error_response(bad.status, bad.message, bad.code)
        try:
            name, scope, models, limit, prompt_cache = key_to_add(body)
        except KeyFieldError as bad:
            return error_response(400, str(bad), "invalid_value", param=bad.param)
        try:
            raw = self.store.add(name, scope, models, limit, prompt_cache=prompt_cache)
        except KeyExists as taken:
            return error_response(409, str(taken), "key_exists", param=taken.field)
        except KeyProblem as problem:
            return error_response(400, str(problem), "invalid_value", param=problem.field)
        added = self.store.get(name)
        return JSONResponse({**(added.public() if added else {"name": name}), "key": raw}, status_code=201)

    async def revoke(self, request: Request) -> Response:
        name = request.path_params["name"]
        if self.store.get(name) is None:
            known = ", ".join(sorted(self.store.keys())) or "none"
            return error_response(404, f"no key named {name!r} (keys: {known})", "key_not_found")
        try:
            revoked = self.store.revoke(name, other_admin=self.legacy_key_set)
        except LastAdminKey as problem:
            return error_response(409, str(problem), "last_admin_key")
        except KeyProblem as problem:  # revoked by someone else meanwhile
            return error_response(404, str(problem), "key_not_found")
        return JSONResponse({"revoked": revoked.public()})


def key_routes(store: KeyStore | None = None, legacy_key_set: bool = False) -> list[Route]:
    """The three routes; by default over the keys file the access guard reads
    (keys.py's default path), so a key added here works on the next request."""
    keys = KeyRoutes(store or KeyStore(), legacy_key_set)
    return [Route("/admin/keys", keys.list, methods=["GET"]), Route("/admin/keys", keys.add, methods=["POST"]),
            Route("/admin/keys/{name}", keys.revoke, methods=["DELETE"])]
