"""Client event validation at the boundary: every bad input is a ProtocolError naming its param."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.ws.audio_events import EAGERNESS_SILENCE_MS, AudioPatch, NoiseReduction, ServerVad, Transcription
from gateway.ws.events import (
    AudioAppend,
    AudioCommit,
    ItemCreate,
    ItemReference,
    ItemTruncate,
    NewFunctionCall,
    NewFunctionCallOutput,
    NewItem,
    ProtocolError,
    ResponseCancel,
    ResponseCreate,
    SessionLimits,
    SessionUpdate,
    ToolsPatch,
    parse_client_event,
)
from voice.formats import PCM16

LIMITS = SessionLimits(max_conversation_items=4, max_conversation_chars=100, default_max_output_tokens=100,
                       max_output_tokens=300, max_audio_append_bytes=1024)


def message(role: str = "user", *parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    content = list(parts) or [{"type": "input_text", "text": "hi"}]
    return {"type": "message", "role": role, "content": content, **extra}


def test_audio_settings_parse_from_ga_and_beta_shapes() -> None:
    ga = parse_client_event({"type": "session.update", "session": {
        "output_modalities": ["audio"],
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                            "transcription": {"model": "whisper-1", "language": "en"},
                            "turn_detection": {"type": "server_vad", "threshold": 0.6, "silence_duration_ms": 400,
                                               "create_response": False}},
                  "output": {"format": {"type": "audio/pcm"}, "voice": "marin", "speed": 1.0}}}}, LIMITS)
    assert isinstance(ga, SessionUpdate)
    assert ga.audio == AudioPatch(output_audio=True, voice="marin",
                                  transcription=Transcription(model="whisper-1", language="en"),
                                  turn_detection=ServerVad(threshold=0.6, silence_duration_ms=400,
                                                           create_response=False),
                                  input_format=PCM16, output_format=PCM16)
    beta = parse_client_event({"type": "session.update", "session": {
        "modalities": ["text", "audio"], "voice": "echo", "input_audio_format": "pcm16",
        "output_audio_format": "pcm16", "input_audio_transcription": None,
        "turn_detection": {"type": "server_vad", "prefix_padding_ms": 100}}}, LIMITS)
    assert isinstance(beta, SessionUpdate)
    assert beta.audio == AudioPatch(output_audio=True, voice="echo", transcription=None,
                                    turn_detection=ServerVad(prefix_padding_ms=100), input_format=PCM16,
                                    output_format=PCM16)
    response = parse_client_event({"type": "response.create", "response": {
        "output_modalities": ["text"], "audio": {"output": {"voice": "ash"}}}}, LIMITS)
    assert response.audio == AudioPatch(output_audio=False, voice="ash")  # type: ignore[union-attr]


def test_framework_voice_settings_parse_with_their_stand_ins() -> None:
    """semantic_vad runs as server VAD whose silence follows the eagerness; noise reduction and
    idle_timeout_ms are kept as given (the session echoes them, and acts on the timeout)."""
    ga = parse_client_event({"type": "session.update", "session": {"audio": {"input": {
        "noise_reduction": {"type": "near_field"},
        "turn_detection": {"type": "semantic_vad", "eagerness": "high", "create_response": True,
                           "interrupt_response": False}}}}}, LIMITS)
    assert ga.audio == AudioPatch(  # type: ignore[union-attr]
        noise_reduction=NoiseReduction("near_field"),
        turn_detection=ServerVad(kind="semantic_vad", eagerness="high", silence_duration_ms=300,
                                 interrupt_response=False))
    assert ga.audio.turn_detection.wire() == {  # type: ignore[union-attr]
        "type": "semantic_vad", "eagerness": "high", "create_response": True, "interrupt_response": False}
    default = parse_client_event({"type": "session.update", "session": {"turn_detection": {
        "type": "semantic_vad"}}}, LIMITS)
    assert default.audio.turn_detection == ServerVad(  # type: ignore[union-attr]
        kind="semantic_vad", eagerness="auto", silence_duration_ms=EAGERNESS_SILENCE_MS["auto"])
    beta = parse_client_event({"type": "session.update", "session": {
        "input_audio_noise_reduction": {"type": "far_field", "strength": 0.5},
        "turn_detection": {"type": "server_vad", "idle_timeout_ms": 6000}}}, LIMITS)
    assert beta.audio == AudioPatch(noise_reduction=NoiseReduction("far_field", 0.5),  # type: ignore[union-attr]
                                    turn_detection=ServerVad(idle_timeout_ms=6000))
    off = parse_client_event({"type": "session.update", "session": {"audio": {"input": {
        "noise_reduction": None}}, "include": []}}, LIMITS)
    assert off.audio == AudioPatch(noise_reduction=None)  # type: ignore[union-attr]


def test_audio_arrives_as_base64_or_bytes() -> None:
    assert parse_client_event({"type": "input_audio_buffer.append", "event_id": "a", "audio": "AQIDBA=="},
                              LIMITS) == AudioAppend(event_id="a", audio=b"\x01\x02\x03\x04")
    assert parse_client_event({"type": "input_audio_buffer.append", "audio": b"\x00\x01"},
                              LIMITS) == AudioAppend(event_id=None, audio=b"\x00\x01")
    assert parse_client_event({"type": "input_audio_buffer.commit"}, LIMITS) == AudioCommit(event_id=None)
    with pytest.raises(ProtocolError) as e:
        parse_client_event({"type": "input_audio_buffer.append", "audio": b"\x00" * 1026}, LIMITS)
    assert e.value.code == "audio_too_large"


def test_valid_events_parse_to_typed_values() -> None:
    update = parse_client_event({"type": "session.update", "event_id": "e1", "session": {
        "type": "realtime", "instructions": "Be kind.", "max_output_tokens": "inf", "temperature": 0.3,
        "output_modalities": ["text"], "tools": [], "audio": {"input": {"turn_detection": None}}}}, LIMITS)
    assert update == SessionUpdate(event_id="e1", instructions="Be kind.", max_output_tokens="inf", temperature=0.3,
                                   tools=ToolsPatch({"tools": []}),
                                   audio=AudioPatch(output_audio=False, turn_detection=None))

    beta_update = parse_client_event({"type": "session.update", "session": {
        "modalities": ["text"], "max_response_output_tokens": 200, "voice": "alloy", "turn_detection": None}}, LIMITS)
    assert beta_update == SessionUpdate(event_id=None, max_output_tokens=200,
                                        audio=AudioPatch(output_audio=False, voice="alloy", turn_detection=None))

    create = parse_client_event({"type": "conversation.item.create", "previous_item_id": "root", "item": message(
        "assistant", {"type": "output_text", "text": "a"}, {"type": "text", "text": "b"}, id="it1")}, LIMITS)
    assert create == ItemCreate(event_id=None, item=NewItem(id="it1", role="assistant", parts=("a", "b")),
                                previous_item_id="root")

    response = parse_client_event({"type": "response.create", "response": {
        "conversation": "none", "instructions": "Short.", "max_output_tokens": 7, "metadata": {"k": "v"},
        "input": [{"type": "item_reference", "id": "it1"}, message("system", {"type": "input_text", "text": "s"})],
        "output_modalities": ["text"], "tool_choice": "auto", "parallel_tool_calls": False}}, LIMITS)
    assert response == ResponseCreate(
        event_id=None, conversation="none", instructions="Short.", max_output_tokens=7, metadata={"k": "v"},
        input=(ItemReference("it1"), NewItem(id=None, role="system", parts=("s",))),
        tools=ToolsPatch({"tool_choice": "auto"}, parallel_tool_calls=False),
        audio=AudioPatch(output_audio=False))

    # Tools travel as sent (the session parses them against the constraints in force); calls and
    # their outputs are items of their own.
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    assert parse_client_event({"type": "session.update", "session": {"tools": tools, "tool_choice": "required"}},
                              LIMITS).tools == ToolsPatch({"tools": tools, "tool_choice": "required"})
    call = parse_client_event({"type": "conversation.item.create", "item": {
        "type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}", "status": "completed"}}, LIMITS)
    assert call == ItemCreate(event_id=None, item=NewFunctionCall(id=None, call_id="call_1", name="f", arguments="{}"))
    output = parse_client_event({"type": "conversation.item.create", "item": {
        "type": "function_call_output", "id": "o1", "call_id": "call_1", "output": "21 C"}}, LIMITS)
    assert output == ItemCreate(event_id=None, item=NewFunctionCallOutput(id="o1", call_id="call_1", output="21 C"))

    assert parse_client_event({"type": "response.create"}, LIMITS) == ResponseCreate(event_id=None)
    assert parse_client_event({"type": "response.create", "response": {"x_ignore_eos": True}},
                              LIMITS) == ResponseCreate(event_id=None, ignore_eos=True)
    assert parse_client_event({"type": "response.cancel", "response_id": "r"}, LIMITS) == ResponseCancel(None, "r")
    assert parse_client_event({"type": "conversation.item.truncate", "item_id": "a", "content_index": 0,
                               "audio_end_ms": 10, "x_text_end": 3}, LIMITS) == ItemTruncate(None, "a", 0, 3, 10)


BAD: list[tuple[str, object, str, str | None]] = [
    # (case, event, code, param)
    ("not an object", ["type"], "invalid_event", None),
    ("no type", {"event_id": "x"}, "missing_required_parameter", "type"),
    ("type not a string", {"type": 5}, "invalid_type", "type"),
    ("unknown type", {"type": "session.delete"}, "unknown_event_type", "type"),
    ("audio not base64", {"type": "input_audio_buffer.append", "audio": "AA!A"}, "invalid_audio", "audio"),
    ("audio missing", {"type": "input_audio_buffer.append"}, "missing_required_parameter", "audio"),
    ("audio a number", {"type": "input_audio_buffer.append", "audio": 7}, "invalid_type", "audio"),
    ("audio too large", {"type": "input_audio_buffer.append", "audio": "AAAA" * 400}, "audio_too_large", "audio"),
    ("output buffer", {"type": "output_audio_buffer.clear"}, "unsupported_feature", "type"),
    ("commit with junk", {"type": "input_audio_buffer.commit", "x": 1}, "unknown_parameter", "x"),
    ("g711 at 16k", {"type": "session.update", "session": {"audio": {"input": {"format": {
        "type": "audio/pcmu", "rate": 16000}}}}}, "invalid_value", "session.audio.input.format.rate"),
    ("pcm at 16k", {"type": "session.update", "session": {"audio": {"output": {"format": {
        "type": "audio/pcm", "rate": 16000}}}}}, "invalid_value", "session.audio.output.format.rate"),
    ("beta unknown format", {"type": "session.update", "session": {"input_audio_format": "g722"}},
     "invalid_value", "session.input_audio_format"),
    ("semantic vad eagerness", {"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "semantic_vad", "eagerness": "eager"}}}}}, "invalid_value",
     "session.audio.input.turn_detection.eagerness"),
    ("semantic vad with a silence", {"type": "session.update", "session": {"turn_detection": {
        "type": "semantic_vad", "silence_duration_ms": 300}}}, "invalid_value",
     "session.turn_detection.silence_duration_ms"),
    ("unknown vad", {"type": "session.update", "session": {"turn_detection": {"type": "push_to_talk"}}},
     "invalid_value", "session.turn_detection.type"),
    ("idle timeout too short", {"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "server_vad", "idle_timeout_ms": 1000}}}}}, "invalid_value",
     "session.audio.input.turn_detection.idle_timeout_ms"),
    ("idle timeout too long", {"type": "session.update", "session": {"turn_detection": {
        "idle_timeout_ms": 60_000}}}, "invalid_value", "session.turn_detection.idle_timeout_ms"),
    ("noise reduction type", {"type": "session.update", "session": {"audio": {"input": {"noise_reduction": {
        "type": "studio"}}}}}, "invalid_value", "session.audio.input.noise_reduction.type"),
    ("beta noise reduction junk", {"type": "session.update", "session": {"input_audio_noise_reduction": {
        "type": "far_field", "gain": 2}}}, "unknown_parameter", "session.input_audio_noise_reduction.gain"),
    ("transcription logprobs", {"type": "session.update", "session": {"include": [
        "item.input_audio_transcription.logprobs"]}}, "unsupported_feature", "session.include[0]"),
    ("unknown include", {"type": "session.update", "session": {"include": ["usage"]}}, "invalid_value",
     "session.include[0]"),
    ("vad threshold", {"type": "session.update", "session": {"turn_detection": {"type": "server_vad",
                                                                               "threshold": 1.5}}},
     "invalid_value", "session.turn_detection.threshold"),
    ("vad silence", {"type": "session.update", "session": {"turn_detection": {"silence_duration_ms": 60_000}}},
     "invalid_value", "session.turn_detection.silence_duration_ms"),
    ("unknown voice", {"type": "session.update", "session": {"audio": {"output": {"voice": "bob"}}}},
     "invalid_value", "session.audio.output.voice"),
    ("custom voice", {"type": "response.create", "response": {"audio": {"output": {"voice": {"id": "v1"}}}}},
     "unsupported_feature", "response.audio.output.voice"),
    ("speed", {"type": "session.update", "session": {"audio": {"output": {"speed": 1.2}}}},
     "unsupported_feature", "session.audio.output.speed"),
    ("non-English transcription", {"type": "session.update", "session": {"audio": {"input": {"transcription": {
        "model": "whisper-1", "language": "fr"}}}}}, "unsupported_feature", "session.audio.input.transcription.language"),
    ("non-string key", {"type": "response.create", 1: 2}, "invalid_type", None),
    ("unknown top-level field", {"type": "response.cancel", "foo": 1}, "unknown_parameter", "foo"),
    ("event_id not a string", {"type": "response.cancel", "event_id": 3}, "invalid_type", "event_id"),
    ("event_id too long", {"type": "response.cancel", "event_id": "e" * 500}, "string_above_max_length", "event_id"),
    ("session missing", {"type": "session.update"}, "missing_required_parameter", "session"),
    ("session not an object", {"type": "session.update", "session": "x"}, "invalid_type", "session"),
    ("unknown session field", {"type": "session.update", "session": {"colour": "red"}}, "unknown_parameter",
     "session.colour"),
    ("transcription session", {"type": "session.update", "session": {"type": "transcription"}},
     "unsupported_feature", "session.type"),
    ("both modalities in GA", {"type": "session.update", "session": {"output_modalities": ["audio", "image"]}},
     "invalid_value", "session.output_modalities"),
    ("empty modalities", {"type": "session.update", "session": {"modalities": []}}, "invalid_value",
     "session.modalities"),
    ("mcp tool", {"type": "session.update", "session": {"tools": [{"type": "mcp", "server_label": "s"}]}},
     "unsupported_feature", "session.tools[0].type"),
    ("parallel_tool_calls not a boolean", {"type": "session.update", "session": {"parallel_tool_calls": "yes"}},
     "invalid_type", "session.parallel_tool_calls"),
    ("stored prompt", {"type": "session.update", "session": {"prompt": {"id": "p"}}}, "unsupported_feature",
     "session.prompt"),
    ("instructions too long", {"type": "session.update", "session": {"instructions": "x" * 101}},
     "string_above_max_length", "session.instructions"),
    ("instructions wrong type", {"type": "session.update", "session": {"instructions": ["x"]}}, "invalid_type",
     "session.instructions"),
    ("lone surrogate", {"type": "session.update", "session": {"instructions": "\ud800"}}, "invalid_value",
     "session.instructions"),
    ("max tokens zero", {"type": "session.update", "session": {"max_output_tokens": 0}}, "invalid_value",
     "session.max_output_tokens"),
    ("max tokens above ceiling", {"type": "session.update", "session": {"max_output_tokens": 301}}, "invalid_value",
     "session.max_output_tokens"),
    ("max tokens bool", {"type": "session.update", "session": {"max_output_tokens": True}}, "invalid_type",
     "session.max_output_tokens"),
    ("max tokens string", {"type": "session.update", "session": {"max_response_output_tokens": "100"}},
     "invalid_type", "session.max_response_output_tokens"),
    ("temperature NaN", {"type": "session.update", "session": {"temperature": float("nan")}}, "invalid_value",
     "session.temperature"),
    ("temperature huge int", {"type": "session.update", "session": {"temperature": 10**400}}, "invalid_value",
     "session.temperature"),
    ("temperature string", {"type": "session.update", "session": {"temperature": "hot"}}, "invalid_type",
     "session.temperature"),
    ("item missing", {"type": "conversation.item.create"}, "missing_required_parameter", "item"),
    ("item not an object", {"type": "conversation.item.create", "item": []}, "invalid_type", "item"),
    ("function call without arguments", {"type": "conversation.item.create",
                                         "item": {"type": "function_call", "name": "f"}},
     "missing_required_parameter", "item.arguments"),
    ("function call output without call_id", {"type": "conversation.item.create",
                                              "item": {"type": "function_call_output", "output": "x"}},
     "missing_required_parameter", "item.call_id"),
    ("function call output too long", {"type": "conversation.item.create", "item": {
        "type": "function_call_output", "call_id": "c", "output": "x" * 101}}, "string_above_max_length",
     "item.output"),
    ("function call with content", {"type": "conversation.item.create", "item": {
        "type": "function_call", "name": "f", "arguments": "{}", "content": []}}, "unknown_parameter", "item.content"),
    ("mcp item", {"type": "conversation.item.create", "item": {"type": "mcp_call"}}, "unsupported_feature",
     "item.type"),
    ("item reference outside response.input", {"type": "conversation.item.create",
                                               "item": {"type": "item_reference", "id": "a"}},
     "invalid_value", "item.type"),
    ("bad role", {"type": "conversation.item.create", "item": message("tool")}, "invalid_value", "item.role"),
    ("role missing", {"type": "conversation.item.create", "item": {"type": "message", "content": []}},
     "missing_required_parameter", "item.role"),
    ("content missing", {"type": "conversation.item.create", "item": {"type": "message", "role": "user"}},
     "missing_required_parameter", "item.content"),
    ("content empty", {"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                                     "content": []}},
     "invalid_value", "item.content"),
    ("audio part", {"type": "conversation.item.create", "item": message("user", {"type": "input_audio",
                                                                                   "audio": "AAAA"})},
     "unsupported_feature", "item.content[0].type"),
    ("image part", {"type": "conversation.item.create", "item": message("user", {"type": "input_image"})},
     "unsupported_feature", "item.content[0].type"),
    ("output_text on a user item", {"type": "conversation.item.create",
                                    "item": message("user", {"type": "output_text", "text": "x"})},
     "invalid_value", "item.content[0].type"),
    ("text missing", {"type": "conversation.item.create", "item": message("user", {"type": "input_text"})},
     "missing_required_parameter", "item.content[0].text"),
    ("text too long", {"type": "conversation.item.create",
                       "item": message("user", {"type": "input_text", "text": "y" * 101})},
     "string_above_max_length", "item.content[0].text"),
    ("unknown part field", {"type": "conversation.item.create",
                            "item": message("user", {"type": "input_text", "text": "y", "lang": "en"})},
     "unknown_parameter", "item.content[0].lang"),
    ("item id root", {"type": "conversation.item.create", "item": message(id="root")}, "invalid_value", "item.id"),
    ("item id too long", {"type": "conversation.item.create", "item": message(id="i" * 65)},
     "string_above_max_length", "item.id"),
    ("bad item status", {"type": "conversation.item.create", "item": message(status="done")}, "invalid_value",
     "item.status"),
    ("too many parts", {"type": "conversation.item.create", "item": message(
        "user", *[{"type": "input_text", "text": "a"}] * 65)}, "array_above_max_length", "item.content"),
    ("previous_item_id wrong type", {"type": "conversation.item.create", "item": message(), "previous_item_id": 1},
     "invalid_type", "previous_item_id"),
    ("delete without id", {"type": "conversation.item.delete"}, "missing_required_parameter", "item_id"),
    ("retrieve id wrong type", {"type": "conversation.item.retrieve", "item_id": 7},
     "invalid_type", "item_id"),
    ("truncate negative offset", {"type": "conversation.item.truncate", "item_id": "a", "content_index": 0,
                                  "x_text_end": -1}, "invalid_value", "x_text_end"),
    ("truncate content_index missing", {"type": "conversation.item.truncate", "item_id": "a", "x_text_end": 1},
     "missing_required_parameter", "content_index"),
    ("response not an object", {"type": "response.create", "response": 3}, "invalid_type", "response"),
    ("unknown response field", {"type": "response.create", "response": {"n": 2}}, "unknown_parameter",
     "response.n"),
    ("response mcp tool", {"type": "response.create", "response": {"tools": [{"type": "mcp"}]}},
     "unsupported_feature", "response.tools[0].type"),
    ("response input not a list", {"type": "response.create", "response": {"input": {}}}, "invalid_type",
     "response.input"),
    ("response input too long", {"type": "response.create", "response": {"input": [message()] * 5}},
     "array_above_max_length", "response.input"),
    ("bad item in input", {"type": "response.create", "response": {"input": [message(), message("x")]}},
     "invalid_value", "response.input[1].role"),
    ("reference without id", {"type": "response.create", "response": {"input": [{"type": "item_reference"}]}},
     "missing_required_parameter", "response.input[0].id"),
    ("metadata not an object", {"type": "response.create", "response": {"metadata": ["a"]}}, "invalid_type",
     "response.metadata"),
    ("metadata value not a string", {"type": "response.create", "response": {"metadata": {"a": 1}}},
     "invalid_type", "response.metadata.a"),
    ("metadata too many pairs", {"type": "response.create",
                                 "response": {"metadata": {str(n): "v" for n in range(17)}}},
     "invalid_value", "response.metadata"),
    ("metadata key too long", {"type": "response.create", "response": {"metadata": {"k" * 65: "v"}}},
     "string_above_max_length", "response.metadata"),
    ("metadata value too long", {"type": "response.create", "response": {"metadata": {"k": "v" * 513}}},
     "string_above_max_length", "response.metadata.k"),
    ("x_ignore_eos not a boolean", {"type": "response.create", "response": {"x_ignore_eos": 1}}, "invalid_type",
     "response.x_ignore_eos"),
    ("conversation wrong type", {"type": "response.create", "response": {"conversation": False}}, "invalid_type",
     "response.conversation"),
    ("cancel id wrong type", {"type": "response.cancel", "response_id": ["r"]}, "invalid_type", "response_id"),
]


@pytest.mark.parametrize(("event", "code", "param"), [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_input_is_a_protocol_error(event: object, code: str, param: str | None) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_client_event(event, LIMITS)
    assert (caught.value.code, caught.value.param) == (code, param)
    assert caught.value.message
    assert caught.value.type == "invalid_request_error"


def test_errors_carry_the_event_id_when_it_is_usable() -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_client_event({"type": "response.create", "event_id": "ev_7", "response": {"bogus": 1}}, LIMITS)
    assert caught.value.event_id == "ev_7"
    with pytest.raises(ProtocolError) as caught:
        parse_client_event({"type": "nope", "event_id": "x" * 1000}, LIMITS)
    assert caught.value.event_id is None


def test_messages_quote_client_keys_safely() -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_client_event({"type": "response.cancel", "k" * 10_000 + "\udc80": 1}, LIMITS)
    assert len(caught.value.message) < 200
    caught.value.message.encode("utf-8")  # no lone surrogate travels back
    assert caught.value.param is not None and len(caught.value.param) <= 64


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_conversation_items"):
        SessionLimits(max_conversation_items=0)
    with pytest.raises(ValueError, match="default_max_output_tokens"):
        SessionLimits(default_max_output_tokens=10, max_output_tokens=5)
