import dataclasses
import itertools
import os
import stat
import tomllib

import pytest

from tray_app.core.config import (
    _SECTIONS, Config, ConfigError, ModelConfig, ServerConfig, apply_overrides, config_to_toml, load_config, log_dir,
    parse_config_text, save_config,
)


def test_defaults_bind_loopback():
    config = Config()
    assert config.server.host == "127.0.0.1" and config.gpu.n_gpu_layers == -1
    # Both contexts are sized from memory unless set.
    assert (config.gpu.n_ctx, config.cpu.n_ctx) == (0, 0)


def test_toml_overrides_defaults():
    config = parse_config_text('[gpu]\nn_ctx = 8192\nreserve_mib = 256\n[cpu]\nqueue_limit = 3\n')
    assert (config.gpu.n_ctx, config.gpu.reserve_mib, config.cpu.queue_limit) == (8192, 256, 3)
    assert config.cpu.n_ctx == Config().cpu.n_ctx


@pytest.mark.parametrize("text, fragment", [
    ("[gpu]\nn_ctx = 'big'\n", "[gpu] n_ctx must be a whole number"),
    ("[gpu]\nn_ctx = 10\n", "[gpu] n_ctx must be 0 .sized from memory. or at least 64, got 10"),
    ("[gpu]\nn_ctx = -1\n", "[gpu] n_ctx must be at least 0"),
    ("[gpu]\nbogus = 1\n", "unknown key [gpu] bogus"),
    ("[nope]\nx = 1\n", "unknown section [nope]"),
    ("[server]\nport = 70000\n", "[server] port must be at most 65535"),
    ("[server]\nmax_body_bytes = 1073741824\n", "[server] max_body_bytes must be at most 268435456"),
    ("[gpu]\nenabled = 1\n", "must be true or false"),
    ("[gpu\n", "not valid TOML"),
    ("[worker]\nbackoff_base_s = 5\nbackoff_cap_s = 1\n", "backoff_cap_s must be at least"),
])
def test_bad_values_name_the_key(text, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        parse_config_text(text)


@pytest.mark.parametrize("text", [
    "[breaker]\ncooldown_s = nan\n",
    "[breaker]\ncooldown_s = inf\n",
    "[gpu]\ntoken_timeout_s = +inf\n",
    "[worker]\nbackoff_cap_s = " + "9" * 400 + "\n",
])
def test_float_keys_refuse_non_finite_numbers(text):
    with pytest.raises(ConfigError, match="must be a finite number"):
        parse_config_text(text)


@pytest.mark.parametrize("overrides", [
    {"breaker": {"window_s": float("nan")}},
    {"cpu": {"assumed_tokens_per_s": float("inf")}},
])
def test_overrides_refuse_non_finite_numbers(overrides):
    with pytest.raises(ConfigError, match="must be a finite number"):
        apply_overrides(Config(), overrides)


@pytest.mark.parametrize("text, fragment", [
    ("[server]\nport = " + "9" * 30 + "\n", "[server] port must be at most 65535"),
    # No upper bound of its own, but llama.cpp reads it as a C int.
    ("[gpu]\nn_ctx = 4294967360\n", "[gpu] n_ctx must be at most 2147483647"),
    ("[worker]\nn_batch = " + "9" * 30 + "\n", "[worker] n_batch must be at most 2147483647"),
])
def test_huge_whole_numbers_are_refused(text, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        parse_config_text(text)


# Every character TOML forbids raw in a basic string, and the two it escapes.
AWKWARD = "".join(chr(c) for c in range(0x20)) + "\x7f" + '"\\' + "é ok"


@pytest.mark.parametrize("value", [AWKWARD, 'x"\nport = 1\n[gpu]\nenabled = false\n#', "trailing backslash\\"])
def test_strings_with_control_characters_round_trip(value):
    config = dataclasses.replace(
        Config(),
        server=ServerConfig(api_key=value, cors_origins=(value, "http://localhost:3000")),
        model=ModelConfig(path=value),
    )
    assert parse_config_text(config_to_toml(config)) == config


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

    example = Path(__file__).resolve().parents[3] / "resources" / "config.example.toml"
    config = parse_config_text(example.read_text())
    assert config == Config(source=None)
    # ...and names every key, so it is the one place to read about them.
    written = tomllib.loads(example.read_text())
    missing = [f"[{section}] {f.name}" for section, cls in _SECTIONS.items() for f in dataclasses.fields(cls)
               if f.name not in written.get(section, {})]
    assert not missing


def test_log_dir_is_private_even_if_it_existed_world_readable(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    existing = tmp_path / "state" / "tray-app" / "log"
    existing.mkdir(parents=True, mode=0o755)
    os.chmod(existing, 0o755)
    assert log_dir() == existing
    assert stat.S_IMODE(os.stat(existing).st_mode) == 0o700


def test_the_example_config_documents_every_peers_key():
    from pathlib import Path

    from tray_app.core.config import PeerEntry

    text = (Path(__file__).resolve().parents[3] / "resources" / "config.example.toml").read_text()
    lines = text.splitlines()
    start = lines.index("# [[peers]]")
    table = "\n".join(line[2:] for line in itertools.takewhile(lambda line: line.startswith("# "), lines[start:]))
    (entry,) = parse_config_text(table).peers
    assert [f.name for f in dataclasses.fields(PeerEntry) if f.name not in table] == []
    assert dataclasses.replace(entry, name="", url="") == PeerEntry()


# ----- the API key of a LAN bind ------------------------------------------------------------


def test_a_lan_bind_refuses_a_short_api_key_and_says_how_to_make_one():
    from tray_app.core.config import SHORTEST_LAN_API_KEY, lan_api_key_problem

    problem = lan_api_key_problem("0.0.0.0", "hunter2")
    assert problem is not None
    assert "7 characters" in problem and f"at least {SHORTEST_LAN_API_KEY}" in problem
    assert "secrets.token_urlsafe" in problem and "TRAY_APP_API_KEY" in problem
    assert lan_api_key_problem("192.168.1.5", "k" * (SHORTEST_LAN_API_KEY - 1)) is not None
    assert lan_api_key_problem("192.168.1.5", "k" * SHORTEST_LAN_API_KEY) is None
    # Loopback needs no key, so a short one is the user's business; no key at all is bind_problem's.
    assert lan_api_key_problem("127.0.0.1", "short") is None
    assert lan_api_key_problem("0.0.0.0", "") is None


def test_serve_on_a_lan_address_with_a_short_key_refuses_to_start(monkeypatch, capsys):
    from tray_app.cli import main

    monkeypatch.setenv("TRAY_APP_API_KEY", "short-key")
    monkeypatch.setenv("XDG_CONFIG_HOME", "/nonexistent-tray-app-test")
    monkeypatch.setattr("tray_app.cli.serve", lambda *args, **kwargs: pytest.fail("the server was started"))
    # `serve` hides the GPUs from its own process by changing os.environ: not this process's.
    monkeypatch.setattr("tray_app.cli.hide_gpus_from_this_process", lambda: None, raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    error = capsys.readouterr().err
    assert "9 characters" in error and "secrets.token_urlsafe(24)" in error


def test_unknown_model_names_are_refused_unless_the_default_model_is_to_answer_them():
    assert Config().model.unknown_name == "refuse"
    assert parse_config_text('[model]\nunknown_name = "default"\n').model.unknown_name == "default"
    with pytest.raises(ConfigError, match="unknown_name"):
        parse_config_text('[model]\nunknown_name = "gpt-3.5-turbo"\n')
