"""The audio format layer: a session's audio is PCM16 at 24 kHz inside, whatever the wire carries;
each format converts at the edge, and the API's names resolve to formats or to a refusal.

G.711 is checked bit for bit against the stdlib's ``audioop`` (the ITU reference coder; the
product code cannot use it, as it is gone in Python 3.13, but this Python still has it)."""

from __future__ import annotations

import struct
import warnings

import numpy as np
import pytest

from gateway.ws.audio_events import response_audio, session_audio
from gateway.ws.fields import Fields, ProtocolError
from voice.errors import AudioError
from voice.formats import BETA_FORMATS, FORMATS, G711, PCM16, PCMA, PCMU, SESSION_BYTES_PER_MS, SESSION_RATE

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

ALL_INT16 = np.arange(-32768, 32768, dtype=np.int16)
CODES = bytes(range(256))
REFERENCE = {PCMU: (audioop.lin2ulaw, audioop.ulaw2lin), PCMA: (audioop.lin2alaw, audioop.alaw2lin)}


def test_pcm16_is_the_session_clock_itself() -> None:
    pcm = struct.pack("<4h", 1, -1, 32767, -32768)
    assert PCM16.to_session(pcm) == pcm and PCM16.from_session(pcm) == pcm
    assert (PCM16.rate, SESSION_RATE, SESSION_BYTES_PER_MS) == (24_000, 24_000, 48)
    assert (PCM16.ratio, PCM16.bytes_per_ms, PCM16.session_bytes(480)) == (1, 48, 480)
    with pytest.raises(AudioError, match="16-bit samples"):
        PCM16.to_session(b"\x00\x01\x02")


@pytest.mark.parametrize("fmt", [PCMU, PCMA], ids=["pcmu", "pcma"])
def test_g711_codes_match_the_reference_bit_for_bit(fmt: G711) -> None:
    encode, decode = REFERENCE[fmt]
    assert fmt.decode(CODES).astype("<i2").tobytes() == decode(CODES, 2)  # all 256 codes
    assert fmt.encode(ALL_INT16) == encode(ALL_INT16.astype("<i2").tobytes(), 2)  # every int16
    # decode then encode gives the code back (mu-law's two zeros, 0x7F and 0xFF, both decode to 0)
    again = np.frombuffer(fmt.encode(fmt.decode(CODES)), np.uint8)
    assert [c for c in range(256) if again[c] != c] == ([0x7F] if fmt is PCMU else [])


@pytest.mark.parametrize("fmt", [PCMU, PCMA], ids=["pcmu", "pcma"])
def test_g711_is_8_khz_one_byte_a_sample_three_session_samples_each(fmt: G711) -> None:
    assert (fmt.rate, fmt.sample_bytes, fmt.ratio, fmt.bytes_per_ms) == (8_000, 1, 3, 8)
    for n in (1, 2, 3, 7, 160, 161):  # odd sizes are whole samples at one byte a sample
        data = fmt.encode(np.full(n, 1000, np.int16))
        assert len(fmt.to_session(data)) == fmt.session_bytes(n) == 3 * n * 2
    for n in (0, 1, 2, 3, 4, 5, 6, 479, 480):  # session samples: a partial wire sample is dropped
        assert len(fmt.from_session(bytes(2 * n))) == n // 3
    assert fmt.to_session(b"") == b"" and fmt.from_session(b"") == b""


@pytest.mark.parametrize("fmt", [PCMU, PCMA], ids=["pcmu", "pcma"])
def test_g711_round_trip_keeps_speech_band_audio(fmt: G711) -> None:
    """A 24 kHz tone in the telephone band out to the wire and back: the same tone, within the
    codec's quantization, 2 ms late (the input filter's constant lag), whole or in 20 ms appends."""
    t = np.arange(SESSION_RATE)  # 1 s
    pcm = (6000 * np.sin(2 * np.pi * 440 * t / SESSION_RATE)).astype("<i2")
    wire = fmt.from_session(pcm.tobytes())
    assert len(wire) == 8000
    whole = np.frombuffer(fmt.to_session(wire), "<i2")
    stream = fmt.stream()
    chunked = np.frombuffer(b"".join(stream.to_session(wire[i:i + 160]) for i in range(0, len(wire), 160)), "<i2")
    assert np.array_equal(whole, chunked)  # appends' edges are no edges to the filter
    lag = 48  # session samples (2 ms)
    err = whole[lag + 480:].astype(float) - pcm[480:-lag]  # past the filters' start from silence
    assert np.sqrt(np.mean(err ** 2)) < 6000 * 0.02  # within 2%: G.711's ~38 dB SNR
    # A stateless conversion of each 20 ms append on its own dips at every edge: what the stream avoids.
    apart = np.frombuffer(b"".join(fmt.to_session(wire[i:i + 160]) for i in range(0, len(wire), 160)), "<i2")
    assert np.sqrt(np.mean((apart[lag + 480:].astype(float) - pcm[480:-lag]) ** 2)) > 3 * np.sqrt(np.mean(err ** 2))


def test_an_8_khz_chunk_is_its_ms_in_session_samples() -> None:
    """n bytes of G.711 are n/8 ms; converted, 3n samples: the session's ms offsets are the wire's."""
    stream = PCMU.stream()
    total = 0
    for n in (160, 80, 1, 7, 240, 312):
        total += len(stream.to_session(PCMU.encode(np.zeros(n, np.int16))))
    assert total == (160 + 80 + 1 + 7 + 240 + 312) * 3 * 2 == 100 * SESSION_BYTES_PER_MS  # 100 ms


def test_the_api_names_resolve_to_formats_or_a_named_refusal() -> None:
    assert FORMATS["audio/pcm"] is BETA_FORMATS["pcm16"] is PCM16
    assert FORMATS["audio/pcmu"] is BETA_FORMATS["g711_ulaw"] is PCMU
    assert FORMATS["audio/pcma"] is BETA_FORMATS["g711_alaw"] is PCMA
    assert PCM16.wire() == {"type": "audio/pcm", "rate": 24_000}
    assert PCMU.wire() == {"type": "audio/pcmu"} and PCMA.wire() == {"type": "audio/pcma"}  # the API's shape
    patch = session_audio(Fields({"input_audio_format": "pcm16", "audio": {"output": {"format": {
        "type": "audio/pcm", "rate": 24_000}}}}, "session"))
    assert patch is not None and (patch.input_format, patch.output_format) == (PCM16, PCM16)
    patch = session_audio(Fields({"audio": {"input": {"format": {"type": "audio/pcmu"}}, "output": {"format": {
        "type": "audio/pcma", "rate": 8000}}}}, "session"))
    assert patch is not None and (patch.input_format, patch.output_format) == (PCMU, PCMA)
    patch = session_audio(Fields({"input_audio_format": "g711_alaw", "output_audio_format": "g711_ulaw"}, "session"))
    assert patch is not None and (patch.input_format, patch.output_format) == (PCMA, PCMU)
    patch = response_audio(Fields({"output_audio_format": "g711_ulaw"}, "response"))
    assert patch is not None and patch.output_format is PCMU
    patch = response_audio(Fields({"audio": {"output": {"format": {"type": "audio/pcmu"}}}}, "response"))
    assert patch is not None and patch.output_format is PCMU
    with pytest.raises(ProtocolError, match="must be 24000"):
        session_audio(Fields({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16_000}}}}, "session"))
    with pytest.raises(ProtocolError, match="must be 8000") as caught:
        session_audio(Fields({"audio": {"output": {"format": {"type": "audio/pcmu", "rate": 24_000}}}}, "session"))
    assert (caught.value.code, caught.value.param) == ("invalid_value", "session.audio.output.format.rate")
    with pytest.raises(ProtocolError) as caught:
        session_audio(Fields({"audio": {"input": {"format": {"type": "audio/g722"}}}}, "session"))
    assert (caught.value.code, caught.value.param) == ("invalid_value", "session.audio.input.format.type")
    with pytest.raises(ProtocolError) as caught:
        session_audio(Fields({"output_audio_format": "g711"}, "session"))
    assert (caught.value.code, caught.value.param) == ("invalid_value", "session.output_audio_format")
