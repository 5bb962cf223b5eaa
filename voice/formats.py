"""Audio formats on the wire, and the one clock inside: a session's audio is PCM16 mono at the
Realtime API's 24 kHz (``SESSION_RATE``) from the moment it is appended to the moment it is sent.

An ``AudioFormat`` converts the client's bytes to that clock (``to_session``) and back
(``from_session``); VAD, recognition, synthesis, truncation offsets and rate bounds never see
another encoding. Today the wire speaks ``audio/pcm`` at 24 kHz (beta ``pcm16``), where both
directions are a check and a copy. A codec (G.711's ``audio/pcmu`` / ``audio/pcma`` at 8 kHz,
named in ``NOT_YET``) plugs in as one more subclass in ``FORMATS``; nothing else changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from voice.audio import BYTES_PER_SAMPLE, REALTIME_RATE
from voice.errors import AudioError

SESSION_RATE = REALTIME_RATE
SESSION_BYTES_PER_MS = SESSION_RATE * BYTES_PER_SAMPLE // 1000


class AudioFormat(ABC):
    type: str  # the GA name (``audio.input.format.type``)
    beta: str  # the beta name (``input_audio_format``)
    rate: int  # samples a second on the wire
    sample_bytes: int  # bytes a sample on the wire

    @abstractmethod
    def to_session(self, data: bytes) -> bytes:
        """The client's bytes as PCM16 at ``SESSION_RATE``; ``AudioError`` when they are not this format."""

    @abstractmethod
    def from_session(self, pcm: bytes) -> bytes:
        """PCM16 at ``SESSION_RATE`` as this format's bytes."""

    def wire(self) -> dict[str, Any]:
        return {"type": self.type, "rate": self.rate}

    def __repr__(self) -> str:
        return f"AudioFormat({self.type}, {self.rate} Hz)"


class Pcm16(AudioFormat):
    type = "audio/pcm"
    beta = "pcm16"
    rate = SESSION_RATE
    sample_bytes = BYTES_PER_SAMPLE

    def to_session(self, data: bytes) -> bytes:
        if len(data) % self.sample_bytes:
            raise AudioError("odd_length", f"audio is {len(data)} bytes, not a whole number of 16-bit samples")
        return bytes(data)

    def from_session(self, pcm: bytes) -> bytes:
        return pcm


PCM16 = Pcm16()
FORMATS: dict[str, AudioFormat] = {PCM16.type: PCM16}  # by GA name
BETA_FORMATS: dict[str, AudioFormat] = {f.beta: f for f in FORMATS.values()}
# Formats of the API that no codec here speaks yet (GA name -> beta name): refused by name.
NOT_YET = {"audio/pcmu": "g711_ulaw", "audio/pcma": "g711_alaw"}
