"""Named API keys, one per app, each with a scope and limits.

Only a key's SHA-256 is stored: the raw key (`tak_` and 32 random bytes) is
shown once, when it is made. A hash of a high-entropy token needs no salt or
slow hash, since nobody can guess their way to a 256-bit token. The file is
the user's alone (0600) and written atomically; a running service notices a
change by the file's mtime, so `tray-app keys revoke` takes effect at once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..base.files import PRIVATE_FILE_MODE, write_atomically
from .usage import OTHER

log = logging.getLogger(__name__)

KEY_PREFIX = "tak_"
SCOPES = ("inference", "admin")
KEYS_FILE = "keys.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# The old single [server] api_key (and TRAY_APP_API_KEY): an admin key under this name.
LEGACY_KEY_NAME = "api_key"
# The tray's own per-process key (api/security.py): an admin key under this name.
TRAY_KEY_NAME = "tray"
# Names a named key can't take: each is an admin's (a web session is
# resolved by its key's name), or usage's bucket for names past its limit.
_RESERVED = {LEGACY_KEY_NAME: "the key set in [server] api_key", TRAY_KEY_NAME: "the tray's own key",
             OTHER: "usage's bucket for apps past its limit"}


class KeyProblem(ValueError):
    """A key that can't be added or revoked, with the sentence that says why,
    and the field at fault when one is (POST /admin/keys names it in its 400)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class KeyExists(KeyProblem):
    """A new key's name is taken (POST /admin/keys answers 409)."""


class LastAdminKey(KeyProblem):
    """The key to revoke is the last admin key (DELETE /admin/keys answers 409)."""


@dataclass(frozen=True)
class ApiKey:
    name: str
    scope: str
    # Library model names this key may use; empty = every model.
    models: tuple[str, ...] = ()
    # Requests of this key running or queued at once; None = no limit.
    max_concurrency: int | None = None
    created: float = 0.0
    sha256: str = field(default="", repr=False)
    # False: this key's requests never reuse the workers' prompt cache, so
    # it can't time whether another key sent the same prompt (its long
    # prompts are read in full each time).
    prompt_cache: bool = True

    @property
    def is_admin(self) -> bool:
        return self.scope == "admin"

    @property
    def identity(self) -> str:
        """Who this key is, for what is kept per key (stored responses,
        idempotency, web sessions, request ids, running requests): its hash,
        so a key revoked and added again under the same name is someone
        else; the name for the [server] api_key and the tray's own key,
        which have no stored hash."""
        return self.sha256 or self.name

    def public(self) -> dict[str, Any]:
        """What `keys list` shows: everything but the hash."""
        return {"name": self.name, "scope": self.scope, "models": list(self.models),
                "max_concurrency": self.max_concurrency, "created": self.created, "prompt_cache": self.prompt_cache}


def default_keys_path() -> Path:
    from ..config import config_dir

    return config_dir() / KEYS_FILE


def digest(raw_key: str) -> str:
    return hashlib.sha256(raw_key.encode()).hexdigest()


def name_problem(name: str) -> str | None:
    if not _NAME.fullmatch(name):
        return (f"key name {name!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a letter "
                "or digit (it appears in /status, /metrics and logs)")
    if name.lower() in _RESERVED:
        return f"{name!r} names {_RESERVED[name.lower()]}; choose another name"
    return None


def parse_keys(data: Any) -> dict[str, ApiKey]:
    """The file's contents, checked: a hand-edited file with a bad entry is an
    error that names it, not a key silently ignored."""
    if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
        raise KeyProblem('the keys file must be {"keys": [...]}')
    keys: dict[str, ApiKey] = {}
    for entry in data["keys"]:
        try:
            key = ApiKey(name=str(entry["name"]), scope=str(entry["scope"]), models=tuple(entry.get("models") or ()),
                         max_concurrency=entry.get("max_concurrency"), created=float(entry.get("created", 0)),
                         prompt_cache=entry.get("prompt_cache", True) is not False,
                         sha256=str(entry["sha256"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise KeyProblem(f"a keys file entry is malformed ({exc!r}): {entry!r}") from None
        if key.scope not in SCOPES:
            raise KeyProblem(f"key {key.name!r} has scope {key.scope!r}; it must be one of {', '.join(SCOPES)}")
        keys[key.name] = key
    return keys


class KeyStore:
    """The keys file, read again whenever its mtime changes (one stat per
    lookup: cheap next to an HTTP request)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_keys_path()
        self._keys: dict[str, ApiKey] = {}
        self._seen: tuple[int, int, int] | None = None
        self._read_once = False
        self._required = False

    def keys(self) -> dict[str, ApiKey]:
        self._refresh()
        return dict(self._keys)

    def has_keys(self) -> bool:
        self._refresh()
        return bool(self._keys)

    def required(self) -> bool:
        """Whether requests need a key because of this file. Once it has held
        a key, it stays on: revoking the last key leaves the file saying so
        (`"required": true`), and a running service that saw it on keeps it on
        even if the file goes. Turning keys off is a deliberate act with the
        service stopped: deleting the file by hand."""
        self._refresh()
        return self._required

    def get(self, name: str) -> ApiKey | None:
        self._refresh()
        return self._keys.get(name)

    def with_identity(self, identity: str) -> ApiKey | None:
        """The named key that is `identity` (ApiKey.identity), if it still exists."""
        self._refresh()
        return next((key for key in self._keys.values() if key.sha256 == identity), None)

    def match(self, raw_key: str) -> ApiKey | None:
        """The key whose hash this is. Every entry is compared, in constant
        time each, so the answer's timing says nothing about which matched."""
        self._refresh()
        offered = digest(raw_key).encode()
        found = None
        for key in self._keys.values():
            if hmac.compare_digest(offered, key.sha256.encode()):
                found = key
        return found

    def add(self, name: str, scope: str = "inference", models: tuple[str, ...] = (),
            max_concurrency: int | None = None, now: float | None = None, prompt_cache: bool = True) -> str:
        """Store a new key; return the raw key, which is not kept anywhere."""
        problem = name_problem(name)
        if problem:
            raise KeyProblem(problem, "name")
        if scope not in SCOPES:
            raise KeyProblem(f"scope must be one of {', '.join(SCOPES)}, not {scope!r}", "scope")
        if max_concurrency is not None and max_concurrency < 1:
            raise KeyProblem("max concurrency must be at least 1 (leave it out for no limit)", "max_concurrency")
        keys = self._read()
        if name in keys:
            raise KeyExists(f"a key named {name!r} exists; revoke it first to replace it", "name")
        raw = KEY_PREFIX + secrets.token_urlsafe(32)
        keys[name] = ApiKey(name, scope, tuple(models), max_concurrency,
                            time.time() if now is None else now, digest(raw), prompt_cache)
        self._write(keys)
        return raw

    def revoke(self, name: str, other_admin: bool = False) -> ApiKey:
        """Remove a key. The last admin key stays unless `other_admin` (the
        [server] api_key is set): without one, nobody could manage keys over
        HTTP, and the service keeps requiring a key either way."""
        keys = self._read()
        if name not in keys:
            known = ", ".join(sorted(keys)) or "none"
            raise KeyProblem(f"no key named {name!r} (keys: {known})")
        if keys[name].is_admin and not other_admin and not any(
                key.is_admin for key in keys.values() if key.name != name):
            raise LastAdminKey(
                f"{name!r} is the last admin key: without it nobody could manage keys over HTTP, and the "
                "service would still require a key (revoking a key never turns the check off). Add another "
                "admin key first (tray-app keys add NAME --scope admin), or set [server] api_key; to turn "
                f"keys off, stop the service and delete {self.path} by hand")
        revoked = keys.pop(name)
        self._write(keys)
        return revoked

    def _read(self) -> dict[str, ApiKey]:
        self._seen = None
        self._refresh()
        return dict(self._keys)

    def _refresh(self) -> None:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            self._keys, self._seen = {}, None
            return
        # The inode too: each write renames a new file into place, so two
        # writes within the clock's granularity still differ.
        seen = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if seen == self._seen:
            return
        try:
            try:
                data = json.loads(self.path.read_text())
            except ValueError as exc:
                raise KeyProblem(f"{self.path} is not valid JSON ({exc}); fix or delete it") from None
            keys = parse_keys(data)
        except KeyProblem as problem:
            if not self._read_once:
                raise
            # A running service whose file was broken by hand keeps the keys
            # it had: failing open would let everyone in, failing every
            # request would take the service down over a typo.
            log.error("%s; keeping the %d keys read before", problem, len(self._keys))
            self._seen = seen
            return
        self._keys, self._seen, self._read_once = keys, seen, True
        self._required = self._required or bool(keys) or data.get("required") is True

    def _write(self, keys: dict[str, ApiKey]) -> None:
        entries = [{**asdict(key), "models": list(key.models)} for key in keys.values()]
        document = {"keys": entries, "required": self._required or bool(keys)}
        write_atomically(self.path, json.dumps(document, indent=2).encode(), mode=PRIVATE_FILE_MODE)
        self._seen = None
        self._refresh()
