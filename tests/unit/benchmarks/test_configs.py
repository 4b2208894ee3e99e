"""The benchmarks' one config builder: what it writes is a config the service
reads, with each benchmark's own keys winning over the shared ones."""

from __future__ import annotations

import pytest

from benchmarks.configs import service_config
from tray_app.core.config import parse_config_text


def test_the_shared_keys_are_written_and_the_service_reads_them() -> None:
    config = parse_config_text(service_config(simulate_mib=4096, n_ctx=2048))
    assert config.gpu.simulate_mib == 4096 and config.gpu.reserve_mib == 256
    assert config.gpu.n_ctx == config.cpu.n_ctx == 2048
    assert config.cpu.ram_floor_mib == 256


def test_patient_and_stays_loaded_add_their_keys_and_a_benchmark_s_own_keys_win() -> None:
    config = parse_config_text(service_config(simulate_mib=2048, n_ctx=1024, patient=True, stays_loaded=True,
                                              gpu={"token_timeout_s": 10, "reserve_mib": 512},
                                              worker={"backoff_base_s": 0.2}))
    assert config.gpu.first_token_timeout_s == 300 and config.server.queue_timeout_s == 600
    assert config.gpu.token_timeout_s == 10 and config.gpu.reserve_mib == 512
    assert config.gpu.yield_to_other_apps is False and config.gpu.idle_unload_s == 0
    assert config.worker.backoff_base_s == 0.2


def test_a_value_toml_cannot_hold_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="no TOML for"):
        service_config(simulate_mib=2048, gpu={"rpc_servers": None})


@pytest.mark.parametrize("module, name", [("estimate_bench", "CONFIG"), ("service_bench", "CONFIG"),
                                          ("soak", "SOAK_CONFIG")])
def test_each_benchmark_s_config_is_read_by_the_service(module: str, name: str) -> None:
    import importlib

    text = getattr(importlib.import_module(f"benchmarks.{module}"), name)
    assert parse_config_text(text).gpu.simulate_mib > 0
