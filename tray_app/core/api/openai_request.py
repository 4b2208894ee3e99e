"""What OpenAI clients send, turned into what a llama.cpp worker can run.

Pure functions over the request body: no I/O, no service state. The router
calls them after its field checks and before it counts the prompt, so the
worker, the token counter and admission all see the same request.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf


class InvalidRequest(Exception):
    """A request the client must change; answered in the OpenAI error envelope."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})
TEXT_PART_TYPES = frozenset({"text", "input_text", "refusal"})


def flatten_content(messages: list[dict[str, Any]], model_name: str) -> None:
    """Every message's content as one string, in place.

    The OpenAI chat API allows a string, a list of typed parts, or null (an
    assistant turn that only called tools). Chat templates and the worker
    take a string, so text parts are joined with newlines, the way
    llama.cpp's server joins them for templates without typed content.
    """
    for index, message in enumerate(messages):
        content = message.get("content")
        if content is None:
            message["content"] = ""
        elif isinstance(content, list):
            message["content"] = "\n".join(_part_text(index, number, part, model_name)
                                           for number, part in enumerate(content))


def _part_text(index: int, number: int, part: Any, model_name: str) -> str:
    where = f"messages[{index}].content[{number}]"
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise InvalidRequest(400, f"{where} must be an object with a string 'type'", "invalid_type", where)
    kind = part["type"]
    if kind in IMAGE_PART_TYPES:
        raise InvalidRequest(400, f"{where} is an image, but the model {model_name} has no vision: it reads text "
                             "only. Send the text, or use a vision model.", "model_has_no_vision", where)
    if kind not in TEXT_PART_TYPES:
        raise InvalidRequest(400, f"{where} has type {kind!r}; this server reads text parts only "
                             "(types 'text', 'input_text', 'refusal')", "unsupported_content_part", where)
    text = part.get("refusal" if kind == "refusal" else "text")
    if not isinstance(text, str):
        raise InvalidRequest(400, f"{where} of type {kind!r} needs a string "
                             f"'{'refusal' if kind == 'refusal' else 'text'}'", "invalid_type", where)
    return text


def constrain_output(body: dict[str, Any], grammar_problem: Callable[[str], str | None]) -> None:
    """Turn response_format into the GBNF grammar the worker constrains
    decoding with, in place, and check that llama.cpp can parse it.

    A grammar llama.cpp can't parse used to reach the worker, whose server
    then crashed on it; now it is a 400 before anything runs. Both workers
    get the same grammar string, so a replay is constrained the same way.
    """
    response_format = body.pop("response_format", None)
    grammar = body.get("grammar")
    if response_format is not None:
        converted = _grammar_for(response_format)
        if converted is not None and grammar is not None:
            raise InvalidRequest(400, "send either 'response_format' or 'grammar', not both", "invalid_value",
                                 "response_format")
        grammar = converted if converted is not None else grammar
    if grammar is None:
        body.pop("grammar", None)
        return
    if not isinstance(grammar, str) or not grammar.strip():
        raise InvalidRequest(400, "'grammar' must be a non-empty GBNF string", "invalid_value", "grammar")
    problem = grammar_problem(grammar)
    if problem is not None:
        param = "response_format" if response_format is not None else "grammar"
        raise InvalidRequest(400, f"the {param} can't be used to constrain the output: {problem}",
                             "invalid_grammar", param)
    body["grammar"] = grammar


def force_named_tool(body: dict[str, Any], grammar_problem: Callable[[str], str | None]) -> str | None:
    """OpenAI's named tool_choice, {"type": "function", "function": {"name": F}},
    forces a call of F. llama-server does not take that form, and a template
    without tool calling (SmolLM2's) can't ask for it, so the router does it
    the same way on every engine: the answer is constrained to F's
    parameters (a grammar from their JSON schema), and the backend turns it
    into F's tool call. Returns F, or None for any other tool_choice.
    """
    choice = body.get("tool_choice")
    if not isinstance(choice, dict):
        if choice is not None and choice not in ("none", "auto", "required"):
            raise InvalidRequest(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                                 "{\"type\": \"function\", \"function\": {\"name\": ...}}", "invalid_value",
                                 "tool_choice")
        return None
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str) or not name:
        raise InvalidRequest(400, "'tool_choice' as an object must be {\"type\": \"function\", "
                             "\"function\": {\"name\": ...}}", "invalid_value", "tool_choice")
    tools = body.get("tools") or []
    declared = next((t.get("function") for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)
                     and t["function"].get("name") == name), None)
    if declared is None:
        raise InvalidRequest(400, f"'tool_choice' names {name!r}, which is not in 'tools'", "invalid_value",
                             "tool_choice")
    if body.get("grammar") is not None:
        raise InvalidRequest(400, "a named 'tool_choice' already constrains the answer; drop 'response_format' "
                             "or 'grammar'", "invalid_value", "tool_choice")
    parameters = declared.get("parameters", {"type": "object"})
    grammar = _schema_grammar(parameters, "tools.function.parameters")
    problem = grammar_problem(grammar)
    if problem is not None:
        raise InvalidRequest(400, f"the parameters of {name!r} can't constrain the output: {problem}",
                             "invalid_json_schema", "tools.function.parameters")
    body["grammar"] = grammar
    # The tools stay in the request (a template that shows tools shows them);
    # "none": the worker must not parse the constrained answer as a call itself.
    body["tool_choice"] = "none"
    return name


def _grammar_for(response_format: Any) -> str | None:
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise InvalidRequest(400, "'response_format' must be an object with a 'type'", "invalid_value",
                             "response_format")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
        return JSON_GBNF if schema is None else _schema_grammar(schema, "response_format.schema")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise InvalidRequest(400, "'response_format.json_schema' must be an object with a 'schema' object",
                                 "invalid_value", "response_format.json_schema")
        return _schema_grammar(spec["schema"], "response_format.json_schema.schema")
    raise InvalidRequest(400, f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'",
                         "invalid_value", "response_format.type")


def _schema_grammar(schema: Any, param: str) -> str:
    try:
        return json_schema_to_gbnf(json.dumps(schema))
    except Exception as exc:  # the converter asserts and raises on what it can't express
        detail = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        raise InvalidRequest(400, f"the JSON schema can't be turned into a grammar: {detail}",
                             "invalid_json_schema", param) from None
