"""The Python SDK's sans-I/O core with literal server events, its backoff and its URLs."""

from __future__ import annotations

import random

import pytest
from rtgw import Backoff, ClientProtocol, TextDelta, TurnResult, realtime_url
from rtgw.errors import FrameError
from rtgw.framing import decode, encode
from rtgw.protocol import ItemTruncated, ServerError


def answer(protocol: ClientProtocol, text: str = "Hello there") -> TurnResult:
    """Feed the events of one streamed response; the TurnResult it ends with."""
    protocol.receive({"type": "response.created", "response": {"id": "resp_1"}})
    protocol.receive({"type": "conversation.item.added", "previous_item_id": protocol.items[-1].id,
                      "item": {"id": "item_a", "role": "assistant", "status": "in_progress", "content": []}})
    deltas = []
    for word in text.split(" "):
        deltas += protocol.receive({"type": "response.output_text.delta", "response_id": "resp_1",
                                    "item_id": "item_a", "delta": word + " "})
    assert all(isinstance(d, TextDelta) for d in deltas) and len(deltas) == len(text.split(" "))
    [done] = protocol.receive({"type": "response.done", "response": {
        "id": "resp_1", "status": "completed", "metadata": {"x_tier": "edge"},
        "output": [{"id": "item_a", "content": [{"type": "output_text", "text": text + " "}]}],
        "usage": {"input_tokens": 30, "input_token_details": {"cached_tokens": 16}}}})
    assert isinstance(done, TurnResult)
    return done


def test_a_turn_builds_its_events_and_keeps_the_conversation() -> None:
    protocol = ClientProtocol()
    create, respond = protocol.user_turn("Hi!", max_output_tokens=16)
    assert create["type"] == "conversation.item.create" and respond["response"] == {"max_output_tokens": 16}
    user_id = create["item"]["id"]
    # The server echoes our item under our id: it is not added twice.
    protocol.receive({"type": "conversation.item.added", "item": {**create["item"]}})
    done = answer(protocol)
    assert done.status == "completed" and done.text == "Hello there " and done.tier == "edge"
    assert done.cached_tokens == 16 and done.item_id == "item_a"
    assert [(i.id, i.role, i.text) for i in protocol.items] == [(user_id, "user", "Hi!"),
                                                                ("item_a", "assistant", "Hello there ")]


def test_restore_recreates_every_item_in_order_with_its_id() -> None:
    protocol = ClientProtocol()
    protocol.user_turn("Hi!")
    answer(protocol)
    events = protocol.restore_events()
    assert [e["item"]["id"] for e in events] == [i.id for i in protocol.items]
    assert events[1]["item"]["content"] == [{"type": "output_text", "text": "Hello there "}]
    assert events[0]["item"]["content"][0]["type"] == "input_text"


def test_a_lost_connection_fails_the_active_turn_and_keeps_its_partial_text() -> None:
    protocol = ClientProtocol()
    protocol.user_turn("Hi!")
    protocol.receive({"type": "response.created", "response": {"id": "resp_9"}})
    protocol.receive({"type": "conversation.item.added",
                      "item": {"id": "item_p", "role": "assistant", "content": []}})
    protocol.receive({"type": "response.output_text.delta", "response_id": "resp_9", "delta": "Half"})
    lost = protocol.connection_lost()
    assert lost is not None and lost.status == "failed" and lost.error["code"] == "connection_lost"
    assert protocol.item("item_p").text == "Half" and protocol.connection_lost() is None


def test_truncate_keeps_what_was_heard_and_the_fallback_replaces_the_item() -> None:
    protocol = ClientProtocol()
    protocol.user_turn("Hi!")
    answer(protocol, "one two three")
    event = protocol.truncate("item_a", 99)
    assert event["x_text_end"] == len("one two three ") and event["audio_end_ms"] == 0
    [truncated] = protocol.receive({"type": "conversation.item.truncated", "item_id": "item_a",
                                    "content_index": 0, "audio_end_ms": 0, "x_text_end": 3})
    assert truncated == ItemTruncated("item_a", "one") and protocol.item("item_a").text == "one"
    delete, create = protocol.replace_events("item_a", "on")
    assert delete == {**delete, "type": "conversation.item.delete", "item_id": "item_a"}
    assert create["previous_item_id"] == protocol.items[0].id and create["item"]["content"][0]["text"] == "on"
    [error] = protocol.receive({"type": "error", "error": {"code": "invalid_value", "message": "no",
                                                           "param": "x_text_end", "event_id": event["event_id"]}})
    assert error == ServerError("invalid_value", "no", "x_text_end", event["event_id"])


def test_backoff_grows_with_jitter_and_stays_bounded() -> None:
    delays = list(Backoff(initial=0.5, factor=2, max_delay=3, jitter=0.5, attempts=6).delays(random.Random(1)))
    assert len(delays) == 5
    caps = [0.5, 1.0, 2.0, 3.0, 3.0]
    assert all(cap / 2 <= d <= cap for d, cap in zip(delays, caps, strict=True))
    again = list(Backoff(initial=0.5, factor=2, max_delay=3, jitter=0.5, attempts=6).delays(random.Random(2)))
    assert again != delays  # jittered: two clients dropped together do not return together


def test_gateway_urls_and_frames() -> None:
    assert realtime_url("https://gw.example/", None) == "wss://gw.example/v1/realtime"
    assert realtime_url("ws://h:1/v1/realtime?x=1", "m") == "ws://h:1/v1/realtime?x=1&model=m"
    with pytest.raises(ValueError):
        realtime_url("ftp://h", None)
    event = {"type": "session.update", "session": {"instructions": "é"}}
    assert decode(encode(event, "json")) == event and decode(encode(event, "msgpack")) == event
    for bad in ("[1]", b"\xc1", "{}"):
        with pytest.raises(FrameError):
            decode(bad)
