"""Property tests: arbitrary client input and engine timing never break the session's promises.

Whatever arrives, ``receive`` and the engine callbacks never raise, every server event
validates against the openai SDK's models, event ids are unique, at most one response is
active, and nothing of a response is emitted after its ``response.done``.
"""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from realtime_sdk_check import check_server_event

from gateway.ws.server_events import to_wire
from gateway.ws.session import AbortGeneration, RealtimeSession, SessionLimits, StartGeneration
from llm_shared.contract import FinishEvent, TokenEvent
from llm_shared.errors import EngineUnavailableError, OverloadedError
from llm_shared.structured import SchemaError, get_family

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# Ids the deterministic id factory hands out, so that events can hit real items and responses.
known_ids = st.sampled_from(["item_3", "item_5", "item_7", "item_9", "resp_4", "resp_6", "a", "b", "root"])
texts = st.text(max_size=12)
maybe = st.one_of(st.none(), json_values)
WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}}
tools = st.just([]) | st.just([WEATHER]) | st.lists(json_values, max_size=2) | json_values
tool_choices = st.sampled_from(["auto", "none", "required", {"type": "function", "name": "get_weather"}]) | json_values
# Engine output: free text, and pieces of SmolLM2's call syntax (whole, split, or broken).
outputs = texts | st.sampled_from([
    "<tool_call>", "[{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": ", "\"Paris\"}}", "]</tool_call>",
    "<tool", "_call>[", '<tool_call>[{"name": "get_weather", "arguments": {}}]</tool_call>', "}", "]", ", {"])


@st.composite
def parts(draw: st.DrawFn) -> dict[str, Any]:
    part: dict[str, Any] = {"type": draw(st.sampled_from(["input_text", "output_text", "text", "input_audio", "x"]))}
    if draw(st.booleans()):
        part["text"] = draw(texts | json_values)
    return part


@st.composite
def valid_items(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(st.sampled_from(["user", "user", "assistant", "system"]))
    kind = "output_text" if role == "assistant" else "input_text"
    item: dict[str, Any] = {"type": "message", "role": role,
                            "content": [{"type": kind, "text": t} for t in draw(st.lists(texts, min_size=1,
                                                                                          max_size=2))]}
    if draw(st.integers(0, 3)) == 0:
        item["id"] = draw(known_ids)
    return item


@st.composite
def random_items(draw: st.DrawFn) -> dict[str, Any]:
    item: dict[str, Any] = {"type": draw(st.sampled_from(["message", "message", "item_reference", "function_call"])),
                            "role": draw(st.sampled_from(["user", "assistant", "system", "tool"])),
                            "content": draw(st.lists(parts(), max_size=3))}
    if draw(st.booleans()):
        item["id"] = draw(known_ids | texts)
    if draw(st.integers(0, 9)) == 0:
        item[draw(st.text(max_size=5))] = draw(json_values)
    return item


@st.composite
def function_items(draw: st.DrawFn) -> dict[str, Any]:
    call_ids = st.sampled_from(["c1", "c2", "call_x"]) | json_values
    if draw(st.booleans()):
        item = {"type": "function_call", "call_id": draw(call_ids), "name": draw(st.just("get_weather") | texts),
                "arguments": draw(st.just('{"city": "Rome"}') | texts)}
    else:
        item = {"type": "function_call_output", "call_id": draw(call_ids), "output": draw(texts | json_values)}
    for key in draw(st.lists(st.sampled_from(sorted(item)), max_size=1)):
        del item[key]
    return item


def items() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(valid_items(), valid_items(), valid_items(), random_items(), function_items())


@st.composite
def client_events(draw: st.DrawFn) -> object:
    kind = draw(st.sampled_from([
        "session.update", "conversation.item.create", "conversation.item.create", "conversation.item.create",
        "conversation.item.delete", "conversation.item.retrieve", "conversation.item.truncate",
        "conversation.item.truncate", "response.create", "response.create", "response.create", "response.cancel",
        "input_audio_buffer.append", "bogus", "raw",
    ]))
    if kind == "raw":
        return draw(json_values)
    event: dict[str, Any] = {"type": kind}
    if draw(st.booleans()):
        event["event_id"] = draw(texts | texts | json_values)
    if kind == "session.update":
        event["session"] = draw(st.fixed_dictionaries({}, optional={
            "instructions": texts | json_values, "max_output_tokens": st.integers(-1, 5000) | st.just("inf"),
            "temperature": st.floats(-1, 3) | json_values, "modalities": st.just(["text"]) | json_values,
            "tools": tools, "tool_choice": tool_choices, "parallel_tool_calls": st.booleans() | json_values,
            "model": st.just("m") | texts}))
    elif kind == "conversation.item.create":
        event["item"] = draw(items())
        if draw(st.booleans()):
            event["previous_item_id"] = draw(known_ids | json_values)
    elif kind in ("conversation.item.delete", "conversation.item.retrieve"):
        event["item_id"] = draw(known_ids | json_values)
    elif kind == "conversation.item.truncate":
        event.update(item_id=draw(known_ids), content_index=draw(st.integers(-1, 1)),
                     x_text_end=draw(st.integers(-1, 12) | st.integers(0, 3) | json_values))
    elif kind == "response.create" and draw(st.booleans()):
        event["response"] = draw(st.fixed_dictionaries({}, optional={
            "conversation": st.sampled_from(["auto", "none", "conv_1", "other"]) | json_values,
            "input": st.lists(items() | st.just({"type": "item_reference", "id": "item_3"}), max_size=3),
            "instructions": texts | texts | json_values,
            "max_output_tokens": st.integers(0, 20) | st.just("inf") | json_values,
            "metadata": st.dictionaries(st.text(max_size=70), texts, max_size=3),
            "temperature": st.floats(-1, 3), "tools": tools, "tool_choice": tool_choices}))
    elif kind == "response.cancel" and draw(st.booleans()):
        event["response_id"] = draw(known_ids | json_values)
    return event


def _response_of(event: dict[str, Any]) -> str | None:
    if "response_id" in event:
        return event["response_id"]
    if event["type"] in ("response.created", "response.done"):
        return event["response"]["id"]
    return None


class Checker:
    """Replays the session's output and asserts the protocol invariants after every step."""

    def __init__(self, session: RealtimeSession) -> None:
        self.session = session
        self.event_ids: set[str] = set()
        self.done: set[str] = set()
        self.open: str | None = None
        self.started: set[str] = set()
        self.last: str | None = None  # last response id, for stale engine events
        self.items: set[str] = set()  # ids in the conversation, so that edits can hit them
        self.streamed: dict[str, str] = {}  # item id -> text sent as deltas
        self.arguments: dict[str, str] = {}  # call item id -> arguments sent as deltas
        self.call_ids: set[str] = set()  # call_ids of function calls that joined the conversation

    def step(self) -> None:
        active_before = self.open
        for event in map(to_wire, self.session.events_to_send()):
            check_server_event(event, beta=self.session.beta)
            assert event["event_id"] not in self.event_ids
            self.event_ids.add(event["event_id"])
            if event["type"] in ("conversation.item.added", "conversation.item.created"):
                self.items.add(event["item"]["id"])
                if event["item"]["type"] == "function_call":
                    self.call_ids.add(event["item"]["call_id"])
            elif event["type"] == "conversation.item.deleted":
                self.items.discard(event["item_id"])
            elif event["type"].endswith("text.delta"):
                self.streamed[event["item_id"]] = self.streamed.get(event["item_id"], "") + event["delta"]
            elif event["type"].endswith("text.done"):  # the final text is exactly what was streamed
                assert event["text"] == self.streamed.get(event["item_id"], "")
            elif event["type"] == "response.function_call_arguments.delta":
                self.arguments[event["item_id"]] = self.arguments.get(event["item_id"], "") + event["delta"]
            elif event["type"] == "response.function_call_arguments.done":  # the same for a call's arguments
                assert event["arguments"] == self.arguments.get(event["item_id"], "")
            rid = _response_of(event)
            if rid is None:
                continue
            assert rid not in self.done, f"{event['type']} after response.done of {rid}"
            if event["type"] == "response.created":
                assert self.open is None, "two responses active at once"
                self.open = self.last = rid
            else:
                assert rid == self.open
            if event["type"] == "response.done":
                self.done.add(rid)
                self.open = None
        assert self.session.active_response_id == self.open
        for command in self.session.commands():
            if isinstance(command, StartGeneration):
                assert command.response_id == self.open and command.response_id not in self.started
                self.started.add(command.response_id)
            else:
                assert isinstance(command, AbortGeneration)
                assert command.response_id == active_before and command.response_id in self.done


class SessionMachine(RuleBasedStateMachine):
    """Interleaves client events, engine output (current and stale) and adapter calls."""

    def __init__(self) -> None:
        super().__init__()
        self.session: RealtimeSession | None = None
        self.checker: Checker | None = None

    # A prompt that lists tools carries the family's instructions (~1,000 characters): a session
    # with the small bound of characters refuses every response that may call.
    @initialize(beta=st.booleans(), chars=st.sampled_from([120, 3000]))
    def start(self, beta: bool, chars: int) -> None:
        counter = itertools.count(1)
        self.session = RealtimeSession(session_id="sess_f", model="m", beta=beta, family=get_family("smollm2"),
                                       limits=SessionLimits(max_conversation_items=8, max_conversation_chars=chars,
                                                            default_max_output_tokens=8, max_output_tokens=16),
                                       id_factory=lambda prefix: f"{prefix}_{next(counter)}")
        self.checker = Checker(self.session)
        self.session.start()

    @property
    def s(self) -> RealtimeSession:
        assert self.session is not None
        return self.session

    @property
    def c(self) -> Checker:
        assert self.checker is not None
        return self.checker

    @rule(event=client_events())
    def client(self, event: object) -> None:
        self.s.receive(event)

    @rule(event=valid_items().map(lambda item: {"type": "conversation.item.create", "item": item}))
    def add_message(self, event: object) -> None:
        self.s.receive(event)

    @precondition(lambda self: self.checker is not None and bool(self.checker.items))
    @rule(data=st.data())
    def edit_item(self, data: st.DataObject) -> None:
        item_id = data.draw(st.sampled_from(sorted(self.c.items)))
        kind = data.draw(st.sampled_from(["delete", "retrieve", "truncate", "truncate"]))
        event: dict[str, Any] = {"type": f"conversation.item.{kind}", "item_id": item_id, "event_id": "edit"}
        if kind == "truncate":
            event.update(content_index=0, x_text_end=data.draw(st.integers(0, 12)))
        self.s.receive(event)

    @rule(choice=st.sampled_from(["auto", "auto", "required", "none"]))
    def set_tools(self, choice: str) -> None:
        self.s.receive({"type": "session.update", "session": {"tools": [WEATHER], "tool_choice": choice}})

    @precondition(lambda self: self.checker is not None and bool(self.checker.call_ids))
    @rule(data=st.data())
    def answer_call(self, data: st.DataObject) -> None:
        call_id = data.draw(st.sampled_from(sorted(self.c.call_ids)))
        self.s.receive({"type": "conversation.item.create", "item": {
            "type": "function_call_output", "call_id": call_id, "output": data.draw(texts)}})

    @rule()
    def respond(self) -> None:
        self.s.receive({"type": "response.create"})

    @precondition(lambda self: self.checker is not None and self.checker.open is not None)
    @rule(text=outputs)
    def token(self, text: str) -> None:
        self.s.engine_event(str(self.c.open), TokenEvent(token_id=7, text=text, logprob=-1.0))

    @precondition(lambda self: self.checker is not None and self.checker.open is not None)
    @rule(data=st.data())
    def call_tokens(self, data: st.DataObject) -> None:
        """A well-formed call (or a prefix of one: cut short by what comes next), in random pieces."""
        text = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
        cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
        end = data.draw(st.sampled_from([len(text), len(text), *cuts])) if cuts else len(text)
        for a, b in itertools.pairwise([0, *[c for c in cuts if c < end], end]):
            self.s.engine_event(str(self.c.open), TokenEvent(token_id=7, text=text[a:b], logprob=-1.0))

    @precondition(lambda self: self.checker is not None and self.checker.open is not None)
    @rule(reason=st.sampled_from(["stop", "stop", "length", "abort", "error"]), text=texts)
    def finish(self, reason: str, text: str) -> None:
        self.s.engine_event(str(self.c.open), FinishEvent(reason=reason, prompt_tokens=4, completion_tokens=2,
                                                          text=text, tier="edge"))

    @precondition(lambda self: self.checker is not None and self.checker.last is not None)
    @rule(text=texts, finish=st.booleans())
    def stale_engine_event(self, text: str, finish: bool) -> None:
        event = FinishEvent(reason="stop", prompt_tokens=1, completion_tokens=1) if finish else TokenEvent(
            token_id=7, text=text, logprob=-1.0)
        for rid in self.c.done:
            self.s.engine_event(rid, event)
        self.s.engine_event("resp_unknown", event)

    @rule(kind=st.sampled_from(["overloaded", "unavailable", "schema"]), stale=st.booleans())
    def engine_failed(self, kind: str, stale: bool) -> None:
        error = {"overloaded": OverloadedError("busy"), "unavailable": EngineUnavailableError("engine down"),
                 "schema": SchemaError("cannot be enforced", param="session.tools[0].parameters")}[kind]
        self.s.engine_failed(str(self.c.last if stale else self.c.open), error)

    @rule(reason=st.sampled_from(["client_too_slow", "server_shutdown", "client_disconnected"]))
    def cancel(self, reason: str) -> None:
        self.s.cancel_active(reason)

    @rule()
    def invalid_frame(self) -> None:
        self.s.receive_invalid("invalid_json", "not JSON")

    @rule()
    def rate_limits(self) -> None:
        self.s.rate_limits([{"name": "requests", "limit": 10, "remaining": 9, "reset_seconds": 1.0}])

    @invariant()
    def promises_hold(self) -> None:
        if self.checker is not None:
            self.checker.step()


SessionMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
TestSessionMachine = SessionMachine.TestCase
