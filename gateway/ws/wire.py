"""Server-side shapes of the Realtime objects (session, item, response), GA or beta flavour.

The GA API and the beta (``OpenAI-Beta: realtime=v1``) differ only in names: event types
(``response.output_text.delta`` vs ``response.text.delta``, ``conversation.item.added`` vs
``conversation.item.created``), the assistant content part type (``output_text`` vs ``text``)
and a few session/response fields. Everything here returns plain dicts ready for JSON or
msgpack; the shapes follow the openai SDK's models (``types/realtime`` and
``types/beta/realtime``), which the tests validate against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.ws.audio_events import AudioSettings
from gateway.ws.conversation import AnyItem, FunctionCall, FunctionCallOutput
from gateway.ws.truncation import AUTO, Truncation
from llm_shared.structured import OutputConstraints

BETA_EVENT_NAMES = {
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "conversation.item.added": "conversation.item.created",
}
AUDIO_TOKEN_MS = 50  # one output audio token in usage: 50 ms of speech (our convention, documented)


def event_name(ga_name: str, beta: bool) -> str:
    return BETA_EVENT_NAMES.get(ga_name, ga_name) if beta else ga_name


def part_type(role: str, beta: bool) -> str:
    if role != "assistant":
        return "input_text"
    return "text" if beta else "output_text"


def item_wire(item: AnyItem, beta: bool) -> dict[str, Any]:
    if isinstance(item, FunctionCall):
        return {"id": item.id, "object": "realtime.item", "type": "function_call", "status": item.status,
                "call_id": item.call_id, "name": item.name, "arguments": item.arguments}
    if isinstance(item, FunctionCallOutput):
        return {"id": item.id, "object": "realtime.item", "type": "function_call_output", "status": item.status,
                "call_id": item.call_id, "output": item.output}
    if item.audio:
        kind = "input_audio" if item.role == "user" else ("audio" if beta else "output_audio")
        content = [{"type": kind, "transcript": None if item.transcribing else text} for text in item.parts]
    else:
        kind = part_type(item.role, beta)
        content = [{"type": kind, "text": text} for text in item.parts]
    return {
        "id": item.id,
        "object": "realtime.item",
        "type": "message",
        "status": item.status,
        "role": item.role,
        "content": content,
    }


@dataclass(frozen=True)
class SessionView:
    """What session.created / session.updated report."""

    id: str
    model: str
    instructions: str
    max_output_tokens: int | str  # int or "inf"
    temperature: float  # our extension in GA (the beta API has it natively)
    constraints: OutputConstraints  # the session's tools, tool_choice and parallel_tool_calls
    audio: AudioSettings = AudioSettings()  # noqa: RUF009  # frozen: one shared default is safe
    truncation: Truncation = AUTO  # when the conversation outgrows the context (gateway/ws/truncation.py)


def tools_wire(constraints: OutputConstraints) -> list[dict[str, Any]]:
    """Function tools in the Realtime shape (flat: no nested ``function``)."""
    return [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters()}
            for t in constraints.tools]


def tool_choice_wire(constraints: OutputConstraints) -> str | dict[str, str]:
    choice = constraints.tool_choice
    if choice.name is not None:
        return {"type": "function", "name": choice.name}
    return choice.mode


def session_wire(s: SessionView, beta: bool) -> dict[str, Any]:
    if beta:
        # The beta SDK types `model` as a closed list of OpenAI model names; ours travels as
        # `model` anyway (SDK parsing is lenient), documented as a deviation.
        return {
            "id": s.id,
            "object": "realtime.session",
            "model": s.model,
            "modalities": ["text", "audio"] if s.audio.output_audio else ["text"],
            "instructions": s.instructions,
            "temperature": s.temperature,
            "max_response_output_tokens": s.max_output_tokens,
            "tools": tools_wire(s.constraints),
            "tool_choice": tool_choice_wire(s.constraints),
            "voice": s.audio.voice,
            "input_audio_format": s.audio.input_format.beta,
            "output_audio_format": s.audio.output_format.beta,
            "turn_detection": vad.wire() if (vad := s.audio.turn_detection) is not None else None,
            "input_audio_transcription": t.wire() if (t := s.audio.transcription) is not None else None,
            "input_audio_noise_reduction": n.wire() if (n := s.audio.noise_reduction) is not None else None,
        }
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": s.id,
        "model": s.model,
        "output_modalities": s.audio.modalities(),
        "instructions": s.instructions,
        "max_output_tokens": s.max_output_tokens,
        "temperature": s.temperature,
        "tools": tools_wire(s.constraints),
        "tool_choice": tool_choice_wire(s.constraints),
        "parallel_tool_calls": s.constraints.parallel_tool_calls,
        "tracing": None,
        "truncation": s.truncation.wire(),
        "prompt": None,
        "audio": audio_wire(s.audio),
    }


def audio_wire(a: AudioSettings) -> dict[str, Any]:
    return {
        "input": {"format": a.input_format.wire(), "transcription": a.transcription.wire() if a.transcription is not None else None,
                  "noise_reduction": a.noise_reduction.wire() if a.noise_reduction is not None else None,
                  "turn_detection": a.turn_detection.wire() if a.turn_detection is not None else None},
        "output": {"format": a.output_format.wire(), "voice": a.voice, "speed": 1.0},
    }


def usage_wire(input_tokens: int, output_tokens: int, cached_tokens: int, beta: bool,
               audio_ms: int = 0) -> dict[str, Any]:
    """Token usage; ``audio_ms`` of speech made count as output audio tokens (``AUDIO_TOKEN_MS``
    each) beside the text tokens the model generated (which its speech reads out)."""
    audio_tokens = -(-audio_ms // AUDIO_TOKEN_MS)
    details: dict[str, Any] = {"cached_tokens": cached_tokens, "text_tokens": input_tokens, "audio_tokens": 0}
    if not beta:
        details["image_tokens"] = 0
        details["cached_tokens_details"] = {"text_tokens": cached_tokens, "audio_tokens": 0, "image_tokens": 0}
    return {
        "total_tokens": input_tokens + output_tokens + audio_tokens,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens + audio_tokens,
        "input_token_details": details,
        "output_token_details": {"text_tokens": output_tokens, "audio_tokens": audio_tokens},
    }


def response_wire(
    *,
    response_id: str,
    status: str,
    status_details: dict[str, Any] | None,
    output: list[dict[str, Any]],
    conversation_id: str | None,
    max_output_tokens: int | str,
    temperature: float,
    metadata: dict[str, str] | None,
    usage: dict[str, Any] | None,
    beta: bool,
    audio: AudioSettings | None = None,  # an audio response's modalities and voice
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "object": "realtime.response",
        "id": response_id,
        "status": status,
        "status_details": status_details,
        "output": output,
        "conversation_id": conversation_id,
        "max_output_tokens": max_output_tokens,
        "metadata": metadata,
        "usage": usage,
    }
    speaks = audio is not None and audio.output_audio
    if beta:
        body["modalities"] = ["text", "audio"] if speaks else ["text"]
        body["temperature"] = temperature
        if audio is not None:
            body["voice"] = audio.voice
            body["output_audio_format"] = audio.output_format.beta
    else:
        body["output_modalities"] = ["audio"] if speaks else ["text"]
        body["temperature"] = temperature  # extension in GA
        if audio is not None:
            body["audio"] = {"output": {"format": audio.output_format.wire(), "voice": audio.voice}}
    return body
