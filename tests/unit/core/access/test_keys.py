"""The named key store: hashed at rest, private, read again when the file changes."""

from __future__ import annotations

import json
import os
import stat

import pytest

from tray_app.core.api.security import AccessPolicy, process_admin_key
from tray_app.core.access.keys import KEY_PREFIX, KeyProblem, KeyStore, digest


@pytest.fixture
def store(tmp_path) -> KeyStore:
    return KeyStore(tmp_path / "config" / "keys.json")


def test_a_key_is_shown_once_and_stored_only_as_its_hash(store):
    raw = store.add("phone", "inference", ("SmolLM2",), 2, now=1000.0)
    text = store.path.read_text()
    assert raw.startswith(KEY_PREFIX) and len(raw) > 40
    assert raw not in text and digest(raw) in text
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o600
    key = store.match(raw)
    assert key is not None and (key.name, key.scope, key.models, key.max_concurrency, key.created) == (
        "phone", "inference", ("SmolLM2",), 2, 1000.0)
    assert store.match(raw + "x") is None and store.match("") is None


def test_names_scopes_and_limits_are_checked(store):
    store.add("phone")
    for bad in ("", "has space", "-dash-first", "x" * 65, "api_key", "tray", "Other"):
        with pytest.raises(KeyProblem):
            store.add(bad)
    with pytest.raises(KeyProblem, match="exists"):
        store.add("phone")
    with pytest.raises(KeyProblem, match="scope"):
        store.add("someone", "root")
    with pytest.raises(KeyProblem, match="at least 1"):
        store.add("someone", max_concurrency=0)
    with pytest.raises(KeyProblem, match="no key named 'ghost'"):
        store.revoke("ghost")


def test_a_second_store_sees_a_revoke_made_by_another_process(store):
    """The service's store and the CLI's are two objects on one file: the
    service notices the CLI's change on its next lookup."""
    raw = store.add("phone")
    service_side = KeyStore(store.path)
    assert service_side.match(raw) is not None
    KeyStore(store.path).revoke("phone")
    assert service_side.match(raw) is None
    assert not service_side.has_keys()


def test_a_hand_broken_file_is_an_error_that_names_it(store):
    store.path.parent.mkdir(parents=True)
    store.path.write_text(json.dumps({"keys": [{"name": "x", "scope": "god", "sha256": "00"}]}))
    with pytest.raises(KeyProblem, match="scope 'god'"):
        store.keys()
    store.path.write_text("{not json")
    with pytest.raises(KeyProblem, match="not valid JSON"):
        store.keys()


def test_policy_names_the_key_a_request_was_made_with(store):
    raw = store.add("ops", "admin")
    policy = AccessPolicy.build(api_key="legacy-key", bind_address="127.0.0.1", allowed_hosts=(), cors_origins=(),
                                keys=store)
    assert policy.authenticate(f"Bearer {raw}") == (True, store.get("ops"))
    passed, legacy = policy.authenticate(None, "legacy-key")
    assert passed and legacy is not None and legacy.is_admin and legacy.name == "api_key"
    assert policy.authenticate("Bearer wrong") == (False, None)
    assert policy.authenticate(None) == (False, None)


def test_without_any_key_everyone_passes_as_nobody(store):
    open_policy = AccessPolicy.build(api_key="", bind_address="127.0.0.1", allowed_hosts=(), cors_origins=(),
                                     keys=store)
    assert not open_policy.key_required
    assert open_policy.authenticate(None) == (True, None)
    # The first named key closes the door without a restart.
    store.add("phone")
    assert open_policy.key_required and open_policy.authenticate(None) == (False, None)


def test_a_running_store_keeps_its_keys_when_the_file_is_broken_by_hand(store):
    raw = store.add("phone")
    running = KeyStore(store.path)
    assert running.match(raw) is not None
    store.path.write_text("{oops")
    # Neither open to everyone nor refusing everyone over a typo.
    assert running.match(raw) is not None and running.has_keys()
    with pytest.raises(KeyProblem):
        KeyStore(store.path).keys()  # the CLI, reading afresh, says what is wrong


def test_the_trays_own_key_is_an_admin_key_when_named_keys_close_the_port(store):
    policy = AccessPolicy.build(api_key="", bind_address="127.0.0.1", allowed_hosts=(), cors_origins=(), keys=store)
    store.add("phone")
    passed, tray = policy.authenticate(f"Bearer {process_admin_key()}")
    assert passed and tray is not None and tray.name == "tray" and tray.is_admin
    assert policy.principal_with_identity("tray") == tray


def test_revoking_the_last_key_leaves_the_check_on(store):
    """Revoking every key never opens the port: the file says keys are
    required, a fresh store (a restart, the CLI) reads that, and a running
    store keeps it even when the file is deleted under it."""
    policy = AccessPolicy.build(api_key="", bind_address="127.0.0.1", allowed_hosts=(), cors_origins=(), keys=store)
    store.add("phone")
    store.revoke("phone")
    assert not store.has_keys()
    assert policy.key_required and policy.authenticate(None) == (False, None)
    assert KeyStore(store.path).required()
    store.path.unlink()
    assert policy.key_required
    # Deleting the file with the service stopped is how keys are turned off.
    assert not KeyStore(store.path).required()


def test_the_last_admin_key_is_not_revoked(store):
    store.add("ops", "admin")
    store.add("phone")
    with pytest.raises(KeyProblem, match="last admin key") as refused:
        store.revoke("ops")
    assert "keys.json" in str(refused.value) and "[server] api_key" in str(refused.value)
    assert store.get("ops") is not None
    store.revoke("phone")  # an inference key may go
    store.add("ops2", "admin")
    store.revoke("ops")  # another admin key remains
    with pytest.raises(KeyProblem, match="last admin key"):
        store.revoke("ops2")
    # With [server] api_key set, that key is an admin of its own.
    store.revoke("ops2", other_admin=True)
    assert not store.has_keys() and store.required()
