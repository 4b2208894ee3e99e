import os
import stat

import pytest

from tray_app.core.config import (
    Config, ConfigError, apply_overrides, load_config, parse_config_text, save_config,
)


def test_defaults_bind_loopback():
    config = Config()
    assert config.server.host == "127.0.0.1" and config.gpu.n_gpu_layers == -1 and config.cpu.n_ctx < config.gpu.n_ctx


def test_toml_overrides_defaults():
    config = parse_config_text('[gpu]\nn_ctx = 8192\nreserve_mib = 256\n[cpu]\nqueue_limit = 3\n')
    assert (config.gpu.n_ctx, config.gpu.reserve_mib, config.cpu.queue_limit) == (8192, 256, 3)
    assert config.cpu.n_ctx == Config().cpu.n_ctx


@pytest.mark.parametrize("text, fragment", [
    ("[gpu]\nn_ctx = 'big'\n", "[gpu] n_ctx must be a whole number"),
    ("[gpu]\nn_ctx = 10\n", "[gpu] n_ctx must be at least 64"),
    ("[gpu]\nbogus = 1\n", "unknown key [gpu] bogus"),
    ("[nope]\nx = 1\n", "unknown section [nope]"),
    ("[server]\nport = 70000\n", "[server] port must be at most 65535"),
    ("[gpu]\nenabled = 1\n", "must be true or false"),
    ("[gpu\n", "not valid TOML"),
    ("[worker]\nbackoff_base_s = 5\nbackoff_cap_s = 1\n", "backoff_cap_s must be at least"),
])
def test_bad_values_name_the_key(text, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        parse_config_text(text)


def test_float_keys_accept_integers():
    assert parse_config_text("[breaker]\ncooldown_s = 5\n").breaker.cooldown_s == 5.0


def test_explicit_missing_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.toml")


def test_save_is_atomic_user_only_and_round_trips(tmp_path):
    config = apply_overrides(Config(), {"gpu": {"n_ctx": 1024}, "server": {"cors_origins": ["http://localhost:3000"]}})
    path = save_config(config, tmp_path / "sub" / "config.toml")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["config.toml"]
    loaded = load_config(path)
    assert loaded.gpu.n_ctx == 1024 and loaded.server.cors_origins == ("http://localhost:3000",)
    assert loaded.source == path


def test_bundled_model_is_found():
    path = Config().model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_the_commented_example_config_is_the_defaults():
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "resources" / "config.example.toml"
    config = parse_config_text(example.read_text())
    assert config == Config(source=None)
