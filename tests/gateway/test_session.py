"""The sans-I/O Realtime session core, driven with literal events (no sockets)."""

from __future__ import annotations

from typing import Any

import pytest
from realtime_sdk_check import check_server_event
from session_helpers import drain, make

from gateway.ws.server_events import to_wire
from gateway.ws.session import AbortGeneration, RealtimeSession, SessionIds, SessionLimits, StartGeneration
from llm_shared.contract import FinishEvent, TokenEvent
from llm_shared.errors import OverloadedError


def user(text: str, **extra: Any) -> dict[str, Any]:
    return {"type": "conversation.item.create",
            "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}], **extra}}


def start_response(session: RealtimeSession, **response: Any) -> StartGeneration:
    session.receive({"type": "response.create", "response": response})
    (command,) = session.commands()
    assert isinstance(command, StartGeneration)
    return command


def tokens(session: RealtimeSession, response_id: str, *texts: str) -> None:
    for n, text in enumerate(texts):
        session.engine_event(response_id, TokenEvent(token_id=100 + n, text=text, logprob=-0.1))


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def test_session_created_is_first_and_describes_the_session() -> None:
    session = RealtimeSession(session_id="sess_9", model="smollm2-135m")
    session.start()
    session.start()  # idempotent
    (created,) = drain(session)
    assert created["type"] == "session.created"
    assert created["session"]["id"] == "sess_9"
    assert created["session"]["model"] == "smollm2-135m"
    assert created["session"]["output_modalities"] == ["text"]
    assert created["session"]["max_output_tokens"] == SessionLimits().default_max_output_tokens


def test_full_turn() -> None:
    session = make()
    session.receive({"type": "session.update", "session": {"type": "realtime", "instructions": "Be brief."}})
    session.receive(user("Hi there"))
    events = drain(session)
    assert types(events) == ["session.updated", "conversation.item.added", "conversation.item.done"]
    assert events[0]["session"]["instructions"] == "Be brief."
    user_item = events[1]["item"]
    assert user_item["content"] == [{"type": "input_text", "text": "Hi there"}]
    assert events[1]["previous_item_id"] is None

    command = start_response(session, metadata={"topic": "greeting"})
    assert command.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert command.params.max_tokens == 512
    assert command.params.temperature == pytest.approx(0.8)
    assert command.metadata == {"topic": "greeting"}
    assert session.active_response_id == command.response_id
    (created,) = drain(session)
    assert created["type"] == "response.created"
    assert created["response"]["status"] == "in_progress"
    assert created["response"]["output"] == []

    rid = command.response_id
    tokens(session, rid, "Hel", "", "lo!")
    session.engine_event(rid, FinishEvent(reason="stop", prompt_tokens=12, completion_tokens=3, cached_tokens=4,
                                          tier="edge"))
    events = drain(session)
    assert types(events) == [
        "response.output_item.added", "conversation.item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "conversation.item.done", "response.done",
    ]
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["Hel", "lo!"]
    assert events[1]["previous_item_id"] == user_item["id"]
    assert events[5]["text"] == "Hello!"
    done = events[-1]["response"]
    assert done["id"] == rid and done["status"] == "completed" and done["status_details"] is None
    assert done["output"][0]["content"] == [{"type": "output_text", "text": "Hello!"}]
    assert done["output"][0]["status"] == "completed"
    assert done["usage"]["input_tokens"] == 12 and done["usage"]["output_tokens"] == 3
    assert done["usage"]["total_tokens"] == 15
    assert done["usage"]["input_token_details"]["cached_tokens"] == 4
    assert done["metadata"] == {"topic": "greeting", "x_tier": "edge"}
    assert done["conversation_id"] is not None
    assert session.active_response_id is None
    assert session.commands() == []

    # The next turn's prompt is the whole conversation, the answer included.
    session.receive(user("And again?"))
    command = start_response(session)
    assert command.messages[1:] == [{"role": "user", "content": "Hi there"},
                                    {"role": "assistant", "content": "Hello!"},
                                    {"role": "user", "content": "And again?"}]


def test_a_token_whose_only_event_is_its_delta_is_handed_back_in_order() -> None:
    """``engine_token``: the connection's way for most tokens. Once the message is open and nothing
    else waits, a token's delta is returned for the caller to send (not queued), numbered in the
    session's order; otherwise the token is handled as ``engine_event`` would and queued."""
    session = make()
    command = start_response(session)
    rid = command.response_id
    drain(session)  # response.created
    assert session.engine_token(rid, TokenEvent(1, "Hel", -0.1)) is None  # opens the message: queued
    assert session.engine_token(rid, TokenEvent(2, "", -0.1)) is None  # no text, no event
    first = drain(session)
    assert types(first) == ["response.output_item.added", "conversation.item.added", "response.content_part.added",
                            "response.output_text.delta"]
    returned = session.engine_token(rid, TokenEvent(3, "lo", -0.1))
    assert returned is not None and not session.has_events
    sent = to_wire(returned)
    check_server_event(sent, beta=False)
    assert sent["delta"] == "lo" and sent["item_id"] == first[-1]["item_id"] and sent["response_id"] == rid
    session.receive({"type": "conversation.item.retrieve", "item_id": "nope"})  # an error now waits
    assert session.engine_token(rid, TokenEvent(4, "!", -0.1)) is None
    assert session.engine_token("resp_other", TokenEvent(5, "x", -0.1)) is None
    queued = drain(session)
    assert types(queued) == ["error", "response.output_text.delta"] and queued[1]["delta"] == "!"
    ids = [e["event_id"] for e in first] + [sent["event_id"]] + [e["event_id"] for e in queued]
    assert ids == sorted(ids, key=lambda i: int(i.split("_")[1]))  # numbered in the order sent
    session.engine_event(rid, FinishEvent(reason="stop", prompt_tokens=2, completion_tokens=4))
    done = drain(session)[-1]["response"]
    assert done["output"][0]["content"] == [{"type": "output_text", "text": "Hello!"}]  # every token's text
    assert done["usage"]["output_tokens"] == 4


def test_held_back_text_and_max_output_tokens() -> None:
    session = make()
    session.receive(user("Count"))
    command = start_response(session, max_output_tokens=2, temperature=0.0)
    assert command.params.max_tokens == 2 and command.params.greedy
    tokens(session, command.response_id, "1,")
    session.engine_event(command.response_id, FinishEvent(reason="length", prompt_tokens=3, completion_tokens=2,
                                                          text=" 2"))
    events = drain(session)
    done = events[-1]["response"]
    assert done["status"] == "incomplete"
    assert done["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
    assert done["output"][0]["content"][0]["text"] == "1, 2"
    assert done["output"][0]["status"] == "incomplete"
    assert done["max_output_tokens"] == 2


def test_ignore_eos_extension_reaches_the_engine() -> None:
    session = make()
    session.receive(user("Tell a story"))
    assert not start_response(session).params.ignore_eos  # off unless asked for
    session.receive({"type": "response.cancel"})
    drain(session)
    session.commands()
    assert start_response(session, x_ignore_eos=True, max_output_tokens=9).params.ignore_eos


def test_inf_max_output_tokens_uses_the_server_ceiling() -> None:
    session = make(limits=SessionLimits(max_output_tokens=1000))
    session.receive({"type": "session.update", "session": {"max_output_tokens": "inf"}})
    assert drain(session)[0]["session"]["max_output_tokens"] == "inf"
    session.receive(user("x"))
    assert start_response(session).params.max_tokens == 1000


def test_finish_without_text_still_yields_an_item() -> None:
    session = make()
    session.receive(user("Say nothing"))
    command = start_response(session)
    drain(session)
    session.engine_event(command.response_id, FinishEvent(reason="stop", prompt_tokens=3, completion_tokens=1))
    events = drain(session)
    assert events[-1]["response"]["output"][0]["content"] == [{"type": "output_text", "text": ""}]
    # An empty assistant turn is left out of the next prompt.
    session.receive(user("Now talk"))
    assert [m["role"] for m in start_response(session).messages] == ["user", "user"]


def test_cancel_mid_stream_keeps_what_was_sent_and_ignores_late_tokens() -> None:
    session = make()
    session.receive(user("Tell me a story"))
    command = start_response(session)
    rid = command.response_id
    tokens(session, rid, "Once", " upon")
    drain(session)
    session.receive({"type": "response.cancel", "event_id": "cancel_1"})
    assert session.commands() == [AbortGeneration(rid)]
    assert session.active_response_id is None
    # Late engine output after response.done is dropped.
    tokens(session, rid, " a time")
    session.engine_event(rid, FinishEvent(reason="abort", prompt_tokens=5, completion_tokens=3))
    events = drain(session)
    assert types(events) == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                             "conversation.item.done", "response.done"]
    done = events[-1]["response"]
    assert done["status"] == "cancelled"
    assert done["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    assert done["output"][0]["content"][0]["text"] == "Once upon"
    assert done["usage"]["output_tokens"] == 2
    session.receive(user("go on"))
    assert start_response(session).messages[1] == {"role": "assistant", "content": "Once upon"}


def test_cancel_before_first_token_has_no_output() -> None:
    session = make()
    session.receive(user("Hi"))
    command = start_response(session)
    drain(session)
    session.cancel_active("client_too_slow")
    assert session.commands() == [AbortGeneration(command.response_id)]
    (done,) = drain(session)
    assert done["type"] == "response.done"
    assert done["response"]["output"] == []
    assert done["response"]["status_details"]["reason"] == "client_too_slow"
    session.receive(user("again"))
    assert [m["role"] for m in start_response(session).messages] == ["user", "user"]


def test_cancel_with_wrong_or_no_active_response_is_an_error() -> None:
    session = make()
    session.receive({"type": "response.cancel", "event_id": "c1"})
    (error,) = drain(session)
    assert error["error"]["code"] == "response_cancel_not_active" and error["error"]["event_id"] == "c1"
    session.receive(user("Hi"))
    command = start_response(session)
    drain(session)
    session.receive({"type": "response.cancel", "response_id": "resp_other", "event_id": "c2"})
    (error,) = drain(session)
    assert error["error"]["param"] == "response_id"
    assert session.active_response_id == command.response_id
    session.receive({"type": "response.cancel", "response_id": command.response_id})
    assert types(drain(session)) == ["response.done"]
    session.cancel_active("server_shutdown")  # nothing active: no event, no command
    assert drain(session) == [] and session.commands() == [AbortGeneration(command.response_id)]


def test_second_response_create_is_refused_and_session_goes_on() -> None:
    session = make()
    session.receive(user("Hi"))
    command = start_response(session)
    drain(session)
    session.receive({"type": "response.create", "event_id": "again"})
    (error,) = drain(session)
    assert error["type"] == "error"
    assert error["error"]["code"] == "conversation_already_has_active_response"
    assert error["error"]["event_id"] == "again"
    assert session.commands() == []
    tokens(session, command.response_id, "ok")
    session.engine_event(command.response_id, FinishEvent(reason="stop", prompt_tokens=1, completion_tokens=1))
    assert drain(session)[-1]["response"]["status"] == "completed"


def test_engine_failure_ends_the_response_failed() -> None:
    session = make()
    session.receive(user("Hi"))
    command = start_response(session)
    drain(session)
    session.engine_failed(command.response_id, OverloadedError("the server is busy, retry later"))
    (done,) = drain(session)
    assert done["response"]["status"] == "failed"
    assert done["response"]["status_details"]["error"] == {
        "type": "server_error", "code": "overloaded", "message": "the server is busy, retry later"}
    session.engine_failed(command.response_id, OverloadedError("late"))
    session.engine_event(command.response_id, TokenEvent(1, "late", 0.0))
    assert drain(session) == []


def test_engine_error_finish_after_tokens() -> None:
    session = make()
    session.receive(user("Hi"))
    command = start_response(session)
    tokens(session, command.response_id, "par")
    session.engine_event(command.response_id, FinishEvent(reason="error", prompt_tokens=2, completion_tokens=1,
                                                          message="the engine stopped"))
    events = drain(session)
    done = events[-1]["response"]
    assert done["status"] == "failed"
    assert done["status_details"]["error"]["message"] == "the engine stopped"
    assert done["output"][0]["status"] == "incomplete"


def test_truncate_extension_keeps_only_what_the_user_saw() -> None:
    session = make()
    session.receive(user("Explain"))
    command = start_response(session)
    rid = command.response_id
    tokens(session, rid, "First part. ", "Second part.")
    item_id = next(e["item"]["id"] for e in drain(session) if e["type"] == "response.output_item.added")
    # Barge-in on the item being written: the response is cancelled, then the item cut.
    session.receive({"type": "conversation.item.truncate", "event_id": "t1", "item_id": item_id,
                     "content_index": 0, "audio_end_ms": 0, "x_text_end": 6})
    assert session.commands() == [AbortGeneration(rid)]
    events = drain(session)
    assert types(events)[-2:] == ["response.done", "conversation.item.truncated"]
    assert events[-2]["response"]["status"] == "cancelled"
    assert events[-1]["x_text_end"] == 6 and events[-1]["item_id"] == item_id
    tokens(session, rid, " late")
    assert drain(session) == []
    session.receive({"type": "conversation.item.retrieve", "item_id": item_id})
    (retrieved,) = drain(session)
    assert retrieved["item"]["content"][0]["text"] == "First "
    session.receive(user("Go on"))
    assert start_response(session).messages[1] == {"role": "assistant", "content": "First "}


def test_truncate_errors() -> None:
    session = make()
    session.receive(user("Hi", id="u1"))
    session.receive({"type": "conversation.item.create", "item": {
        "type": "message", "id": "a1", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]}})
    drain(session)
    cases = [
        ({"item_id": "u1", "content_index": 0, "x_text_end": 1}, "invalid_value", "item_id"),
        ({"item_id": "nope", "content_index": 0, "x_text_end": 1}, "item_not_found", "item_id"),
        ({"item_id": "a1", "content_index": 1, "x_text_end": 1}, "invalid_value", "content_index"),
        ({"item_id": "a1", "content_index": 0, "x_text_end": 6}, "invalid_value", "x_text_end"),
        ({"item_id": "a1", "content_index": 0, "audio_end_ms": 300}, "missing_required_parameter", "x_text_end"),
    ]
    for fields, code, param in cases:
        session.receive({"type": "conversation.item.truncate", "event_id": "e", **fields})
        (error,) = drain(session)
        assert (error["error"]["code"], error["error"]["param"], error["error"]["event_id"]) == (code, param, "e")
    session.receive({"type": "conversation.item.truncate", "item_id": "a1", "content_index": 0, "x_text_end": 2})
    assert types(drain(session)) == ["conversation.item.truncated"]
    session.receive({"type": "conversation.item.retrieve", "item_id": "a1"})
    assert drain(session)[0]["item"]["content"][0]["text"] == "He"


def test_event_ids_count_up_per_session_and_what_clients_can_name_stays_random() -> None:
    """Event ids (one per token) are cheap but unique, also across sessions; item and response ids,
    which a client could otherwise guess and take first with its own item, are random."""
    first, second = SessionIds(), SessionIds()
    events = [first("event") for _ in range(1000)] + [second("event") for _ in range(1000)]
    assert len(set(events)) == 2000 and all(e.startswith("event_") for e in events)
    items = [first("item") for _ in range(3)]
    assert len(set(items)) == 3
    # Drawn in batches from the OS's generator: still distinct, and the same length, past a batch.
    many = [first(prefix) for _ in range(SessionIds.BATCH + 5) for prefix in ("item", "resp")]
    assert len(set(many + items)) == len(many) + 3 and {len(i) for i in many if i.startswith("item_")} == {21}
    tags = {e[len("event_"):len("event_") + 12] for e in events}
    assert not any(tag in item for tag in tags for item in items)
