"""VRAM ballast: "the other app" as a process that holds an exact amount of
GPU memory, with torch or cupy when one is installed.

    python -m tray_app.drill.ballast        (driven by Ballast, below)

It reads a target in MiB per line on stdin, allocates or frees 32 MiB
chunks with plain device allocations (no caching allocator, so a free gives
the memory back to the driver at once), and answers "held N" (or "full N"
when the device refused more). It exits when stdin closes, so a drill or a
check that dies can't leave the memory taken.

llama.cpp processes can hold VRAM too (pressure.py does that when neither
library is installed), but their size is only known within a KV cache's
step; a ballast hits a target to 32 MiB, which is what a check on a card
with a hundred GiB free needs to make it behave like a home GPU.
"""

from __future__ import annotations

import importlib.util
import os
import select
import subprocess
import sys
from typing import Any, Callable

CHUNK_MIB = 32
MIB = 1024 * 1024
# A CUDA start that hangs must not hang the drill or the check with it.
ANSWER_TIMEOUT_S = 60.0


def library() -> str | None:
    """The GPU library the ballast would allocate with, or None."""
    for name in ("torch", "cupy"):
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def _allocator(name: str) -> Callable[[int], Any]:
    if name == "torch":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        return lambda mib: torch.empty(mib * MIB, dtype=torch.uint8, device="cuda")
    import cupy

    cupy.cuda.set_allocator(None)  # plain cudaMalloc/cudaFree, no pool
    return lambda mib: cupy.empty(mib * MIB, dtype=cupy.uint8)


def _releaser(name: str) -> Callable[[], None]:
    """Hands freed chunks back to the driver at once, in case a caching
    allocator is on after all."""
    if name == "torch":
        import torch

        return torch.cuda.empty_cache
    import cupy

    return cupy.get_default_memory_pool().free_all_blocks


def main() -> int:
    name = library()
    if name is None:
        print("error neither torch nor cupy is installed", flush=True)
        return 2
    try:
        allocate = _allocator(name)
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which decides
        print(f"error {exc}", flush=True)
        return 2
    chunks: list[Any] = []
    release = _releaser(name)
    try:
        # The CUDA context (some hundreds of MiB) exists before "ready", so the
        # first hold() is not off by its size. The chunk itself is dropped at once.
        allocate(1)
        release()
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which decides
        print(f"error {exc}", flush=True)
        return 2
    print(f"ready {name}", flush=True)
    for line in sys.stdin:
        want = max(0, int(float(line) // CHUNK_MIB))
        if want < len(chunks):
            del chunks[want:]
            release()
        verdict = "held"
        while len(chunks) < want:
            try:
                chunks.append(allocate(CHUNK_MIB))
            except Exception:  # noqa: BLE001 - the device's out-of-memory error, whichever library
                verdict = "full"
                break
        print(f"{verdict} {len(chunks) * CHUNK_MIB}", flush=True)
    return 0


class Ballast:
    """Drives one ballast process."""

    def __init__(self, python: str = sys.executable) -> None:
        env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
        self.process = subprocess.Popen([python, "-m", "tray_app.drill.ballast"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=env)
        first = self._answer()
        if not first.startswith("ready"):
            self.close()
            raise RuntimeError(f"the VRAM ballast did not start: {first}")
        self.library = first.split(" ", 1)[1]
        self.held_mib = 0

    def _answer(self) -> str:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], ANSWER_TIMEOUT_S)
        if not ready:
            self.process.kill()
            raise RuntimeError(f"the VRAM ballast did not answer within {ANSWER_TIMEOUT_S:g} s")
        line = self.process.stdout.readline().strip()
        if not line:
            raise RuntimeError(f"the VRAM ballast exited ({self.process.poll()})")
        return line

    def hold(self, mib: float) -> int:
        """Hold about `mib` (rounded down to a chunk); returns what is held."""
        assert self.process.stdin is not None
        self.process.stdin.write(f"{max(0.0, mib):.0f}\n")
        self.process.stdin.flush()
        verdict, held = self._answer().split()
        self.held_mib = int(held)
        return self.held_mib

    @property
    def pid(self) -> int:
        return self.process.pid

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.close()
                self.process.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self.held_mib = 0


if __name__ == "__main__":
    sys.exit(main())
