"""The drill's phases, by concern; each phase is a function of a
`DrillSession` and the `PhaseResult` it fills. `runner.PHASES` is their order.

- `traffic`: requests only (calibration; over the GPU profile; cancel in the
  CPU queue; concurrent clients): phases 1 to 4, which also run against a
  live service.
- `agents`: agents with a counted mock tool, one killed mid-turn (phase 5).
- `faults`: the GPU worker failing: allocation failure, kills, a poison
  request (phases 7 to 9).
- `sharing`: the GPU's memory shared with others: shrinking VRAM, another
  app taking it, a second model (phases 6, 10 and 11).
"""
