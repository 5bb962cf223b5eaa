"""Answering ahead end to end (``gateway.ws.foresight``): a served gateway with the real voice
pipeline and a fake language engine that records when and what it was asked, speech made by
flite and streamed in real time through the official openai SDK's Realtime client.

Server VAD's silence window is set to 1.5 s here so that the transcript started at the pause
(160 ms into it) is in well before the turn ends on a busy machine: what is under test is what
happens then, not how fast Whisper is."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import pytest
from fake_engine import FakeEngine, FakeTokenizer
from gateway_harness import MODEL
from voice_serving import QUESTION, said, serve, stream_in_real_time, voice_pipeline, words

from gateway.ws.voice_service import GatewayVoice
from llm_shared.contract import SamplingParams

pytestmark = pytest.mark.timeout(300)

ANSWER = ["The ", "lights ", "are ", "on. "]
SILENCE_MS = 1500


@pytest.fixture(scope="module")
def voice() -> Iterator[GatewayVoice]:
    yield from voice_pipeline()


class AskedEngine(FakeEngine):
    """A fake engine that notes the loop time and the last prompt line of each request."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(reply=self._answer, **kwargs)  # type: ignore[arg-type]
        self.asked: list[tuple[float, str]] = []
        self.aborted_at: list[float] = []

    async def abort(self, request_id: str) -> None:
        self.aborted_at.append(asyncio.get_running_loop().time())
        await super().abort(request_id)

    def _answer(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[str]:
        user_lines = [line for line in FakeTokenizer().decode(prompt_ids).splitlines() if line.startswith("<user>")]
        self.asked.append((asyncio.get_running_loop().time(), user_lines[-1].removeprefix("<user>")))
        return list(ANSWER)


async def session_turn(served_url: str, audio: object, *, silence_ms: int = SILENCE_MS,
                       modality: str = "text") -> dict[str, object]:
    """One turn streamed in real time; the events seen, with the loop time of speech_stopped."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{served_url}/v1", api_key="unused", max_retries=0)
    seen: dict[str, object] = {"types": [], "transcripts": [], "text": ""}
    types: list[str] = seen["types"]  # type: ignore[assignment]
    async with client, client.realtime.connect(model=MODEL) as conn:
        await conn.session.update(session={"type": "realtime", "output_modalities": [modality], "audio": {
            "input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": silence_ms}}}})
        microphone = asyncio.create_task(stream_in_real_time(conn, audio))  # type: ignore[arg-type]
        async for event in conn:
            types.append(event.type)
            if event.type == "input_audio_buffer.speech_stopped":
                seen["stopped_at"] = asyncio.get_running_loop().time()
            elif event.type == "conversation.item.input_audio_transcription.completed":
                seen["transcripts"].append(event.transcript)  # type: ignore[attr-defined]
            elif event.type in ("response.output_text.delta", "response.output_audio_transcript.delta"):
                seen["text"] = f"{seen['text']}{event.delta}"
            elif event.type == "response.output_audio.delta":
                seen["audio_at"] = seen.get("audio_at") or asyncio.get_running_loop().time()
            elif event.type == "error":
                raise AssertionError(event.error)
            elif event.type == "response.done":
                seen["status"], seen["response_id"] = event.response.status, event.response.id
                break
        microphone.cancel()
    return seen


@pytest.mark.parametrize("tokens_per_second", [None, 4.0], ids=["done-before-the-turn-ends", "still-streaming"])
async def test_the_answer_starts_at_the_pause_and_the_turns_response_takes_it_over(
        voice: GatewayVoice, tokens_per_second: float | None) -> None:
    audio, _ = said(QUESTION, after_ms=3000)
    engine = AskedEngine(tokens_per_second=tokens_per_second)
    async for served in serve(voice, engine):
        seen = await session_turn(served.url, audio)
    # One engine request, started inside the silence, before the turn ended, for what was said.
    ((asked_at, asked),) = engine.asked
    assert asked_at < seen["stopped_at"]  # type: ignore[operator]
    assert words(asked) == words(QUESTION) and engine.aborts == []
    ((request_id, _),) = engine.started
    assert request_id == seen["response_id"]  # the engine's request is the response's, as always
    # The client sees the turn as always: nothing of the answer before the turn ended, then all of it.
    types: list[str] = seen["types"]  # type: ignore[assignment]
    assert types.index("input_audio_buffer.speech_stopped") < types.index("input_audio_buffer.committed") \
        < types.index("response.created") < types.index("response.output_text.delta")
    assert seen["status"] == "completed" and seen["text"] == "".join(ANSWER)
    assert [words(t) for t in seen["transcripts"]] == [words(QUESTION)]  # type: ignore[attr-defined]
    assert engine.blocks_in_use == 0


async def test_an_answer_started_at_a_pause_the_user_talks_through_is_aborted_and_never_heard(
        voice: GatewayVoice) -> None:
    audio, _ = said(QUESTION, pause_after="the", pause_ms=1200, after_ms=3000)  # "Please turn on the ... kitchen lights."
    engine = AskedEngine(tokens_per_second=2.0)  # still answering the half when the user goes on
    async for served in serve(voice, engine):
        seen = await session_turn(served.url, audio)
    # Two requests: the half question, at the pause, aborted when the speech came back; the whole one.
    (_, half), (whole_at, whole) = engine.asked
    assert words(half) == words("Please turn on the") and words(whole) == words(QUESTION)
    (first, _), (second, _) = engine.started
    assert engine.aborts == [first] and engine.finished[first] == "abort"
    # aborted as the speech came back, not only when the next pause started another ("kitchen lights": ~0.8 s)
    assert engine.aborted_at[0] < whole_at - 0.3, (engine.aborted_at, whole_at)
    assert engine.finished[second] == "stop" and second == seen["response_id"] and engine.blocks_in_use == 0
    types: list[str] = seen["types"]  # type: ignore[assignment]
    assert types.count("input_audio_buffer.committed") == 1 and types.count("response.created") == 1
    assert seen["status"] == "completed" and seen["text"] == "".join(ANSWER)
    assert [words(t) for t in seen["transcripts"]] == [words(QUESTION)]  # type: ignore[attr-defined]


class TimedVoice:
    """The voice pipeline, noting when each phrase's synthesis was asked for."""

    def __init__(self, voice: GatewayVoice) -> None:
        self._voice = voice
        self.spoken: list[tuple[float, str]] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self._voice, name)

    async def synthesize(self, text: str, voice: str, owner: object = None) -> object:
        self.spoken.append((asyncio.get_running_loop().time(), text))
        return await self._voice.synthesize(text, voice, owner=owner)


async def test_a_spoken_answer_started_ahead_has_its_first_phrase_spoken_before_the_turn_ends(
        voice: GatewayVoice) -> None:
    audio, _ = said(QUESTION, after_ms=3000)
    timed = TimedVoice(voice)
    engine = AskedEngine()
    async for served in serve(timed, engine):  # type: ignore[arg-type]
        seen = await session_turn(served.url, audio, modality="audio")
    first = "The lights are on."
    assert seen["status"] == "completed" and seen["text"] == "".join(ANSWER).rstrip()
    # Its first phrase was made once, inside the silence, and is what the response sent first:
    # asked for at least half the window before the turn's end (the transcript at the pause comes
    # ~1 s before it; a phrase the response asks for comes after the end, so only one made ahead
    # can be this early).
    (spoken_at,) = [at for at, t in timed.spoken if t == first]
    assert spoken_at < seen["stopped_at"] - SILENCE_MS / 2000 < seen["audio_at"]  # type: ignore[operator]
    assert [t for _, t in timed.spoken] == [first]  # (the answer is one phrase: nothing else to say)
