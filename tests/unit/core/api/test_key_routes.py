"""POST /admin/keys in-process, over a real key store in a temporary folder:
the route checks the body's JSON types, the store what a key may be, and
every refusal is a 400 (or 409) in the error envelope naming the field."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
from starlette.applications import Starlette

from tray_app.core.access.keys import KeyProblem, KeyStore
from tray_app.core.api.key_routes import key_routes
from tray_app.core.config import parse_config_text


@pytest.fixture
def store(tmp_path) -> KeyStore:
    return KeyStore(tmp_path / "keys.json")


@pytest.fixture
async def http(store):
    app = Starlette(routes=key_routes(store))
    # The body reader takes its size and time bounds from the service's [server] config.
    app.state.service = SimpleNamespace(config=parse_config_text(""))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
        yield client


@pytest.mark.parametrize("body, field", [
    ({"name": 7}, "name"),  # JSON types: the route's
    ({"name": "x", "scope": ["admin"]}, "scope"),
    ({"name": "x", "models": "all"}, "models"),
    ({"name": "x", "max_concurrency": True}, "max_concurrency"),
    ({"name": "x", "owner": "me"}, "owner"),
    ({"name": "has space"}, "name"),  # values: the store's
    ({"name": "api_key"}, "name"),
    ({"name": "x", "scope": "root"}, "scope"),
    ({"name": "x", "max_concurrency": 0}, "max_concurrency"),
])
async def test_a_bad_field_is_a_400_that_names_it(http, store, body, field):
    answer = await http.post("/admin/keys", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == field and answer.json()["error"]["code"] == "invalid_value"
    assert not store.keys()


@pytest.mark.parametrize("name, scope, limit, field", [
    ("has space", "inference", None, "name"), ("x", "root", None, "scope"), ("x", "inference", 0, "max_concurrency")])
async def test_the_route_says_what_the_store_says(http, store, name, scope, limit, field):
    """One rule, one sentence: the web page, the CLI and the settings window
    get the store's own words for a bad name, scope or limit."""
    with pytest.raises(KeyProblem) as refused:
        store.add(name, scope, max_concurrency=limit)
    assert refused.value.field == field
    answer = await http.post("/admin/keys", json={"name": name, "scope": scope, "max_concurrency": limit})
    assert answer.json()["error"]["message"] == str(refused.value)


async def test_a_taken_name_is_a_409(http):
    made = await http.post("/admin/keys", json={"name": "phone", "max_concurrency": 2})
    assert made.status_code == 201 and made.json()["key"].startswith("tak_") and made.json()["max_concurrency"] == 2
    again = await http.post("/admin/keys", json={"name": "phone", "scope": "admin"})
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "key_exists" and again.json()["error"]["param"] == "name"


async def test_revoking_the_last_admin_key_is_a_409_that_says_why(http, store):
    store.add("ops", "admin")
    answer = await http.delete("/admin/keys/ops")
    assert answer.status_code == 409, answer.text
    assert answer.json()["error"]["code"] == "last_admin_key"
    assert "stop the service and delete" in answer.json()["error"]["message"]
    assert store.get("ops") is not None


async def test_a_key_may_be_made_without_the_prompt_cache(http, store):
    made = await http.post("/admin/keys", json={"name": "guest", "prompt_cache": False})
    assert made.status_code == 201 and made.json()["prompt_cache"] is False
    assert store.get("guest").prompt_cache is False and KeyStore(store.path).get("guest").prompt_cache is False
    refused = await http.post("/admin/keys", json={"name": "other", "prompt_cache": "no"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_cache"
