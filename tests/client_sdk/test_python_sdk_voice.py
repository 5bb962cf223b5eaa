"""The Python SDK's voice against a served gateway with the real voice pipeline (Silero VAD,
Whisper tiny.en, flite) and a fake language model (a fixed answer): a question made by flite is
spoken from a WAV file, the SDK reads the user's transcript and the spoken answer (its
transcript and audio, played by a player that keeps time), and barge-in stops the player and
truncates the answer on the server to the audio actually played. The fixtures are the server
tests' own (``tests/gateway/voice_serving.py``)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from fake_engine import FakeEngine
from rtgw import GatewayError, RealtimeClient
from rtgw.audio import RealTimePlayer
from rtgw.protocol import TranscriptDelta
from rtgw.turn import TurnStarted
from rtgw.voice_events import (
    AudioCommitted,
    AudioDelta,
    InputTranscript,
    Interrupted,
    SpeechStarted,
    SpeechStopped,
)
from voice_serving import QUESTION, serve, spoken, voice_pipeline, words, write_wav
from voice_waits import until

from gateway.ws.voice_service import GatewayVoice
from voice.audio import encode_pcm16

pytestmark = pytest.mark.timeout(300)

ANSWER = ["The ", "kitchen ", "lights ", "are ", "on ", "now. ", "Is ", "there ", "anything ", "else ", "you ",
          "would ", "like? "]
WAIT_S = 120.0  # for the models on a busy 2-core machine



@pytest.fixture(scope="module")
def voice() -> Iterator[GatewayVoice]:
    yield from voice_pipeline()


@pytest.fixture(scope="module")
def question_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The question at 16 kHz, flite's own rate: the SDK resamples it to the API's 24 kHz."""
    return write_wav(tmp_path_factory.mktemp("voice") / "question.wav", spoken(rate=16_000), 16_000)


def client(url: str, **options: Any) -> RealtimeClient:
    return RealtimeClient(url, connect_timeout=30, silence_timeout=WAIT_S, request_timeout=30, **options)


async def test_a_spoken_question_from_a_wav_file_gets_its_transcript_and_a_spoken_answer(
        voice: GatewayVoice, question_wav: Path) -> None:
    player = RealTimePlayer()
    async for served in serve(voice, FakeEngine(reply=lambda p, s: list(ANSWER))):
        async with client(served.url, player=player) as c:
            await c.update_session(output_modalities=["audio"], voice="marin")  # server VAD: the default
            sent_ms = await c.speak(question_wav, speed=None)  # as fast as the gateway takes it
            turn = await c.next_turn(timeout=WAIT_S)
            transcript, audio, order = "", bytearray(), []
            async for event in turn.events():
                order.append(type(event).__name__)
                if isinstance(event, TranscriptDelta):
                    transcript += event.text
                elif isinstance(event, AudioDelta):
                    audio += event.pcm
            result = await turn.result()
            events = c.voice_events()
            heard, before = await until(events, InputTranscript)
            conversation = c.conversation
    assert sent_ms >= 4000  # the file (3.5 s at 24 kHz) and a second of silence after it
    kinds = [type(e) for e in before]
    assert kinds.index(SpeechStarted) < kinds.index(SpeechStopped) < kinds.index(AudioCommitted) \
        < kinds.index(TurnStarted)
    assert words(heard.transcript) == words(QUESTION) and turn.user_transcript == heard.transcript
    assert result.status == "completed" and result.text == "".join(ANSWER).rstrip() == transcript
    assert order[0] in ("InputTranscript", "TranscriptDelta") and "AudioDelta" in order
    assert order.index("TranscriptDelta") < order.index("AudioDelta")  # the words come before their audio
    assert len(audio) == turn.audio_bytes and player.queued_ms == len(audio) / 48 and player.stops == 0
    # one audio token per 50 ms of speech, as the server counts them
    assert abs(result.usage["output_token_details"]["audio_tokens"] - len(audio) / 48 / 50) < 2
    said = (await voice.transcribe(bytes(audio))).text  # the audio the SDK decoded says the answer
    assert words(said) == words(transcript)
    assert [(i.role, i.text) for i in conversation] == [("user", heard.transcript), ("assistant", result.text)]


async def test_talking_over_the_answer_stops_playback_and_keeps_only_what_was_played(
        voice: GatewayVoice, question_wav: Path) -> None:
    engine = FakeEngine(reply=lambda p, s: ANSWER * 6, tokens_per_second=8)  # still answering when interrupted
    player = RealTimePlayer()
    async for served in serve(voice, engine):
        async with client(served.url, player=player, framing="msgpack") as c:  # audio as raw bytes
            await c.update_session(output_modalities=["audio"])
            await c.speak(question_wav, speed=None)
            turn = await c.next_turn(timeout=WAIT_S)
            item_audio = bytearray()
            talking: asyncio.Task[float] | None = None
            async for event in turn.events():
                if isinstance(event, AudioDelta):
                    item_audio += event.pcm
                    if talking is None:  # the answer plays: the user asks again, in real time
                        talking = asyncio.create_task(c.speak(question_wav))
            result = await turn.result()
            interrupted, _ = await until(c.voice_events(), Interrupted)
            kept = await c.retrieve_item(interrupted.item_id)
            local = c.protocol.message(interrupted.item_id)
            # The question asked again is answered next, from a conversation holding only what was heard.
            assert talking is not None
            await talking
            second = await c.next_turn(timeout=WAIT_S)
            async for event in second.events():
                if isinstance(event, TranscriptDelta):
                    break  # its first words: the engine has its prompt
            prompt = "".join(map(chr, engine.prompts[second.response_id or ""]))
    assert result.status == "cancelled" and result.reason == "turn_detected"
    assert turn.response_id in engine.aborts  # the engine was told at once
    assert player.stops == 1
    played = interrupted.audio_end_ms
    assert 0 < played < len(item_audio) / 48  # cut during the answer, after some of it was heard
    assert bytes(player.audio[:played * 48]) == bytes(item_audio[:played * 48])  # what played was the answer
    said = result.text  # the words whose audio was sent before the cancel
    assert kept.text == interrupted.text == (local.text if local else None)
    assert said.startswith(kept.text) and len(kept.text) < len(said)
    assert kept.text == "" or said[len(kept.text)] == " "  # whole words
    assert said not in prompt and (kept.text == "" or f"<assistant>{kept.text}\n" in prompt)


async def test_push_to_talk_commit_and_respond(voice: GatewayVoice, question_wav: Path) -> None:
    async for served in serve(voice, FakeEngine(reply=lambda p, s: list(ANSWER))):
        async with client(served.url) as c:
            await c.update_session(turn_detection=None)  # push to talk; answers in text (the default)
            with pytest.raises(ValueError, match="2-byte samples"):
                await c.append_audio(b"\x00")
            await c.append_audio(encode_pcm16(spoken(after_ms=0)))
            await c.clear_audio()
            with pytest.raises(GatewayError, match="input_audio_buffer_commit_empty"):
                await c.commit_audio()
            await c.speak(question_wav, speed=None, trailing_silence_ms=0)
            turn = await c.respond()
            events = [e async for e in turn.events()]
            result = await turn.result()
    transcripts = [e for e in events if isinstance(e, InputTranscript)]
    assert len(transcripts) == 1 and words(transcripts[0].transcript) == words(QUESTION)
    assert result.status == "completed" and result.text == "".join(ANSWER)
    assert not any(isinstance(e, AudioDelta) for e in events)
