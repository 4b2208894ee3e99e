"""The real-GPU kit's check that the router holds no GPU memory of its own
(benchmarks/gpu_check/run.py): NVML lists only processes with a context."""

from __future__ import annotations

from benchmarks.gpu_check.run import Device

ROUTER, WORKER = 100, 200


def device_listing(readings: dict[int, float]) -> Device:
    device = Device(simulated=True, card_mib=6144)
    device.process_mib = readings.get  # NVML's per-process reading, by pid
    return device


def test_a_router_nvml_does_not_list_beside_a_listed_worker_holds_0_mib():
    assert device_listing({WORKER: 310.0}).own_mib(ROUTER, WORKER) == 0.0


def test_a_router_with_a_context_holds_what_nvml_says():
    assert device_listing({WORKER: 310.0, ROUTER: 254.0}).own_mib(ROUTER, WORKER) == 254.0


def test_without_per_process_readings_the_router_is_unknown_not_clean():
    assert device_listing({}).own_mib(ROUTER, WORKER) is None
