"""Saved chat conversations: one JSON file each, in the app's data folder. No Qt here.

Files are written atomically (a crash leaves the old file or the new one)
and owner-only, like the logs: they hold what the user typed. A file that
is not one of ours, or is damaged, is skipped with a log line; it never
stops the chat window from opening.

A question may carry images: its turn keeps them as data: URIs ("images"),
and its message is sent as OpenAI content parts, so a reopened conversation
shows them and sends them again.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs

from ..core.api.openai_request import InvalidRequest, MAX_IMAGE_BYTES, assemble_content, image_part, image_type
from ..core.config import APP_NAME
from ..core.base.files import PRIVATE_FILE_MODE, make_private_dir, write_atomically

log = logging.getLogger(__name__)

FORMAT = "tray-app-conversation"
VERSION = 1
TITLE_CHARS = 60
ROLES = ("user", "assistant")
MESSAGE_ROLES = ("system", "user", "assistant")
# Ids are made here and become file names: nothing else may reach a path.
_ID = re.compile(r"^[A-Za-z0-9_-]{1,80}$")


def default_dir() -> Path:
    """Where the app keeps conversations (~/.local/share/tray-app/conversations on Linux)."""
    return Path(platformdirs.user_data_dir(APP_NAME)) / "conversations"


def new_id(now: float | None = None) -> str:
    """Sorts by creation time, and two made in the same second differ."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now if now is not None else time.time()))
    return f"{stamp}-{uuid.uuid4().hex[:6]}"


def title_for(turns: list[dict[str, str]]) -> str:
    """The first line of the first question, shortened."""
    first = next((t["text"] for t in turns if t["role"] == "user" and t["text"].strip()), "")
    line = first.strip().splitlines()[0] if first.strip() else "New conversation"
    return line if len(line) <= TITLE_CHARS else line[:TITLE_CHARS - 1].rstrip() + "…"


@dataclass
class Conversation:
    """What a conversation saves: the turns as shown and the messages as sent.

    They differ: a question whose answer failed with nothing is shown but not
    sent again (a retry would be a double)."""

    id: str = field(default_factory=new_id)
    system_prompt: str = ""
    turns: list[dict[str, str]] = field(default_factory=list)      # role, text, meta, error
    messages: list[dict[str, str]] = field(default_factory=list)   # role, content (no system prompt)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)

    @property
    def title(self) -> str:
        return title_for(self.turns)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "id": self.id, "title": self.title,
                "created": self.created, "updated": self.updated, "system_prompt": self.system_prompt,
                "turns": self.turns, "messages": self.messages}


@dataclass(frozen=True)
class Summary:
    id: str
    title: str
    updated: float


class ConversationStore:
    """The conversations in one folder: list, load, save, delete."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def path(self, conversation_id: str) -> Path:
        if not _ID.match(conversation_id):
            raise ValueError(f"not a conversation id: {conversation_id!r}")
        return self.folder / f"{conversation_id}.json"

    def save(self, conversation: Conversation) -> Path:
        make_private_dir(self.folder)
        conversation.updated = time.time()
        data = json.dumps(conversation.to_json(), ensure_ascii=False, indent=1).encode()
        return write_atomically(self.path(conversation.id), data, mode=PRIVATE_FILE_MODE)

    def load(self, conversation_id: str) -> Conversation | None:
        """The conversation, or None (and a log line) if it is gone or not one of ours."""
        try:
            path = self.path(conversation_id)
            return parse(json.loads(path.read_text(encoding="utf-8")), conversation_id)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            # json.JSONDecodeError and UnicodeDecodeError are ValueErrors.
            log.warning("skipping the conversation %s: %s", conversation_id, exc)
            return None

    def list(self) -> list[Summary]:
        """Every readable conversation, the most recently updated first."""
        found = []
        try:
            paths = sorted(self.folder.glob("*.json"))
        except OSError as exc:
            log.warning("cannot list the conversations in %s: %s", self.folder, exc)
            return []
        for path in paths:
            if not _ID.match(path.stem):
                continue
            conversation = self.load(path.stem)
            if conversation is not None:
                found.append(Summary(conversation.id, conversation.title, conversation.updated))
        return sorted(found, key=lambda s: s.updated, reverse=True)

    def delete(self, conversation_id: str) -> bool:
        try:
            self.path(conversation_id).unlink()
            return True
        except (OSError, ValueError) as exc:
            log.warning("cannot delete the conversation %s: %s", conversation_id, exc)
            return False


def parse(data: Any, conversation_id: str) -> Conversation:
    """A Conversation from a file's JSON; ValueError if it is not one of ours."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError("not a tray-app conversation")
    if not isinstance(data.get("version"), int) or data["version"] > VERSION:
        raise ValueError(f"unknown version {data.get('version')!r}")
    prompt = data.get("system_prompt", "")
    if not isinstance(prompt, str):
        raise ValueError("system_prompt is not text")
    turns = [_turn(t) for t in _list(data, "turns")]
    messages = [_message(m) for m in _list(data, "messages")]
    return Conversation(id=conversation_id, system_prompt=prompt, turns=turns, messages=messages,
                        created=_number(data, "created"), updated=_number(data, "updated"))


def _list(data: dict, key: str) -> list:
    value = data.get(key)
    if not isinstance(value, list):
        raise ValueError(f"{key} is not a list")
    return value


def _number(data: dict, key: str) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} is not a number")
    return float(value)


def _record(item: Any, roles: tuple[str, ...], role_key: str, text_key: str,
            optional: tuple[str, ...]) -> dict[str, str]:
    if not isinstance(item, dict) or item.get(role_key) not in roles or not isinstance(item.get(text_key), str):
        raise ValueError(f"not a {text_key} record: {str(item)[:80]}")
    record = {role_key: item[role_key], text_key: item[text_key]}
    for key in optional:
        value = item.get(key, "")
        record[key] = value if isinstance(value, str) else ""
    return record


def _turn(item: Any) -> dict[str, Any]:
    record: dict[str, Any] = _record(item, ROLES, "role", "text", ("meta", "error"))
    images = item.get("images")
    if images is not None:
        if not isinstance(images, list) or not all(isinstance(i, str) and i.startswith("data:image/")
                                                   for i in images):
            raise ValueError("a turn's images are not data: URIs")
        record["images"] = images
    return record


def _message(item: Any) -> dict[str, Any]:
    if isinstance(item, dict) and isinstance(item.get("content"), list) and item.get("role") == "user":
        for part in item["content"]:
            image = part.get("image_url") if isinstance(part, dict) else None
            if not (isinstance(part, dict) and (
                    (part.get("type") == "text" and isinstance(part.get("text"), str))
                    or (part.get("type") == "image_url" and isinstance(image, dict)
                        and isinstance(image.get("url"), str) and image["url"].startswith("data:image/")))):
                raise ValueError(f"not a content part: {str(part)[:80]}")
        return {"role": "user", "content": item["content"]}
    return _record(item, MESSAGE_ROLES, "role", "content", ())


# ----- attached images ---------------------------------------------------------------------------


def image_data_uri(raw: bytes) -> str:
    """An image file's bytes as a data: URI to attach; ValueError saying why
    when the service would refuse it (not an image it reads, damaged, too large)."""
    if len(raw) > MAX_IMAGE_BYTES:
        raise ValueError(f"the image is over the {MAX_IMAGE_BYTES // (1024 * 1024)} MiB limit")
    try:
        mime = image_type(raw, "the image")
    except InvalidRequest as refused:
        raise ValueError(refused.message) from None
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def image_bytes(data_uri: str) -> bytes:
    """An attached image's bytes, for showing it."""
    return base64.b64decode(data_uri.partition(",")[2])


def user_content(text: str, images: list[str]) -> str | list[dict[str, Any]]:
    """A question's content as the service takes it: text alone, or its images then its text."""
    return assemble_content([image_part(uri) for uri in images] + ([{"type": "text", "text": text}] if text else []))
