"""The grammar checker's child process: turns a client's JSON schema into a
GBNF grammar and has llama.cpp parse it, away from the service.

llama.cpp's grammar parser is native code that recurses without a depth limit
(upstream #26600); in the service a crafted grammar was a segfault that took
every request and the tray with it. Here a crash, a runaway allocation or a
hang ends this process only, and the parent (core/grammar/check.py) answers
the request with a 400 and starts a new child.

Protocol, one JSON object per line: the parent sends {"schema": ...} or
{"grammar": "..."}; the child answers {"grammar": "..."} when llama.cpp can use
it, or {"problem": "...", "code": "..."}. The first line it writes is
{"ready": true}.

    python -m tray_app.core.grammar.child MODEL.gguf
"""

from __future__ import annotations

import json
import os
import re
import resource
import sys
import tempfile
import threading
from typing import Any

from ..api import bounds
from ..api.grammar_bounds import grammar_problem, schema_problem
from ..catalog.vocab_model import vocab_only_model


# llama-cpp-python's converter lets a JSON string hold any character but a
# quote and a backslash, raw control characters included: the model can end
# normally with an answer json.loads refuses ("Invalid control character").
# llama.cpp's own converter (common/json-schema-to-grammar.cpp, what
# llama-server uses) excludes them, and DEL; its rule replaces the other.
_LOOSE_CHAR_RULE = re.compile(r'^(char(?:-[0-9]+)?) ::= \[\^"\\\\\] \| ', re.MULTILINE)
_STRICT_CHAR = r'[^"\\\x7F\x00-\x1F] | '


def strict_json_strings(grammar: str) -> str:
    """The converter's grammar with its string characters as JSON allows them."""
    return _LOOSE_CHAR_RULE.sub(lambda match: f"{match.group(1)} ::= {_STRICT_CHAR}", grammar)


class Checker:
    def __init__(self, model_path: str) -> None:
        import llama_cpp
        from llama_cpp.llama_grammar import json_schema_to_gbnf

        self._llama_cpp = llama_cpp
        self._to_gbnf = json_schema_to_gbnf
        self._llm = vocab_only_model(model_path)
        self._vocab = llama_cpp.llama_model_get_vocab(self._llm.model)

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        if "schema" in request:
            problem = schema_problem(request["schema"])
            if problem:
                return {"problem": f"the JSON schema is too large: {problem}", "code": "grammar_too_complex"}
            try:
                grammar = strict_json_strings(self._to_gbnf(json.dumps(request["schema"])))
            except MemoryError:
                raise
            except Exception as exc:  # the converter asserts and raises on what it can't express
                detail = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
                return {"problem": f"the JSON schema can't be turned into a grammar: {detail}",
                        "code": "invalid_json_schema"}
        else:
            grammar = request["grammar"]
        problem = grammar_problem(grammar)
        if problem:
            return {"problem": f"the grammar is too large for llama.cpp: {problem}", "code": "grammar_too_complex"}
        parse_error = self._parse(grammar)
        if parse_error is not None:
            return {"problem": parse_error, "code": "invalid_grammar"}
        return {"grammar": grammar}

    def _parse(self, grammar: str) -> str | None:
        """llama.cpp's own parser, on a thread with a stack well below a
        worker's (8 MiB), so what passes here can't overflow there."""
        encoded = grammar.encode("utf-8", "surrogatepass")
        if b"\0" in encoded:
            return "it contains a NUL character"
        result: list[bool] = []

        def parse() -> None:
            llama_cpp = self._llama_cpp
            sampler = llama_cpp.llama_sampler_init_grammar(self._vocab, encoded, b"root")
            result.append(bool(sampler))
            if sampler:
                llama_cpp.llama_sampler_free(sampler)

        threading.stack_size(bounds.GRAMMAR_CHECK_STACK_BYTES)
        thread = threading.Thread(target=parse, name="grammar-parse")
        # llama.cpp prints its parse error, and the whole grammar, on stderr:
        # caught here to tell the client what it expected, and kept out of the log.
        with tempfile.TemporaryFile() as caught:
            saved = os.dup(2)
            os.dup2(caught.fileno(), 2)
            try:
                thread.start()
                thread.join()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            caught.seek(0)
            printed = caught.read(64 * 1024).decode("utf-8", "replace")
        if result and result[0]:
            return None
        found = re.search(r"error parsing grammar: ([^\n]*)", printed)
        detail = found.group(1).strip()[:300] if found else "a syntax error, an undefined rule, or left recursion"
        return f"llama.cpp can't parse it as a GBNF grammar with a 'root' rule: {detail}"


def limit_memory(mib: int) -> None:
    """Called once the model is loaded: from here on a runaway request meets
    this limit (heap and anonymous maps; the model file's mapping doesn't
    count) and fails with a MemoryError or dies, in this child only."""
    limit = mib * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tray_app.core.grammar.child MODEL.gguf", file=sys.stderr)
        return 2
    checker = Checker(args[0])
    limit_memory(bounds.GRAMMAR_CHECK_MEMORY_MIB)
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            reply = checker.answer(request)
        except MemoryError:
            reply = {"problem": f"checking it needed more than {bounds.GRAMMAR_CHECK_MEMORY_MIB} MiB",
                     "code": "grammar_too_complex"}
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            reply = {"problem": f"it can't be checked: {type(exc).__name__}", "code": "invalid_grammar"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
