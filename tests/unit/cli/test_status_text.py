"""`tray-app status` against a service that requires an API key."""

from __future__ import annotations

import pytest

from tests.status_sample import sample_status
from tests.unit import fake_status_service
from tray_app.cli import main
from tray_app.core.api.security import API_KEY_ENV


@pytest.fixture
def no_key_in_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    # The user's own config must not leak a key into the test.
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))


def config_with_key(tmp_path, key: str):
    path = tmp_path / "config.toml"
    path.write_text(f'[server]\napi_key = "{key}"\n')
    return path


def test_status_sends_the_configured_key(key_checking_service, no_key_in_environment, tmp_path, capsys):
    config = config_with_key(tmp_path, key_checking_service.api_key)
    assert main(["status", "--url", key_checking_service.url, "--config", str(config)]) == 0
    assert key_checking_service.authorizations == ["Bearer the-right-key"]
    assert "fake-model" in capsys.readouterr().out


def test_status_sends_the_environment_key_over_the_configured_one(key_checking_service, no_key_in_environment,
                                                                   monkeypatch, tmp_path):
    monkeypatch.setenv(API_KEY_ENV, key_checking_service.api_key)
    config = config_with_key(tmp_path, "a-stale-key")
    assert main(["status", "--url", key_checking_service.url, "--config", str(config)]) == 0
    assert key_checking_service.authorizations == ["Bearer the-right-key"]


@pytest.mark.parametrize("as_json", [False, True])
def test_status_refused_is_an_error_not_an_empty_status(key_checking_service, no_key_in_environment, capsys,
                                                         as_json):
    assert main(["status", "--url", key_checking_service.url, *(["--json"] if as_json else [])]) != 0
    out, err = capsys.readouterr()
    assert out == ""
    assert "HTTP 401" in err and API_KEY_ENV in err


def test_status_text_names_the_engine_and_why_it_is_not_the_configured_one():
    from tray_app.cli.status_text import render_status

    status = sample_status()
    status["engine"].update(version="llama-cpp-python 0.3.36", configured="llama-server",
                            fallback_reason="llama-server is not installed", slots={"gpu": 1, "cpu": 1})
    text = render_status(status)
    assert "engine:    llama-cpp-python 0.3.36; slots: GPU 1, CPU 1" in text
    assert "not llama-server: llama-server is not installed" in text


def test_status_text_lists_the_peers_and_names_one_that_serves():
    from tray_app.cli.status_text import render_status

    status = sample_status()
    status["degraded"].update(active=True, fallback_model="Smol", reason="paused", peers=["desk"])
    (desk,) = status["peers"]
    desk.update(name="desk", role="fallback", url="http://desk:8642", healthy=True, latency_ms=1.5, served=2,
                failures=0)
    attic = {**desk, "name": "attic", "role": "overflow", "url": "http://attic:8642", "healthy": False,
             "problem": "it refused our API key (HTTP 401)", "latency_ms": None, "served": 0, "failures": 1}
    status["peers"].append(attic)
    text = render_status(status)
    assert "peer serving: desk" in text
    assert "  desk  fallback  http://desk:8642  healthy  rtt 1.5 ms  served 2  failures 0" in text
    assert "  attic  overflow  http://attic:8642  out: it refused our API key (HTTP 401)  rtt -" in text


def test_a_status_of_another_shape_is_an_error_that_names_the_key(key_checking_service, no_key_in_environment,
                                                                  monkeypatch, tmp_path, capsys):
    renamed = sample_status()
    renamed["service"]["is_healthy"] = renamed["service"].pop("healthy")
    monkeypatch.setattr(fake_status_service, "STATUS", renamed)
    config = config_with_key(tmp_path, key_checking_service.api_key)
    assert main(["status", "--url", key_checking_service.url, "--config", str(config)]) != 0
    out, err = capsys.readouterr()
    assert out == ""
    assert "status.service.healthy: missing (and 1 more)" in err and "tray-app status --json" in err
