"""``semantic_vad`` end to end: a served gateway with the real voice pipeline and the Smart Turn
v3 turn model, driven through the official openai SDK's Realtime client, speech made by flite's
``rms`` voice (the API's "echo": on it the turn model judges these clips as a listener would;
tests/voice/test_turn.py has the figures)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from fake_engine import FakeEngine
from gateway_harness import MODEL
from voice_serving import CHUNK_MS, chunks, serve, voice_pipeline, words

from gateway.ws.voice_service import GatewayVoice
from llm_shared.contract import SamplingParams
from voice.audio import REALTIME_RATE, encode_pcm16, resample, to_int16
from voice.tts import FliteSynthesizer

pytestmark = pytest.mark.timeout(300)

QUESTION = "Please turn on the kitchen lights."
VOICE = "echo"
ANSWER = ["The ", "lights ", "are ", "on. "]


@pytest.fixture(scope="module")
def voice() -> Iterator[GatewayVoice]:
    yield from voice_pipeline()


def answer(prompt_ids: Sequence[int], params: SamplingParams) -> list[str]:
    return list(ANSWER)


def silence(ms: int) -> np.ndarray:
    return np.zeros(REALTIME_RATE * ms // 1000, np.int16)


def said(text: str, *, pause_after: str | None = None, pause_ms: int = 500, voice: str = VOICE) -> tuple[np.ndarray, int]:
    """``text`` in flite's voice at 24 kHz with 500 ms before and 1.5 s after, optionally a pause
    after the word ``pause_after`` (one utterance cut, so the words before keep their mid-sentence
    prosody); and where the voice really ends, in ms."""
    made = FliteSynthesizer().synthesize(text, voice)
    samples = to_int16(resample(made.samples, made.sample_rate, REALTIME_RATE))
    parts = [silence(500), samples]
    if pause_after is not None:
        char_end = text.index(f" {pause_after} ") + len(pause_after) + 1
        cut = round(dict(made.marks)[char_end] * REALTIME_RATE / made.sample_rate)
        parts = [silence(500), samples[:cut], silence(pause_ms), samples[cut:]]
    audio = np.concatenate([*parts, silence(1500)])
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


async def test_a_finished_question_is_answered_sooner_than_server_vad_allows(voice: GatewayVoice) -> None:
    from openai import AsyncOpenAI

    audio, speech_end_ms = said(QUESTION)
    ends: dict[str, int] = {}
    async for served in serve(voice, FakeEngine(reply=answer)):
        client = AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        for kind in ("semantic_vad", "server_vad"):
            async with client.realtime.connect(model=MODEL) as conn:
                await conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                                   "audio": {"input": {"turn_detection": {"type": kind}}}})
                seen = await turn(conn, audio)
            assert words(seen["transcripts"][0]) == words(QUESTION)
            ends[kind] = seen["stopped"][0] - speech_end_ms
        await client.close()
    # In audio ms from the end of the voice: the turn model ends the turn at the first 200 ms
    # pause (measured: ~300 ms after the voice, Silero's lag included); server VAD waits 500 ms
    # of silence after its own (later) speech end.
    assert ends["semantic_vad"] < 500 <= ends["server_vad"], ends


async def test_a_pause_mid_sentence_is_not_the_end_of_the_turn(voice: GatewayVoice) -> None:
    from openai import AsyncOpenAI

    audio, _ = said(QUESTION, pause_after="the", pause_ms=500)
    async for served in serve(voice, FakeEngine(reply=answer)):
        client = AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        async with client, client.realtime.connect(model=MODEL) as conn:
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "audio": {
                "input": {"turn_detection": {"type": "semantic_vad", "eagerness": "high"}}}})
            seen = await turn(conn, audio)
    assert seen["types"].count("input_audio_buffer.committed") == 1, seen["types"]
    assert len(seen["stopped"]) == 1 and [words(t) for t in seen["transcripts"]] == [words(QUESTION)]
    assert seen["types"].index("input_audio_buffer.speech_stopped") < seen["types"].index("response.created")


BOOKING = "I'd like to book a table for four people tonight."
BOOKING_VOICE = "cedar"  # a flite voice in which Smart Turn hears "...a table for" as finished (0.99)


async def test_a_pause_after_an_unfinished_clause_waits_for_the_rest_of_the_sentence(voice: GatewayVoice) -> None:
    """Smart Turn judges "I'd like to book a table for" in this voice finished (0.99 here; alone,
    it ends the turn 200 ms into the pause: tests/voice/test_text_turn.py); the words at the pause
    hold the end, and the turn is the whole sentence. Streamed in real time, so the pause is a
    pause for the server too."""
    from openai import AsyncOpenAI

    audio, _ = said(BOOKING, pause_after="for", pause_ms=700, voice=BOOKING_VOICE)
    async for served in serve(voice, FakeEngine(reply=answer)):
        client = AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        async with client, client.realtime.connect(model=MODEL) as conn:
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "audio": {
                "input": {"turn_detection": {"type": "semantic_vad", "eagerness": "auto"}}}})
            seen = await turn(conn, audio, real_time=True)
    assert seen["types"].count("input_audio_buffer.committed") == 1, seen["types"]
    (heard,) = seen["transcripts"]  # the whole sentence (Whisper tiny hears "for four" as one word or two)
    assert words(heard)[:8] == words(BOOKING)[:8] and words(heard)[-2:] == ["people", "tonight"], heard


async def test_each_eagerness_set_through_the_sdk_gets_a_turn(voice: GatewayVoice) -> None:
    from openai import AsyncOpenAI

    audio, _ = said(QUESTION)
    async for served in serve(voice, FakeEngine(reply=answer)):
        client = AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        async with client, client.realtime.connect(model=MODEL) as conn:
            for eagerness in ("low", "medium", "high", "auto"):
                await conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "audio": {
                    "input": {"turn_detection": {"type": "semantic_vad", "eagerness": eagerness}}}})
                seen = await turn(conn, audio)
                detection = seen["turn_detection"]
                assert detection.type == "semantic_vad" and detection.eagerness == eagerness
                assert len(seen["stopped"]) == 1 and words(seen["transcripts"][0]) == words(QUESTION)
