"""Turn a worker's exit status and last log lines into a verdict a person can act on.

The supervisor needs to tell "ran out of memory" (retry with fewer GPU layers or
fail over to the CPU worker) from "the model file is bad" (retrying is pointless)
from an ordinary crash.  llama.cpp reports both kinds of failure the same ways --
exit code 1 from llama-cpp-python's ValueError, or SIGABRT from ggml_abort -- so
the exit status alone cannot decide; the log text does.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum


class ExitKind(str, Enum):
    CLEAN_STOP = "clean_stop"
    CRASH = "crash"
    OUT_OF_MEMORY = "out_of_memory"
    BAD_MODEL = "bad_model"
    ERROR = "error"


# Matched case-insensitively as substrings.  Covers CUDA/ROCm/Metal allocation
# failures at load and at context creation, and the ggml_abort path when an
# allocation fails mid-request.  Bare "failed to initialize the context" is left
# out on purpose: llama.cpp also prints it for non-memory causes
# (https://github.com/ggml-org/llama.cpp/issues/24343); the memory variant
# always carries "failed to allocate" as well.
OUT_OF_MEMORY_PATTERNS: tuple[str, ...] = (
    "out of memory",  # "cudaMalloc failed: out of memory", "CUDA error: out of memory"
    "cudamalloc failed",
    "failed to allocate",  # "alloc_tensor_range: failed to allocate CUDA0 buffer", "... compute pp buffers"
    "unable to allocate",  # "llama_model_load: error loading model: unable to allocate CUDA0 buffer"
    "erroroutofdevicememory",  # Vulkan: "vk::Device::allocateMemory: ErrorOutOfDeviceMemory"
    "std::bad_alloc",  # host RAM exhausted inside llama.cpp
    "memoryerror",  # host RAM exhausted inside the Python server
)

# OOM-looking lines that are harmless: ggml-cuda falls back to pageable memory
# when pinned host memory runs out ("failed to allocate ... of pinned memory: out
# of memory"), and that warning sits in the startup log of a healthy worker.
BENIGN_OUT_OF_MEMORY_PATTERNS: tuple[str, ...] = ("pinned memory",)

BAD_MODEL_PATTERNS: tuple[str, ...] = (
    "gguf_init_from_",  # gguf_init_from_file (older) / gguf_init_from_reader (current) header errors
    "invalid magic",
    "unknown model architecture",
    "error loading model",  # "llama_model_load: error loading model: ..."
    "failed to load model from file",  # llama-cpp-python's ValueError
    "model path does not exist",  # llama-cpp-python checks the path before llama.cpp sees it
)

# Lines worth showing for a crash or error that matched nothing specific.
_CLUE_PATTERNS: tuple[str, ...] = ("error", "exception", "assert", "abort", "fatal")

_SIGTERM, _SIGKILL, _SIGINT = 15, 9, 2  # POSIX numbers; signal.SIGKILL does not exist on Windows
_OBEYED_STOP_RETURNCODES = frozenset({0, -_SIGTERM, -_SIGKILL, -_SIGINT})
# Popen.terminate()/kill() on Windows is TerminateProcess(handle, 1).
_WINDOWS_TERMINATE_RETURNCODE = 1

# Windows reports a crash as an NTSTATUS exit code instead of a signal.
_NTSTATUS_FIRST_ERROR = 0xC0000000
_NTSTATUS_NAMES = {
    0xC0000005: "STATUS_ACCESS_VIOLATION",
    0xC000001D: "STATUS_ILLEGAL_INSTRUCTION",
    0xC00000FD: "STATUS_STACK_OVERFLOW",
    0xC0000409: "STATUS_STACK_BUFFER_OVERRUN",  # abort() / fail-fast in the MSVC runtime
}

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_MAX_EVIDENCE_CHARS = 300


@dataclass(frozen=True)
class ExitReport:
    kind: ExitKind
    returncode: int | None
    signal_name: str | None
    evidence: str | None

    def describe(self) -> str:
        how = self._how_it_ended()
        if self.kind is ExitKind.CLEAN_STOP:
            text = "stopped as requested"
        elif self.kind is ExitKind.OUT_OF_MEMORY:
            text = f"out of memory ({how})"
        elif self.kind is ExitKind.BAD_MODEL:
            text = f"could not load the model ({how})"
        elif self.kind is ExitKind.CRASH:
            text = f"crashed ({how})"
            if self.signal_name == "SIGKILL":
                text += "; SIGKILL from nobody we know of is usually the system's out-of-memory killer"
        elif self.returncode == 0:
            text = "exited on its own (exit code 0) without being asked to stop"
        else:
            text = f"exited with an error ({how})"
        return f"{text}: {self.evidence}" if self.evidence else text

    def as_status(self) -> dict:
        """The worker's `last_exit` in /status."""
        return {"kind": self.kind.value, "returncode": self.returncode, "signal": self.signal_name,
                "evidence": self.evidence, "description": self.describe()}

    def _how_it_ended(self) -> str:
        if self.signal_name:
            return self.signal_name
        if self.returncode is None:
            return "exit status unknown"
        return f"exit code {self.returncode}"


# Crashes that are bugs reached by the input being processed (a bad pointer, a
# bad instruction, a division by zero), not resource failures: out of memory
# ends in an error exit or SIGABRT, a lost device in SIGABRT, the kernel's OOM
# killer in SIGKILL. Re-running the request that caused one of these would
# crash the next worker the same way.
INPUT_CRASH_SIGNALS = frozenset({
    "SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "STATUS_ACCESS_VIOLATION", "STATUS_ILLEGAL_INSTRUCTION",
    "STATUS_STACK_OVERFLOW",
})


# An abort is the input's fault when llama.cpp says it failed a check on what
# it was given: a GGML_ASSERT (`grammar_triggers` with an unknown type
# reaches one in common/sampling.cpp) or a C++ exception nobody caught. The
# aborts that are not (a failed allocation, a lost device, a CUDA error)
# print their own cause, which wins: memory is classified before this, and a
# device's fault is named here so it is never blamed on the request.
INPUT_ABORT_PATTERNS: tuple[str, ...] = ("ggml_assert", "terminate called after throwing")
DEVICE_FAULT_PATTERNS: tuple[str, ...] = (
    "cuda error", "hip error", "rocm error", "devicelost", "device lost", "illegal memory access",
    "launch failure", "vk::", "metal error", "sycl error",
)
_ABORT_SIGNALS = frozenset({"SIGABRT", "STATUS_STACK_BUFFER_OVERRUN"})


def is_input_crash(report: ExitReport) -> bool:
    """True when a worker that died mid-request most likely died of the request."""
    if report.kind is not ExitKind.CRASH:
        return False
    if report.signal_name in INPUT_CRASH_SIGNALS:
        return True
    return (report.signal_name in _ABORT_SIGNALS and report.evidence is not None
            and _matches(report.evidence, INPUT_ABORT_PATTERNS) and not _matches(report.evidence, DEVICE_FAULT_PATTERNS))


def classify_exit(returncode: int | None, log_tail: Sequence[str], stop_requested: bool) -> ExitReport:
    """Classify how a worker ended.  returncode < 0 means killed by signal -returncode."""
    signal_name = _crash_code_name(returncode)

    def report(kind: ExitKind, evidence: str | None = None) -> ExitReport:
        return ExitReport(kind, returncode, signal_name, evidence)

    # Checked before the log: llama.cpp logs recoverable allocation failures at
    # startup (e.g. it retries without pipeline parallelism,
    # https://github.com/ggml-org/llama.cpp/pull/16748), and those stale lines
    # must not relabel a stop we asked for and got.
    if stop_requested and returncode in _OBEYED_STOP_RETURNCODES:
        return report(ExitKind.CLEAN_STOP)
    if (line := _first_line_matching(log_tail, OUT_OF_MEMORY_PATTERNS, BENIGN_OUT_OF_MEMORY_PATTERNS)) is not None:
        return report(ExitKind.OUT_OF_MEMORY, line)
    if (line := _first_line_matching(log_tail, BAD_MODEL_PATTERNS)) is not None:
        return report(ExitKind.BAD_MODEL, line)
    if stop_requested and returncode in (_WINDOWS_TERMINATE_RETURNCODE, None):
        return report(ExitKind.CLEAN_STOP)
    clue = _last_line_matching(log_tail, _CLUE_PATTERNS)
    if signal_name is not None:
        if signal_name in _ABORT_SIGNALS:
            # The device's fault if it names one; else the failed check
            # itself, not the backtrace lines after it.
            clue = (_first_line_matching(log_tail, DEVICE_FAULT_PATTERNS)
                    or _last_line_matching(log_tail, INPUT_ABORT_PATTERNS) or clue)
        return report(ExitKind.CRASH, clue)
    return report(ExitKind.ERROR, clue)


def _crash_code_name(returncode: int | None) -> str | None:
    if returncode is None:
        return None
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    if returncode >= _NTSTATUS_FIRST_ERROR:
        return _NTSTATUS_NAMES.get(returncode, f"NTSTATUS {returncode:#010X}")
    return None


def _clean(line: str) -> str:
    text = _ANSI_ESCAPE.sub("", line).strip()
    if len(text) > _MAX_EVIDENCE_CHARS:
        text = text[: _MAX_EVIDENCE_CHARS - 1] + "…"
    return text


def mentions_out_of_memory(text: str) -> bool:
    """True when an error message reads as an allocation failure."""
    return _matches(text, OUT_OF_MEMORY_PATTERNS) and not _matches(text, BENIGN_OUT_OF_MEMORY_PATTERNS)


def _matches(line: str, patterns: tuple[str, ...]) -> bool:
    lowered = line.lower()
    return any(pattern in lowered for pattern in patterns)


def _first_line_matching(
    lines: Iterable[str], patterns: tuple[str, ...], benign: tuple[str, ...] = ()
) -> str | None:
    # The first match is the root cause; later lines repeat it in vaguer words
    # ("unable to allocate CUDA0 buffer" after "cudaMalloc failed: out of memory").
    for line in lines:
        if _matches(line, patterns) and not _matches(line, benign):
            return _clean(line)
    return None


def _last_line_matching(lines: Sequence[str], patterns: tuple[str, ...]) -> str | None:
    # For a generic failure the last error-ish line is the Python exception
    # message or the ggml assertion, which is what the user needs to see.
    for line in reversed(lines):
        if _matches(line, patterns):
            return _clean(line)
    return None
