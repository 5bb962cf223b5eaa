"""Hostile WebSocket frames for the ``fuzz`` arm of bench/faults.py: pure functions of a seeded
``random.Random``, no I/O.

``fuzz_frame`` returns one ``Frame`` (what to send, and as which frame kind) drawn from a mix
of Realtime client events with random field values (in JSON text or msgpack binary, as the
connection's encoding says), events that are nearly valid (real types and field names, wrong
or extreme values), random bytes (as binary, or as text frames that are not UTF-8), nesting far
past the server's depth limit, numbers no field takes, JSON the standard forbids, fragmented
messages, frames of the other encoding, and (rarely) frames over ``server.max_frame_bytes``.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

Encoding = Literal["json", "msgpack"]

EVENT_TYPES = (
    "session.update", "conversation.item.create", "conversation.item.delete", "conversation.item.retrieve",
    "conversation.item.truncate", "response.create", "response.cancel", "input_audio_buffer.append",
    "input_audio_buffer.commit", "output_audio_buffer.clear", "transcription_session.update", "session.created",
    "response.done", "error", "nonsense.event", "", " response.create", "RESPONSE.CREATE",
)
FIELDS = (
    "event_id", "item", "item_id", "content_index", "x_text_end", "audio_end_ms", "response", "response_id",
    "session", "previous_item_id", "instructions", "max_output_tokens", "max_response_output_tokens",
    "temperature", "metadata", "conversation", "input", "modalities", "output_modalities", "tools", "model",
    "type", "role", "content", "text", "id", "object", "status", "prompt", "audio", "voice",
)
ROLES = ("user", "assistant", "system", "tool", "", "USER", None)
PART_TYPES = ("input_text", "output_text", "text", "input_audio", "audio", "input_image", "image", "")
HUGE_NUMBERS = ("1e999", "-1e999", "1" + "0" * 400, "-" + "9" * 5000, "1e-400", "0.1e+99999", "123456789" * 100,
                "18446744073709551616", "-9223372036854775809", "4.9e-324", "-0")
JSON_GARBAGE = ('{"type": "response.create",}', '{"type": "response.create"', '{"type": NaN}',
                '{"type": Infinity}', '{"type": -Infinity}', '[]', '"response.create"', 'null', 'true', '42',
                '{"type": "response.create"} {"type": "response.cancel"}', '\ufeff{"type": "response.cancel"}',
                '{"type": "a", "type": "response.create"}', "{'type': 'response.cancel'}", '{"type": "\\ud800"}',
                '{"type": "conversation.item.create", "item": {"role": "user", "content": [{"type": '
                '"input_text", "text": "\\udfff\\ud800"}]}}', '{"type": "\\u0000"}', "", " ", "{}" * 1000)
TEXT_ALPHABET = string.printable + "\u00e9\u4e2d\U0001f600\u202e\u0000\u200b\ufeff"


@dataclass(frozen=True)
class Frame:
    kind: str  # which generator made it (results count by kind)
    data: str | bytes | list[bytes] | list[str]  # a list: the fragments of one message
    text: bool  # sent as a text frame (data may be bytes that are not UTF-8)


def random_text(rng: random.Random, max_len: int = 40) -> str:
    n = rng.choice((0, 1, rng.randint(0, max_len), rng.randint(0, max_len)))
    return "".join(rng.choice(TEXT_ALPHABET) for _ in range(n))


def random_scalar(rng: random.Random, surrogates: bool) -> Any:
    pick = rng.randrange(12)
    if pick == 0:
        return None
    if pick == 1:
        return rng.random() < 0.5
    if pick == 2:
        return rng.randint(-2**63, 2**64 - 1)
    if pick == 3:
        return rng.choice((0, 1, -1, 2**31, 2**53 + 1, 4096, 4097))
    if pick == 4:
        return rng.uniform(-1e308, 1e308)
    if pick == 5:
        return rng.choice((0.0, -0.0, 1e-320, 2.0000001, 0.5))
    if pick == 6 and surrogates:
        return "\ud800" + random_text(rng, 8)  # a lone surrogate: json.dumps escapes it as \ud800
    if pick == 7:
        return rng.choice(EVENT_TYPES)
    if pick == 8:
        return "x" * rng.choice((64, 65, 128, 129, 513, 5000))
    return random_text(rng)


def random_value(rng: random.Random, depth: int, surrogates: bool) -> Any:
    if depth <= 0 or rng.random() < 0.55:
        return random_scalar(rng, surrogates)
    width = rng.randint(0, 4)
    if rng.random() < 0.5:
        return [random_value(rng, depth - 1, surrogates) for _ in range(width)]
    return {rng.choice(FIELDS) if rng.random() < 0.7 else random_text(rng, 12): random_value(rng, depth - 1, surrogates)
            for _ in range(width)}


def random_event(rng: random.Random, surrogates: bool) -> dict[str, Any]:
    """A known (or nearly known) event type with random fields of random values."""
    event: dict[str, Any] = {"type": rng.choice(EVENT_TYPES) if rng.random() < 0.9 else random_scalar(rng, surrogates)}
    for _ in range(rng.randint(0, 5)):
        event[rng.choice(FIELDS)] = random_value(rng, 4, surrogates)
    return event


def message_item(rng: random.Random, surrogates: bool) -> dict[str, Any]:
    parts = [{"type": rng.choice(PART_TYPES), "text": random_text(rng, 60) if rng.random() < 0.9
              else random_scalar(rng, surrogates)} for _ in range(rng.choice((0, 1, 1, 1, 2, 65)))]
    item: dict[str, Any] = {"type": rng.choice(("message", "message", "function_call", "item_reference")),
                            "role": rng.choice(ROLES), "content": parts}
    if rng.random() < 0.3:
        item["id"] = rng.choice(("root", "", "item_1", "x" * 65, random_text(rng, 10)))
    return item


def plausible_event(rng: random.Random, surrogates: bool) -> dict[str, Any]:
    """Real event types and field names; values from valid to absurd. Some start responses."""
    kind = rng.choice(("session.update", "conversation.item.create", "conversation.item.delete",
                       "conversation.item.retrieve", "conversation.item.truncate", "response.create",
                       "response.cancel"))
    tokens = rng.choice((1, 2, 4, 8, 0, -1, 4097, "inf", "8", 1.5, None, True, 2**70))
    if kind == "session.update":
        session = {"type": rng.choice(("realtime", "transcription", None)), "instructions": random_text(rng, 80),
                   "max_output_tokens": tokens, "temperature": rng.choice((0, 0.8, 2, 2.01, -1, "hot", None)),
                   "model": rng.choice(("smollm2-135m-edge", "gpt-4o", "", None)),
                   "output_modalities": rng.choice((["text"], ["audio"], [], ["text", "text"], "text"))}
        return {"type": kind, "session": {k: v for k, v in session.items() if v is not None or rng.random() < 0.2}}
    if kind == "conversation.item.create":
        return {"type": kind, "item": message_item(rng, surrogates),
                "previous_item_id": rng.choice((None, "root", "missing", 7))}
    if kind in ("conversation.item.delete", "conversation.item.retrieve"):
        return {"type": kind, "item_id": rng.choice(("root", "item_1", "", None, 5, "x" * 100))}
    if kind == "conversation.item.truncate":
        return {"type": kind, "item_id": rng.choice(("item_1", "", None)), "content_index": rng.choice((0, -1, 9, "0")),
                "x_text_end": rng.choice((0, 5, -1, 2**64, None)), "audio_end_ms": rng.choice((0, -5, None))}
    if kind == "response.cancel":
        return {"type": kind, "response_id": rng.choice((None, "resp_1", "", 3))}
    response: dict[str, Any] = {"max_output_tokens": tokens,
                                "conversation": rng.choice(("auto", "none", "conv_x", None, 1)),
                                "metadata": rng.choice((None, {"k": "v"}, {str(i): "v" for i in range(17)}, [1])),
                                "temperature": rng.choice((None, 0, 1.0, 2.5))}
    if rng.random() < 0.4:
        response["input"] = [message_item(rng, surrogates) if rng.random() < 0.8 else
                             {"type": "item_reference", "id": rng.choice(("item_1", "root", ""))}
                             for _ in range(rng.randint(0, 3))]
    if rng.random() < 0.1:
        response["tools"] = [{"type": "function", "name": "f"}]
    return {"type": kind, "response": {k: v for k, v in response.items() if v is not None}}


def deep_nesting(rng: random.Random, encoding: Encoding) -> bytes | str:
    depth = rng.choice((33, 64, 1000, 20_000))  # 20,000 levels stay under the frame limit
    if encoding == "msgpack":
        return b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]
    if rng.random() < 0.5:
        return "[" * depth + "]" * depth
    return '{"type": "response.create", "response": ' + '{"a": ' * depth + "1" + "}" * depth + "}"


def _fit_msgpack(value: Any) -> Any:
    """``value`` with integers msgpack cannot hold (past 64 bits) clamped to its range."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return max(-2**63, min(2**64 - 1, value))
    if isinstance(value, list):
        return [_fit_msgpack(v) for v in value]
    if isinstance(value, dict):
        return {k: _fit_msgpack(v) for k, v in value.items()}
    return value


def _pack(event: Any) -> bytes:
    try:
        return msgpack.packb(event, use_bin_type=True)
    except OverflowError:
        return msgpack.packb(_fit_msgpack(event), use_bin_type=True)


def msgpack_oddities(rng: random.Random) -> bytes:
    """msgpack a JSON encoder cannot express: invalid UTF-8 in a str, ext types, bin for str,
    non-string map keys, truncated objects, two objects in one frame, huge declared lengths."""
    choice = rng.randrange(8)
    if choice == 0:
        return b"\x81\xa4type" + b"\xa3\xff\xfe\xfd"  # {"type": <str with invalid UTF-8>}
    if choice == 1:
        return b"\x81\xa4type\xd4\x05\x00"  # an ext type as the value
    if choice == 2:
        return _pack({"type": b"response.create"})  # bin where a str belongs
    if choice == 3:
        return b"\x81\x01\xa1x"  # {1: "x"}
    if choice == 4:
        return _pack({"type": "response.cancel"})[:-3]  # truncated
    if choice == 5:
        return _pack({"type": "response.cancel"}) * 2  # two objects
    if choice == 6:
        return b"\xdd\xff\xff\xff\xff"  # an array announcing 4 billion elements
    return b"\x81\xa4type\xcf" + rng.randbytes(8)  # a uint64 where a str belongs


def encode(event: Any, encoding: Encoding) -> str | bytes:
    if encoding == "msgpack":
        return _pack(event)
    return json.dumps(event)


def fuzz_frame(rng: random.Random, encoding: Encoding, max_frame_bytes: int) -> Frame:
    """One hostile frame for a connection speaking ``encoding``."""
    surrogates = encoding == "json"  # msgpack cannot carry a lone surrogate in a str
    roll = rng.random()
    for limit, make in _MIX:
        if roll < limit:
            return make(rng, encoding, surrogates, max_frame_bytes)
    raise AssertionError("the mix's limits end at 1.0")


def _native(kind: str, data: Any, encoding: Encoding) -> Frame:
    payload = encode(data, encoding)
    return Frame(kind, payload, isinstance(payload, str))


def _random_event(rng: random.Random, encoding: Encoding, surrogates: bool, limit: int) -> Frame:
    return _native("random_event", random_event(rng, surrogates), encoding)


def _plausible(rng: random.Random, encoding: Encoding, surrogates: bool, limit: int) -> Frame:
    return _native("plausible_event", plausible_event(rng, surrogates), encoding)


def _random_binary(rng: random.Random, encoding: Encoding, surrogates: bool, limit: int) -> Frame:
    return Frame("random_bytes_binary", rng.randbytes(rng.choice((0, 1, 2, 16, 300, 4096))), False)


def _random_text(rng: random.Random, encoding: Encoding, surrogates: bool, limit: int) -> Frame:
    # Random bytes are almost never UTF-8: the server closes with 1007, and the sender reconnects.
    return Frame("invalid_utf8_text", rng.randbytes(rng.choice((1, 7, 64))) + b"\xff", True)


def _nesting(rng: random.Random, encoding: Encoding, surrogates: bool, limit: int) -> Frame:
    data = deep_nesting(rng, encoding)
    return Frame("deep_nesting", data, isinstance(data, str))


def _numbers(rng: random.Random, encoding: Encoding, surrogates: bool, limit: int) -> Frame:
    number = rng.choice(HUGE_NUMBERS)
    field = rng.choice(('"max_output_tokens"', '"temperature"', '"content_index"', '"x_text_end"'))
    if encoding == "msgpack":
        value: Any = rng.choice((2**64 - 1, -2**63, float("inf"), float("nan"), 1e308))
        return _native("huge_numbers", {"type": "response.create", "response": {"max_output_tokens": value}}, encoding)
    return Frame("huge_numbers", f'{{"type": "response.create", "response": {{{field}: {number}}}}}', True)


def _garbage(rng: random.Random, encoding: Encoding, surrogates: bool, limit: int) -> Frame:
    if encoding == "msgpack":
        return Frame("msgpack_oddities", msgpack_oddities(rng), False)
    return Frame("json_garbage", rng.choice(JSON_GARBAGE), True)


def _other_encoding(rng: random.Random, encoding: Encoding, surrogates: bool, limit: int) -> Frame:
    event = plausible_event(rng, surrogates=False)
    if encoding == "msgpack":
        return Frame("wrong_frame_kind", json.dumps(event), True)
    return Frame("wrong_frame_kind", _pack(event), False)


def _fragmented(rng: random.Random, encoding: Encoding, surrogates: bool, limit: int) -> Frame:
    payload = encode(plausible_event(rng, surrogates=False), encoding)
    cuts = sorted(rng.sample(range(1, len(payload)), min(3, len(payload) - 1))) if len(payload) > 1 else []
    pieces = [payload[a:b] for a, b in zip([0, *cuts], [*cuts, len(payload)], strict=True)]
    return Frame("fragmented", pieces, isinstance(payload, str))  # type: ignore[arg-type]


def _oversized(rng: random.Random, encoding: Encoding, surrogates: bool, limit: int) -> Frame:
    text = "x" * (limit + rng.randint(1, limit))
    return _native("oversized", {"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}, encoding)


_Make = Callable[[random.Random, Encoding, bool, int], Frame]
_WEIGHTS: tuple[tuple[float, _Make], ...] = (
    (0.30, _random_event), (0.30, _plausible), (0.06, _random_binary), (0.005, _random_text),
    (0.06, _nesting), (0.06, _numbers), (0.10, _garbage), (0.05, _other_encoding), (0.0645, _fragmented),
    (0.0005, _oversized),
)


def _cumulative(weights: tuple[tuple[float, _Make], ...]) -> tuple[tuple[float, _Make], ...]:
    total = sum(w for w, _ in weights)
    out, acc = [], 0.0
    for w, make in weights:
        acc += w / total
        out.append((acc, make))
    out[-1] = (1.0, out[-1][1])
    return tuple(out)


_MIX = _cumulative(_WEIGHTS)
