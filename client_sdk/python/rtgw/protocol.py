"""The client side of a Realtime session, without I/O.

``ClientProtocol`` builds the client events to send (as dicts) and takes the server's events in
(``receive``), returning typed events and keeping a local copy of the conversation: every item
with its id, role and text, as the server last described it. The asyncio client (``client.py``)
moves the dicts over a WebSocket; the on-device fallback (``offline.py``) appends its turns to
the same conversation, so a later session can be restored from it (``restore_events``).

Item ids are chosen here for user items (the API lets a client name its items), and taken from
the server for assistant items, so the same ids survive a reconnect.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant"]

GOING_AWAY = 1001
MAX_RECONNECT_AFTER_MS = 60_000  # a hint asking for a longer wait is held to this


def reconnect_hint(code: int | None, reason: str | None) -> int | None:
    """The gateway's drain hint: a close with 1001 whose reason is ``{"reconnect":true,
    "after_ms":N}`` asks the client to reconnect after N ms (the load balancer then picks a
    replica that is not going away). The delay in ms, or None for any other close."""
    if code != GOING_AWAY or not reason:
        return None
    try:
        hint = json.loads(reason)
    except ValueError:
        return None
    if not isinstance(hint, dict) or hint.get("reconnect") is not True:
        return None
    after = hint.get("after_ms", 0)
    if isinstance(after, bool) or not isinstance(after, (int, float)) or not after >= 0:
        after = 0
    return int(min(after, MAX_RECONNECT_AFTER_MS))


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


@dataclass
class Item:
    """One message of the conversation, as both sides know it."""

    id: str
    role: Role
    text: str
    status: str = "completed"

    def wire(self) -> dict[str, Any]:
        kind = "output_text" if self.role == "assistant" else "input_text"
        return {"type": "message", "id": self.id, "role": self.role, "content": [{"type": kind, "text": self.text}]}


@dataclass(frozen=True)
class TextDelta:
    response_id: str
    text: str


@dataclass(frozen=True)
class TurnResult:
    """How a turn ended. ``status``: completed, incomplete, cancelled or failed."""

    response_id: str
    status: str
    text: str
    item_id: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    usage: Mapping[str, Any] = field(default_factory=dict)
    reason: str | None = None  # why it was cancelled or incomplete
    error: Mapping[str, Any] | None = None  # why it failed
    offline: bool = False  # served by the on-device model, not the gateway

    @property
    def tier(self) -> str:
        return str(self.metadata.get("x_tier", ""))

    @property
    def cached_tokens(self) -> int:
        details = self.usage.get("input_token_details") or {}
        return int(details.get("cached_tokens", 0) or 0)


@dataclass(frozen=True)
class ServerError:
    """An ``error`` event: ``event_id`` names the client event it answers, when the server knows it."""

    code: str
    message: str
    param: str | None = None
    event_id: str | None = None


@dataclass(frozen=True)
class ItemTruncated:
    item_id: str
    text: str


@dataclass(frozen=True)
class ItemRetrieved:
    item: Item  # the server's copy (the local conversation is not changed by it)


@dataclass(frozen=True)
class SessionInfo:
    id: str
    model: str


Event = TextDelta | TurnResult | ServerError | ItemTruncated | ItemRetrieved | SessionInfo


@dataclass
class _Active:
    response_id: str
    item_id: str | None = None
    text: str = ""


class ClientProtocol:
    def __init__(self) -> None:
        self.items: list[Item] = []  # the conversation, oldest first
        self.session: SessionInfo | None = None
        self._active: _Active | None = None

    # --- what to send ---------------------------------------------------------------------------

    @staticmethod
    def event(kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "event_id": new_id("evt"), **fields}

    def session_update(self, **session: Any) -> dict[str, Any]:
        return self.event("session.update", session={"type": "realtime", **session})

    def user_turn(self, text: str, **response: Any) -> list[dict[str, Any]]:
        """The user's message (added to the local conversation now) and the request to answer it."""
        item = Item(new_id("item"), "user", text)
        self.items.append(item)
        create = self.event("conversation.item.create", item=item.wire())
        return [create, self.event("response.create", response=response) if response else self.event("response.create")]

    def cancel(self) -> dict[str, Any] | None:
        return self.event("response.cancel") if self._active is not None else None

    def truncate(self, item_id: str, heard_chars: int) -> dict[str, Any]:
        """Keep the first ``heard_chars`` characters of an assistant item (our ``x_text_end``)."""
        item = self.item(item_id)
        end = max(0, min(heard_chars, len(item.text) if item else heard_chars))
        return self.event("conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=0,
                          x_text_end=end)

    def replace_events(self, item_id: str, text: str) -> list[dict[str, Any]]:
        """For a server without ``x_text_end``: delete the item, create it again holding ``text``."""
        index = self._index(item_id)
        previous = self.items[index - 1].id if index > 0 else None
        item = self.items[index]
        item.text = text
        create = self.event("conversation.item.create", item=item.wire())
        if previous is not None:
            create["previous_item_id"] = previous
        return [self.event("conversation.item.delete", item_id=item_id), create]

    def restore_events(self) -> list[dict[str, Any]]:
        """Re-create the whole conversation on a new session, in order, with the same ids."""
        return [self.event("conversation.item.create", item=item.wire()) for item in self.items if item.text]

    def add_local_turn(self, user_text: str | None, assistant_text: str, item_id: str | None = None) -> Item:
        """A turn served without the gateway (on the device): it joins the conversation."""
        if user_text is not None:
            self.items.append(Item(new_id("item"), "user", user_text))
        item = Item(item_id or new_id("item"), "assistant", assistant_text)
        self.items.append(item)
        return item

    # --- what arrives -------------------------------------------------------------------------

    @property
    def active_response_id(self) -> str | None:
        return self._active.response_id if self._active else None

    def connection_lost(self) -> TurnResult | None:
        """The socket closed: the active turn (if any) ends ``failed``; its partial text stays."""
        active, self._active = self._active, None
        if active is None:
            return None
        self._keep_partial(active)
        return TurnResult(active.response_id, "failed", active.text, active.item_id,
                          error={"type": "connection_error", "code": "connection_lost",
                                 "message": "the connection to the gateway was lost"})

    def receive(self, event: Mapping[str, Any]) -> list[Event]:
        kind = event.get("type")
        if kind in ("session.created", "session.updated"):
            session = event.get("session") or {}
            self.session = SessionInfo(str(session.get("id", "")), str(session.get("model", "")))
            return [self.session]
        if kind == "response.created":
            self._active = _Active(str(event["response"]["id"]))
            return []
        if kind in ("conversation.item.added", "conversation.item.created"):
            self._item_added(event.get("item") or {}, event.get("previous_item_id"))
            return []
        if kind in ("response.output_text.delta", "response.text.delta"):
            active = self._active
            if active is None or event.get("response_id") != active.response_id:
                return []
            active.item_id = active.item_id or event.get("item_id")
            active.text += event.get("delta", "")
            return [TextDelta(active.response_id, event.get("delta", ""))]
        if kind == "response.done":
            return [self._response_done(event.get("response") or {})]
        if kind == "conversation.item.truncated":
            item = self.item(str(event.get("item_id")))
            if item is None:
                return []
            item.text = item.text[: int(event.get("x_text_end", len(item.text)))]
            return [ItemTruncated(item.id, item.text)]
        if kind == "conversation.item.retrieved":
            raw = event.get("item") or {}
            text = "".join(str(part.get("text") or "") for part in raw.get("content") or [])
            return [ItemRetrieved(Item(str(raw.get("id", "")), raw.get("role", "user"), text,
                                       str(raw.get("status", "completed"))))]
        if kind == "conversation.item.deleted":
            self.items = [i for i in self.items if i.id != event.get("item_id")]
            return []
        if kind == "error":
            error = event.get("error") or {}
            return [ServerError(str(error.get("code") or "error"), str(error.get("message", "")), error.get("param"),
                                error.get("event_id"))]
        return []

    def item(self, item_id: str) -> Item | None:
        return next((i for i in self.items if i.id == item_id), None)

    def last_assistant(self) -> Item | None:
        return next((i for i in reversed(self.items) if i.role == "assistant"), None)

    # --- internals -------------------------------------------------------------------------------

    def _index(self, item_id: str) -> int:
        for n, item in enumerate(self.items):
            if item.id == item_id:
                return n
        raise KeyError(item_id)

    def _item_added(self, raw: Mapping[str, Any], previous_id: object) -> None:
        item_id = raw.get("id")
        if not isinstance(item_id, str) or self.item(item_id) is not None:
            return  # ours (a user item we named, or a restored one): already in the conversation
        role = raw.get("role")
        if role not in ("system", "user", "assistant"):
            return
        text = "".join(str(part.get("text") or part.get("transcript") or "") for part in raw.get("content") or [])
        item = Item(item_id, role, text, str(raw.get("status", "completed")))
        after = self.item(previous_id) if isinstance(previous_id, str) else None
        self.items.insert(self._index(after.id) + 1 if after else len(self.items), item)
        if role == "assistant" and self._active is not None and self._active.item_id is None:
            self._active.item_id = item_id

    def _keep_partial(self, active: _Active) -> None:
        if active.item_id is not None:
            item = self.item(active.item_id)
            if item is not None:
                item.text = active.text

    def _response_done(self, response: Mapping[str, Any]) -> TurnResult:
        active = self._active
        response_id = str(response.get("id", ""))
        if active is None or active.response_id != response_id:
            active = _Active(response_id)
        self._active = None
        output = response.get("output") or []
        if output and not active.item_id:
            active.item_id = output[0].get("id")
        if output:
            active.text = "".join(str(p.get("text") or "") for p in output[0].get("content") or []) or active.text
        self._keep_partial(active)
        details = response.get("status_details") or {}
        return TurnResult(response_id, str(response.get("status", "")), active.text, active.item_id,
                          metadata=dict(response.get("metadata") or {}), usage=dict(response.get("usage") or {}),
                          reason=details.get("reason"), error=details.get("error"))
