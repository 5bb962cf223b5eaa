"""The core <-> client wire protocol: framing, round trips and validation, with literals only."""

from __future__ import annotations

import asyncio
import socket

import msgpack
import pytest

from engine_gpu.outputs import RequestOutput
from engine_gpu.protocol import (
    HEADER,
    AbortDone,
    AbortRequest,
    AddRequest,
    ErrorReply,
    FrameDecoder,
    Hello,
    ProtocolError,
    Rejected,
    SetThreads,
    Shutdown,
    StatsReply,
    StatsRequest,
    StepOutputs,
    decode_client_message,
    decode_core_message,
    encode_frame,
    error_from_code,
    parse_listen,
    read_frame,
)
from llm_shared import errors
from llm_shared.contract import FinishEvent, Priority, SamplingParams, TokenEvent


def payload(message: object) -> bytes:
    frame = encode_frame(message)  # type: ignore[arg-type]
    (size,) = HEADER.unpack_from(frame)
    assert size == len(frame) - HEADER.size
    return frame[HEADER.size:]


def raw(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_client_messages_round_trip() -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3, max_tokens=9, stop=("\n\n",),
                            stop_token_ids=(7,), logprobs=2, ignore_eos=True)
    for message in (
        AddRequest("r1", [1, 2, 3], params, Priority.REALTIME),
        AddRequest("r2", [1, 2, 3], params, Priority.REALTIME, [4, 5], cache_salt="0123456789abcdef" * 2),
        AbortRequest("r1", 4),
        StatsRequest(5),
        SetThreads(6, 2),
        Shutdown(),
    ):
        assert decode_client_message(payload(message)) == message


def test_core_messages_round_trip() -> None:
    out = RequestOutput("r1", [TokenEvent(5, "hi", -0.5, ((5, -0.5), (6, -1.25)))],
                        FinishEvent("length", 3, 1, 2, text="!", tier="gpu"))
    stats = {"running": 1.0, "kv_blocks_in_use": 4.0}
    for message in (
        Hello({"vocab_size": 10, "max_model_len": 64}, stats),
        StepOutputs([out, RequestOutput("r2")], stats),
        Rejected("r1", "context_length_exceeded", "too long", "prompt"),
        AbortDone(3, "r1", stats),
        StatsReply(4, stats),
        ErrorReply(None, "bad_message", "nope"),
    ):
        assert decode_core_message(payload(message)) == message


def test_frames_split_and_joined_arbitrarily() -> None:
    frames = encode_frame(StatsRequest(1)) + encode_frame(Shutdown()) + encode_frame(AbortRequest("x", 2))
    decoder = FrameDecoder()
    got = [p for i in range(len(frames)) for p in decoder.feed(frames[i:i + 1])]
    assert [decode_client_message(p) for p in got] == [StatsRequest(1), Shutdown(), AbortRequest("x", 2)]
    assert [decode_client_message(p) for p in FrameDecoder().feed(frames)] == [
        StatsRequest(1), Shutdown(), AbortRequest("x", 2)]


def test_oversized_frame_is_refused_from_its_header() -> None:
    decoder = FrameDecoder(max_frame_bytes=100)
    with pytest.raises(ProtocolError) as e:
        decoder.feed(HEADER.pack(101))
    assert e.value.code == "frame_too_large"


async def test_read_frame_from_a_stream() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(encode_frame(StatsRequest(9)) + HEADER.pack(5) + b"ab")
    reader.feed_eof()
    assert decode_client_message(await read_frame(reader) or b"") == StatsRequest(9)
    with pytest.raises(ProtocolError):
        await read_frame(reader)  # truncated frame
    empty = asyncio.StreamReader()
    empty.feed_eof()
    assert await read_frame(empty) is None


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"\xc1", "not a valid msgpack"),
        (raw([1, 2]), "must be a msgpack map"),
        (raw({"t": "launch"}), "unknown message type"),
        (raw({"t": "abort", "id": "x", "seq": -1}), "'seq'"),
        (raw({"t": "abort", "id": "", "seq": 1}), "'id'"),
        (raw({"t": "stats", "seq": True}), "'seq'"),
        (raw({"t": "stats", "seq": 1, "extra": 2}), "unknown field"),
        (raw({"t": "shutdown", "now": True}), "unknown field"),
        (raw({"t": "threads", "seq": 1, "threads": 0}), "'threads'"),  # a core computes on at least one
        (raw({"t": "threads", "seq": 1, "threads": 1 << 20}), "'threads'"),
        (raw({"t": "threads", "seq": 1}), "'threads'"),
        (raw({1: 2}), "not a valid msgpack"),  # non-string map keys
    ],
)
def test_bad_client_messages_raise_protocol_errors(data: bytes, fragment: str) -> None:
    with pytest.raises(ProtocolError) as e:
        decode_client_message(data)
    assert fragment in e.value.message
    assert e.value.request_id is None


def test_seq_of_a_bad_message_is_kept_for_the_reply() -> None:
    with pytest.raises(ProtocolError) as e:
        decode_client_message(raw({"t": "abort", "id": 5, "seq": 77}))
    assert e.value.seq == 77


def add(**fields: object) -> bytes:
    base: dict[str, object] = {"t": "add", "id": "req", "prompt": [1, 2], "params": {}, "priority": 1}
    base.update(fields)
    return raw(base)


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({"params": {"temperature": 5.0}}, "invalid_sampling_params", "temperature"),
        ({"params": {"stop": "x"}}, "invalid_sampling_params", "stop"),
        ({"params": {"frequency": 1}}, "invalid_sampling_params", "frequency"),
        ({"params": {"ignore_eos": 1}}, "invalid_sampling_params", "ignore_eos"),
        ({"params": [1]}, "invalid_sampling_params", "params"),
        ({"prompt": [1, -2]}, "invalid_request", "prompt"),
        ({"prompt": [1, True]}, "invalid_request", "prompt"),
        ({"prompt": "hello"}, "invalid_request", "prompt"),
        ({"prompt": []}, "empty_prompt", "prompt"),
        ({"priority": 9}, "invalid_request", "priority"),
        # absurd values that would otherwise reach a tensor op shared by the whole step
        ({"params": {"top_k": 2**64 - 1}}, "invalid_sampling_params", "top_k"),
        ({"params": {"max_tokens": 2**63}}, "invalid_sampling_params", "max_tokens"),
        ({"params": {"stop_token_ids": [2**40]}}, "invalid_sampling_params", "stop_token_ids"),
        ({"params": {"stop_token_ids": list(range(65))}}, "invalid_sampling_params", "stop_token_ids"),
        ({"params": {"seed": 2**64 - 1}}, "invalid_sampling_params", "seed"),
        ({"params": {"stop": ["x"] * 9}}, "invalid_sampling_params", "stop"),
        # a cache salt names a tenant's prefix cache: bounded, printable ASCII, a string
        ({"salt": "s" * 65}, "invalid_request", "cache_salt"),
        ({"salt": 7}, "invalid_request", "cache_salt"),
        ({"salt": b"bytes"}, "invalid_request", "cache_salt"),
        ({"salt": "caf\u00e9"}, "invalid_request", "cache_salt"),
        ({"salt": "a\nb"}, "invalid_request", "cache_salt"),
    ],
)
def test_bad_add_is_rejected_with_a_typed_code_for_its_request(fields: dict, code: str, param: str) -> None:
    with pytest.raises(ProtocolError) as e:
        decode_client_message(add(**fields))
    assert (e.value.request_id, e.value.code, e.value.param) == ("req", code, param)
    assert isinstance(error_from_code(e.value.code, e.value.message, e.value.param), errors.InvalidRequestError)


def test_error_codes_map_back_to_their_classes() -> None:
    assert type(error_from_code("context_length_exceeded", "m")) is errors.PromptTooLongError
    assert type(error_from_code("overloaded", "m")) is errors.OverloadedError
    assert type(error_from_code("duplicate_request_id", "m")) is errors.DuplicateRequestError
    assert type(error_from_code("something_new", "m")) is errors.EngineError


def test_core_messages_are_validated_too() -> None:
    with pytest.raises(ProtocolError):
        decode_core_message(raw({"t": "out", "reqs": [["r", [[1, "a"]], None]], "stats": {}}))
    with pytest.raises(ProtocolError):
        decode_core_message(raw({"t": "out", "reqs": [["r", [], ["exploded", 1, 1, 0, "", ""]]], "stats": {}}))
    with pytest.raises(ProtocolError):
        decode_core_message(raw({"t": "stats", "seq": 1, "stats": {"running": "many"}}))


def test_parse_listen() -> None:
    assert parse_listen("unix:/tmp/x.sock") == (socket.AF_UNIX, "/tmp/x.sock")
    assert parse_listen("tcp:127.0.0.1:7100") == (socket.AF_INET, ("127.0.0.1", 7100))
    assert parse_listen("tcp:[::1]:0") == (socket.AF_INET6, ("::1", 0))
    for bad in ("tcp:host", "tcp::80", "udp:1.2.3.4:5", "unix:", "tcp:h:99999"):
        with pytest.raises(errors.ConfigError):
            parse_listen(bad)
