"""Frame decoding: JSON and msgpack events in, typed DecodeErrors (never crashes) for the rest."""

import dataclasses
import json

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import json_wire
from gateway.ws.codec import MAX_DEPTH, DecodeError, FrameCodec
from gateway.ws.server_events import TextDelta

JSON = FrameCodec("json", 64 * 1024)
MSGPACK = FrameCodec("msgpack", 64 * 1024)


def nested(depth: int) -> object:
    value: object = {"type": "x"}
    for _ in range(depth - 1):
        value = [value]
    return value


def test_json_event_roundtrip() -> None:
    event = {"type": "response.create", "event_id": "e1", "response": {"metadata": {"k": "v"}}}
    assert JSON.decode_text(json.dumps(event)) == event
    assert json.loads(JSON.encode(event)) == event


def test_msgpack_event_roundtrip() -> None:
    event = {"type": "conversation.item.create", "item": {"content": [{"type": "input_text", "text": "héllo"}]}}
    frame = MSGPACK.encode(event)
    assert isinstance(frame, bytes)
    assert MSGPACK.decode_binary(frame) == event


@pytest.mark.parametrize("text, code", [
    ("{not json", "invalid_json"),
    ("", "invalid_json"),
    ("[1, 2]", "invalid_event"),
    ('"a string"', "invalid_event"),
    ('{"type": NaN}', "invalid_json"),
    ('{"x": Infinity}', "invalid_json"),
    ("[" * 5000 + "]" * 5000, "invalid_event"),
    ('{"n": ' + "9" * 5000 + "}", "invalid_json"),  # Python's int-from-str digit limit
])
def test_bad_json_is_a_decode_error(text: str, code: str) -> None:
    with pytest.raises(DecodeError) as e:
        JSON.decode_text(text)
    assert e.value.code == code


def test_nesting_limit_is_exact() -> None:
    ok = {"type": "x", "a": nested(MAX_DEPTH - 1)}  # the event object itself is level 1
    assert JSON.decode_text(json.dumps(ok)) == ok
    with pytest.raises(DecodeError):
        JSON.decode_text(json.dumps({"type": "x", "a": nested(MAX_DEPTH)}))
    assert MSGPACK.decode_binary(msgpack.packb(ok)) == ok
    with pytest.raises(DecodeError):
        MSGPACK.decode_binary(msgpack.packb({"type": "x", "a": nested(MAX_DEPTH)}))


@pytest.mark.parametrize("frame", [
    b"\x91" * 100_000 + b"\xc0",  # 100k nested one-element arrays
    b"\xdd\xff\xff\xff\xff",  # array header claiming 4 billion entries
    b"\xdf\xff\xff\xff\xff",  # map header claiming 4 billion pairs
    b"\xdb\xff\xff\xff\xff",  # str header claiming 4 GiB
    b"\xc6\x7f\xff\xff\xff",  # bin header claiming 2 GiB
    b"\xd4\x01\x00",  # fixext: ext types are refused
    b"\xc7\x05\x01abcde",
    b"\x81\x01\x02",  # int map key (strict_map_key)
    b"\x81\x91\x01\x02",  # array map key
    b"\xa3\xff\xfe\xfd",  # invalid UTF-8 in a str
    b"\xc1",  # never-used byte
    b"",  # empty
    msgpack.packb({"type": "x"}) + b"\x00",  # trailing data
    msgpack.packb([1, 2, 3]),  # not a map
])
def test_msgpack_bombs_and_garbage_are_decode_errors(frame: bytes) -> None:
    with pytest.raises(DecodeError):
        MSGPACK.decode_binary(frame)


def test_wide_msgpack_array_is_refused() -> None:
    with pytest.raises(DecodeError):
        MSGPACK.decode_binary(msgpack.packb({"type": "x", "a": [0] * 5000}))


def test_frames_of_the_other_encoding_are_refused() -> None:
    with pytest.raises(DecodeError, match="msgpack"):
        JSON.decode_binary(msgpack.packb({"type": "x"}))
    with pytest.raises(DecodeError, match="binary frames"):
        MSGPACK.decode_text('{"type": "x"}')


@given(delta=st.text(max_size=300), ids=st.text(min_size=1, max_size=40), index=st.integers(0, 1 << 40),
       beta=st.booleans())
@settings(max_examples=300, deadline=None)
def test_a_delta_is_encoded_as_its_dict_would_be(delta: str, ids: str, index: int, beta: bool) -> None:
    """Deltas skip the dict on the way out; what the client gets must not change, whatever the text
    (quotes, backslashes, control characters, any Unicode) or the ids hold."""
    event = TextDelta(type="response.text.delta" if beta else "response.output_text.delta", event_id=ids,
                      response_id=ids[::-1], item_id=ids + "i", output_index=index, content_index=index // 3,
                      delta=delta)
    assert JSON.encode_event(event) == JSON.encode(event.to_wire())
    assert msgpack.unpackb(MSGPACK.encode_event(event)) == event.to_wire()
    # The next token of the same part reuses what was escaped for the first.
    later = dataclasses.replace(event, event_id=ids + "+1", delta=delta[::-1] + '"')
    assert JSON.encode_event(later) == JSON.encode(later.to_wire())


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 63) - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30)


@given(value=JSON_VALUES)
@settings(max_examples=300, deadline=None)
def test_events_are_written_as_compact_utf8_json_of_the_same_value(value: object) -> None:
    sent = json_wire.dumps(value)
    assert json.loads(sent) == value and json_wire.dumps_bytes(value) == sent.encode()
    if isinstance(value, str):  # strings exactly as the standard library writes them (the delta fast path relies on it)
        assert sent == json.dumps(value, ensure_ascii=False)


def test_what_orjson_refuses_is_written_by_the_standard_library() -> None:
    assert json_wire.dumps({"n": 1 << 70}) == '{"n":1180591620717411303424}'
    assert json_wire.dumps(["a\ud800b"]) == '["a\ud800b"]'
    assert json_wire.dumps_bytes(["a\ud800b"]) == b'["a?b"]'
