"""llama.cpp RPC workers: addresses, the GPU worker's flags, the
rpc-worker command's refusal to listen openly, the health probe, the
panel's line per server, and the local GPU's share of a split model."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from pathlib import Path

import pytest

from tests.unit.core.memory.test_estimate import llama3_8b_shape
from tests.unit.core.engine.test_rpc_protocol import fake_rpc_server
from tray_app.cli.rpc_worker import is_loopback, rpc_server_argv, run_rpc_worker
from tray_app.core.config import ConfigError, parse_config_text, rpc_address_problem
from tray_app.core.engine.runtime import LaunchRequest, LlamaServerRuntime
from tray_app.core.engine.worker import free_loopback_port
from tray_app.core.memory import estimate
from tray_app.core.engine.rpc import RpcHealth


@pytest.mark.parametrize("address", ["10.0.0.2:50052", "gpu-box.lan:1", "127.0.0.1:65535"])
def test_good_addresses(address):
    assert rpc_address_problem(address) is None


@pytest.mark.parametrize("address", ["gpu-box", "gpu-box:0", "gpu-box:65536", ":50052", "gpu-box:port",
                                     "a b:50052", "a,b:50052", "", "[::1]:50052", "fe80::1:50052"])
def test_bad_addresses_are_refused_with_the_reason(address):
    assert rpc_address_problem(address)


def test_the_config_names_the_bad_address():
    with pytest.raises(ConfigError, match=r"\[gpu\] rpc_servers: 'gpu-box' is not host:port"):
        parse_config_text('[gpu]\nrpc_servers = ["10.0.0.2:50052", "gpu-box"]\n')
    config = parse_config_text('[gpu]\nrpc_servers = ["10.0.0.2:50052"]\n')
    assert config.gpu.rpc_servers == ("10.0.0.2:50052",)


def _launch(**extra) -> LaunchRequest:
    return LaunchRequest(model_path=Path("m.gguf"), port=1234, n_ctx=512, n_gpu_layers=-1, n_batch=512,
                         n_threads=0, **extra)


def test_the_gpu_worker_is_given_the_remote_devices():
    runtime = LlamaServerRuntime(Path("/opt/llama-server"), bundled=False)
    argv = runtime.argv(_launch(rpc_servers=("10.0.0.2:50052", "10.0.0.3:50052")))
    assert argv[argv.index("--rpc") + 1] == "10.0.0.2:50052,10.0.0.3:50052"
    assert "--rpc" not in runtime.argv(_launch())


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("::1", True), ("[::1]", True),
                                            ("localhost", True), ("0.0.0.0", False), ("192.168.1.5", False),
                                            ("gpu-box.lan", False)])
def test_loopback(host, loopback):
    assert is_loopback(host) is loopback


def _args(**values) -> argparse.Namespace:
    defaults = {"host": "127.0.0.1", "port": 50052, "device": None, "threads": 0, "cache": False,
                "understood": False}
    return argparse.Namespace(**{**defaults, **values})


def test_rpc_worker_refuses_an_open_address_without_the_acknowledgement(capsys):
    assert run_rpc_worker(_args(host="0.0.0.0")) == 2
    assert "no authentication" in capsys.readouterr().err
    assert run_rpc_worker(_args(port=0)) == 2


@pytest.mark.parametrize("host", ["gpu-box.lan", "::1", "[::1]"])
def test_rpc_worker_refuses_what_llama_cpps_server_cant_listen_on(host, capsys):
    # ggml-rpc-server would say "Invalid host address" and exit 0, like a clean stop.
    assert run_rpc_worker(_args(host=host, understood=True)) == 2
    assert "IPv4 address only" in capsys.readouterr().err


def test_rpc_server_argv():
    argv = rpc_server_argv("/bin/ggml-rpc-server", _args(device="CUDA0", threads=4, cache=True))
    assert argv == ["/bin/ggml-rpc-server", "--host", "127.0.0.1", "--port", "50052", "--device", "CUDA0",
                    "--threads", "4", "--cache"]


def test_the_probe_sees_a_server_come_and_go():
    async def scenario() -> list[list[dict]]:
        port = free_loopback_port()
        health = RpcHealth((f"127.0.0.1:{port}",), clock=lambda: 100.0)
        seen = [health.status()]
        server = await asyncio.start_server(fake_rpc_server(), "127.0.0.1", port)
        await health.probe_all()
        seen.append(health.status())
        server.close()
        await server.wait_closed()
        await health.probe_all()
        seen.append(health.status())
        return seen

    before, up, down = (states[0] for states in asyncio.run(scenario()))
    assert before["reachable"] is None
    assert up["reachable"] is True and up["latency_ms"] is not None and up["since"] == 100.0
    assert down["reachable"] is False and down["error"] and down["latency_ms"] is None
    # The memory read while it was up is kept, with its time.
    assert down["free_mib"] == up["free_mib"] == 6144.0 and down["memory_read_at"] == 100.0


class _FakeLlamaCpp:
    """llama_cpp as a CPU build with the RPC backend sees it."""

    def __init__(self, local_gpu: bool) -> None:
        def by_type(kind):
            return 0x1234 if local_gpu and kind == 1 else None

        self.llama_cpp = type("Module", (), {"_lib": type("Lib", (), {"ggml_backend_dev_by_type": staticmethod(by_type)})()})()

    @staticmethod
    def llama_supports_gpu_offload() -> bool:
        return True  # llama.cpp says so for any build with RPC

    @staticmethod
    def llama_supports_rpc() -> bool:
        return True


def test_an_rpc_build_without_a_local_gpu_is_not_called_gpu_capable(monkeypatch):
    from tray_app.core.memory import telemetry

    for local_gpu in (False, True):
        monkeypatch.setattr(telemetry.importlib, "import_module", lambda name, fake=_FakeLlamaCpp(local_gpu): fake)
        assert telemetry.detect_gpu_offload_support().supported is local_gpu


def test_the_panel_names_each_remote_device_its_memory_and_its_state():
    from tray_app.ui.viewmodel import rpc_servers_text

    assert rpc_servers_text([]) == ""
    text = rpc_servers_text([
        {"address": "10.0.0.2:50052", "reachable": True, "state": "idle", "latency_ms": 0.4,
         "free_mib": 7987.2, "total_mib": 8192.0, "memory_age_s": 0.0},
        {"address": "10.0.0.5:50052", "reachable": True, "state": "in_use", "latency_ms": None,
         "free_mib": 24105.6, "total_mib": 24105.6, "memory_age_s": 720.0},
        {"address": "10.0.0.3:50052", "reachable": False, "state": "unreachable", "latency_ms": None,
         "error": "[Errno 111] Connection refused", "free_mib": None},
        {"address": "10.0.0.6:50052", "reachable": True, "state": "busy", "error": "serving another client"},
        {"address": "10.0.0.7:50052", "reachable": True, "state": "incompatible",
         "error": "the server speaks RPC protocol v8.0.0"},
        {"address": "10.0.0.4:50052", "reachable": None}])
    assert text.split("\n") == [
        "RPC 10.0.0.2:50052: 7,987 MiB free of 8,192 MiB · 0.4 ms",
        "RPC 10.0.0.5:50052: 23.5 GiB free (read 12 min ago) · in use by the GPU worker",
        "RPC 10.0.0.3:50052: unreachable: [Errno 111] Connection refused",
        "RPC 10.0.0.6:50052: busy with another client",
        "RPC 10.0.0.7:50052: can't be used: the server speaks RPC protocol v8.0.0",
        "RPC 10.0.0.4:50052: not checked yet",
    ]
    # A status from before memory was read: reachability only.
    assert rpc_servers_text([{"address": "a:1", "reachable": True, "latency_ms": 2.0}]) == "RPC a:1: 2 ms"
    # A server lending two GPUs: each is its own share of the split.
    two = rpc_servers_text([{"address": "b:1", "reachable": True, "state": "idle", "latency_ms": 0.5,
                             "free_mib": 30720.0, "total_mib": 32768.0,
                             "devices": [{"index": 0, "free_mib": 22528.0}, {"index": 1, "free_mib": 8192.0}]}])
    assert two == "RPC b:1: 30.0 GiB free of 32.0 GiB (device 0: 22.0 GiB + device 1: 8.0 GiB) · 0.5 ms"


# ----- the local GPU's share of a model split over RPC devices ----------------------------------


def _llama_cpp_local_layers(offloaded: int, free: list[float]) -> int:
    """llama_model_base::load_tensors' default split, line by line: cumulative
    fractions of each device's free memory, RPC devices first and the local
    GPU last; layer k goes to upper_bound(splits, k / offloaded)."""
    import bisect

    total = sum(free)
    cumulative, running = [], 0.0
    for value in free:
        running += value
        cumulative.append(running / total)
    devices = [bisect.bisect_right(cumulative, k / offloaded) for k in range(offloaded)]
    return devices.count(len(free) - 1)


@pytest.mark.parametrize("offloaded", [1, 2, 7, 25, 31, 81])
@pytest.mark.parametrize("local, remote", [(8192, [24576]), (24576, [8192]), (12288, [12288]),
                                           (10000, [5000, 3000]), (1, [100000]), (100000, [1]),
                                           (6000, [24105.6])])
def test_the_local_share_is_what_llama_cpp_gives_the_last_device(offloaded, local, remote):
    assert estimate.local_gpu_layers(offloaded, local, remote) == _llama_cpp_local_layers(offloaded, [*remote, local])


def test_local_share_in_plain_numbers():
    assert estimate.local_share(8192, [24576]) == 0.25
    assert estimate.local_share(8192, [4096, 4096]) == 0.5
    assert estimate.local_share(8192, []) == 1.0  # no remote device: all local
    # A build without a local GPU: the RPC devices are the only offload devices.
    assert estimate.local_share(None, [24576]) == 0.0 and estimate.local_share(0, [24576]) == 0.0
    assert estimate.local_gpu_layers(31, None, [24576]) == 0
    assert estimate.local_gpu_layers(31, 8192, []) == 31
    # 31 layers, a quarter local: layers 24..30 (k/31 >= 0.75), the output layer among them.
    assert estimate.local_gpu_layers(31, 8192, [24576]) == 7


def test_the_local_footprint_is_its_layers_weights_and_kv_plus_the_whole_runtime():
    # Llama-3-8B's shape, every block a different size so the slice shows.
    info = dataclasses.replace(llama3_8b_shape(), layer_bytes=tuple((100 + i) * 1024 * 1024 for i in range(32)))
    settings = estimate.WorkerSettings(n_ctx=1024, n_gpu_layers=-1, logits_all=False)
    full = estimate.estimate_worker(info, settings)
    assert estimate.local_footprint(info, settings, full.layers_on_gpu) == full
    half = estimate.local_footprint(info, settings, 3)
    assert half.layers_on_gpu == 3 and half.host == full.host
    assert half.gpu.weights == sum(info.layer_bytes[info.n_layer - 2:]) + info.output_bytes
    assert half.gpu.kv_cache * info.n_layer == full.gpu.kv_cache * 2
    assert half.gpu.compute == full.gpu.compute and half.gpu.runtime_overhead == full.gpu.runtime_overhead
    none = estimate.local_footprint(info, settings, 0)
    assert none.gpu.weights == none.gpu.kv_cache == 0 and none.gpu.runtime_overhead == full.gpu.runtime_overhead
    assert estimate.request_vram_bytes(info, estimate.with_gpu_layers(settings, 3), 100) < \
        estimate.request_vram_bytes(info, settings, 100)


def test_a_probe_that_fails_oddly_is_the_servers_error_and_start_goes_on():
    health = RpcHealth(("127.0.0.1:1", "127.0.0.1:2"))

    async def odd(address: str) -> None:
        raise ValueError("something no one expected")

    health._probe_memory = odd

    async def scenario() -> None:
        await health.start()  # the service awaits this before its GPU worker starts
        await health.stop()

    asyncio.run(scenario())
    first = health.status()[0]
    assert first["reachable"] is False and first["state"] == "unreachable"
    assert first["error"] == "probe failed: ValueError: something no one expected"


def test_a_layer_exactly_on_a_split_boundary_is_charged_to_the_local_gpu():
    # llama.cpp compares in float32 and puts this layer on the local GPU; in
    # double precision 1 - 2/3 is a hair over 1/3 and the layer would go remote.
    assert estimate.local_gpu_layers(3, 2.0, [1.0]) == 2
    assert estimate.local_gpu_layers(30, 1.0, [1.0]) == 15
