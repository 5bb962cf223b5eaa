"""Audio for a voice session: the Realtime API's PCM (16-bit little-endian mono at 24 kHz), WAV
files read into it and written from it, sources to ``speak``, and players.

Reading a WAV file and resampling need numpy (``pip install numpy``), imported only here and only
when a file is read: a client streaming its own 24 kHz PCM needs nothing beyond the SDK. The
resampler is a windowed-sinc low-pass (when going down in rate) followed by linear interpolation:
plenty for speech, no heavy dependency.

A ``Player`` is what the client hands a spoken answer to, and asks how much of it was heard:
``play`` queues PCM and returns at once, ``stop`` drops what is queued, ``played_ms`` counts
the audio actually played since the player began or was last stopped. ``RealTimePlayer`` plays
into memory at the pace of the clock (a speaker nobody hears: tests, headless apps);
``rtgw.sound`` plays on a sound device when ``sounddevice`` is installed.
"""

from __future__ import annotations

import asyncio
import time
import wave
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rtgw.voice_events import BYTES_PER_MS, SAMPLE_RATE, pcm_ms

if TYPE_CHECKING:
    import numpy as np

NUMPY_HINT = "reading and writing WAV files needs numpy: pip install numpy"
CHUNK_MS = 100  # what speak() sends per append, as a microphone's buffer would

AudioSource = bytes | bytearray | memoryview | str | Path | Iterable[bytes] | AsyncIterable[bytes]


def _numpy() -> Any:
    try:
        import numpy
    except ImportError as e:
        raise ImportError(NUMPY_HINT) from e
    return numpy


def check_pcm(pcm: bytes | bytearray | memoryview) -> bytes:
    """``pcm`` as bytes, or ValueError when it is not whole 16-bit samples."""
    data = bytes(pcm)
    if len(data) % 2:
        raise ValueError(f"PCM16 audio must be a whole number of 2-byte samples, got {len(data)} bytes")
    return data


def silence(ms: float) -> bytes:
    return bytes(int(ms * BYTES_PER_MS) // 2 * 2)


def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """float samples at ``from_rate`` to ``to_rate``: low-pass below the new Nyquist frequency
    when going down (a Hann-windowed sinc, 64 taps a ratio step), then linear interpolation."""
    np = _numpy()
    x = np.asarray(samples, dtype=np.float64)
    if from_rate == to_rate or x.size == 0:
        return x.copy()
    if to_rate < from_rate:
        cutoff = 0.45 * to_rate / from_rate  # of the input rate; 0.5 is the new Nyquist
        half = int(32 * from_rate / to_rate)
        n = np.arange(-half, half + 1)
        taps = 2 * cutoff * np.sinc(2 * cutoff * n) * np.hanning(2 * half + 1)
        x = np.convolve(x, taps / taps.sum(), mode="same")
    n_out = round(x.size * to_rate / from_rate)
    positions = np.arange(n_out) * (from_rate / to_rate)
    return np.interp(positions, np.arange(x.size), x)


def read_wav(path: str | Path) -> bytes:
    """A WAV file (PCM of 8, 16, 24 or 32 bits, any rate, any channels) as the Realtime API's
    PCM: channels averaged to mono, resampled to 24 kHz, 16-bit little-endian."""
    np = _numpy()
    with wave.open(str(path), "rb") as w:
        width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
        raw = w.readframes(w.getnframes())
    if width == 1:
        x = (np.frombuffer(raw, np.uint8).astype(np.float64) - 128) / 128
    elif width == 2:
        x = np.frombuffer(raw, "<i2") / 32768.0
    elif width == 3:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        x = ((b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8) / 8388608.0  # sign-extend 24 bits
    elif width == 4:
        x = np.frombuffer(raw, "<i4") / 2147483648.0
    else:
        raise ValueError(f"{path}: {width * 8}-bit samples are not supported")
    x = x.reshape(-1, channels).mean(axis=1)
    y = resample(x, rate, SAMPLE_RATE)
    return np.clip(np.rint(y * 32768.0), -32768, 32767).astype("<i2").tobytes()


def write_wav(path: str | Path, pcm: bytes, rate: int = SAMPLE_RATE) -> Path:
    """PCM16 mono (at ``rate``) as a WAV file; returns the path."""
    path = Path(path)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(check_pcm(pcm))
    return path


def pcm_chunks(pcm: bytes, chunk_ms: float = CHUNK_MS) -> Iterable[bytes]:
    size = max(2, int(chunk_ms * BYTES_PER_MS) // 2 * 2)
    return (pcm[i:i + size] for i in range(0, len(pcm), size))


async def source_chunks(source: AudioSource, chunk_ms: float = CHUNK_MS) -> AsyncIterator[bytes]:
    """Chunks of 24 kHz PCM16 from ``source``: PCM bytes (cut into ``chunk_ms`` pieces), a WAV
    file's path (read and resampled), or an iterator or async iterator of PCM chunks (as given)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        for chunk in pcm_chunks(check_pcm(source), chunk_ms):
            yield chunk
    elif isinstance(source, (str, Path)):
        for chunk in pcm_chunks(read_wav(source), chunk_ms):
            yield chunk
    elif isinstance(source, AsyncIterable):
        async for chunk in source:
            yield check_pcm(chunk)
    else:
        for chunk in source:
            yield check_pcm(chunk)


async def stream_paced(source: AudioSource, send: Callable[[bytes], Awaitable[None]], *, speed: float | None,
                       trailing_silence_ms: float, chunk_ms: float) -> float:
    """``source``'s chunks to ``send``, ``speed`` times real time (None: as fast as they come), then
    ``trailing_silence_ms`` of silence, as a microphone that goes on; returns the milliseconds sent."""
    started = time.monotonic()
    sent_ms = 0.0

    async def paced(chunk: bytes) -> None:
        nonlocal sent_ms
        if speed is not None:  # pacing, not waiting for an event: a microphone's clock
            await asyncio.sleep(max(0.0, started + sent_ms / 1000 / speed - time.monotonic()))
        await send(chunk)
        sent_ms += pcm_ms(len(chunk))

    async for chunk in source_chunks(source, chunk_ms):
        if chunk:
            await paced(chunk)
    for chunk in pcm_chunks(silence(trailing_silence_ms), chunk_ms):
        await paced(chunk)
    return sent_ms


class Player(Protocol):
    """Where the client plays a spoken answer (PCM16, 24 kHz, mono)."""

    def play(self, pcm: bytes) -> None:
        """Queue ``pcm`` after what is queued; returns at once."""

    def stop(self) -> None:
        """Stop at once and drop what is queued; ``played_ms`` starts again from 0."""

    @property
    def played_ms(self) -> float:
        """Audio actually played (heard) since the player began or was last stopped."""


class RealTimePlayer:
    """A player into memory at the pace of a clock: queued audio is "played" as time passes, with
    gaps when it runs dry, as a sound card would. ``audio`` is everything played, ``stops`` how
    many times ``stop`` cut the queue."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.audio = bytearray()  # played, all stops included
        self.stops = 0
        self._queue = bytearray()  # queued since the last stop; _position ms of it played
        self._position = 0.0
        self._at = clock()

    def _advance(self) -> None:
        now = self._clock()
        queued = pcm_ms(len(self._queue))
        position = min(queued, self._position + (now - self._at) * 1000.0)
        start, end = int(self._position * BYTES_PER_MS) // 2 * 2, int(position * BYTES_PER_MS) // 2 * 2
        self.audio += self._queue[start:end]
        self._position, self._at = position, now

    def play(self, pcm: bytes) -> None:
        self._advance()
        self._queue += check_pcm(pcm)

    def stop(self) -> None:
        self._advance()
        self.stops += 1
        self._queue.clear()
        self._position = 0.0

    @property
    def played_ms(self) -> float:
        self._advance()
        return self._position

    @property
    def queued_ms(self) -> float:
        """Audio given to ``play`` since the last stop, played or not."""
        return pcm_ms(len(self._queue))
