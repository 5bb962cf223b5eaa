"""The voice events of a Realtime session as the client reads them, without I/O.

``voice_event`` turns a server event about audio into a typed one: the answer's audio
(``AudioDelta``: PCM16 at 24 kHz mono, decoded from base64 on JSON or taken as the raw bytes of
the msgpack subprotocol), server voice detection (``SpeechStarted``, ``SpeechStopped``), the
user's committed speech (``AudioCommitted``) and its transcript (``InputTranscript``,
``TranscriptionFailed``): ``ServerVoiceEvent``. ``TranscriptDelta`` (the words of a spoken answer, in
``rtgw.protocol``) is made by the protocol core, which keeps them as the assistant's text. Two
events the SDK itself reports ride along: ``Interrupted`` (a barge-in the client finished:
playback stopped, the item truncated to what was played) and ``AudioRefused`` (an append the
server turned down; the session goes on). The third, ``TurnStarted``, carries a ``Turn`` and lives
beside it (``rtgw.turn``); ``rtgw.voice.VoiceEvent`` is all of them.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SAMPLE_RATE = 24_000  # the Realtime API's audio/pcm: 16-bit little-endian mono at 24 kHz
BYTES_PER_MS = SAMPLE_RATE * 2 // 1000  # 48

# Errors about the audio the client sent: the session goes on, no turn fails because of them.
AUDIO_ERROR_CODES = frozenset({"invalid_audio", "audio_too_large", "audio_rate_exceeded", "input_audio_buffer_full"})


def pcm_ms(n_bytes: int) -> float:
    """Milliseconds of PCM16 24 kHz mono in ``n_bytes``."""
    return n_bytes / BYTES_PER_MS


@dataclass(frozen=True)
class AudioDelta:
    """A piece of a spoken answer: PCM16 LE mono at 24 kHz (at most 500 ms of it)."""

    response_id: str
    item_id: str
    pcm: bytes

    @property
    def ms(self) -> float:
        return pcm_ms(len(self.pcm))


@dataclass(frozen=True)
class SpeechStarted:
    """Server VAD heard the user start speaking (``audio_start_ms`` from the session's first
    audio). A response in progress is cancelled by the server (``turn_detected``)."""

    audio_start_ms: int
    item_id: str


@dataclass(frozen=True)
class SpeechStopped:
    audio_end_ms: int
    item_id: str


@dataclass(frozen=True)
class AudioCommitted:
    """The input buffer became the user item ``item_id`` (by server VAD or ``commit_audio``)."""

    item_id: str
    previous_item_id: str | None


@dataclass(frozen=True)
class AudioCleared:
    """The input buffer was emptied (``clear_audio``)."""


@dataclass(frozen=True)
class InputTranscript:
    """What the user said in item ``item_id``, as the server's recognizer heard it."""

    item_id: str
    transcript: str


@dataclass(frozen=True)
class TranscriptionFailed:
    item_id: str
    message: str


@dataclass(frozen=True)
class Interrupted:
    """Barge-in done: the user spoke while ``item_id`` played; playback stopped after
    ``audio_end_ms`` of its audio, and the item (here and on the server) keeps ``text``, the words
    said by then."""

    item_id: str
    audio_end_ms: int
    text: str


@dataclass(frozen=True)
class AudioRefused:
    """An ``input_audio_buffer.append`` the server refused (``code``: ``invalid_audio``,
    ``audio_too_large``, ``audio_rate_exceeded``, ``input_audio_buffer_full``); that chunk is lost."""

    code: str
    message: str


# What a server event about audio becomes (``voice_event``).
ServerVoiceEvent = (AudioDelta | SpeechStarted | SpeechStopped | AudioCommitted | AudioCleared | InputTranscript
                    | TranscriptionFailed)

AUDIO_DELTAS = ("response.output_audio.delta", "response.audio.delta")
TRANSCRIPT_DELTAS = ("response.output_audio_transcript.delta", "response.audio_transcript.delta")


def decode_audio(data: object) -> bytes | None:
    """The ``delta`` / ``audio`` field's bytes: raw on msgpack, base64 on JSON; None if neither."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if isinstance(data, str):
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            return None
    return None


def voice_event(event: Mapping[str, Any]) -> ServerVoiceEvent | None:
    """The typed form of a server event about audio in or out; None for any other event (and for
    an audio delta whose bytes cannot be read)."""
    kind = event.get("type")
    if kind in AUDIO_DELTAS:
        pcm = decode_audio(event.get("delta"))
        if pcm is None:
            return None
        return AudioDelta(str(event.get("response_id", "")), str(event.get("item_id", "")), pcm)
    if kind == "input_audio_buffer.speech_started":
        return SpeechStarted(int(event.get("audio_start_ms") or 0), str(event.get("item_id", "")))
    if kind == "input_audio_buffer.speech_stopped":
        return SpeechStopped(int(event.get("audio_end_ms") or 0), str(event.get("item_id", "")))
    if kind == "input_audio_buffer.committed":
        previous = event.get("previous_item_id")
        return AudioCommitted(str(event.get("item_id", "")), previous if isinstance(previous, str) else None)
    if kind == "input_audio_buffer.cleared":
        return AudioCleared()
    if kind == "conversation.item.input_audio_transcription.completed":
        return InputTranscript(str(event.get("item_id", "")), str(event.get("transcript") or ""))
    if kind == "conversation.item.input_audio_transcription.failed":
        error = event.get("error") or {}
        return TranscriptionFailed(str(event.get("item_id", "")), str(error.get("message", "")))
    return None
