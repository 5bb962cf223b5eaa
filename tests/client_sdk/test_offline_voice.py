"""The Python SDK's voice on the device, with the real models and no gateway listening: a question
flite speaks is heard by the device's server VAD, transcribed by Whisper, answered by the embedded
SmolLM2 and spoken back with flite, through the same events and player as online; talking over
the answer cuts it, in the local conversation, to the words played; push to talk with a tool the
model must call; and the errors that say what to install when the voice package or flite is
missing. The speech is made as the gateway's voice tests make it (``tests/gateway/voice_serving.py``)."""

from __future__ import annotations

import asyncio
import difflib
import functools
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rtgw import Backoff, GatewayError, OfflineConfig, RealtimeClient
from rtgw.audio import RealTimePlayer
from rtgw.errors import OfflineVoiceError
from rtgw.offline import OfflineModel
from rtgw.protocol import FunctionCall, TranscriptDelta
from rtgw.turn import TurnStarted
from rtgw.voice_events import (
    AudioCommitted,
    AudioDelta,
    InputTranscript,
    Interrupted,
    SpeechStarted,
    SpeechStopped,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from voice_serving import QUESTION, spoken, words, write_wav
from voice_waits import until

import voice.config
from voice.asr import WhisperRecognizer
from voice.audio import REALTIME_RATE, SPEECH_RATE, encode_pcm16, resample

pytestmark = [pytest.mark.model, pytest.mark.timeout(600)]

NOWHERE = "http://127.0.0.1:9"  # nothing listens: every turn and every utterance goes to the device
WAIT_S = 240.0  # for the models on a busy 2-core machine
LIGHTS = {"type": "function", "name": "turn_on_lights", "description": "Turn on the lights in a room.",
          "parameters": {"type": "object", "properties": {"room": {"type": "string"}}, "required": ["room"],
                         "additionalProperties": False}}



@pytest.fixture(scope="module")
def question_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The question at 16 kHz, flite's own rate: the SDK resamples it to the API's 24 kHz."""
    return write_wav(tmp_path_factory.mktemp("device-voice") / "question.wav", spoken(rate=16_000), 16_000)


@pytest.fixture(scope="module")
def recognizer() -> Iterator[WhisperRecognizer]:
    yield WhisperRecognizer(threads=1, workers=1)


def device_client(max_output_tokens: int = 48, **options: Any) -> RealtimeClient:
    return RealtimeClient(NOWHERE, connect_timeout=2, silence_timeout=WAIT_S, retry_online_s=3600.0,
                          backoff=Backoff(attempts=1),
                          offline=OfflineConfig(max_output_tokens=max_output_tokens, temperature=0.0), **options)


def similar(a: list[str], b: list[str]) -> float:
    return difflib.SequenceMatcher(a=a, b=b).ratio()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_spoken_question_is_heard_answered_and_spoken_back_on_the_device(
        question_wav: Path, recognizer: WhisperRecognizer) -> None:
    player = RealTimePlayer()
    async with device_client(player=player) as c:
        assert not c.online
        await c.update_session(output_modalities=["audio"], voice="marin")  # server VAD: the default
        sent_ms = await c.speak(question_wav, speed=None)
        turn = await c.next_turn(timeout=WAIT_S)
        transcript, audio, order = "", bytearray(), []
        async with asyncio.timeout(WAIT_S):
            async for event in turn.events():
                order.append(type(event).__name__)
                if isinstance(event, TranscriptDelta):
                    transcript += event.text
                elif isinstance(event, AudioDelta):
                    audio += event.pcm
        result = await turn.result()
        heard, before = await until(c.voice_events(), InputTranscript)
        conversation = [(i.role, i.text) for i in c.conversation]
        online = c.online
    assert sent_ms >= 4000 and not online  # the file (3.5 s) and a second of silence; never the gateway
    kinds = [type(e) for e in before]
    assert kinds.index(SpeechStarted) < kinds.index(SpeechStopped) < kinds.index(AudioCommitted) \
        < kinds.index(TurnStarted)
    assert words(heard.transcript) == words(QUESTION) and turn.user_transcript == heard.transcript
    assert result.offline and result.tier == "device" and result.status in ("completed", "incomplete"), result
    assert result.text == transcript and words(transcript)
    assert order[0] == "InputTranscript" and order.index("TranscriptDelta") < order.index("AudioDelta")
    assert len(audio) == turn.audio_bytes > 0 and player.queued_ms == len(audio) / 48 and player.stops == 0
    said = recognizer.transcribe(resample(np.frombuffer(bytes(audio), "<i2").astype(np.int16), REALTIME_RATE,
                                          SPEECH_RATE)).text
    assert similar(words(said), words(transcript)) >= 0.75, (said, transcript)  # the audio says the answer
    assert conversation == [("user", heard.transcript), ("assistant", result.text)]


async def test_talking_over_the_device_answer_keeps_only_the_words_played(monkeypatch: pytest.MonkeyPatch) -> None:
    prompts: list[list[tuple[str, str]]] = []
    prepare = OfflineModel.prepare

    async def spy(self: OfflineModel, instructions: str, items: Any, *args: Any) -> Any:
        prompts.append([(i.role, i.text) for i in items])
        return await prepare(self, instructions, items, *args)

    monkeypatch.setattr(OfflineModel, "prepare", spy)
    clock = Clock()
    player = RealTimePlayer(clock)  # plays when the test says: 1.2 s of the answer, exactly
    story = encode_pcm16(spoken("Tell me a long story about a dragon and a knight."))
    interruption = encode_pcm16(spoken("Stop, please.", before_ms=0))
    async with device_client(max_output_tokens=160, player=player) as c:
        await c.update_session(output_modalities=["audio"])
        await c.append_audio(story)
        turn = await c.next_turn(timeout=WAIT_S)
        received = 0
        async with asyncio.timeout(WAIT_S):
            async for event in turn.events():
                if isinstance(event, AudioDelta):
                    received += len(event.pcm)
                    if received >= 48 * 1500:  # 1.5 s of the answer's audio is here
                        break
        clock.now += 1.2
        await c.append_audio(interruption)  # the user talks over it (and stops: the next turn begins)
        result = await turn.result()
        interrupted, _ = await until(c.voice_events(), Interrupted)
        kept = c.protocol.message(interrupted.item_id)
        second = await c.next_turn(timeout=WAIT_S)
        answer = await second.result()
    assert received >= 48 * 1500, "the answer was too short to talk over"
    assert interrupted.audio_end_ms == 1200 and player.stops == 1
    if result.status == "cancelled":  # still speaking when the user started: it stopped at once
        assert result.reason == "turn_detected"
    said = result.text  # what the device had said (sent) when it stopped
    assert kept is not None and kept.text == interrupted.text
    assert said.startswith(kept.text) and 0 < len(kept.text) < len(said)
    assert said[len(kept.text)].isspace()  # whole words
    assert 1 <= len(words(kept.text)) <= 8  # about a second of flite's speech
    assert answer.offline and answer.status in ("completed", "incomplete") and answer.text.strip()
    # The interruption was answered from what was heard, not from what the device had said.
    assert len(prompts) == 2 and prompts[1][1] == ("assistant", kept.text) and prompts[1][0][0] == "user"
    assert [role for role, _ in prompts[1]] == ["user", "assistant", "user"]
    assert words(prompts[1][2][1]) == ["stop", "please"]


async def test_push_to_talk_on_the_device_calls_the_sessions_tool(question_wav: Path) -> None:
    async with device_client(tools=[LIGHTS], tool_choice="required", parallel_tool_calls=False) as c:
        await c.update_session(turn_detection=None)  # push to talk; answers in text (the default)
        with pytest.raises(GatewayError, match="input_audio_buffer_commit_empty"):
            await c.commit_audio()
        await c.speak(question_wav, speed=None, trailing_silence_ms=0)
        turn = await c.respond(max_output_tokens=80, temperature=0.0)
        events = [e async for e in turn.events()]
        result = await turn.result()
        kinds = [i.type for i in c.conversation]
    transcripts = [e for e in events if isinstance(e, InputTranscript)]
    assert len(transcripts) == 1 and words(transcripts[0].transcript) == words(QUESTION)
    assert result.offline and result.status == "completed", result
    [call] = result.calls
    assert call.name == "turn_on_lights" and call.complete and isinstance(call.parsed["room"], str)
    assert [e for e in events if isinstance(e, FunctionCall)] == [call]
    assert not any(isinstance(e, AudioDelta) for e in events)
    assert kinds == ["message", "function_call"]


async def test_without_flite_the_error_says_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    speech = encode_pcm16(spoken(after_ms=0))  # made while flite is still there
    # flite's library where the device looks for it is gone (as without Debian's flite package)
    monkeypatch.setattr(voice.config, "VoiceConfig",
                        functools.partial(voice.config.VoiceConfig, tts_library=str(tmp_path / "libflite.so.1")))
    async with device_client() as c:
        for _ in range(2):  # the client goes on; the next utterance says it again
            with pytest.raises(OfflineVoiceError, match=r"offline voice needs the voice models: no flite library "
                                                        r"at ") as e:
                await c.append_audio(speech)
            assert "apt-get install flite" in str(e.value)


def test_without_the_voice_package_the_error_names_what_to_install() -> None:
    """As an app that installed the SDK alone sees it: text offline is not its concern here."""
    script = textwrap.dedent("""
        import asyncio, sys
        sys.modules["voice"] = None  # as if not installed: importing it raises ImportError
        from rtgw import Backoff, OfflineConfig, OfflineModelError, RealtimeClient

        async def main():
            async with RealtimeClient("http://127.0.0.1:9", connect_timeout=2, offline=OfflineConfig(),
                                      backoff=Backoff(attempts=1)) as client:
                try:
                    await client.append_audio(bytes(4800))
                except OfflineModelError as e:
                    print("RAISED", type(e).__name__, e)

        asyncio.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "RAISED OfflineVoiceError offline voice needs the voice models, which are not importable" in out.stdout
    assert "pip install 'faster-whisper==1.2.1'" in out.stdout and "apt-get install flite" in out.stdout
