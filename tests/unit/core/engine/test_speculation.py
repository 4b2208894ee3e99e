"""Which --spec-type a worker gets from [gpu]/[cpu] speculative."""

from __future__ import annotations

from pathlib import Path

import pytest

from tray_app.core.base.policies import SPECULATIVE_TYPES
from tray_app.core.engine import speculation
from tray_app.core.engine.runtime import LaunchRequest, LlamaCppPythonRuntime, LlamaServerRuntime
from tray_app.core.engine.speculation import speculation_for


def test_a_named_type_runs_where_the_runtime_has_it_and_off_is_none():
    assert speculation_for("cpu", "ngram-mod", SPECULATIVE_TYPES) == "ngram-mod"
    assert speculation_for("gpu", "off", SPECULATIVE_TYPES) is None
    # llama-cpp-python's server has no draft-free speculation: nothing is passed to it.
    assert speculation_for("cpu", "ngram-mod", LlamaCppPythonRuntime.spec_types) is None


@pytest.mark.parametrize("path", ["gpu", "cpu"])
def test_auto_is_the_measured_choice_of_each_path(path, monkeypatch):
    assert speculation_for(path, "auto", SPECULATIVE_TYPES) == (
        None if speculation.AUTO_BY_PATH[path] == "off" else speculation.AUTO_BY_PATH[path])
    monkeypatch.setitem(speculation.AUTO_BY_PATH, path, "ngram-simple")
    assert speculation_for(path, "auto", SPECULATIVE_TYPES) == "ngram-simple"


def test_llama_server_is_started_with_the_type_and_without_it_when_none():
    runtime = LlamaServerRuntime(Path("/bin/llama-server"))
    launch = LaunchRequest(model_path=Path("m.gguf"), port=1, n_ctx=512, n_gpu_layers=0, n_batch=512, n_threads=1)
    assert "--spec-type" not in runtime.argv(launch)
    argv = runtime.argv(LaunchRequest(model_path=Path("m.gguf"), port=1, n_ctx=512, n_gpu_layers=0, n_batch=512,
                                      n_threads=1, spec_type="ngram-mod"))
    assert argv[argv.index("--spec-type") + 1] == "ngram-mod"
