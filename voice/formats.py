"""Audio formats on the wire, and the one clock inside: a session's audio is PCM16 mono at the
Realtime API's 24 kHz (``SESSION_RATE``) from the moment it is appended to the moment it is sent.

An ``AudioFormat`` converts the client's bytes to that clock (``to_session``, or a session's own
``stream()`` for appends) and back (``from_session``); VAD, recognition, synthesis, truncation
offsets and rate bounds never see another encoding. The wire speaks ``audio/pcm`` at 24 kHz
(beta ``pcm16``), where both directions are a check and a copy, and G.711 at 8 kHz, telephony's
codecs: ``audio/pcmu`` (mu-law, beta ``g711_ulaw``) and ``audio/pcma`` (A-law, ``g711_alaw``),
one byte a sample.

G.711 is coded with lookup tables (256 entries to decode; 65,536 indexed by the int16 sample to
encode, built once at import), bit-exact with the ITU reference that the stdlib's ``audioop``
implements (gone in Python 3.13, so not used here). 8 kHz and 24 kHz are a factor of 3: a wire
sample is exactly 3 session samples, so an 8 kHz chunk of n bytes (n/8 ms) is 3n session samples
and every ms offset on either side is the same ms on the other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from voice.audio import BYTES_PER_SAMPLE, REALTIME_RATE
from voice.errors import AudioError

SESSION_RATE = REALTIME_RATE
SESSION_BYTES_PER_MS = SESSION_RATE * BYTES_PER_SAMPLE // 1000


class InputStream(Protocol):
    """One session's appends, converted in order (a converter may keep a filter's history)."""

    def to_session(self, data: bytes) -> bytes: ...


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
        """PCM16 at ``SESSION_RATE`` as this format's bytes: ``ratio`` session samples a wire
        sample (a trailing partial one is dropped; callers send whole ones)."""

    def stream(self) -> InputStream:
        """A converter for one session's appends, in order (stateless formats are their own)."""
        return self

    @property
    def ratio(self) -> int:
        """Session samples a wire sample (1 at 24 kHz, 3 at 8 kHz)."""
        return SESSION_RATE // self.rate

    @property
    def bytes_per_ms(self) -> int:
        return self.rate * self.sample_bytes // 1000

    def session_bytes(self, n_bytes: int) -> int:
        """How many bytes of session PCM ``n_bytes`` of this format become (bounds count these)."""
        return n_bytes // self.sample_bytes * self.ratio * BYTES_PER_SAMPLE

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


# ----- G.711 ------------------------------------------------------------------------------------

_ALL_INT16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.int16).astype(np.int32)  # by uint16 index
_ULAW_SEG_END = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
_ALAW_SEG_END = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])


def _frozen(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    a.flags.writeable = False
    return a


def _ulaw_encode_table() -> npt.NDArray[np.uint8]:
    """mu-law code of every int16 (indexed by its uint16 bits): the 14-bit reference coder."""
    x = _ALL_INT16 >> 2
    mask = np.where(x < 0, 0x7F, 0xFF)
    v = np.minimum(np.abs(x), 8159) + 0x21  # clip, then the bias (0x84 at 16 bits)
    seg = np.searchsorted(_ULAW_SEG_END, v)
    code = np.where(seg >= 8, 0x7F, (seg << 4) | ((v >> (seg + 1)) & 0xF))
    return _frozen((code ^ mask).astype(np.uint8))


def _alaw_encode_table() -> npt.NDArray[np.uint8]:
    """A-law code of every int16 (indexed by its uint16 bits): the 13-bit reference coder."""
    x = _ALL_INT16 >> 3
    mask = np.where(x < 0, 0x55, 0xD5)
    v = np.where(x < 0, -x - 1, x)
    seg = np.searchsorted(_ALAW_SEG_END, v)
    mantissa = np.where(seg < 2, v >> 1, v >> np.maximum(seg, 1)) & 0xF
    code = np.where(seg >= 8, 0x7F, (seg << 4) | mantissa)
    return _frozen((code ^ mask).astype(np.uint8))


def _ulaw_decode_table() -> npt.NDArray[np.int16]:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    t = (((u & 0xF) << 3) + 0x84) << ((u & 0x70) >> 4)
    return _frozen(np.where(u & 0x80, 0x84 - t, t - 0x84).astype(np.int16))


def _alaw_decode_table() -> npt.NDArray[np.int16]:
    a = np.arange(256, dtype=np.int32) ^ 0x55
    seg = (a & 0x70) >> 4
    t = ((a & 0xF) << 4) + np.where(seg == 0, 8, 0x108)
    t = np.where(seg > 1, t << np.maximum(seg - 1, 0), t)
    return _frozen(np.where(a & 0x80, t, -t).astype(np.int16))


# The 8 <-> 24 kHz filter: a Kaiser-windowed sinc at 24 kHz cut at 8 kHz's Nyquist (4 kHz), 6K+1
# taps centred on tap 3K. Telephony speech stops at 3.4 kHz: the passband reaches ~3.5 kHz, and
# from ~4.5 kHz up the images of upsampling and the aliases of downsampling are ~60 dB down.
_HALF = 16  # K, in 8 kHz samples: an append's session audio lags its wire audio by K/8 = 2 ms
_TAPS = np.arange(-3 * _HALF, 3 * _HALF + 1)
_LOWPASS = np.sinc(_TAPS / 3) / 3 * np.kaiser(_TAPS.size, 6.0)
_LOWPASS /= _LOWPASS.sum()  # unity gain at DC


def _phases() -> npt.NDArray[np.float64]:
    """The low-pass split for upsampling: session sample 3i+p is phase p's taps over wire samples
    i, i-1, ...; as a [taps, 3] matrix over a window of wire samples, oldest first."""
    phases = np.zeros((3, 2 * _HALF + 1))
    for p in range(3):
        taps = _LOWPASS[p::3]
        phases[p, :taps.size] = taps / taps.sum()  # each phase passes DC whole: no 8 kHz ripple
    return _frozen(phases[:, ::-1].T.copy())


_PHASES = _phases()


def _to_int16(x: npt.NDArray[np.float64]) -> npt.NDArray[np.int16]:
    return np.clip(np.rint(x), -32768, 32767).astype(np.int16)


class _Upsampler:
    """8 kHz samples to 24 kHz, exactly 3 out for each in, a constant ``_HALF`` samples late: the
    history of the last ``2 * _HALF`` wire samples carries the filter across appends, so a chunk's
    edge is no edge to the filter (converted on its own, every 20 ms append would dip at its ends)."""

    def __init__(self) -> None:
        self._history = np.zeros(2 * _HALF, np.float64)

    def feed(self, samples: npt.NDArray[np.int16]) -> npt.NDArray[np.int16]:
        if samples.size == 0:
            return np.zeros(0, np.int16)
        x = np.concatenate([self._history, samples.astype(np.float64)])
        self._history = x[x.size - 2 * _HALF:]
        windows = np.lib.stride_tricks.sliding_window_view(x, 2 * _HALF + 1)  # [n, taps]
        return _to_int16((windows @ _PHASES).ravel())  # [n, 3] -> 3n, in time order


def _downsample(pcm: npt.NDArray[np.int16]) -> npt.NDArray[np.int16]:
    """24 kHz to 8 kHz, one sample out for each whole 3 in, with no delay: the filter is centred
    on the sample it keeps and sees silence past the ends. ``from_session`` is called with a whole
    phrase of synthesized speech (which starts and ends in silence), so converting it stateless
    puts no edge where there is sound."""
    n = pcm.size // 3
    if n == 0:
        return np.zeros(0, np.int16)
    full = np.convolve(pcm.astype(np.float64), _LOWPASS)  # output k is centred on input k - 3K
    return _to_int16(full[3 * _HALF:3 * _HALF + 3 * n:3])


class G711(AudioFormat):
    rate = 8_000
    sample_bytes = 1

    def __init__(self, kind: str, beta: str, encode: npt.NDArray[np.uint8], decode: npt.NDArray[np.int16]) -> None:
        self.type = kind
        self.beta = beta
        self._encode = encode
        self._decode = decode

    def decode(self, data: bytes) -> npt.NDArray[np.int16]:
        """Codes to 8 kHz int16 samples."""
        return self._decode[np.frombuffer(data, np.uint8)]

    def encode(self, samples: npt.NDArray[np.int16]) -> bytes:
        """8 kHz int16 samples to codes."""
        return self._encode[samples.astype(np.int16, copy=False).view(np.uint16)].tobytes()

    def to_session(self, data: bytes) -> bytes:
        """One chunk on its own (a fresh ``stream()``: the filter starts from silence)."""
        return self.stream().to_session(data)

    def from_session(self, pcm: bytes) -> bytes:
        samples = np.frombuffer(pcm, "<i2", len(pcm) // BYTES_PER_SAMPLE)
        return self.encode(_downsample(samples.astype(np.int16)))

    def stream(self) -> InputStream:
        return _G711Stream(self)

    def wire(self) -> dict[str, Any]:
        return {"type": self.type}  # the API's G.711 formats have no rate field (8 kHz, always)


class _G711Stream:
    def __init__(self, fmt: G711) -> None:
        self._fmt = fmt
        self._upsampler = _Upsampler()

    def to_session(self, data: bytes) -> bytes:
        return self._upsampler.feed(self._fmt.decode(data)).astype("<i2").tobytes()


PCM16 = Pcm16()
PCMU = G711("audio/pcmu", "g711_ulaw", _ulaw_encode_table(), _ulaw_decode_table())
PCMA = G711("audio/pcma", "g711_alaw", _alaw_encode_table(), _alaw_decode_table())
FORMATS: dict[str, AudioFormat] = {f.type: f for f in (PCM16, PCMU, PCMA)}  # by GA name
BETA_FORMATS: dict[str, AudioFormat] = {f.beta: f for f in FORMATS.values()}
