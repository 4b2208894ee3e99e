"""llama.cpp RPC workers: addresses, the GPU worker's flags, the
rpc-worker command's refusal to listen openly, and the health probe."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

from tray_app.cli.rpc_worker import is_loopback, rpc_server_argv, run_rpc_worker
from tray_app.core.config import ConfigError, parse_config_text, rpc_address_problem
from tray_app.core.engine.runtime import LaunchRequest, LlamaServerRuntime
from tray_app.core.engine.worker import free_loopback_port
from tray_app.core.rpc import RpcHealth


@pytest.mark.parametrize("address", ["10.0.0.2:50052", "[::1]:50052", "gpu-box.lan:1", "127.0.0.1:65535"])
def test_good_addresses(address):
    assert rpc_address_problem(address) is None


@pytest.mark.parametrize("address", ["gpu-box", "gpu-box:0", "gpu-box:65536", ":50052", "gpu-box:port",
                                     "a b:50052", "a,b:50052", ""])
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


def test_rpc_server_argv():
    argv = rpc_server_argv("/bin/ggml-rpc-server", _args(device="CUDA0", threads=4, cache=True))
    assert argv == ["/bin/ggml-rpc-server", "--host", "127.0.0.1", "--port", "50052", "--device", "CUDA0",
                    "--threads", "4", "--cache"]


def test_the_probe_sees_a_server_come_and_go():
    async def scenario() -> list[list[dict]]:
        port = free_loopback_port()
        health = RpcHealth((f"127.0.0.1:{port}",), clock=lambda: 100.0)
        seen = [health.status()]
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
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


def test_the_panel_names_each_remote_device_and_its_state():
    from tray_app.ui.viewmodel import rpc_servers_text

    assert rpc_servers_text([]) == ""
    text = rpc_servers_text([{"address": "10.0.0.2:50052", "reachable": True, "latency_ms": 0.4},
                             {"address": "10.0.0.3:50052", "reachable": False, "latency_ms": None},
                             {"address": "10.0.0.4:50052", "reachable": None}])
    assert text == ("Remote devices (RPC): 10.0.0.2:50052 reachable, 0.4 ms · 10.0.0.3:50052 unreachable · "
                    "10.0.0.4:50052 not checked yet")
