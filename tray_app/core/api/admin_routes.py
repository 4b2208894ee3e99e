"""The household's controls: /admin/* (the GPU, models, the library, the
workers) and DELETE /v1/requests/{id}. The access guard keeps inference keys
off /admin/*; a cancel checks here whose request it is (key_access.py)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.worker import WorkerState
from ..service import Service
from ..status_build import model_summary
from .errors import error_response
from .key_access import KeyAccess
from .openai_request import InvalidRequest
from .requests import PRESSURE_RULE, ModelNames, read_json_object, unknown_model_message


# The states a worker shows once it has taken a restart command.
RESTARTING = (WorkerState.STOPPING, WorkerState.STARTING, WorkerState.STOPPED, WorkerState.UNHEALTHY)
# How long POST /admin/restart waits for that: a worker's owner takes a command at once, unless stuck.
RESTART_BEGUN_WAIT_S = 2.0


class AdminRoutes:
    def __init__(self, service: Service, access: KeyAccess, model_names: Callable[[], ModelNames]) -> None:
        self.service = service
        self.access = access
        self._model_names = model_names

    async def cancel(self, request: Request) -> Response:
        request_id = request.path_params["request_id"]
        refusal = self.access.cancel_refusal(request, request_id)
        if refusal is not None:
            return error_response(403, refusal, "insufficient_scope")
        result = self.service.cancel(request_id)
        if result is None:
            return error_response(404, f"no queued or running request has id {request_id!r}; "
                                  "it may have finished already", "request_not_found")
        return JSONResponse(result)

    async def gpu(self, request: Request) -> Response:
        try:
            body = await read_json_object(request)
        except InvalidRequest as bad:
            return error_response(bad.status, bad.message, bad.code)
        if "paused" in body:
            if not isinstance(body["paused"], bool):
                return error_response(400, "'paused' must be true or false", "invalid_value", param="paused")
            self.service.set_gpu_paused(body["paused"])
        if "yield_to_other_apps" in body:
            if not isinstance(body["yield_to_other_apps"], bool):
                return error_response(400, "'yield_to_other_apps' must be true or false", "invalid_value",
                                      param="yield_to_other_apps")
            try:
                self.service.set_yield_to_other_apps(body["yield_to_other_apps"])
            except ValueError as exc:
                return error_response(409, str(exc), "no_gpu")
        if "given_back" in body:
            if not isinstance(body["given_back"], bool):
                return error_response(400, "'given_back' must be true or false", "invalid_value", param="given_back")
            try:
                self.service.give_gpu_back(body["given_back"])
            except ValueError as exc:
                return error_response(409, str(exc), "no_gpu")
        if "simulated_pressure_mib" in body:
            problem = PRESSURE_RULE(body["simulated_pressure_mib"])
            if problem:
                return error_response(400, f"'simulated_pressure_mib' {problem}", "invalid_value",
                                      param="simulated_pressure_mib")
            value = body["simulated_pressure_mib"]
            try:
                self.service.set_simulated_pressure(float(value))
            except ValueError as exc:
                return error_response(409, str(exc), "not_simulated")
        return JSONResponse({"gpu_paused": self.service.gpu_paused, "gpu": self.service.gpu_status()})

    async def model(self, request: Request) -> Response:
        """POST /admin/models/{name} {"loaded": true|false}: load a model's GPU
        worker now (making room as a request would), or unload the model."""
        name = request.path_params["name"]
        model_host = self.service.model_host_for(name)
        if model_host is None:
            return error_response(404, unknown_model_message(name, self._model_names()), "model_not_found")
        try:
            body = await read_json_object(request)
        except InvalidRequest as bad:
            return error_response(bad.status, bad.message, bad.code)
        loaded = body.get("loaded")
        if not isinstance(loaded, bool):
            return error_response(400, "'loaded' must be true or false", "invalid_value", param="loaded")
        if loaded:
            await self.service.ensure_started(model_host)
            self.service.preload(model_host)
        else:
            try:
                await self.service.unload_model(model_host)
            except ValueError as exc:
                return error_response(409, str(exc), "model_busy")
        return JSONResponse(model_summary(model_host), status_code=202 if loaded else 200)

    async def rescan(self, request: Request) -> Response:
        """POST /admin/library/rescan: models downloaded into the folder since the start are served now."""
        return JSONResponse(await self.service.rescan_models())

    async def restart(self, request: Request) -> Response:
        restarted = self.service.restart_workers()
        # Answered once each worker has left "ready" (the owner took the
        # command), so a status read right after the answer shows the
        # restart: the tray reads one at once, and a quick restart could
        # otherwise start and finish between two of its reads.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(worker.wait_for_state(*RESTARTING) for worker in restarted)),
                                   RESTART_BEGUN_WAIT_S)
        return JSONResponse({"restarting": True})
