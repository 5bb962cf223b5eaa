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

import asyncio
import base64
import re
import wave
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from fake_engine import FakeEngine
from gateway_harness import make_config

from gateway.process.server import create_app, start_server
from gateway.ws.voice_service import GatewayVoice
from voice.audio import REALTIME_RATE, encode_pcm16, resample, to_int16
from voice.config import VoiceConfig
from voice.tts import FliteSynthesizer

QUESTION = "Please turn on the kitchen lights."
# flite's ``rms`` voice (the API's "echo"): on it the turn model judges clips as a listener would
SAID_VOICE = "echo"
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


def silence(ms: int) -> np.ndarray:
    return np.zeros(REALTIME_RATE * ms // 1000, np.int16)


def said(text: str, *, pause_after: str | None = None, pause_ms: int = 500, voice: str = SAID_VOICE,
         after_ms: int = 1500) -> tuple[np.ndarray, int]:
    """``text`` in flite's voice at 24 kHz with 500 ms before and ``after_ms`` after, optionally a pause
    after the word ``pause_after`` (one utterance cut, so the words before keep their mid-sentence
    prosody); and where the voice really ends, in ms."""
    made = FliteSynthesizer().synthesize(text, voice)
    samples = to_int16(resample(made.samples, made.sample_rate, REALTIME_RATE))
    parts = [silence(500), samples]
    if pause_after is not None:
        char_end = text.index(f" {pause_after} ") + len(pause_after) + 1
        cut = round(dict(made.marks)[char_end] * REALTIME_RATE / made.sample_rate)
        parts = [silence(500), samples[:cut], silence(pause_ms), samples[cut:]]
    audio = np.concatenate([*parts, silence(after_ms)])
    loud = np.flatnonzero(np.abs(audio.astype(np.int32)) > 328)  # -40 dBFS
    return audio, (loud[-1] + 1) * 1000 // REALTIME_RATE


async def turn(conn: Any, audio: np.ndarray, *, real_time: bool = False) -> dict[str, Any]:
    """Stream ``audio`` (as fast as it goes, or as a microphone does) and read the events up to
    the response's end."""
    if real_time:
        microphone = asyncio.create_task(stream_in_real_time(conn, audio))
    else:
        for chunk in chunks(encode_pcm16(audio)):
            await conn.input_audio_buffer.append(audio=base64.b64encode(chunk).decode())
    seen: dict[str, Any] = {"types": [], "transcripts": [], "stopped": []}
    async for event in conn:
        seen["types"].append(event.type)
        if event.type == "input_audio_buffer.speech_stopped":
            seen["stopped"].append(event.audio_end_ms)
        elif event.type == "conversation.item.input_audio_transcription.completed":
            seen["transcripts"].append(event.transcript)
        elif event.type == "session.updated":
            seen["turn_detection"] = event.session.audio.input.turn_detection  # type: ignore[union-attr]
        elif event.type == "error":
            raise AssertionError(event.error)
        elif event.type == "response.done":
            if real_time:
                await microphone
            return seen
    raise AssertionError("the connection closed")


async def stream_in_real_time(conn: Any, audio: np.ndarray) -> None:
    """A microphone: each 40 ms chunk when its time comes (so the server's decisions in a pause
    are made before the speech after it has arrived)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    for n, chunk in enumerate(chunks(encode_pcm16(audio), CHUNK_MS)):
        await asyncio.sleep(max(0.0, start + n * CHUNK_MS / 1000 - loop.time()))
        await conn.input_audio_buffer.append(audio=base64.b64encode(chunk).decode())
