"""The on-device voice's parts without models: a spoken device answer told as the gateway's events,
the session's voice settings, the input buffer, phrases sent in order and before a call, and the
client's offline voice flow (server VAD, push to talk, barge-in cut to the words played) on a
stand-in voice service (scripted VAD, fixed transcripts, 10 ms of audio a character) and a
stand-in device model. The real models: ``test_offline_voice.py``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import pytest
from rtgw import Backoff, ClientProtocol, GatewayError, OfflineConfig, RealtimeClient, TextDelta
from rtgw.audio import RealTimePlayer, silence
from rtgw.device_response import DeviceResponse
from rtgw.device_voice import (
    EAGERNESS_SILENCE_MS as DEVICE_EAGERNESS_SILENCE_MS,
)
from rtgw.device_voice import (
    DeviceVoice,
    InputBuffer,
    SpokenOutput,
    TurnDetection,
    speaks,
    turn_detection,
    voice_name,
)
from rtgw.errors import OfflineVoiceError
from rtgw.offline import DeviceRequest
from rtgw.protocol import FunctionCall, TranscriptDelta, TurnResult, new_id
from rtgw.settings import session_fields
from rtgw.turn import TurnStarted
from rtgw.voice import VoiceEvent
from rtgw.voice_events import (
    AudioCommitted,
    AudioDelta,
    InputTranscript,
    Interrupted,
    SpeechStarted,
    SpeechStopped,
)

from voice.phrases import PhraseSplitter
from voice.vad import SpeechStarted as VadStarted
from voice.vad import SpeechStopped as VadStopped

E = TypeVar("E")
MS_PER_CHAR = 10  # the stand-in synthesizer's speech: 10 ms a character
LOUD = 8000


def test_a_spoken_device_answer_is_told_as_the_gateways_audio_events() -> None:
    ids = iter(["item_a"])
    device = DeviceResponse("resp_1", ids=lambda prefix: next(ids), audio=True)
    pcm = silence(1200)  # 1.2 s: three deltas of at most 500 ms
    protocol = ClientProtocol()
    typed = [t for e in device.created() + device.spoken("Hello there. ", pcm) for t in protocol.receive(e)]
    assert typed[0] == TranscriptDelta("resp_1", "Hello there. ", "item_a")
    assert [len(t.pcm) for t in typed[1:]] == [24_000, 24_000, 9_600]
    assert all(isinstance(t, AudioDelta) and t.item_id == "item_a" for t in typed[1:])
    assert b"".join(t.pcm for t in typed[1:]) == pcm
    done = device.finish("completed")
    assert [e["type"] for e in done] == ["response.output_audio.done", "response.output_audio_transcript.done",
                                         "response.content_part.done", "response.output_item.done",
                                         "conversation.item.done", "response.done"]
    [result] = [t for e in done for t in protocol.receive(e)]
    assert isinstance(result, TurnResult) and result.text == "Hello there. " and result.item_id == "item_a"
    assert done[-1]["response"]["output"][0]["content"] == [{"type": "output_audio", "transcript": "Hello there. "}]
    assert [(i.role, i.text) for i in protocol.items] == [("assistant", "Hello there. ")]


def test_the_sessions_voice_settings_as_the_device_reads_them() -> None:
    assert turn_detection({}) == TurnDetection()  # server VAD, the API's default
    assert turn_detection(session_fields({"turn_detection": None})) is None  # push to talk
    assert turn_detection(session_fields({"turn_detection": {"type": "server_vad", "silence_duration_ms": 800,
                                                             "create_response": False}})) == \
        TurnDetection(silence_duration_ms=800, create_response=False)
    # semantic_vad: server VAD whose silence follows the eagerness, as on the gateway
    assert turn_detection(session_fields({"turn_detection": "semantic_vad"})) == \
        TurnDetection(silence_duration_ms=600, kind="semantic_vad", eagerness="auto")
    assert turn_detection(session_fields({"turn_detection": {"type": "semantic_vad", "eagerness": "high",
                                                             "interrupt_response": False}})) == \
        TurnDetection(silence_duration_ms=300, interrupt_response=False, kind="semantic_vad", eagerness="high")
    with pytest.raises(OfflineVoiceError, match="eagerness must be one of"):
        turn_detection(session_fields({"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}))
    with pytest.raises(OfflineVoiceError, match="silence_duration_ms apply to server_vad only"):
        turn_detection(session_fields({"turn_detection": {"type": "semantic_vad", "silence_duration_ms": 200}}))
    with pytest.raises(OfflineVoiceError, match="server_vad, semantic_vad or push to talk"):
        turn_detection(session_fields({"turn_detection": "webrtc_vad"}))
    session = session_fields({"output_modalities": "audio", "voice": "ash"})
    assert speaks(session, {}) and not speaks(session, {"output_modalities": ["text"]}) and not speaks({}, {})
    assert voice_name(session, {}) == "ash" and voice_name(session, {"audio": {"output": {"voice": "cedar"}}}) == "cedar"


def test_the_devices_eagerness_table_is_the_gateways() -> None:
    # The SDK keeps its own copy (it cannot import the gateway): the two must not drift apart.
    from gateway.ws.audio_events import EAGERNESS, EAGERNESS_SILENCE_MS

    assert DEVICE_EAGERNESS_SILENCE_MS == EAGERNESS_SILENCE_MS
    assert set(DEVICE_EAGERNESS_SILENCE_MS) == set(EAGERNESS)


def test_the_input_buffer_takes_a_span_and_drops_what_is_before_it() -> None:
    buffer = InputBuffer()
    buffer.add(bytes(range(96)) * 5)  # 10 ms
    assert buffer.take(2, 5) == (bytes(range(96)) * 5)[96:240] and buffer.start_ms == 5
    assert buffer.buffered_ms == 5 and buffer.total_ms == 10
    buffer.drop_before(100)
    assert buffer.buffered_ms == 0 and buffer.start_ms == 10


# --- stand-ins ------------------------------------------------------------------------------------


class ScriptedVad:
    """Speech is a 10 ms window with a sample over half of LOUD; it stops after 200 ms without one."""

    def __init__(self) -> None:
        self.ms = 0
        self.start: int | None = None
        self.quiet_since: int | None = None

    def feed(self, samples: np.ndarray) -> list[Any]:
        events: list[Any] = []
        for window in samples.reshape(-1, 240):  # whole 10 ms windows: the tests send whole ones
            self.ms += 10
            if np.abs(window.astype(np.int32)).max() > LOUD // 2:
                self.quiet_since = None
                if self.start is None:
                    self.start = self.ms - 10
                    events.append(VadStarted(self.start, self.start))
            elif self.start is not None:
                self.quiet_since = self.ms - 10 if self.quiet_since is None else self.quiet_since
                if self.ms - self.quiet_since >= 200:
                    self.start = None
                    events.append(VadStopped(self.ms, self.quiet_since))
        return events


class Identity:
    def feed(self, samples: np.ndarray) -> np.ndarray:
        return samples


@dataclass
class Phrase:
    pcm: np.ndarray
    marks: tuple[tuple[int, int], ...] = ()


@dataclass
class FakeService:
    transcripts: list[str]
    said: list[str] = field(default_factory=list)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)  # a phrase's synthesis waits for its gate
    broken: bool = False  # synthesis fails, as flite exiting with an error would

    def segmenter(self, params: Any) -> ScriptedVad:
        return ScriptedVad()

    def input_resampler(self) -> Identity:
        return Identity()

    def phrase_splitter(self) -> PhraseSplitter:
        return PhraseSplitter()

    async def transcribe(self, pcm: np.ndarray) -> Any:
        return type("T", (), {"text": self.transcripts.pop(0)})

    async def speak(self, text: str, voice: str | None = None) -> Phrase:
        gate = self.gates.get(text.strip())
        if gate is not None:
            await gate.wait()
        if self.broken:
            raise RuntimeError("flite exited with 1")
        self.said.append(text)
        return Phrase(np.full(len(text) * MS_PER_CHAR * 24, 100, np.int16))

    def close(self) -> None:
        pass


class FakeModel:
    """The device model: each answer's words as deltas; with ``hold``, the first answer then waits
    until it is cancelled."""

    def __init__(self, *answers: list[str], hold: bool = False) -> None:
        self.answers = list(answers)
        self.hold = hold
        self.prompts: list[list[tuple[str, str]]] = []
        self.last_usage: dict[str, int] = {}

    async def prepare(self, instructions: str, items: Any, session: Any, response: Any) -> DeviceRequest:
        self.prompts.append([(i.role, i.text) for i in items])
        return DeviceRequest([], "", None)

    async def generate(self, request: Any, **options: Any) -> AsyncIterator[tuple[str, str | None]]:
        for word in self.answers.pop(0):
            yield word, None
        if self.hold:
            self.hold = False
            await asyncio.Event().wait()
        yield "", "stop"

    async def close(self) -> None:
        pass


def device_client(model: FakeModel, service: FakeService, **options: Any) -> RealtimeClient:
    client = RealtimeClient("http://127.0.0.1:9", connect_timeout=2, offline=OfflineConfig(), retry_online_s=3600.0,
                            backoff=Backoff(attempts=1), **options)
    assert client._device is not None
    client._device.model = model  # type: ignore[assignment]
    client._device.device_voice = DeviceVoice(service, new_id)
    return client


def speech(ms: int) -> bytes:
    return np.full(ms * 24, LOUD, "<i2").tobytes()


async def until(events: AsyncIterator[VoiceEvent], kind: type[E]) -> tuple[E, list[VoiceEvent]]:
    seen: list[VoiceEvent] = []
    async with asyncio.timeout(10):
        async for event in events:
            seen.append(event)
            if isinstance(event, kind):
                return event, seen
    raise AssertionError("the voice events ended")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- the client's offline voice ----------------------------------------------------------------


async def test_speech_is_committed_transcribed_and_answered_on_the_device_and_spoken() -> None:
    service = FakeService(["Turn on the lights."])
    model = FakeModel(["The ", "lights ", "are ", "on. ", "Anything ", "else?"])
    player = RealTimePlayer()
    async with device_client(model, service, player=player) as c:
        await c.update_session(output_modalities=["audio"], voice="ash")
        await c.append_audio(silence(300) + speech(500) + silence(300))
        turn = await c.next_turn(timeout=10)
        events = [e async for e in turn.events()]
        result = await turn.result()
        _, seen = await until(c.voice_events(), InputTranscript)
    kinds = [type(e) for e in seen]
    assert kinds[:4] == [SpeechStarted, SpeechStopped, AudioCommitted, TurnStarted]
    assert seen[0].audio_start_ms == 300 and seen[1].audio_end_ms == 1000  # type: ignore[union-attr]
    assert result.offline and result.tier == "device" and result.status == "completed"
    assert result.text == "The lights are on. Anything else?" and service.said == ["The lights are on.",
                                                                                   " Anything else?"]
    assert [type(e) for e in events] == [InputTranscript, TranscriptDelta, AudioDelta, TranscriptDelta, AudioDelta]
    assert turn.user_transcript == "Turn on the lights."
    assert player.queued_ms == len(result.text) * MS_PER_CHAR == turn.audio_bytes / 48
    assert model.prompts == [[("user", "Turn on the lights.")]]
    assert [(i.role, i.text) for i in c.conversation] == [("user", "Turn on the lights."), ("assistant", result.text)]


async def test_talking_over_a_device_answer_cancels_it_and_keeps_the_words_played() -> None:
    service = FakeService(["Tell me a story.", "Stop."])
    model = FakeModel(["Once upon a time, ", "a keeper ", "lived by the sea. ", "Every "], ["Sorry."], hold=True)
    clock = Clock()
    async with device_client(model, service, player=RealTimePlayer(clock)) as c:
        await c.update_session(output_modalities=["audio"])
        await c.append_audio(speech(400) + silence(300))
        turn = await c.next_turn(timeout=10)
        received = 0
        async for event in turn.events():
            if isinstance(event, AudioDelta):
                received += len(event.pcm)
                if received >= 48 * 250:
                    break
        clock.now += 0.22  # 220 ms played: "time," ends at 170 ms, then " a" at 190 ms, " keeper" at 260 ms
        await c.append_audio(speech(300) + silence(300))  # the user talks over it, and stops, in one append
        result = await turn.result()
        interrupted, _ = await until(c.voice_events(), Interrupted)
        kept = c.protocol.message(interrupted.item_id)
        second = await c.next_turn(timeout=10)  # answered once the cut one has ended
        answer = await second.result()
    assert result.status == "cancelled" and result.reason == "turn_detected" and result.offline
    assert answer.status == "completed" and answer.text == "Sorry."
    assert interrupted.audio_end_ms == 220 and interrupted.text == "Once upon a time, a"
    assert kept is not None and kept.text == interrupted.text and result.text.startswith(kept.text)
    assert c.player is not None and c.player.stops == 1  # type: ignore[attr-defined]
    assert model.prompts[1] == [("user", "Tell me a story."), ("assistant", "Once upon a time, a"), ("user", "Stop.")]


async def test_push_to_talk_on_the_device_answers_in_text() -> None:
    service = FakeService(["What time is it?"])
    model = FakeModel(["It ", "is ", "noon."])
    async with device_client(model, service) as c:
        await c.update_session(turn_detection=None)
        await c.append_audio(speech(50))
        with pytest.raises(GatewayError, match="input_audio_buffer_commit_empty"):
            await c.commit_audio()  # 50 ms: too little to be a turn
        await c.append_audio(speech(500))
        turn = await c.respond()
        events = [e async for e in turn.events()]
        result = await turn.result()
    assert [type(e) for e in events] == [InputTranscript, TextDelta]
    assert result.text == "It is noon." and result.offline and service.said == []
    assert model.prompts == [[("user", "What time is it?")]]


@dataclass(frozen=True)
class ParserEvent:
    kind: str
    text: str = ""
    index: int = 0
    name: str = ""
    delta: str = ""
    arguments: str = ""
    complete: bool = True


async def test_phrases_go_out_in_order_and_before_a_call() -> None:
    service = FakeService([])
    voice = DeviceVoice(service, new_id)
    first = service.gates["First phrase here."] = asyncio.Event()
    sent: list[dict[str, Any]] = []
    ids = iter(["item_m", "item_c", "call_1"])
    device = DeviceResponse("resp_1", ids=lambda prefix: next(ids), audio=True)

    async def ready() -> DeviceVoice:
        return voice

    out = SpokenOutput(device, sent.extend, ready, None)
    await out.ready()
    await out.write("First phrase here. Second one. ")  # the first phrase's synthesis waits at its gate
    await out._jobs[1][1]  # the second phrase's audio is made...
    assert sent == [] and service.said == [" Second one."]  # ... and not sent before the first's
    first.set()
    await out.write([ParserEvent("call_started", name="lights"), ParserEvent("call_done", arguments="{}")])
    kinds = [e["type"] for e in sent]
    assert kinds.index("response.output_audio_transcript.delta") < kinds.index("response.function_call_arguments.done")
    said = [e["delta"] for e in sent if e["type"] == "response.output_audio_transcript.delta"]
    assert said == ["First phrase here.", " Second one."]
    assert voice.heard("item_m", 10_000) == "First phrase here. Second one."
    protocol = ClientProtocol()
    calls = [t for e in sent for t in protocol.receive(e) if isinstance(t, FunctionCall)]
    assert [c.name for c in calls] == ["lights"]


async def test_a_cancelled_answer_says_nothing_more() -> None:
    service = FakeService([])
    voice = DeviceVoice(service, new_id)
    gate = service.gates["Not yet said."] = asyncio.Event()
    sent: list[dict[str, Any]] = []

    async def ready() -> DeviceVoice:
        return voice

    out = SpokenOutput(DeviceResponse("resp_1", audio=True), sent.extend, ready, None)
    await out.ready()
    await out.write("Not yet said. ")
    jobs = [job for _, job in out._jobs]
    out.close()
    gate.set()
    await asyncio.wait(jobs)  # the synthesis under way ends cancelled
    out.leftover([ParserEvent("text", text="held back")])
    assert sent == [] and service.said == []


async def test_a_typed_turn_is_spoken_too_and_a_synthesis_failure_fails_it_saying_why() -> None:
    service = FakeService([])
    model = FakeModel(["Hello ", "there."], ["Again."])
    async with device_client(model, service, player=RealTimePlayer()) as c:
        await c.update_session(output_modalities=["audio"])
        turn = await c.send("Hi!")
        kinds = [type(e) async for e in turn.events()]
        result = await turn.result()
        service.broken = True
        failing = await c.send("Once more.")
        with pytest.raises(OfflineVoiceError, match="the on-device speech failed: flite exited with 1"):
            await failing.result()
    assert kinds == [TranscriptDelta, AudioDelta] and result.text == "Hello there." and result.offline
