from __future__ import annotations

import pytest

from tray_app.core.config import ConfigError, parse_config_text
from tray_app.core.api.security import API_KEY_ENV, AccessPolicy, bearer_header, effective_api_key


def policy(allowed_hosts=()) -> AccessPolicy:
    return AccessPolicy.build(api_key="", bound_host="127.0.0.1", allowed_hosts=allowed_hosts, cors_origins=())


def test_the_environment_key_wins_over_the_configured_one(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert effective_api_key("from-config") == "from-env"


def test_the_configured_key_applies_without_an_environment_key(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert effective_api_key("from-config") == "from-config"


def test_an_empty_environment_key_does_not_hide_the_configured_one(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "")
    assert effective_api_key("from-config") == "from-config"


def test_bearer_header_only_with_a_key():
    assert bearer_header("k") == {"Authorization": "Bearer k"}
    assert bearer_header("") == {}


def test_a_listed_name_is_allowed_and_a_rebinding_name_is_not():
    allowed = policy(allowed_hosts=["myhost.lan"])
    assert allowed.host_allowed("myhost.lan:8642") and allowed.host_allowed("localhost:8642")
    assert not allowed.host_allowed("evil.example:8642")


def test_a_star_in_allowed_hosts_is_not_a_wildcard():
    assert not policy(allowed_hosts=["*"]).host_allowed("evil.example:8642")


@pytest.mark.parametrize("hosts", ['["*"]', '["myhost.lan", "*.lan"]'])
def test_config_refuses_wildcards_in_allowed_hosts(hosts):
    with pytest.raises(ConfigError, match=r"\[server\] allowed_hosts takes host names, not wildcards"):
        parse_config_text(f"[server]\nallowed_hosts = {hosts}\n")
