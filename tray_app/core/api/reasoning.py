"""Reasoning, both ways: each dialect's thinking knob in, llama-server's
controls out, and the answer's reasoning in the field each client reads.

In, every dialect's knob becomes OpenAI chat's `reasoning_effort` (or,
for an explicit budget, llama-server's own `reasoning_budget_tokens`) in
the translated body, and `apply_to_chat` turns that into what llama-server
runs, once, in the body both workers get (so a replay thinks the same):

- "none": the chat template's thinking switch off
  (`chat_template_kwargs.enable_thinking = false`), the way Qwen3-style
  templates skip the thinking;
- "minimal", "low", "medium": a thinking budget, a share of the answer's
  token limit (llama-server ends the thinking after that many tokens by
  writing the end tag), so the answer itself keeps the rest;
- "high", "xhigh": no budget.

The effort itself stays in the body: llama-server hands it to templates
that read it (gpt-oss's). Pure functions, no I/O.
"""

from __future__ import annotations

from typing import Any

from . import bounds
from .openai_request import InvalidRequest

EFFORTS = bounds.REASONING_EFFORTS
# The share of the answer's token limit the thinking may take, by effort;
# an effort not here thinks without a budget.
BUDGET_SHARE = {"minimal": 1 / 8, "low": 1 / 4, "medium": 1 / 2}
# llama-server's budget field; -1 is its "no budget".
BUDGET_FIELD = "reasoning_budget_tokens"
# Ollama's `think`: on/off, or gpt-oss's effort levels.
OLLAMA_THINK_LEVELS = ("low", "medium", "high")


def _invalid(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(400, message, "invalid_value", param)


def _effort_problem(value: Any) -> str | None:
    return None if value in EFFORTS else "must be one of " + ", ".join(repr(e) for e in EFFORTS)


def check_fields(body: dict[str, Any]) -> None:
    """The reasoning fields of an OpenAI body, checked (either kind):
    reasoning_effort, the `reasoning` object (OpenRouter's and the
    Responses API's shape), and llama-server's own budget and template
    switches. Raises InvalidRequest naming the field."""
    effort = body.get("reasoning_effort")
    if effort is not None and _effort_problem(effort):
        raise _invalid(f"'reasoning_effort' {_effort_problem(effort)}", "reasoning_effort")
    nested = body.get("reasoning")
    if nested is not None:
        if not isinstance(nested, dict):
            raise InvalidRequest(400, "'reasoning' must be an object such as {\"effort\": \"low\"}", "invalid_type",
                                 "reasoning")
        if nested.get("effort") is not None and _effort_problem(nested["effort"]):
            raise _invalid(f"'reasoning.effort' {_effort_problem(nested['effort'])}", "reasoning.effort")
        if effort is not None and nested.get("effort") not in (None, effort):
            raise _invalid("'reasoning_effort' and 'reasoning.effort' disagree; send one", "reasoning.effort")
        budget = nested.get("max_tokens")
        if budget is not None and _budget_problem(budget):
            raise _invalid(f"'reasoning.max_tokens' {_budget_problem(budget)}", "reasoning.max_tokens")
        if nested.get("enabled") is not None and not isinstance(nested["enabled"], bool):
            raise InvalidRequest(400, "'reasoning.enabled' must be true or false", "invalid_type", "reasoning.enabled")
    if body.get(BUDGET_FIELD) is not None and bounds.REASONING_BUDGET.problem(body[BUDGET_FIELD]):
        raise _invalid(f"'{BUDGET_FIELD}' must be a whole number of thinking tokens, or -1 for no budget",
                       BUDGET_FIELD)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise InvalidRequest(400, "'chat_template_kwargs' must be an object", "invalid_type",
                                 "chat_template_kwargs")
        if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
            raise InvalidRequest(400, "'chat_template_kwargs.enable_thinking' must be true or false", "invalid_type",
                                 "chat_template_kwargs.enable_thinking")


# A budget a client names (Anthropic's budget_tokens, OpenRouter's reasoning.max_tokens).
_NAMED_BUDGET = bounds.REASONING_BUDGET._replace(low=1)


def _budget_problem(value: Any) -> str | None:
    return "must be a whole number of thinking tokens, at least 1" if _NAMED_BUDGET.problem(value) else None


def apply_to_chat(body: dict[str, Any], answer_limit: int) -> None:
    """A checked chat body's reasoning knobs as llama-server's controls, in
    place. `answer_limit` is the answer's token limit, which an effort's
    budget is a share of. What the client set itself in llama-server's
    own fields wins."""
    nested = body.pop("reasoning", None) or {}
    effort = body.get("reasoning_effort") or nested.get("effort")
    if nested.get("enabled") is False:
        effort = "none"
    if effort is not None:
        body["reasoning_effort"] = effort
    kwargs = body.get("chat_template_kwargs")
    kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
    if effort == "none":
        kwargs.setdefault("enable_thinking", False)
    elif nested.get("enabled") is True:
        kwargs.setdefault("enable_thinking", True)
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    if BUDGET_FIELD in body:
        return
    if nested.get("max_tokens") is not None:
        body[BUDGET_FIELD] = nested["max_tokens"]
    elif effort in BUDGET_SHARE:
        body[BUDGET_FIELD] = max(1, int(answer_limit * BUDGET_SHARE[effort]))


# ----- each dialect's knob, as OpenAI chat's ---------------------------------------------------


def from_ollama_think(think: Any, out: dict[str, Any]) -> None:
    """Ollama's `think`: true, false, or "low" / "medium" / "high"."""
    if think is None:
        return
    if think is True:
        out["chat_template_kwargs"] = {"enable_thinking": True}
    elif think is False:
        out["reasoning_effort"] = "none"
    elif think in OLLAMA_THINK_LEVELS:
        out["reasoning_effort"] = think
    else:
        raise _invalid("'think' must be true, false, \"low\", \"medium\" or \"high\"", "think")


def from_anthropic_thinking(thinking: Any, out: dict[str, Any]) -> None:
    """Anthropic's `thinking`: {"type": "enabled", "budget_tokens": N},
    {"type": "adaptive"} (the model decides: no budget) or {"type": "disabled"}."""
    if thinking is None:
        return
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        out["reasoning_effort"] = "none"
        return
    if kind not in ("enabled", "adaptive"):
        raise _invalid("thinking: must be {\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": \"adaptive\"} "
                       "or {\"type\": \"disabled\"}", "thinking")
    out["chat_template_kwargs"] = {"enable_thinking": True}
    budget = thinking.get("budget_tokens")
    if kind == "enabled":
        if _budget_problem(budget):
            raise _invalid(f"thinking.budget_tokens: {_budget_problem(budget)}", "thinking.budget_tokens")
        out[BUDGET_FIELD] = budget


# ----- the answer's field on OpenAI chat -------------------------------------------------------


def in_field(message: dict[str, Any], field: str) -> None:
    """A message or stream delta with its `reasoning_content` (llama-server's
    field) where [server] reasoning_field says, in place."""
    if field == "reasoning_content" or "reasoning_content" not in message:
        return
    text = message["reasoning_content"] if field == "both" else message.pop("reasoning_content")
    message["reasoning"] = text

