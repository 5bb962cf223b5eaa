"""Conversation editing, out-of-band responses, limits, beta naming and failure handling of the
Realtime session core."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from realtime_sdk_check import check_server_event

from gateway.ws.responses import ResponseStream
from gateway.ws.server_events import to_wire
from gateway.ws.session import AbortGeneration, RealtimeSession, SessionLimits, StartGeneration
from llm_shared.contract import FinishEvent, TokenEvent


def make(*, beta: bool = False, limits: SessionLimits | None = None) -> RealtimeSession:
    counter = itertools.count(1)
    session = RealtimeSession(session_id="sess_1", model="smollm2-135m", limits=limits or SessionLimits(), beta=beta,
                              id_factory=lambda prefix: f"{prefix}_{next(counter)}")
    session.start()
    return session


def drain(session: RealtimeSession) -> list[dict[str, Any]]:
    events = [to_wire(e) for e in session.events_to_send()]
    for event in events:
        check_server_event(event, beta=session.beta)
    return events


def say(session: RealtimeSession, role: str, text: str, *, item_id: str | None = None,
        previous: str | None = None, event_id: str | None = None) -> None:
    kind = "output_text" if role == "assistant" else "input_text"
    item: dict[str, Any] = {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}
    if item_id:
        item["id"] = item_id
    event: dict[str, Any] = {"type": "conversation.item.create", "item": item}
    if previous:
        event["previous_item_id"] = previous
    if event_id:
        event["event_id"] = event_id
    session.receive(event)


def start_response(session: RealtimeSession, **response: Any) -> StartGeneration:
    session.receive({"type": "response.create", "response": response})
    (command,) = session.commands()
    assert isinstance(command, StartGeneration)
    return command


def finish(session: RealtimeSession, response_id: str, text: str) -> list[dict[str, Any]]:
    session.engine_event(response_id, TokenEvent(token_id=1, text=text, logprob=0.0))
    session.engine_event(response_id, FinishEvent(reason="stop", prompt_tokens=3, completion_tokens=1))
    return drain(session)


def error_of(events: list[dict[str, Any]]) -> dict[str, Any]:
    (event,) = events
    assert event["type"] == "error"
    return event["error"]


def test_previous_item_id_orders_the_conversation() -> None:
    session = make()
    say(session, "user", "b", item_id="b")
    say(session, "user", "a", item_id="a", previous="root")
    say(session, "user", "c", item_id="c", previous="a")
    events = drain(session)
    added = [e for e in events if e["type"] == "conversation.item.added"]
    assert [e["previous_item_id"] for e in added] == [None, None, "a"]
    assert [m["content"] for m in start_response(session).messages] == ["a", "c", "b"]


def test_item_errors() -> None:
    session = make()
    say(session, "user", "x", item_id="dup")
    drain(session)
    say(session, "user", "y", item_id="dup", event_id="e1")
    assert error_of(drain(session)) | {"message": ""} == {
        "type": "invalid_request_error", "code": "duplicate_item_id", "param": "item.id", "event_id": "e1",
        "message": ""}
    say(session, "user", "y", previous="ghost", event_id="e2")
    assert error_of(drain(session))["code"] == "item_not_found"
    for kind in ("conversation.item.delete", "conversation.item.retrieve"):
        session.receive({"type": kind, "item_id": "ghost", "event_id": "e3"})
        error = error_of(drain(session))
        assert (error["code"], error["param"], error["event_id"]) == ("item_not_found", "item_id", "e3")


def test_delete_and_retrieve() -> None:
    session = make()
    say(session, "user", "keep", item_id="k")
    say(session, "user", "drop", item_id="d")
    drain(session)
    session.receive({"type": "conversation.item.retrieve", "item_id": "d"})
    (retrieved,) = drain(session)
    assert retrieved["type"] == "conversation.item.retrieved"
    assert retrieved["item"]["content"] == [{"type": "input_text", "text": "drop"}]
    session.receive({"type": "conversation.item.delete", "item_id": "d"})
    (deleted,) = drain(session)
    assert (deleted["type"], deleted["item_id"]) == ("conversation.item.deleted", "d")
    assert [m["content"] for m in start_response(session).messages] == ["keep"]


def test_deleting_the_item_being_written_cancels_the_response() -> None:
    session = make()
    say(session, "user", "hi")
    command = start_response(session)
    session.engine_event(command.response_id, TokenEvent(token_id=1, text="Hel", logprob=0.0))
    item_id = next(e["item"]["id"] for e in drain(session) if e["type"] == "response.output_item.added")
    session.receive({"type": "conversation.item.delete", "item_id": item_id})
    assert session.commands() == [AbortGeneration(command.response_id)]
    events = drain(session)
    assert [e["type"] for e in events][-2:] == ["response.done", "conversation.item.deleted"]
    assert [m["role"] for m in start_response(session).messages] == ["user"]


def test_out_of_band_response_stays_out_of_the_conversation() -> None:
    session = make()
    say(session, "user", "Tell a joke")
    drain(session)
    command = start_response(session, conversation="none", instructions="Classify the topic.",
                             metadata={"purpose": "topic"})
    assert command.messages == [{"role": "system", "content": "Classify the topic."},
                                {"role": "user", "content": "Tell a joke"}]
    events = finish(session, command.response_id, "humour")
    assert "conversation.item.added" not in [e["type"] for e in events]
    assert "conversation.item.done" not in [e["type"] for e in events]
    done = events[-1]["response"]
    assert done["conversation_id"] is None and done["metadata"] == {"purpose": "topic"}
    assert done["output"][0]["content"][0]["text"] == "humour"
    # Not in the conversation, and the session's instructions were untouched.
    assert start_response(session).messages == [{"role": "user", "content": "Tell a joke"}]


def test_input_replaces_the_conversation_as_prompt() -> None:
    session = make()
    say(session, "user", "first", item_id="u1")
    say(session, "user", "second", item_id="u2")
    drain(session)
    command = start_response(session, input=[
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Summarise."}]},
        {"type": "item_reference", "id": "u2"}])
    assert command.messages == [{"role": "system", "content": "Summarise."}, {"role": "user", "content": "second"}]
    events = finish(session, command.response_id, "ok")
    # The output still joins the default conversation; the input items do not.
    assert [e["type"] for e in events].count("conversation.item.added") == 1
    assert [m["content"] for m in start_response(session).messages] == ["first", "second", "ok"]


def test_input_reference_to_a_missing_item() -> None:
    session = make()
    drain(session)
    session.receive({"type": "response.create", "event_id": "r1",
                     "response": {"input": [{"type": "item_reference", "id": "ghost"}]}})
    error = error_of(drain(session))
    assert (error["code"], error["param"], error["event_id"]) == ("item_not_found", "response.input[0].id", "r1")
    assert session.commands() == [] and session.active_response_id is None


def test_repeated_references_to_a_large_item_are_refused_before_any_string_is_joined(monkeypatch) -> None:
    session = make(limits=SessionLimits(max_conversation_chars=1000))
    session.receive({"type": "conversation.item.create", "item": {
        "id": "big", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * 600}]}})
    drain(session)
    import gateway.ws.prompt as session_module  # where prompts are joined

    joined: list[int] = []
    real = session_module.to_history
    monkeypatch.setattr(session_module, "to_history", lambda *a: joined.append(1) or real(*a))
    session.receive({"type": "response.create", "event_id": "r2", "response": {
        "conversation": "none", "input": [{"type": "item_reference", "id": "big"}] * 200}})
    error = error_of(drain(session))
    assert (error["code"], error["param"]) == ("conversation_limit_exceeded", "response.input[1]")
    assert joined == [] and session.commands() == []  # refused at the second reference, nothing joined


def test_conversation_limits() -> None:
    session = make(limits=SessionLimits(max_conversation_items=3, max_conversation_chars=20))
    say(session, "user", "0123456789")
    say(session, "user", "0123456789")
    drain(session)
    say(session, "user", "x", event_id="over")
    error = error_of(drain(session))
    assert (error["code"], error["param"], error["event_id"]) == ("conversation_limit_exceeded", "item", "over")
    assert "20" in error["message"]
    session.receive({"type": "response.create", "response": {"instructions": "too much text here"}})
    error = error_of(drain(session))
    assert error["code"] == "conversation_limit_exceeded" and "characters" in error["message"]
    command = start_response(session)  # 2 items + the answer fits in 3 items
    drain(session)
    # The answer's slot is reserved: no new item fits while the response is running.
    say(session, "user", "")
    assert error_of(drain(session))["code"] == "conversation_limit_exceeded"
    finish(session, command.response_id, "")
    session.receive({"type": "response.create"})
    error = error_of(drain(session))
    assert error["code"] == "conversation_limit_exceeded" and "items" in error["message"]
    start_response(session, conversation="none")  # out-of-band needs no slot


def test_session_update_rejects_another_model_and_keeps_settings() -> None:
    session = make()
    drain(session)
    session.receive({"type": "session.update", "event_id": "u", "session": {"model": "gpt-4o"}})
    error = error_of(drain(session))
    assert (error["code"], error["param"]) == ("invalid_value", "session.model")
    session.receive({"type": "session.update", "session": {"model": "smollm2-135m", "temperature": 0.1,
                                                           "max_output_tokens": 9}})
    (updated,) = drain(session)
    assert updated["session"]["temperature"] == pytest.approx(0.1)
    say(session, "user", "hi")
    params = start_response(session).params
    assert (params.temperature, params.max_tokens) == (pytest.approx(0.1), 9)


def test_beta_naming() -> None:
    session = RealtimeSession(session_id="sess_b", model="smollm2-135m", beta=True)
    session.start()
    created = drain(session)
    assert [e["type"] for e in created] == ["session.created", "conversation.created"]
    assert created[0]["session"]["modalities"] == ["text"]
    assert created[0]["session"]["max_response_output_tokens"] == 512
    session.receive({"type": "session.update", "session": {"modalities": ["text"], "max_response_output_tokens": 5}})
    assert drain(session)[0]["session"]["max_response_output_tokens"] == 5
    say(session, "user", "hi")
    assert [e["type"] for e in drain(session)] == ["conversation.item.created"]
    session.receive({"type": "conversation.item.create", "item": {
        "type": "message", "role": "assistant", "content": [{"type": "text", "text": "earlier"}]}})
    assert drain(session)[0]["item"]["content"] == [{"type": "text", "text": "earlier"}]
    command = start_response(session)
    events = finish(session, command.response_id, "hey")
    assert [e["type"] for e in events] == [
        "response.created", "response.output_item.added", "conversation.item.created", "response.content_part.added",
        "response.text.delta", "response.text.done", "response.content_part.done", "response.output_item.done",
        "response.done"]
    assert events[-1]["response"]["output"][0]["content"] == [{"type": "text", "text": "hey"}]
    assert events[-1]["response"]["modalities"] == ["text"]


def test_invalid_frames_and_rate_limits() -> None:
    session = make()
    drain(session)
    session.receive_invalid("invalid_json", "the frame is not valid JSON")
    error = error_of(drain(session))
    assert (error["code"], error["event_id"], error["param"]) == ("invalid_json", None, None)
    session.rate_limits([{"name": "requests", "limit": 600, "remaining": 599, "reset_seconds": 0.1},
                         {"name": "tokens", "limit": 200_000, "remaining": 199_000, "reset_seconds": 3.0}])
    (event,) = drain(session)
    assert event["type"] == "rate_limits.updated" and event["rate_limits"][1]["remaining"] == 199_000


def test_internal_failures_become_a_generic_server_error(monkeypatch: pytest.MonkeyPatch) -> None:
    session = make()
    drain(session)

    def broken(*args: object) -> None:
        raise RuntimeError("secret detail /srv/internal.py")

    monkeypatch.setattr(session._items, "create", broken)
    say(session, "user", "hi", event_id="ev")
    error = error_of(drain(session))
    assert (error["type"], error["code"], error["event_id"]) == ("server_error", "server_error", "ev")
    assert "secret" not in error["message"]

    say_ok = make()
    say(say_ok, "user", "hi")
    command = start_response(say_ok)
    drain(say_ok)
    monkeypatch.setattr(ResponseStream, "_delta", broken)
    say_ok.engine_event(command.response_id, TokenEvent(token_id=1, text="x", logprob=0.0))
    assert say_ok.commands() == [AbortGeneration(command.response_id)]
    (done,) = drain(say_ok)
    assert done["response"]["status"] == "failed" and "secret" not in str(done)
    assert say_ok.active_response_id is None


def test_a_broken_failure_report_still_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    session = make()
    say(session, "user", "hi")
    command = start_response(session)

    def broken(*args: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(ResponseStream, "_delta", broken)
    monkeypatch.setattr(ResponseStream, "_finish", broken)
    session.engine_event(command.response_id, TokenEvent(token_id=1, text="x", logprob=0.0))
    assert session.active_response_id is None
    assert session.commands() == [AbortGeneration(command.response_id)]
    session.engine_event(command.response_id, TokenEvent(token_id=2, text="y", logprob=0.0))
    assert [e["type"] for e in drain(session)][-1] == "response.created"
