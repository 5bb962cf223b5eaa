"""A sound device as the voice session's speaker and microphone, through ``sounddevice``
(PortAudio) when it is installed (``pip install sounddevice``); nothing in the SDK needs it.

    from rtgw.sound import SoundDevicePlayer, microphone
    async with RealtimeClient(url, player=SoundDevicePlayer()) as client:
        await client.update_session(output_modalities=["audio"])
        await client.speak(microphone(), speed=None)    # the microphone keeps its own time

Both run PortAudio at the API's format (24 kHz, mono, 16-bit); PortAudio converts where the
device cannot. The player's callback runs on PortAudio's thread and takes from a locked buffer;
``played_ms`` counts what the device consumed, less its output latency (what is still in the
device's buffers has not been heard yet).
"""

from __future__ import annotations

import asyncio
import importlib
import threading
from collections.abc import AsyncIterator
from typing import Any

from rtgw.audio import check_pcm
from rtgw.voice_events import BYTES_PER_MS, SAMPLE_RATE, pcm_ms

INSTALL_HINT = "the sound device needs sounddevice: pip install sounddevice"


def available() -> bool:
    """True when ``sounddevice`` imports (PortAudio found)."""
    try:
        importlib.import_module("sounddevice")
    except (ImportError, OSError):  # OSError: the module is there, PortAudio is not
        return False
    return True


def _sounddevice() -> Any:
    try:
        return importlib.import_module("sounddevice")
    except (ImportError, OSError) as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e


class PcmBuffer:
    """Bytes queued for a device: written by the event loop, read by the audio thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = bytearray()
        self.consumed = 0  # bytes of queued audio the device took since the last clear

    def write(self, pcm: bytes) -> None:
        with self._lock:
            self._data += pcm

    def read(self, n: int) -> bytes:
        """``n`` bytes for the device: the queued audio, then silence when it runs dry (not counted)."""
        with self._lock:
            out = bytes(self._data[:n])
            del self._data[:n]
            self.consumed += len(out)
        return out + bytes(n - len(out))

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.consumed = 0

    @property
    def queued(self) -> int:
        with self._lock:
            return len(self._data)


class SoundDevicePlayer:
    """A ``rtgw.audio.Player`` on a sound device (``device``: a sounddevice device id or name)."""

    def __init__(self, device: int | str | None = None, *, sd: Any = None) -> None:
        self._sd = sd if sd is not None else _sounddevice()
        self._device = device
        self._buffer = PcmBuffer()
        self._stream: Any = None

    def _callback(self, outdata: Any, frames: int, time: Any, status: Any) -> None:
        outdata[:] = self._buffer.read(frames * 2)

    def play(self, pcm: bytes) -> None:
        if self._stream is None:
            self._stream = self._sd.RawOutputStream(samplerate=SAMPLE_RATE, channels=1, dtype="int16",
                                                    device=self._device, callback=self._callback)
            self._stream.start()
        self._buffer.write(check_pcm(pcm))

    def stop(self) -> None:
        self._buffer.clear()

    @property
    def played_ms(self) -> float:
        latency_ms = float(getattr(self._stream, "latency", 0.0) or 0.0) * 1000
        return max(0.0, pcm_ms(self._buffer.consumed) - latency_ms)

    def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.stop()
            stream.close()


async def microphone(chunk_ms: float = 100, device: int | str | None = None, *, sd: Any = None,
                     max_queued_chunks: int = 100) -> AsyncIterator[bytes]:
    """The microphone as PCM16 24 kHz mono chunks of ``chunk_ms``, until the loop is left. Chunks
    the application does not take in time (``max_queued_chunks``, 10 s by default) are dropped,
    oldest first, rather than piling up."""
    sd = sd if sd is not None else _sounddevice()
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes] = asyncio.Queue()

    def put(data: bytes) -> None:
        if queue.qsize() >= max_queued_chunks:
            queue.get_nowait()
        queue.put_nowait(data)

    def callback(indata: Any, frames: int, time: Any, status: Any) -> None:
        loop.call_soon_threadsafe(put, bytes(indata))

    stream = sd.RawInputStream(samplerate=SAMPLE_RATE, channels=1, dtype="int16", device=device,
                               blocksize=int(chunk_ms * BYTES_PER_MS) // 2, callback=callback)
    stream.start()
    try:
        while True:
            yield await queue.get()
    finally:
        stream.stop()
        stream.close()
