"""Structured output that stops normally is valid JSON: a property test on
the real service and model, many seeds over schemas with free-text strings,
the newline and tab tokens pushed up so that the model tries to put them raw
into strings (where JSON forbids them)."""

from __future__ import annotations

import concurrent.futures
import json

import pytest

from tests.harness import BASE_CONFIG, running

pytestmark = pytest.mark.integration

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "story": {"type": "string"}},
     "required": ["name", "story"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}}, "required": ["items"]},
    {"type": "object", "properties": {"title": {"type": "string"}, "lines": {"type": "array", "items": {"type": "string"}},
                                      "n": {"type": "integer"}}, "required": ["title", "lines", "n"]},
]
PROMPTS = ["Write a poem of several lines as JSON.", "List some code snippets, with their newlines, as JSON.",
           "Give a recipe as JSON, one step per line."]
SEEDS = 12


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with running(tmp_path_factory.mktemp("structured"), BASE_CONFIG) as service:
        yield service


def test_every_answer_that_stops_normally_parses(service):
    whitespace = [t for text in ("\n", "\t") for t in service.http.post("/tokenize", json={"content": text}).json()["tokens"]]

    def ask(case: tuple[int, int]) -> tuple[str, str]:
        seed, index = case
        answer = service.http.post("/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": PROMPTS[index]}], "max_tokens": 160, "temperature": 1.0,
            "seed": seed, "logit_bias": {str(t): 3 for t in whitespace},
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMAS[index]}}})
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        return choice["finish_reason"], choice["message"]["content"]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, [(seed, index) for seed in range(SEEDS) for index in range(len(SCHEMAS))]))
    stopped = [content for finish, content in answers if finish == "stop"]
    invalid = []
    for content in stopped:
        try:
            json.loads(content)
        except ValueError as error:
            invalid.append((content[:100], str(error)))
    print(f"{len(stopped)} of {len(answers)} answers stopped normally; {len(invalid)} did not parse")
    assert len(stopped) >= len(answers) // 2 and invalid == []
