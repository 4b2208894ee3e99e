"""The service's OpenAPI 3.0 description, served at GET /openapi.json.

Written by hand because the service is plain Starlette, except the bounds of
the checked request fields, which come from bounds.py like the validator's
rules; the fuzz test (schemathesis) holds every response to it, so it can't
drift silently.
"""

from __future__ import annotations

from typing import Any

from .bounds import COMPLETION_LOGPROBS, SAMPLING, TOKENS, TOP_LOGPROBS, request_properties

ERROR = {"$ref": "#/components/schemas/Error"}
ERROR_RESPONSE = {"description": "an error in the OpenAI envelope",
                  "content": {"application/json": {"schema": ERROR}}}


LLAMACPP_ERROR_RESPONSE = {"description": "an error in llama-server's envelope",
                           "content": {"application/json": {"schema": {"$ref": "#/components/schemas/LlamaCppError"}}}}


def _errors(*codes: int, response: dict[str, Any] = ERROR_RESPONSE) -> dict[str, Any]:
    return {str(code): response for code in codes}


def _object(*required: str) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": {"type": "object", "required": list(required)}}}}


def _llamacpp_paths(sampling: dict[str, Any], messages: dict[str, Any], json_or_sse: dict[str, Any],
                    max_tokens: int) -> dict[str, Any]:
    """llama-server's own routes (api/llamacpp.py), in its field names and error envelope."""
    errors = _errors(400, 401, 403, 404, 408, 409, 413, 415, 422, 431, response=LLAMACPP_ERROR_RESPONSE)
    token_ids = {"type": "array", "items": {"type": "integer", "minimum": 0}}

    def post(operation: str, required: str, properties: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
        return {"post": {"operationId": operation, "requestBody": {"required": True, "content": {
            "application/json": {"schema": {"type": "object", "required": [required], "properties": properties}}}},
            "responses": {"200": answer, **errors}}}

    return {
        "/completion": post("llamaCppCompletion", "prompt", {
            "prompt": {"anyOf": [{"type": "string", "minLength": 1}, {**token_ids, "minItems": 1}]},
            "n_predict": {"type": "integer", "minimum": -1, "maximum": max_tokens},
            "cache_prompt": {"type": "boolean"}, **sampling},
            {"description": "an answer in llama-server's shape, or its SSE stream", "content": json_or_sse}),
        "/tokenize": post("llamaCppTokenize", "content", {
            "content": {"type": "string"}, "add_special": {"type": "boolean"}, "parse_special": {"type": "boolean"},
            "with_pieces": {"type": "boolean"}}, {"description": "the tokens", **_object("tokens")}),
        "/detokenize": post("llamaCppDetokenize", "tokens", {"tokens": token_ids},
                            {"description": "the text", **_object("content")}),
        "/apply-template": post("llamaCppApplyTemplate", "messages", {"messages": messages},
                                {"description": "the prompt", **_object("prompt")}),
        "/props": {"get": {"operationId": "llamaCppProps", "responses": {
            "200": {"description": "what this server is",
                    **_object("default_generation_settings", "total_slots", "chat_template", "modalities")},
            **_errors(401, 403, 404, response=LLAMACPP_ERROR_RESPONSE)}}},
    }


def build_openapi(max_tokens: int, max_messages: int) -> dict[str, Any]:
    sampling = {
        "model": {"type": "string"},
        "stream": {"type": "boolean"},
        # The bounds the service checks, from the table its validator is built from.
        **request_properties(max_tokens),
    }
    completion_errors = _errors(400, 401, 403, 404, 408, 409, 413, 415, 422, 431)
    json_or_sse = {
        "application/json": {"schema": {"type": "object"}},
        # Each event is a completion chunk object, then the literal [DONE].
        "text/event-stream": {},
    }
    messages = {"type": "array", "minItems": 1, "maxItems": max_messages, "items": {
        "type": "object", "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": ["system", "user", "assistant"]},
            "content": {"anyOf": [
                {"type": "string"},
                {"type": "array", "maxItems": 8, "items": {
                    "type": "object", "required": ["type", "text"],
                    "properties": {"type": {"type": "string", "enum": ["text"]},
                                   "text": {"type": "string"}}}},
            ]},
        }}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "tray-app", "version": "1",
                 "description": "OpenAI-compatible API in front of a GPU and a CPU llama.cpp worker."},
        "paths": {
            "/health": {"get": {"operationId": "health", "responses": {
                "200": {"description": "a path can serve", "content": {"application/json": {"schema": {"type": "object"}}}},
                "503": {"description": "no path can serve", "content": {"application/json": {"schema": {"type": "object"}}}},
            }}},
            "/status": {"get": {"operationId": "status", "responses": {
                "200": {"description": "service status", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["workers", "gpu", "ram", "breaker", "queues", "degraded", "requests"]}}}},
                **_errors(401, 403)}}},
            "/v1/models": {"get": {"operationId": "listModels", "responses": {
                "200": {"description": "models", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["object", "data"]}}}},
                **_errors(401, 403)}}},
            "/v1/chat/completions": {"post": {
                "operationId": "createChatCompletion",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["messages"],
                    "properties": {
                        "messages": messages,
                        **sampling,
                        "logprobs": {"type": "boolean"},
                        "top_logprobs": TOP_LOGPROBS.schema(),
                        "tool_choice": {"type": "string", "enum": ["none", "auto", "required"]},
                    }}}}},
                "responses": {"200": {"description": "a completion, or an SSE stream", "content": json_or_sse},
                              **completion_errors},
            }},
            "/v1/completions": {"post": {
                "operationId": "createCompletion",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["prompt"],
                    "properties": {"prompt": {"type": "string", "minLength": 1}, **sampling,
                                   "logprobs": COMPLETION_LOGPROBS.schema()}}}}},
                "responses": {"200": {"description": "a completion, or an SSE stream", "content": json_or_sse},
                              **completion_errors},
            }},
            "/v1/responses": {"post": {
                "operationId": "createResponse",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["input"],
                    "properties": {
                        "model": {"type": "string"},
                        "input": {"anyOf": [
                            {"type": "string"},
                            {"type": "array", "minItems": 1, "maxItems": max_messages, "items": {
                                "type": "object", "required": ["role", "content"],
                                "properties": {
                                    "type": {"type": "string", "enum": ["message"]},
                                    "role": {"type": "string", "enum": ["user", "assistant", "system", "developer"]},
                                    "content": {"type": "string"},
                                }}},
                        ]},
                        "instructions": {"type": "string"},
                        "max_output_tokens": TOKENS._replace(high=max_tokens).schema(),
                        "temperature": SAMPLING["temperature"].schema(),
                        "top_p": SAMPLING["top_p"].schema(),
                        "stream": {"type": "boolean"},
                        "store": {"type": "boolean"},
                        "previous_response_id": {"type": "string"},
                        "truncation": {"type": "string", "enum": ["auto", "disabled"]},
                        "tool_choice": {"type": "string", "enum": ["none", "auto", "required"]},
                    }}}}},
                # The JSON answer is a Response object; the stream is its named events.
                "responses": {"200": {"description": "a Response object, or an SSE stream of its events",
                                      "content": json_or_sse,
                                      # So the fuzzer's stateful phase reads and deletes real stored ones.
                                      "links": {name: {"operationId": operation,
                                                       "parameters": {"response_id": "$response.body#/id"}}
                                                for name, operation in (("GetResponse", "getResponse"),
                                                                        ("DeleteResponse", "deleteResponse"))}},
                              **completion_errors},
            }},
            "/v1/responses/{response_id}": {
                "parameters": [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "get": {"operationId": "getResponse", "responses": {
                    "200": {"description": "a stored Response object", "content": {"application/json": {"schema": {
                        "type": "object", "required": ["id", "object", "status", "output"]}}}},
                    **_errors(401, 403, 404)}},
                "delete": {"operationId": "deleteResponse", "responses": {
                    "200": {"description": "deleted", "content": {"application/json": {"schema": {
                        "type": "object", "required": ["id", "deleted"]}}}},
                    **_errors(401, 403, 404)}},
            },
            "/v1/requests/{request_id}": {"delete": {
                "operationId": "cancelRequest",
                "parameters": [{"name": "request_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "canceled", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["id", "canceled"]}}}}, **_errors(401, 403, 404)},
            }},
            **_llamacpp_paths(sampling, messages, json_or_sse, max_tokens),
        },
        "components": {"schemas": {"Error": {
            "type": "object", "required": ["error"],
            "properties": {"error": {
                "type": "object", "required": ["message", "type", "code"],
                "properties": {
                    "message": {"type": "string", "minLength": 1},
                    "type": {"type": "string"},
                    "param": {"type": "string", "nullable": True},
                    "code": {"type": "string"},
                }}},
        }, "LlamaCppError": {
            "type": "object", "required": ["error"],
            "properties": {"error": {
                "type": "object", "required": ["code", "message", "type"],
                "properties": {
                    "code": {"type": "integer"},
                    "message": {"type": "string", "minLength": 1},
                    "type": {"type": "string"},
                    "param": {"type": "string"},
                }}},
        }}},
    }
