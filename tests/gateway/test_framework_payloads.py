"""The client events two voice frameworks send to an OpenAI Realtime server, as JSON literals read
off their sources, fed to a sans-I/O session: each is accepted (no ``error``) and a turn
completes, typed and spoken. One refused field would fail the framework's whole session.

- LiveKit Agents, livekit-plugins-openai 1.7.0 (``livekit/plugins/openai/version.py``), commit
  da6af86ac640a3bc54585764e64321d7048c1c16: ``realtime/realtime_model.py`` and ``realtime/utils.py``.
  Events are pydantic models of the openai SDK dumped with ``by_alias, exclude_unset`` (so a
  field set to None travels as ``null``); the defaults are semantic VAD (medium), transcription
  by gpt-4o-mini-transcribe, voice marin, ``max_output_tokens: "inf"``, ``tracing: null``.
- Pipecat, pipecat-ai 1.7.0.dev771 (``git describe``: v1.7.0-771-gacead0507), commit
  acead0507d7de44e216d24533964106ca1d1d044: ``services/openai/realtime/events.py`` and ``llm.py``,
  ``adapters/services/open_ai_realtime_adapter.py``. Events are dumped with ``exclude_none``;
  the voice example (``examples/realtime/realtime-openai.py``) sets semantic VAD, near-field
  noise reduction and transcription by gpt-realtime-whisper.

One change to the payloads as sent: ``session.model``. Both frameworks default to an OpenAI
model name (LiveKit "gpt-realtime", Pipecat "gpt-realtime-2.1") and both take the model as an
argument; pointed at this server, they are given a served id, which is what these tests send.
"""

from __future__ import annotations

import copy
from typing import Any

from session_helpers import drain
from test_session_voice import LOUD, QUIET, append, make, tone, types

from gateway.ws.commands import AdmitResponse, StartGeneration, Synthesize, Transcribe
from gateway.ws.session import RealtimeSession
from llm_shared.contract import FinishEvent, TokenEvent

MODEL = "smollm2-135m"  # the served id the framework is configured with (see the docstring)
AUDIO_24K = {"type": "audio/pcm", "rate": 24000}

LIVEKIT_SESSION = {
    "type": "session.update", "event_id": "session_update_8Kq3XbRk2m",
    "session": {
        "type": "realtime", "model": MODEL, "output_modalities": ["audio"],
        "audio": {
            "input": {"format": AUDIO_24K, "noise_reduction": None,
                      "transcription": {"model": "gpt-4o-mini-transcribe"},
                      "turn_detection": {"type": "semantic_vad", "create_response": True, "eagerness": "medium",
                                         "interrupt_response": True}},
            "output": {"format": AUDIO_24K, "speed": 1.0, "voice": "marin"},
        },
        "max_output_tokens": "inf", "tool_choice": "auto", "tracing": None,
    },
}
# RealtimeModel(input_audio_noise_reduction="near_field", eagerness="auto", gpt-4o-transcribe),
# the docstring's example.
LIVEKIT_VOICE_SESSION = copy.deepcopy(LIVEKIT_SESSION)
LIVEKIT_VOICE_SESSION["session"]["audio"]["input"].update(
    noise_reduction={"type": "near_field"}, transcription={"model": "gpt-4o-transcribe"},
    turn_detection={"type": "semantic_vad", "create_response": True, "eagerness": "auto", "interrupt_response": True})
LIVEKIT_TEXT_SESSION = copy.deepcopy(LIVEKIT_SESSION)
LIVEKIT_TEXT_SESSION["session"]["output_modalities"] = ["text"]
LIVEKIT_TOOLS = {  # update_tools: model_construct, so only type, model and tools
    "type": "session.update", "event_id": "tools_update_Qm4a9Tz1cD",
    "session": {"type": "realtime", "model": MODEL, "tools": [{
        "type": "function", "name": "lookup_weather", "description": "Look up the weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]},
}
LIVEKIT_INSTRUCTIONS = {"type": "session.update", "event_id": "instructions_update_Zr8", "session": {
    "type": "realtime", "instructions": "You are a helpful voice assistant."}}
LIVEKIT_ITEM = {  # update_chat_ctx: the item carries the agent's id, placed after "root"
    "type": "conversation.item.create", "event_id": "chat_ctx_create_Lp2Vw7", "previous_item_id": "root",
    "item": {"id": "item_3fa1c2d9e0b4", "type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "What is the capital of France?"}]},
}
LIVEKIT_REPLY = {  # generate_reply: instructions=None is set, so it travels as null
    "type": "response.create", "event_id": "response_create_Hs81",
    "response": {"instructions": None, "metadata": {"client_event_id": "response_create_Hs81"}},
}

PIPECAT_SESSION = {  # SessionProperties of the voice example, with the context's tools and instructions
    "event_id": "5b0c1e8e-7d0f-4c6a-9a43-2f1d1f7b9b11", "type": "session.update",
    "session": {
        "type": "realtime", "model": MODEL, "instructions": "You are a helpful and friendly AI.",
        "audio": {"input": {"transcription": {"model": "gpt-realtime-whisper"},
                            "noise_reduction": {"type": "near_field"},
                            "turn_detection": {"type": "semantic_vad"}}},
        "tools": [{"type": "function", "name": "get_current_weather", "description": "Get the current weather.",
                   "parameters": {"type": "object", "properties": {
                       "location": {"type": "string", "description": "The city and state."},
                       "format": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["location", "format"]}}],
    },
}
PIPECAT_TEXT_SESSION = copy.deepcopy(PIPECAT_SESSION)  # realtime-openai-text.py: output_modalities ["text"]
PIPECAT_TEXT_SESSION["session"]["output_modalities"] = ["text"]
PIPECAT_ITEM = {  # the first context message: a developer message becomes a user one, its id a uuid hex
    "event_id": "0d6f4c1e-1b7a-4f0e-8d55-7a1c9e2b3f40", "type": "conversation.item.create",
    "item": {"id": "9f1c2b7e4d3a4c5b8e6f7a8b9c0d1e2f", "type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "Say hello!"}]},
}
PIPECAT_RETRIEVE = {"event_id": "rci_9f1c2b7e4d3a4c5b8e6f7a8b9c0d1e2f", "type": "conversation.item.retrieve",
                    "item_id": "9f1c2b7e4d3a4c5b8e6f7a8b9c0d1e2f"}


def pipecat_reply(modalities: list[str]) -> dict[str, Any]:
    return {"event_id": "c3b2a1d0-9e8f-4a7b-8c6d-5e4f3a2b1c0d", "type": "response.create",
            "response": {"output_modalities": modalities}}


def accepted(session: RealtimeSession, *events: dict[str, Any]) -> list[dict[str, Any]]:
    """Feed the events; every server event checks against the SDK's types, and none is an error."""
    out: list[dict[str, Any]] = []
    for event in events:
        session.receive(copy.deepcopy(event))
        produced = drain(session)
        assert not [e for e in produced if e["type"] == "error"], (event["type"], produced)
        out += produced
    return out


def answer(session: RealtimeSession, text: str = "Paris.") -> list[dict[str, Any]]:
    """The fake engine answers the started response (and the speech is made, if it speaks)."""
    (start,) = [c for c in session.commands() if isinstance(c, StartGeneration)]
    session.engine_event(start.response_id, TokenEvent(token_id=1, text=text, logprob=0.0))
    session.engine_event(start.response_id, FinishEvent(reason="stop", prompt_tokens=9, completion_tokens=1))
    for command in session.commands():
        if isinstance(command, Synthesize):
            session.speech_ready(start.response_id, command.index, tone(300, 5))
    events = drain(session)
    assert not [e for e in events if e["type"] == "error"], events
    assert events[-1]["type"] == "response.done" and events[-1]["response"]["status"] == "completed", events[-1]
    return events


def spoken_turn(session: RealtimeSession, transcript: str) -> list[dict[str, Any]]:
    """The user speaks; the VAD ends the turn; the transcript comes; the response starts."""
    events = append(session, tone(200, QUIET) + tone(600, LOUD))
    events += append(session, tone(1200, QUIET))  # past semantic_vad's medium/auto silence (600 ms)
    assert "input_audio_buffer.committed" in types(events)
    commands = session.commands()
    (transcribe,) = [c for c in commands if isinstance(c, Transcribe)]
    assert [c for c in commands if isinstance(c, AdmitResponse)]
    session.response_admitted(True)
    session.transcribed(transcribe.item_id, transcript, 0.8, transcribe.tag)
    return events + drain(session)


def test_livekit_default_session_takes_a_spoken_turn() -> None:
    session = make()
    updated = accepted(session, LIVEKIT_SESSION, LIVEKIT_TOOLS, LIVEKIT_INSTRUCTIONS)
    audio = updated[0]["session"]["audio"]
    assert audio["input"]["turn_detection"] == {"type": "semantic_vad", "eagerness": "medium",
                                                "create_response": True, "interrupt_response": True}
    assert audio["output"]["voice"] == "marin" and audio["input"]["noise_reduction"] is None
    assert "x_warnings" not in updated[0]["session"]
    events = spoken_turn(session, "What is the capital of France?")
    assert types(events)[-3:] == ["response.created", "conversation.item.input_audio_transcription.delta",
                                  "conversation.item.input_audio_transcription.completed"]
    done = answer(session)[-1]["response"]
    assert done["output_modalities"] == ["audio"]
    assert done["output"][0]["content"] == [{"type": "output_audio", "transcript": "Paris."}]


def test_livekit_voice_example_is_warned_once_that_noise_reduction_is_not_applied() -> None:
    session = make()
    (updated,) = accepted(session, LIVEKIT_VOICE_SESSION)
    assert updated["session"]["audio"]["input"]["noise_reduction"] == {"type": "near_field"}
    (warning,) = updated["session"]["x_warnings"]
    assert warning["code"] == "noise_reduction_not_applied"
    assert warning["param"] == "session.audio.input.noise_reduction"
    (again,) = accepted(session, LIVEKIT_VOICE_SESSION)
    assert "x_warnings" not in again["session"]


def test_livekit_text_turn_with_its_item_and_reply() -> None:
    session = make()
    accepted(session, LIVEKIT_TEXT_SESSION, LIVEKIT_TOOLS, LIVEKIT_INSTRUCTIONS, LIVEKIT_ITEM, LIVEKIT_REPLY)
    done = answer(session)
    assert done[-1]["response"]["metadata"]["client_event_id"] == "response_create_Hs81"


def test_pipecat_voice_example_takes_a_spoken_turn() -> None:
    session = make()
    (updated,) = accepted(session, PIPECAT_SESSION)
    assert updated["session"]["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
    assert updated["session"]["x_warnings"][0]["code"] == "noise_reduction_not_applied"
    accepted(session, PIPECAT_ITEM, PIPECAT_RETRIEVE, pipecat_reply(["audio"]))
    answer(session, "Hello!")
    events = spoken_turn(session, "What's the weather in Paris?")
    assert "conversation.item.input_audio_transcription.completed" in types(events)
    # The example sets no output_modalities: the API's default is ["audio"], ours ["text"]
    # (docs/protocol.md), so a turn server VAD answers is text unless the session asks for audio.
    assert answer(session, "Sunny.")[-1]["response"]["output_modalities"] == ["text"]


def test_pipecat_text_turn() -> None:
    session = make()
    accepted(session, PIPECAT_TEXT_SESSION, PIPECAT_ITEM)
    accepted(session, pipecat_reply(["text"]))
    done = answer(session, "Hello!")
    assert done[-1]["response"]["output_modalities"] == ["text"]
