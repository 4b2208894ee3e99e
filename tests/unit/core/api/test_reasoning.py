"""Reasoning knobs in every dialect, mapped onto llama-server's controls,
and the answer's reasoning in the field each client reads: pure functions
with plain values (issue 30, part 3)."""

from __future__ import annotations

import json

import pytest

from tray_app.core.api.anthropic import translate_messages
from tray_app.core.api.ollama import OllamaChat
from tray_app.core.api.openai_request import InvalidRequest
from tray_app.core.api.protocol import Protocol
from tray_app.core.api.requests import ModelNames, validate
from tray_app.core.api.responses import translate_request
from tray_app.core.config import ConfigError, parse_config_text
from tray_app.core.dispatch.upstream import AttemptShaping, shape_event
from tray_app.core.dispatch.jobs import Job, JobKind, JobRequest

CONTEXT = 2048
NAMES = ModelNames("m", frozenset({"m"}), frozenset({"m", "m:latest"}))
HI = [{"role": "user", "content": "hi"}]


def checked(body: dict, kind: JobKind = JobKind.CHAT) -> dict:
    """A chat body as validation leaves it for the workers."""
    body = {"messages": [dict(m) for m in HI], **body}
    validate(body, kind, NAMES, CONTEXT)
    return body


def worker_controls(body: dict) -> dict:
    return {k: body[k] for k in ("reasoning_effort", "reasoning_budget_tokens", "chat_template_kwargs") if k in body}


@pytest.mark.parametrize("knob, controls", [
    ({"reasoning_effort": "none"}, {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": False}}),
    ({"reasoning_effort": "minimal"}, {"reasoning_effort": "minimal", "reasoning_budget_tokens": 50}),
    ({"reasoning_effort": "low"}, {"reasoning_effort": "low", "reasoning_budget_tokens": 100}),
    ({"reasoning_effort": "medium"}, {"reasoning_effort": "medium", "reasoning_budget_tokens": 200}),
    ({"reasoning_effort": "high"}, {"reasoning_effort": "high"}),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, {"reasoning_effort": "low", "reasoning_budget_tokens": 100}),
    ({"reasoning": {"enabled": False}}, {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": False}}),
    ({"reasoning": {"max_tokens": 30}}, {"reasoning_budget_tokens": 30}),
    # llama-server's own fields, sent by a client that knows them, win.
    ({"reasoning_effort": "low", "reasoning_budget_tokens": 7}, {"reasoning_effort": "low", "reasoning_budget_tokens": 7}),
    ({}, {}),
])
def test_openai_efforts_become_llama_servers_switch_and_budget(knob, controls):
    body = checked({"max_tokens": 400, **knob})
    assert worker_controls(body) == controls
    assert "reasoning" not in body  # not llama-server's field


def test_a_budget_without_a_limit_is_a_share_of_the_context():
    assert checked({"reasoning_effort": "low"})["reasoning_budget_tokens"] == CONTEXT // 4


def test_the_mapping_is_the_same_when_the_body_is_checked_again():
    """count_tokens and apply-template check a body too: a second pass must not change it."""
    body = checked({"max_tokens": 400, "reasoning": {"effort": "medium"}})
    again = json.loads(json.dumps(body))
    validate(again, JobKind.CHAT, NAMES, CONTEXT)
    assert again == body


@pytest.mark.parametrize("knob, param", [
    ({"reasoning_effort": "maximum"}, "reasoning_effort"),
    ({"reasoning_effort": 3}, "reasoning_effort"),
    ({"reasoning": "high"}, "reasoning"),
    ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
    ({"reasoning_effort": "low", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"reasoning": {"max_tokens": 0}}, "reasoning.max_tokens"),
    ({"reasoning": {"enabled": "yes"}}, "reasoning.enabled"),
    ({"reasoning_budget_tokens": -2}, "reasoning_budget_tokens"),
    ({"reasoning_budget_tokens": 1.5}, "reasoning_budget_tokens"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": "false"}}, "chat_template_kwargs.enable_thinking"),
])
def test_a_bad_reasoning_knob_is_a_400_naming_it(knob, param):
    with pytest.raises(InvalidRequest) as refused:
        checked(knob)
    assert refused.value.status == 400 and refused.value.param == param


@pytest.mark.parametrize("think, controls", [
    (False, {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": False}}),
    (True, {"chat_template_kwargs": {"enable_thinking": True}}),
    ("low", {"reasoning_effort": "low", "reasoning_budget_tokens": 10}),
    ("high", {"reasoning_effort": "high"}),
    (None, {}),
])
def test_ollamas_think_maps_onto_the_same_controls(think, controls):
    body = OllamaChat(CONTEXT).translate({"model": "m", "messages": HI, "think": think,
                                          "options": {"num_predict": 40}}, JobKind.CHAT).body
    validate(body, JobKind.CHAT, NAMES, CONTEXT)
    assert worker_controls(body) == controls


@pytest.mark.parametrize("think", ["max", 1, {"level": "low"}])
def test_ollamas_think_refuses_other_values(think):
    with pytest.raises(InvalidRequest) as refused:
        OllamaChat(CONTEXT).translate({"model": "m", "messages": HI, "think": think}, JobKind.CHAT)
    assert refused.value.param == "think"


@pytest.mark.parametrize("thinking, controls", [
    ({"type": "enabled", "budget_tokens": 1024},
     {"chat_template_kwargs": {"enable_thinking": True}, "reasoning_budget_tokens": 1024}),
    ({"type": "adaptive"}, {"chat_template_kwargs": {"enable_thinking": True}}),
    ({"type": "disabled"}, {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": False}}),
])
def test_anthropics_thinking_maps_onto_the_same_controls(thinking, controls):
    body = translate_messages({"model": "m", "max_tokens": 2000, "messages": HI, "thinking": thinking}, CONTEXT)
    validate(body, JobKind.CHAT, NAMES, CONTEXT)
    assert worker_controls(body) == controls


@pytest.mark.parametrize("thinking, param", [
    ({"type": "enabled"}, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": 0}, "thinking.budget_tokens"),
    ({"type": "on"}, "thinking"),
    (True, "thinking"),
])
def test_anthropics_bad_thinking_is_a_400_naming_it(thinking, param):
    with pytest.raises(InvalidRequest) as refused:
        translate_messages({"model": "m", "max_tokens": 20, "messages": HI, "thinking": thinking}, CONTEXT)
    assert refused.value.param == param


def test_the_responses_apis_reasoning_effort_maps_like_chats():
    body, _ = translate_request({"input": "hi", "max_output_tokens": 80, "reasoning": {"effort": "low",
                                                                                     "summary": "auto"}}, CONTEXT, [])
    validate(body, JobKind.CHAT, NAMES, CONTEXT)
    assert worker_controls(body) == {"reasoning_effort": "low", "reasoning_budget_tokens": 20}


# ----- the answer's field -----------------------------------------------------------------------


def openai_protocol(field: str) -> Protocol:
    protocol = Protocol()
    protocol.reasoning_field = field
    return protocol


@pytest.mark.parametrize("field, expected", [
    ("reasoning_content", {"reasoning_content": "hmm"}),
    ("reasoning", {"reasoning": "hmm"}),
    ("both", {"reasoning_content": "hmm", "reasoning": "hmm"}),
])
def test_openai_chat_answers_in_the_configured_field(field, expected):
    protocol = openai_protocol(field)
    answer = protocol.answer({"choices": [{"message": {"role": "assistant", "content": "ok",
                                                       "reasoning_content": "hmm"}}]}, None)
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "ok", **expected}
    framed = protocol.encoder(None).event({"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]})
    assert json.loads(framed.decode().removeprefix("data: "))["choices"][0]["delta"] == expected


def test_an_upstreams_reasoning_field_reaches_every_sink_as_reasoning_content():
    """A peer configured with reasoning_field = "reasoning" (or vLLM) streams
    `reasoning`; the sinks read llama-server's name."""
    event = {"choices": [{"index": 0, "delta": {"reasoning": "hmm"}}]}
    job = Job(JobRequest(id="r1", kind=JobKind.CHAT, body={}, stream=True))
    assert shape_event(event, job, AttemptShaping(), model="m", fingerprint="f") is True
    assert event["choices"][0]["delta"] == {"reasoning_content": "hmm"}


def test_the_reasoning_field_setting_takes_only_its_three_values():
    assert parse_config_text('[server]\nreasoning_field = "both"\n').server.reasoning_field == "both"
    with pytest.raises(ConfigError, match="reasoning_field"):
        parse_config_text('[server]\nreasoning_field = "thoughts"\n')
