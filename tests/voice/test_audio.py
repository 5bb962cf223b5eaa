"""PCM16 decoding (the trust boundary), conversions and resampling, with literals."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from voice.audio import (
    REALTIME_RATE,
    SPEECH_RATE,
    StreamResampler,
    decode_pcm16,
    decode_pcm16_base64,
    duration_ms,
    encode_pcm16,
    encode_pcm16_base64,
    encoded_length,
    resample,
    samples_for_ms,
    to_float32,
    to_int16,
)
from voice.errors import AudioError


def test_little_endian_bytes_decode_to_samples() -> None:
    raw = bytes([0x01, 0x00, 0xFF, 0xFF, 0x00, 0x80, 0xFF, 0x7F])
    assert decode_pcm16(raw, max_bytes=100).tolist() == [1, -1, -32768, 32767]
    assert decode_pcm16(memoryview(bytearray(raw)), max_bytes=8).tolist() == [1, -1, -32768, 32767]


def test_decoded_samples_do_not_share_the_callers_buffer() -> None:
    raw = bytearray(b"\x01\x00\x02\x00")
    samples = decode_pcm16(raw, max_bytes=4)
    raw[0] = 9
    assert samples.tolist() == [1, 2]


def test_base64_round_trip() -> None:
    samples = np.array([0, 1000, -1000, 32767, -32768], np.int16)
    text = encode_pcm16_base64(samples)
    assert text == base64.b64encode(encode_pcm16(samples)).decode()
    assert decode_pcm16_base64(text, max_bytes=10).tolist() == samples.tolist()


@pytest.mark.parametrize(("data", "reason"), [
    (b"", "empty"),
    (b"\x01\x00\x02", "odd_length"),
    (b"\x00" * 11, "too_long"),
])
def test_bad_raw_audio_is_refused_with_its_reason(data: bytes, reason: str) -> None:
    with pytest.raises(AudioError) as info:
        decode_pcm16(data, max_bytes=10)
    assert info.value.reason == reason
    assert isinstance(info.value, ValueError)
    assert info.value.to_dict()["code"] == "invalid_audio"


@pytest.mark.parametrize(("text", "reason"), [
    ("", "empty"),
    ("not base64!!", "not_base64"),
    ("AAA", "not_base64"),  # bad padding
    ("AA AA", "not_base64"),  # whitespace is not accepted
    ("AAé=", "not_base64"),  # non-ASCII
    ("AAAA", "odd_length"),  # three bytes: valid base64, half a sample too many
    ("A" * 20, "too_long"),  # 15 bytes against a bound of 10, refused before decoding
])
def test_bad_base64_audio_is_refused_with_its_reason(text: str, reason: str) -> None:
    with pytest.raises(AudioError) as info:
        decode_pcm16_base64(text, max_bytes=10)
    assert info.value.reason == reason


def test_a_non_string_is_not_base64() -> None:
    with pytest.raises(AudioError, match="base64"):
        decode_pcm16_base64(b"AAAA", max_bytes=10)  # type: ignore[arg-type]


def test_an_absurd_length_is_refused_by_its_encoded_size() -> None:
    # 40 MB of text against a 256 KiB bound: refused on the length alone (decoding it would
    # allocate 30 MB first).
    huge = "A" * (40 * 2**20)
    with pytest.raises(AudioError) as info:
        decode_pcm16_base64(huge, max_bytes=262_144)
    assert info.value.reason == "too_long"
    assert "262144" in info.value.message


def test_the_bound_is_inclusive() -> None:
    assert encoded_length(10) == 16 and encoded_length(9) == 12
    assert len(decode_pcm16_base64(base64.b64encode(b"\x00" * 10).decode(), max_bytes=10)) == 5


def test_int16_float32_conversions() -> None:
    assert to_float32(np.array([0, 16384, -32768], np.int16)).tolist() == [0.0, 0.5, -1.0]
    # Past full scale clips instead of wrapping to the other sign.
    assert to_int16(np.array([0.5, 1.5, -1.5, -1.0], np.float32)).tolist() == [16384, 32767, -32768, -32768]


def test_durations() -> None:
    assert duration_ms(24_000, REALTIME_RATE) == 1000.0
    assert duration_ms(512, SPEECH_RATE) == 32.0
    assert samples_for_ms(300, REALTIME_RATE) == 7200
    assert samples_for_ms(0.99, SPEECH_RATE) == 15  # rounded down


def _peak_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[int(np.argmax(spectrum))])


def test_resampling_keeps_length_and_pitch() -> None:
    t = np.arange(REALTIME_RATE) / REALTIME_RATE
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    down = resample(tone, REALTIME_RATE, SPEECH_RATE)
    assert down.dtype == np.float32 and len(down) == SPEECH_RATE
    assert _peak_hz(down, SPEECH_RATE) == pytest.approx(440, abs=1)
    up = resample(down, SPEECH_RATE, REALTIME_RATE)
    assert len(up) == REALTIME_RATE
    assert np.abs(up[1000:-1000] - tone[1000:-1000]).max() < 0.01
    as_int = resample(to_int16(tone), REALTIME_RATE, SPEECH_RATE)  # int16 in: scaled to float
    assert np.abs(as_int - down).max() < 1e-3


def test_streamed_resampling_matches_whole_chunks() -> None:
    rng = np.random.default_rng(1)
    audio = (rng.standard_normal(REALTIME_RATE) * 0.1).astype(np.float32)
    whole = resample(audio, REALTIME_RATE, SPEECH_RATE)
    stream = StreamResampler(REALTIME_RATE, SPEECH_RATE)
    sizes = [1, 479, 480, 4000, 7]
    pieces, at = [], 0
    while at < len(audio):
        size = sizes[len(pieces) % len(sizes)]
        pieces.append(stream.feed(audio[at:at + size]))
        at += size
    pieces.append(stream.flush())
    streamed = np.concatenate(pieces)
    assert abs(len(streamed) - len(whole)) <= 1
    n = min(len(streamed), len(whole))
    assert np.abs(streamed[:n] - whole[:n]).max() < 1e-3


def test_same_rate_is_a_copy() -> None:
    x = np.array([0.1, 0.2], np.float32)
    y = resample(x, SPEECH_RATE, SPEECH_RATE)
    y[0] = 1
    assert x[0] == np.float32(0.1)
    assert StreamResampler(SPEECH_RATE, SPEECH_RATE).feed(x).tolist() == x.tolist()
