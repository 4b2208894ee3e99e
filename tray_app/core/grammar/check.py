"""Structured output's grammars, checked in a child process.

A client's JSON schema or GBNF grammar is untrusted input, and llama.cpp
parses grammars natively with no depth limit: in the service that parser once
turned a 191-byte request into a segfault of the whole service. So the service
never parses one itself. `GrammarChecker` owns one child
(core/grammar/child.py) that converts and parses, one request at a time, under
a time limit (here) and a memory limit (there). A child that crashes, runs
out of memory or takes too long ends that request with a 400 and is replaced
for the next one; nothing else notices.

Verdicts are cached by what was sent: agents send the same schema with every
request, and a bomb that crashed the child once is refused from the cache
without crashing it again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..api import bounds

log = logging.getLogger(__name__)

# The child's answer carries the converted grammar, which bounds.MAX_GRAMMAR_BYTES caps.
_LINE_LIMIT = 4 * bounds.MAX_GRAMMAR_BYTES + 64 * 1024
_STARTUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Verdict:
    """A grammar the workers can use, or why not (with an error code)."""

    grammar: str | None = None
    problem: str | None = None
    code: str | None = None


class GrammarChecker:
    def __init__(self, model_path: Path, *, timeout_s: float = bounds.GRAMMAR_CHECK_TIMEOUT_S,
                 cache_size: int = 256, python: str = sys.executable) -> None:
        self._argv = [python, "-m", "tray_app.core.grammar.child", str(model_path)]
        self._timeout_s = timeout_s
        self._cache: OrderedDict[str, Verdict] = OrderedDict()
        self._cache_size = cache_size
        self._lock = asyncio.Lock()
        self._process: asyncio.subprocess.Process | None = None
        self.children_started = 0

    async def check_schema(self, schema: Any) -> Verdict:
        return await self._check({"schema": schema})

    async def check_grammar(self, grammar: str) -> Verdict:
        return await self._check({"grammar": grammar})

    async def _check(self, request: dict[str, Any]) -> Verdict:
        line = (json.dumps(request, ensure_ascii=True) + "\n").encode()
        key = hashlib.sha256(line).hexdigest()
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        async with self._lock:
            verdict, deterministic = await self._ask(line)
        if deterministic:
            self._cache[key] = verdict
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return verdict

    async def _ask(self, line: bytes, retried: bool = False) -> tuple[Verdict, bool]:
        """The child's verdict, and whether the same input would always get it."""
        started_before = self.children_started
        try:
            process = await self._ready_child()
        except (OSError, asyncio.TimeoutError, ConnectionError) as exc:
            log.error("the grammar checker could not start: %s", exc)
            return Verdict(problem="the server's grammar checker could not start; retry shortly",
                           code="grammar_checker_unavailable"), False
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(line)
            await process.stdin.drain()
            reply = await asyncio.wait_for(process.stdout.readline(), self._timeout_s)
        except asyncio.TimeoutError:
            await self._discard(process, "took longer than %.0f s" % self._timeout_s)
            return Verdict(problem=f"checking it took longer than {self._timeout_s:.0f} s; simplify it",
                           code="grammar_too_complex"), False
        except ConnectionError as exc:
            # The child was gone before this request reached it (killed from
            # outside): not this request's fault, so it gets a fresh child.
            await self._discard(process, f"was gone: {exc}")
            if retried:
                return Verdict(problem="the server's grammar checker failed; retry shortly",
                               code="grammar_checker_unavailable"), False
            return await self._ask(line, retried=True)
        except ValueError as exc:  # the answer's line is over the limit
            await self._discard(process, f"answered too much: {exc}")
            return Verdict(problem="checking it failed; simplify it", code="grammar_too_complex"), True
        if not reply:
            returncode = await self._discard(process, "exited")
            if self.children_started == started_before and not retried:
                # A child that served earlier requests may have been killed
                # from outside (the OOM killer, a user's kill) before this one
                # arrived, and a pipe can't say when: a fresh child hears it
                # once before the input is blamed and its verdict cached.
                return await self._ask(line, retried=True)
            return Verdict(problem=f"llama.cpp's grammar parser failed on it (exit {returncode}); it is probably "
                           "nested too deeply or too large: simplify it", code="grammar_too_complex"), True
        answer = json.loads(reply)
        if "grammar" in answer:
            return Verdict(grammar=answer["grammar"]), True
        return Verdict(problem=answer["problem"], code=answer["code"]), True

    async def _ready_child(self) -> asyncio.subprocess.Process:
        if self._process is not None and self._process.returncode is None:
            return self._process
        process = await asyncio.create_subprocess_exec(
            *self._argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=_LINE_LIMIT)
        self.children_started += 1
        assert process.stdout is not None
        try:
            ready = await asyncio.wait_for(process.stdout.readline(), _STARTUP_TIMEOUT_S)
        except asyncio.TimeoutError:
            await self._discard(process, "did not start in time")
            raise
        if not ready or not json.loads(ready).get("ready"):
            await self._discard(process, "exited at start")
            raise ConnectionError("the grammar checker exited at start")
        self._process = process
        return process

    async def _discard(self, process: asyncio.subprocess.Process, why: str) -> int | None:
        if process.returncode is None:
            process.kill()
        returncode = await process.wait()
        log.warning("grammar checker child %s %s (exit %s); the next check starts a new one",
                    process.pid, why, returncode)
        if self._process is process:
            self._process = None
        return returncode

    async def start(self) -> None:
        """Start the child ahead of the first structured request (optional)."""
        async with self._lock:
            await self._ready_child()

    async def close(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            if process.stdin is not None:
                process.stdin.close()
            try:
                await asyncio.wait_for(process.wait(), 2.0)
            except asyncio.TimeoutError:
                process.kill()
                await process.wait()

    @property
    def pid(self) -> int | None:
        process = self._process
        return process.pid if process is not None and process.returncode is None else None
