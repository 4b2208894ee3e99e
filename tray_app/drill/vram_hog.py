"""Another app that takes VRAM: a game starting, a second model, a render.

A real second process, so the service sees what it sees on a user's desktop:
a process it doesn't own, named in the device's process list, whose memory
comes back when it exits however it exits.

- Simulated device (`--simulated-dir`, the service's /status
  gpu.simulated_device_dir): the allocation is registered there under this
  process's pid.
- Real NVIDIA GPU: the memory is allocated with CuPy or PyTorch, whichever
  is installed (the drill's GPU machine has both; the app needs neither).

`--name` sets the process name (Linux /proc/self/comm), so the service's
"GPU given to <app>" names the app the way it would name steam.

    python -m tray_app.drill.vram_hog --mib 6000 --name steam --hold 20

It prints one JSON line when it holds the memory, and lets go after --hold
seconds, on SIGTERM or on SIGINT.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..core.memory.telemetry import hold_simulated_vram
from ..core.status_contract import Status

MIB = 1024 * 1024


def set_process_name(name: str) -> None:
    """What `ps` and NVML's process list (through psutil) show for us."""
    try:
        with open("/proc/self/comm", "w") as handle:
            handle.write(name[:15])
    except OSError:
        pass  # not Linux: the interpreter's name shows instead


def allocate_real(mib: float) -> Any:
    """Hold `mib` of device memory on GPU 0 (less if, once this process's own
    CUDA context exists, that much is no longer free); the returned object
    owns it."""
    try:
        import cupy

        cupy.cuda.Device(0).use()
        cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1))  # the context, before measuring
        free = cupy.cuda.runtime.memGetInfo()[0]
        block = cupy.empty(min(int(mib * MIB), free - 64 * MIB), dtype=cupy.uint8)
        block.fill(1)  # touch it, so the driver really commits it
        cupy.cuda.Device(0).synchronize()
        return block
    except ImportError:
        pass
    try:
        import torch
    except ImportError:
        raise SystemExit("a real GPU allocation needs cupy or torch; neither is installed") from None
    torch.cuda.init()
    free = torch.cuda.mem_get_info(0)[0]
    block = torch.ones(min(int(mib * MIB), free - 64 * MIB), dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    return block


def crowding_mib(status: Status) -> float:
    """How much another app must take so the loaded GPU worker can no longer
    keep the reserve: all that is free with the worker loaded, less half the
    reserve. /status's reading can be a second old and miss a worker that
    just loaded, so its own footprint estimate bounds what is free."""
    gpu = status["gpu"]
    worker = next(w for w in status["workers"] if w["role"] == "gpu")
    free = gpu["free_mib"] or 0.0
    if worker["state"] == "ready" and gpu["total_mib"]:
        free = min(free, gpu["total_mib"] - worker["estimated_vram_mib"])
    return max(1.0, free - gpu["reserve_mib"] / 2)


class OtherApp:
    """A vram_hog process, started and ended from another program (the
    drill, the tests). It holds the memory once the constructor returns."""

    def __init__(self, mib: float, name: str, simulated_dir: str | Path | None = None,
                 start_timeout_s: float = 60.0) -> None:
        argv = [sys.executable, "-m", "tray_app.drill.vram_hog", "--mib", f"{mib:.1f}", "--name", name]
        if simulated_dir is not None:
            argv += ["--simulated-dir", str(simulated_dir)]
        self.name = name
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        line = _read_line(self.process, start_timeout_s)
        if not line:
            self.crash()
            raise RuntimeError(f"the other app did not take {mib:.0f} MiB (exit {self.process.returncode})")
        self.holding = json.loads(line)
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int:
        return self.process.pid

    def quit(self) -> None:
        """It lets go, the way an app that closes does."""
        if self.process.poll() is None:
            self.process.terminate()
        self.process.wait(10)

    def crash(self) -> None:
        """It dies; the memory comes back all the same."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


def _read_line(process: subprocess.Popen, timeout_s: float) -> str:
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return result[0] if result else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tray_app.drill.vram_hog", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, required=True, help="how much VRAM to take")
    parser.add_argument("--name", default="vram-hog", help="the process name the GPU's process list shows")
    parser.add_argument("--hold", type=float, default=0.0, help="seconds to hold it (0 = until SIGTERM)")
    parser.add_argument("--simulated-dir", type=Path, help="take it on this simulated device instead of GPU 0")
    args = parser.parse_args(argv)
    if not args.mib > 0:
        parser.error("--mib must be a positive number")
    set_process_name(args.name)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    started = time.monotonic()
    if args.simulated_dir is not None:
        entry = hold_simulated_vram(args.simulated_dir, args.mib)
        held: Any = None
    else:
        entry = None
        held = allocate_real(args.mib)
    print(json.dumps({"holding_mib": args.mib, "name": args.name, "took_s": round(time.monotonic() - started, 3),
                      "simulated": entry is not None}), flush=True)
    try:
        stop.wait(args.hold if args.hold > 0 else None)
    finally:
        if entry is not None:
            entry.unlink(missing_ok=True)
        del held
    return 0


if __name__ == "__main__":
    sys.exit(main())
