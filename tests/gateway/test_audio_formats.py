"""The audio format layer: a session's audio is PCM16 at 24 kHz inside, whatever the wire carries;
each format converts at the edge, and the API's names resolve to formats or to a refusal."""

from __future__ import annotations

import struct

import pytest

from gateway.ws.audio_events import session_audio
from gateway.ws.fields import Fields, ProtocolError
from voice.errors import AudioError
from voice.formats import BETA_FORMATS, FORMATS, NOT_YET, PCM16, SESSION_BYTES_PER_MS, SESSION_RATE


def test_pcm16_is_the_session_clock_itself() -> None:
    pcm = struct.pack("<4h", 1, -1, 32767, -32768)
    assert PCM16.to_session(pcm) == pcm and PCM16.from_session(pcm) == pcm
    assert (PCM16.rate, SESSION_RATE, SESSION_BYTES_PER_MS) == (24_000, 24_000, 48)
    with pytest.raises(AudioError, match="16-bit samples"):
        PCM16.to_session(b"\x00\x01\x02")


def test_the_api_names_resolve_to_formats_or_a_named_refusal() -> None:
    assert FORMATS["audio/pcm"] is BETA_FORMATS["pcm16"] is PCM16
    assert PCM16.wire() == {"type": "audio/pcm", "rate": 24_000}
    patch = session_audio(Fields({"input_audio_format": "pcm16", "audio": {"output": {"format": {
        "type": "audio/pcm", "rate": 24_000}}}}, "session"))
    assert patch is not None and (patch.input_format, patch.output_format) == (PCM16, PCM16)
    for ga, beta in NOT_YET.items():
        with pytest.raises(ProtocolError) as caught:
            session_audio(Fields({"audio": {"input": {"format": {"type": ga}}}}, "session"))
        assert (caught.value.code, caught.value.param) == ("unsupported_feature", "session.audio.input.format.type")
        with pytest.raises(ProtocolError) as caught:
            session_audio(Fields({"output_audio_format": beta}, "session"))
        assert caught.value.code == "unsupported_feature"
    with pytest.raises(ProtocolError, match="must be 24000"):
        session_audio(Fields({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16_000}}}}, "session"))
