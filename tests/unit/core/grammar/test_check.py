"""The grammar checker's child process (core/grammar/check.py): the real
child with llama.cpp's parser on the bundled model's vocabulary, and stand-in
children that crash or hang, so that what a crash does to a request is shown
with a real dead process."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tray_app.core.api import bounds
from tray_app.core.config import bundled_model_path
from tray_app.core.engine.worker import pid_alive
from tray_app.core.grammar.check import GrammarChecker

MODEL = bundled_model_path()


def stand_in_child(tmp_path: Path, behaviour: str) -> str:
    """A 'python' for the checker's argv that starts, says ready, then on its
    first request does `behaviour` (Python code)."""
    code = tmp_path / "child.py"
    code.write_text("import json, os, sys, time\n"
                    "print(json.dumps({'ready': True}), flush=True)\n"
                    "sys.stdin.readline()\n" + behaviour + "\n")
    script = tmp_path / "child.sh"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} {code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


async def test_a_valid_schema_becomes_a_grammar_and_is_cached():
    checker = GrammarChecker(MODEL)
    try:
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        verdict = await checker.check_schema(schema)
        assert verdict.problem is None and "root ::=" in verdict.grammar
        assert (await checker.check_schema(schema)) == verdict
        assert checker.children_started == 1
    finally:
        await checker.close()


async def test_llama_cpps_own_parse_error_is_told():
    checker = GrammarChecker(MODEL)
    try:
        verdict = await checker.check_grammar("root ::= undefined-rule")
        assert verdict.code == "invalid_grammar" and verdict.grammar is None
        assert "undefined-rule" in verdict.problem  # llama.cpp's own words
        verdict = await checker.check_grammar('root ::= "a" (')
        assert verdict.code == "invalid_grammar"
        # The same child goes on serving.
        assert (await checker.check_grammar('root ::= "yes" | "no"')).grammar is not None
        assert checker.children_started == 1
    finally:
        await checker.close()


async def test_the_deepest_grammar_the_bounds_admit_parses_on_the_childs_small_stack():
    checker = GrammarChecker(MODEL)
    try:
        depth = bounds.MAX_GRAMMAR_NESTING
        verdict = await checker.check_grammar("root ::= " + "(" * depth + '"a"' + ")" * depth)
        assert verdict.grammar is not None, verdict.problem
        verdict = await checker.check_schema({"type": "string", "maxLength": bounds.MAX_SCHEMA_COUNT})
        assert verdict.grammar is not None, verdict.problem
    finally:
        await checker.close()


def test_llama_cpps_parser_really_crashes_on_a_deep_grammar():
    """Why the parse runs in a child: the same parser, given a grammar 50
    times deeper than the bound, kills its process (upstream #26600)."""
    depth = 50 * bounds.MAX_GRAMMAR_NESTING
    code = ("import sys\nfrom tray_app.core.grammar.child import Checker\n"
            f"Checker(sys.argv[1])._parse('root ::= ' + '(' * {depth} + '\"a\"' + ')' * {depth})\n")
    result = subprocess.run([sys.executable, "-c", code, str(MODEL)], capture_output=True, timeout=120)
    assert result.returncode == -signal.SIGSEGV, result.stderr[-2000:]


async def test_a_child_that_crashes_is_a_refusal_and_is_replaced(tmp_path):
    checker = GrammarChecker(MODEL, python=stand_in_child(tmp_path, "os.abort()"))
    try:
        verdict = await checker.check_grammar('root ::= "a"')
        assert verdict.grammar is None and verdict.code == "grammar_too_complex"
        assert "failed on it" in verdict.problem
        # Cached: the same input doesn't crash a child again.
        assert (await checker.check_grammar('root ::= "a"')) == verdict
        assert checker.children_started == 1
        await checker.check_grammar('root ::= "b"')
        assert checker.children_started == 2
    finally:
        await checker.close()


async def test_a_child_that_hangs_is_killed_at_the_deadline(tmp_path):
    # The child never answers, so the verdict is the same at any deadline: a short one keeps the test quick.
    checker = GrammarChecker(MODEL, timeout_s=0.25, python=stand_in_child(tmp_path, "time.sleep(600)"))
    try:
        first = await checker.check_grammar('root ::= "a"')
        pid_before = checker.pid
        assert first.code == "grammar_too_complex" and "checking it took longer than" in first.problem
        assert pid_before is None  # the hung child was killed and forgotten
        # Not cached (a busy machine can be slow): asked again, a new child.
        await checker.check_grammar('root ::= "a"')
        assert checker.children_started == 2
    finally:
        await checker.close()


async def test_a_child_killed_between_requests_costs_no_request_anything():
    checker = GrammarChecker(MODEL)
    try:
        await checker.start()
        pid = checker.pid
        os.kill(pid, signal.SIGKILL)
        while pid_alive(pid):
            await asyncio.sleep(0.01)
        verdict = await checker.check_grammar('root ::= "ok"')
        assert verdict.grammar is not None
        assert checker.children_started == 2
    finally:
        await checker.close()


async def test_a_child_that_dies_after_serving_is_not_the_next_inputs_fault(tmp_path):
    """A warm child that dies on a request may have been killed before it
    arrived (the pipe can't tell): the input gets one fresh child before it is
    blamed. The stand-in answers its first request, then dies on the next,
    as a child killed between requests looks from here."""
    answer = "print(json.dumps({'grammar': 'root ::= \"a\"'}), flush=True)"
    checker = GrammarChecker(MODEL, python=stand_in_child(tmp_path, answer + "\nsys.stdin.readline()\nos._exit(1)"))
    try:
        assert (await checker.check_grammar('root ::= "a"')).grammar is not None
        verdict = await checker.check_grammar('root ::= "b"')
        assert verdict.grammar is not None, verdict
        assert checker.children_started == 2
    finally:
        await checker.close()


async def test_close_ends_the_child():
    checker = GrammarChecker(MODEL)
    await checker.start()
    pid = checker.pid
    await checker.close()
    assert checker.pid is None and not pid_alive(pid)


async def test_a_schemas_strings_hold_no_raw_control_characters():
    """llama-cpp-python's converter let a string hold a raw newline or tab:
    an answer that ended normally and json.loads refused. The grammar the
    real child returns has llama.cpp's own character class, which llama.cpp
    parsed (the child parses every grammar it returns)."""
    checker = GrammarChecker(MODEL)
    try:
        schema = {"type": "object", "properties": {"text": {"type": "string"},
                                                   "lines": {"type": "array", "items": {"type": "string"}}}}
        verdict = await checker.check_schema(schema)
        char_rules = [line for line in verdict.grammar.splitlines() if line.startswith("char")]
        assert char_rules and all(r'[^"\\\x7F\x00-\x1F]' in rule for rule in char_rules), char_rules
    finally:
        await checker.close()
