"""llama.cpp's tokenizer on client input, run in a child process.

Nothing parses untrusted input natively inside the service: a crash there
takes every request and the tray with it. Prompts, /tokenize bodies,
embedding inputs and /detokenize ids are client input, so `TokenizerProcess`
hands them to one warm child (core/catalog/tokenizer_child.py), one request
at a time, under a time limit (here) and a memory limit (there). A child that
crashes, runs out of memory or takes too long ends that request with a 400
(prompt_not_tokenizable) and is replaced for the next one.

The I/O is blocking, under the caller's lock (PromptCounter's): a round trip
for a short prompt costs 0.1 to 0.3 ms (measured, 150 B to 1 KiB), little
enough for the event loop, where short prompts are counted; there it waits
neither for a child that is starting nor past QUICK_TIMEOUT_S for a hung one
(tokenize_if_warm).
"""

from __future__ import annotations

import array
import json
import logging
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from ..api.openai_request import InvalidRequest

log = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 60.0
# A 4 MiB prompt tokenized in 0.8 to 6 s on a busy 2-core machine (measured;
# 4 MiB of spaces is the slow one): the limit is there to end a hang, not to
# police slow machines.
BASE_TIMEOUT_S = 10.0
TIMEOUT_S_PER_MIB = 30.0
# A short text on the event loop (tokens.QUICK_COUNT_BYTES) takes well under
# a millisecond; past this the loop stops waiting and a thread takes over.
QUICK_TIMEOUT_S = 0.5
_READ_CHUNK = 1 << 20


class PromptNotTokenizable(InvalidRequest):
    """The tokenizer crashed, ran out of memory or hung on this input."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message, "prompt_not_tokenizable")


class TokenizerUnavailable(InvalidRequest):
    """The tokenizer's child could not be started (or the counter is closed)."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, "tokenizer_unavailable")


class _ChildGone(Exception):
    """The child closed its pipes: it died before or while answering."""

    returncode: int | None = None


class TokenizerProcess:
    def __init__(self, model_path: Path, *, python: str = sys.executable,
                 base_timeout_s: float = BASE_TIMEOUT_S) -> None:
        self._argv = [python, "-m", "tray_app.core.catalog.tokenizer_child", str(model_path)]
        self._base_timeout_s = base_timeout_s
        self._process: subprocess.Popen | None = None
        self._ready = False
        self._closed = False
        self.children_started = 0
        # Started now, waited for at the first request: the model's load
        # overlaps whatever the service does meanwhile.
        self._spawn()

    @property
    def warm(self) -> bool:
        """Whether a request would be answered without starting a child."""
        process = self._process
        return self._ready and process is not None and process.poll() is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def tokenize(self, data: bytes, add_bos: bool, special: bool) -> list[int]:
        _, body = self._ask(_message({"tokenize": True, "add_bos": add_bos, "special": special}, data), len(data))
        return _token_list(body)

    def tokenize_if_warm(self, data: bytes, add_bos: bool, special: bool) -> list[int] | None:
        """The tokens, or None when the child is not warm or doesn't answer
        within QUICK_TIMEOUT_S: for the event loop, which must neither wait
        for a child to start nor for a hung one's full time limit. A child
        that fails here is replaced, and `tokenize` on a worker thread then
        decides whether the input is to blame."""
        process = self._process
        if not self.warm or process is None:
            return None
        message = _message({"tokenize": True, "add_bos": add_bos, "special": special}, data)
        try:
            header, body = self._answer(process, message, QUICK_TIMEOUT_S)
        except (TimeoutError, _ChildGone):
            return None
        return None if "problem" in header else _token_list(body)

    def pieces(self, tokens: Sequence[int]) -> list[bytes]:
        payload = array.array("i", tokens).tobytes()
        header, body = self._ask(_message({"pieces": True}, payload), len(payload))
        out, start = [], 0
        for length in header["lengths"]:
            out.append(body[start:start + length])
            start += length
        return out

    def _ask(self, message: bytes, size: int, retried: bool = False) -> tuple[dict[str, Any], bytes]:
        timeout_s = self._base_timeout_s + TIMEOUT_S_PER_MIB * size / 2**20
        was_warm = self.warm
        process = self._ready_child()
        try:
            header, body = self._answer(process, message, timeout_s)
        except TimeoutError:
            raise PromptNotTokenizable(f"tokenizing it took longer than {timeout_s:.0f} s") from None
        except _ChildGone as gone:
            if was_warm and not retried:
                # A child that served earlier requests may have been killed
                # from outside (the OOM killer, a user's kill) before this
                # one arrived, and a pipe can't say when: a fresh child hears
                # it once before the input is blamed.
                return self._ask(message, size, retried=True)
            raise PromptNotTokenizable(f"llama.cpp's tokenizer failed on it (exit {gone.returncode})") from None
        if "problem" in header:
            raise PromptNotTokenizable(f"it can't be tokenized: {header['problem']}")
        return header, body

    def _answer(self, process: subprocess.Popen, message: bytes, timeout_s: float) -> tuple[dict[str, Any], bytes]:
        """The child's answer; a child that fails to give one is discarded
        (TimeoutError, or _ChildGone with its exit status)."""
        try:
            return _exchange(process, message, time.monotonic() + timeout_s)
        except TimeoutError:
            self._discard(f"took longer than {timeout_s:.1f} s")
            raise
        except _ChildGone as gone:
            gone.returncode = self._discard("exited")
            raise
        except BaseException:
            # Part of an answer may still be in the pipe, which would be read
            # as the next request's: this child can't be asked again.
            self._discard("was left mid-answer")
            raise

    def _spawn(self) -> None:
        self._process = subprocess.Popen(self._argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._ready = False
        self.children_started += 1
        assert self._process.stdin is not None and self._process.stdout is not None
        os.set_blocking(self._process.stdin.fileno(), False)
        os.set_blocking(self._process.stdout.fileno(), False)

    def _ready_child(self) -> subprocess.Popen:
        if self._closed:
            raise TokenizerUnavailable("the model's tokenizer is closed (the model is unloading); retry shortly")
        if self._process is None or self._process.poll() is not None:
            if self._process is not None:
                self._discard("was gone")
            self._spawn()
        assert self._process is not None
        if not self._ready:
            try:
                self._answer(self._process, b"", _STARTUP_TIMEOUT_S)
            except (TimeoutError, _ChildGone):
                raise TokenizerUnavailable("the server's tokenizer could not start; retry shortly") from None
            self._ready = True
        return self._process

    def _discard(self, why: str) -> int | None:
        process, self._process = self._process, None
        if process is None:
            return None
        if process.poll() is None:
            process.kill()
        returncode = process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()
        log.warning("tokenizer child %s %s (exit %s); the next request starts a new one", process.pid, why,
                    returncode)
        return returncode

    def rest(self) -> bool:
        """End a warm child between requests to give its memory back; the next
        request starts a new one, as after a crash. False when there was none."""
        if self._closed or not self.warm:
            return False
        self._end()
        return True

    def close(self) -> None:
        """End the child for good: a request after this one is refused."""
        self._closed = True
        self._end()

    def _end(self) -> None:
        """The child ended: its stdin closed, it exits at once (between requests)."""
        process, self._process = self._process, None
        if process is None:
            return
        assert process.stdin is not None and process.stdout is not None
        if not self._ready:
            process.kill()  # still loading: nothing to finish
        self._ready = False
        process.stdin.close()
        try:
            process.wait(2.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()


def _message(request: dict[str, Any], payload: bytes) -> bytes:
    return json.dumps({**request, "bytes": len(payload)}).encode() + b"\n" + payload


def _token_list(body: bytes) -> list[int]:
    tokens = array.array("i")
    tokens.frombytes(body)
    return tokens.tolist()


def _exchange(process: subprocess.Popen, message: bytes, deadline: float) -> tuple[dict[str, Any], bytes]:
    """Send `message`, read the header line and the bytes it announces.
    Raises TimeoutError at the deadline, _ChildGone when the child's pipes
    close. poll(), not select() (whose fds stop at 1024) nor a selector
    (whose epoll set costs more to make than a short round trip)."""
    assert process.stdin is not None and process.stdout is not None
    to_child, from_child = process.stdin.fileno(), process.stdout.fileno()
    view = memoryview(message)
    sent = 0
    received = bytearray()
    header: dict[str, Any] | None = None
    poller = select.poll()
    poller.register(from_child, select.POLLIN)
    waiting_to_write = False
    while True:
        if sent < len(view):
            try:
                sent += os.write(to_child, view[sent:])  # a short request fits the pipe's buffer at once
            except BlockingIOError:
                pass
            except BrokenPipeError:
                raise _ChildGone() from None
            if sent < len(view) and not waiting_to_write:
                poller.register(to_child, select.POLLOUT)
            elif sent == len(view) and waiting_to_write:
                poller.unregister(to_child)
            waiting_to_write = sent < len(view)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError()
        events = dict(poller.poll(remaining * 1000))
        if not events.get(from_child):
            continue
        chunk = os.read(from_child, _READ_CHUNK)
        if not chunk:
            raise _ChildGone()
        received += chunk
        if header is None and b"\n" in received:
            line, _, rest = bytes(received).partition(b"\n")
            header, received = json.loads(line), bytearray(rest)
        if header is not None and len(received) >= header.get("bytes", 0):
            return header, bytes(received)
