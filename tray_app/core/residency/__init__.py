"""Memory residency: which of our workers hold memory, and who gives way.

- `policy`: the GPU worker's residency as a pure state machine (`Residency`):
  yield to other apps, idle unload, the user's give-back, eviction for
  another model, a refused load. Plain values in, an `Action` out.
- `eviction`: which idle models to unload so another one fits (pure).
- `gpu`: `GpuSharing`, the one writer of a model's `Residency`, and the
  effects of its actions (drain, unload, wait for the memory, reload).
- `on_demand`: `OnDemandWorker`, a CPU or embedding worker loaded by the
  first request and unloaded when idle.
- `coordinator`: `ResidencyCoordinator`, residency across models: making
  room in VRAM and RAM before a load, and the order models look at a reading.

The pure modules do no I/O and no asyncio; the effects live in the other three.
"""
