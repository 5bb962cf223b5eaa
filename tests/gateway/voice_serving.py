"""A served gateway with the real voice pipeline (Silero VAD, Whisper tiny.en, flite) and a fake
language engine, and speech made by flite: shared by the server's voice tests
(``test_server_voice.py``), the Python SDK's (``tests/client_sdk/test_python_sdk_voice.py``) and
the demo page's (``test_demo_voice.py``).

A test module makes its own module-scoped fixtures from these (loading the models takes seconds):

    @pytest.fixture(scope="module")
    def voice() -> Iterator[GatewayVoice]:
        yield from voice_pipeline()
"""

from __future__ import annotations

import re
import wave
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
from fake_engine import FakeEngine
from gateway_harness import make_config

from gateway.process.server import create_app, start_server
from gateway.ws.voice_service import GatewayVoice
from voice.audio import REALTIME_RATE, encode_pcm16, resample, to_int16
from voice.config import VoiceConfig
from voice.tts import FliteSynthesizer

QUESTION = "Please turn on the kitchen lights."
CHUNK_MS = 100


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9 ]", " ", text.lower()).split()


def voice_pipeline() -> Iterator[GatewayVoice]:
    """The gateway's voice pipeline on two worker threads, closed after."""
    service = GatewayVoice(VoiceConfig(pool_threads=2))
    try:
        yield service
    finally:
        service.close()


def spoken(text: str = QUESTION, *, rate: int = REALTIME_RATE, before_ms: int = 500, after_ms: int = 1000,
           voice: str = "alloy") -> np.ndarray:
    """``text`` as flite says it, int16 at ``rate``, with silence around (``after_ms`` lets server
    VAD hear the end of the speech, as a microphone that goes on sending would)."""
    speech = FliteSynthesizer().synthesize(text, voice)
    samples = to_int16(resample(speech.samples, speech.sample_rate, rate))
    return np.concatenate([np.zeros(rate * before_ms // 1000, np.int16), samples,
                           np.zeros(rate * after_ms // 1000, np.int16)])


def question_pcm() -> bytes:
    """The question as a client's microphone would send it: 24 kHz PCM16, with silence around."""
    return encode_pcm16(spoken())


def write_wav(path: Path, samples: np.ndarray, rate: int) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())
    return path


def chunks(pcm: bytes, ms: int = CHUNK_MS) -> list[bytes]:
    size = ms * REALTIME_RATE * 2 // 1000
    return [pcm[i:i + size] for i in range(0, len(pcm), size)]


class Served:
    def __init__(self, url: str, engine: FakeEngine) -> None:
        self.url = url
        self.engine = engine


async def serve(voice: GatewayVoice, engine: FakeEngine, **server: object) -> AsyncIterator[Served]:
    """A gateway on a free loopback port (``async for served in serve(...)``), stopped after;
    ``server``: ``[server]`` settings to change."""
    running = await start_server(create_app(make_config(**server), {"edge": engine}, voice=voice))
    try:
        yield Served(running.url, engine)
    finally:
        await running.stop()
