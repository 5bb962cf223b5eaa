"""Client events serialized by the openai SDK itself (GA and beta models) are accepted, and a
whole exchange reads back through the SDK's lenient parser as the right event classes."""

from __future__ import annotations

import json
from typing import Any

from openai._models import construct_type_unchecked
from openai.types import realtime as ga
from openai.types.beta import realtime as beta
from openai.types.realtime import realtime_conversation_item_assistant_message as assistant_message
from openai.types.realtime import realtime_conversation_item_user_message as user_message
from openai.types.realtime.realtime_server_event import RealtimeServerEvent
from openai.types.realtime.response_create_event import ResponseCreateEvent
from pydantic import BaseModel
from realtime_sdk_check import check_server_event

from gateway.ws.server_events import to_wire
from gateway.ws.session import RealtimeSession, StartGeneration
from llm_shared.contract import FinishEvent, TokenEvent


def as_sent(event: BaseModel) -> dict[str, Any]:
    """Exactly what the SDK's connection.send puts on the wire for a model instance."""
    return json.loads(event.to_json(use_api_names=True, exclude_unset=True))  # type: ignore[attr-defined]


def run(session: RealtimeSession, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for event in events:
        session.receive(event)
        produced = [to_wire(e) for e in session.events_to_send()]
        for server_event in produced:
            check_server_event(server_event, beta=session.beta)
        errors = [e["error"] for e in produced if e["type"] == "error"]
        assert not errors, (event, errors)
        out.extend(produced)
    return out


def test_ga_sdk_client_events_are_accepted() -> None:
    session = RealtimeSession(session_id="sess_1", model="smollm2-135m")
    session.start()
    events = [
        as_sent(ga.SessionUpdateEvent(type="session.update", session=ga.RealtimeSessionCreateRequest(
            type="realtime", instructions="Be brief.", output_modalities=["text"], max_output_tokens=64,
            tools=[], tool_choice="auto", model="smollm2-135m"))),
        as_sent(ga.ConversationItemCreateEvent(type="conversation.item.create", event_id="c1", item=(
            ga.RealtimeConversationItemUserMessage(type="message", role="user", id="u1", content=[
                user_message.Content(type="input_text", text="Hello")])))),
        as_sent(ga.ConversationItemCreateEvent(type="conversation.item.create", previous_item_id="root", item=(
            ga.RealtimeConversationItemAssistantMessage(type="message", role="assistant", content=[
                assistant_message.Content(type="output_text", text="Earlier answer")])))),
        as_sent(ga.ConversationItemRetrieveEvent(type="conversation.item.retrieve", item_id="u1")),
        as_sent(ResponseCreateEvent(type="response.create", response=ga.RealtimeResponseCreateParams(
            conversation="none", instructions="Reply in French.", max_output_tokens="inf", metadata={"k": "v"},
            output_modalities=["text"]))),
        as_sent(ga.ResponseCancelEvent(type="response.cancel")),
        as_sent(ga.ConversationItemDeleteEvent(type="conversation.item.delete", item_id="u1")),
    ]
    out = run(session, events)
    assert [e["type"] for e in out][-2:] == ["response.done", "conversation.item.deleted"]
    (start,) = [c for c in session.commands() if isinstance(c, StartGeneration)]
    assert start.messages[0] == {"role": "system", "content": "Reply in French."}


def test_beta_sdk_client_events_are_accepted() -> None:
    session = RealtimeSession(session_id="sess_1", model="smollm2-135m", beta=True)
    session.start()
    events = [
        as_sent(beta.SessionUpdateEvent(type="session.update", session=beta.session_update_event.Session(
            modalities=["text"], instructions="Be brief.", temperature=0.7, max_response_output_tokens=32,
            turn_detection=None, voice="alloy", input_audio_format="pcm16"))),
        as_sent(beta.ConversationItemCreateEvent(type="conversation.item.create", item=beta.ConversationItem(
            type="message", role="user", id="u1", content=[beta.ConversationItemContent(type="input_text",
                                                                                        text="Hi")]))),
        as_sent(beta.ConversationItemCreateEvent(type="conversation.item.create", item=beta.ConversationItem(
            type="message", role="assistant", content=[beta.ConversationItemContent(type="text", text="Yo")]))),
        as_sent(beta.ResponseCreateEvent(type="response.create", response=beta.response_create_event.Response(
            modalities=["text"], temperature=0.2, max_response_output_tokens="inf", conversation="auto"))),
    ]
    run(session, events)
    (start,) = session.commands()
    assert isinstance(start, StartGeneration)
    assert start.params.temperature == 0.2
    assert start.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": "Yo"}]


def test_the_sdk_parser_reads_a_turn_as_typed_events() -> None:
    session = RealtimeSession(session_id="sess_1", model="smollm2-135m")
    session.start()
    session.receive({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}})
    session.receive({"type": "response.create"})
    (start,) = session.commands()
    session.engine_event(start.response_id, TokenEvent(token_id=1, text="Hey", logprob=0.0))
    session.engine_event(start.response_id, FinishEvent(reason="stop", prompt_tokens=5, completion_tokens=1,
                                                        cached_tokens=2))
    # The same path as the SDK's connection.recv(): json text -> construct_type_unchecked.
    parsed = [construct_type_unchecked(value=json.loads(json.dumps(e)), type_=RealtimeServerEvent)
              for e in map(to_wire, session.events_to_send())]
    kinds = {type(p).__name__ for p in parsed}
    assert {"SessionCreatedEvent", "ConversationItemAdded", "ResponseTextDeltaEvent", "ResponseDoneEvent"} <= kinds
    done = parsed[-1]
    assert isinstance(done, ga.ResponseDoneEvent)
    assert done.response.usage is not None and done.response.usage.input_token_details is not None
    assert done.response.usage.input_token_details.cached_tokens == 2
    assert done.response.output is not None and done.response.output[0].content[0].text == "Hey"  # type: ignore[union-attr]
