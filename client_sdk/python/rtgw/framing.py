"""Frames on the wire: JSON text frames (the Realtime API's own) or msgpack binary frames (our
extension, asked for with the ``x-openai-realtime-msgpack`` subprotocol)."""

from __future__ import annotations

import json
from typing import Any, Literal

import msgpack

from rtgw.errors import FrameError

Framing = Literal["json", "msgpack"]
MSGPACK_SUBPROTOCOL = "x-openai-realtime-msgpack"


def encode(event: dict[str, Any], framing: Framing) -> str | bytes:
    if framing == "msgpack":
        return msgpack.packb(event, use_bin_type=True)
    return json.dumps(event, ensure_ascii=False)


def decode(frame: str | bytes) -> dict[str, Any]:
    try:
        event = msgpack.unpackb(frame, raw=False) if isinstance(frame, bytes) else json.loads(frame)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise FrameError(f"the server sent an undecodable frame: {e}") from e
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise FrameError("the server sent a frame that is not an event object")
    return event
