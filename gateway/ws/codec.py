"""Turning WebSocket frames into client events and server events into frames.

Two encodings carry the same event objects: JSON in text frames (the default, what the
OpenAI SDK speaks) and msgpack in binary frames, chosen by the WebSocket subprotocol
``x-openai-realtime-msgpack``. Decoding is the first thing untrusted bytes meet, so it is
strict and bounded: the frame size is capped by the server before we see it, nesting deeper
than ``MAX_DEPTH`` is refused (a "bomb" of nested arrays costs memory and recursion), and the
msgpack decoder gets explicit limits on every length plus no ext types.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack

from gateway import json_wire
from gateway.ws.server_events import AudioDelta, ServerEvent, TextDelta
from llm_shared.errors import APIError

MSGPACK_SUBPROTOCOL = "x-openai-realtime-msgpack"
# Events nest a few levels; a tool's parameters schema sits 5 levels down (event, session or response,
# tools, the tool, parameters) and may nest StructuredLimits.max_schema_depth (32) more, which the
# parser bounds with an error naming the field. Past this the frame is refused whole.
MAX_DEPTH = 40
# Realtime client events are small objects; these bound what one frame can expand into.
MAX_CONTAINER_LEN = 4096
MAX_MAP_LEN = 256
PACKER_BUFFER_BYTES = 4096  # a msgpack connection's encoder buffer to start with; it grows with the frames

Encoding = Literal["json", "msgpack"]
# A str as ``json_wire.dumps`` writes it (the same escapes, checked for every code point), for the delta's fast path.
_json_string = json.encoder.encode_basestring


class DecodeError(APIError):
    """A frame that is not a valid client event. ``code`` becomes the ``error`` event's code."""

    type = "invalid_request_error"

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message, code=code)


def _too_deep(value: Any, limit: int) -> bool:
    """True when ``value`` nests containers deeper than ``limit``. Iterative: a hostile
    structure must not be able to exhaust the Python stack here either."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _as_event(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DecodeError("invalid_event", "each frame must hold one event object with a 'type' field")
    if _too_deep(value, MAX_DEPTH):
        raise DecodeError("invalid_event", f"event nests deeper than {MAX_DEPTH} levels")
    return value


def _reject_constant(name: str) -> Any:
    # json accepts NaN and Infinity by default; they are not JSON and no event field takes them.
    raise ValueError(f"{name} is not valid JSON")


def _reject_ext(code: int, data: bytes) -> Any:
    raise DecodeError("invalid_msgpack", "msgpack ext types are not accepted")


@dataclass(frozen=True)
class FrameCodec:
    """Decoder and encoder for one connection's negotiated encoding."""

    encoding: Encoding
    max_frame_bytes: int
    # msgpack's module-level packb builds a Packer per call; one per msgpack connection is reused.
    # JSON connections make none, and a Packer's buffer starts small: its default is 256 KiB, a
    # dozen times what an idle session costs otherwise (bench/gateway_overhead.py's idle_sessions_per_gib).
    _packer: msgpack.Packer | None = field(default=None, init=False, repr=False, compare=False)
    # A text delta's JSON but for its event id and text, per content part: the same for every token
    # of a response, so it is escaped once rather than per token. Holds the latest part's only.
    _delta_heads: dict[tuple[str, str, str, int, int], tuple[str, str]] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    def decode_text(self, data: str) -> dict[str, Any]:
        if self.encoding != "json":
            raise DecodeError("invalid_event", f"this connection uses {MSGPACK_SUBPROTOCOL}: send binary frames")
        if len(data) > self.max_frame_bytes:  # the server caps bytes already; this guards direct callers
            raise DecodeError("invalid_event", "frame too large")
        try:
            value = json.loads(data, parse_constant=_reject_constant)
        except RecursionError as e:
            raise DecodeError("invalid_event", f"event nests deeper than {MAX_DEPTH} levels") from e
        except ValueError as e:
            # json's message names only a position in the client's own text; no internals.
            raise DecodeError("invalid_json", f"frame is not valid JSON: {e}") from e
        return _as_event(value)

    def decode_binary(self, data: bytes) -> dict[str, Any]:
        if self.encoding != "msgpack":
            raise DecodeError(
                "invalid_event",
                f"binary frames need the {MSGPACK_SUBPROTOCOL} subprotocol; send JSON in text frames",
            )
        limit = self.max_frame_bytes
        unpacker = msgpack.Unpacker(
            raw=False,
            strict_map_key=True,
            max_buffer_size=limit,
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=MAX_CONTAINER_LEN,
            max_map_len=MAX_MAP_LEN,
            max_ext_len=0,
            ext_hook=_reject_ext,
            use_list=True,
        )
        try:
            unpacker.feed(data)
            value = unpacker.unpack()
        except DecodeError:
            raise
        except msgpack.BufferFull as e:
            raise DecodeError("invalid_event", "frame too large") from e
        except msgpack.OutOfData as e:
            raise DecodeError("invalid_msgpack", "frame is a truncated msgpack object") from e
        except msgpack.StackError as e:
            raise DecodeError("invalid_event", f"event nests deeper than {MAX_DEPTH} levels") from e
        except (msgpack.UnpackValueError, msgpack.ExtraData, ValueError, TypeError) as e:
            # ValueError covers limit violations and invalid UTF-8; TypeError an unhashable map key.
            raise DecodeError("invalid_msgpack", "frame is not a valid msgpack event") from e
        if unpacker.tell() != len(data):
            raise DecodeError("invalid_msgpack", "frame holds more than one msgpack object")
        return _as_event(value)

    def encode_event(self, event: ServerEvent) -> str | bytes:
        """The frame of one server event. A text delta (one per token) is written out directly in
        JSON, byte for byte what ``encode(event.to_wire())`` gives, without the dict."""
        if type(event) is TextDelta and self.encoding == "json":
            part = (event.type, event.response_id, event.item_id, event.output_index, event.content_index)
            head = self._delta_heads.get(part)
            if head is None:
                self._delta_heads.clear()
                head = self._delta_heads[part] = (
                    f'{{"type":{_json_string(event.type)},"event_id":',
                    f',"response_id":{_json_string(event.response_id)},"item_id":{_json_string(event.item_id)},'
                    f'"output_index":{event.output_index:d},"content_index":{event.content_index:d},"delta":')
            return f"{head[0]}{_json_string(event.event_id)}{head[1]}{_json_string(event.delta)}}}"
        if type(event) is AudioDelta:
            return self.encode(event.to_wire(binary=self.encoding == "msgpack"))
        return self.encode(event.to_wire())

    def encode(self, event: dict[str, Any]) -> str | bytes:
        if self.encoding == "msgpack":
            packer = self._packer
            if packer is None:
                packer = msgpack.Packer(use_bin_type=True, buf_size=PACKER_BUFFER_BYTES)
                object.__setattr__(self, "_packer", packer)  # frozen: set once, on first use
            return packer.pack(event)
        return json_wire.dumps(event)
