"""``semantic_vad`` end to end: a served gateway with the real voice pipeline and the Smart Turn
v3 turn model, driven through the official openai SDK's Realtime client, speech made by flite's
``rms`` voice (the API's "echo": on it the turn model judges these clips as a listener would;
tests/voice/test_turn.py has the figures)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
from fake_engine import FakeEngine
from gateway_harness import MODEL
from voice_serving import said, serve, turn, voice_pipeline, words

from gateway.ws.voice_service import GatewayVoice
from llm_shared.contract import SamplingParams

pytestmark = pytest.mark.timeout(300)

QUESTION = "Please turn on the kitchen lights."
ANSWER = ["The ", "lights ", "are ", "on. "]


@pytest.fixture(scope="module")
def voice() -> Iterator[GatewayVoice]:
    yield from voice_pipeline()


def answer(prompt_ids: Sequence[int], params: SamplingParams) -> list[str]:
    return list(ANSWER)


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
