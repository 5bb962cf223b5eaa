"""The Python SDK's voice parts without a gateway: session settings, WAV reading and resampling,
the clock-paced player, the protocol core on literal audio events, a turn's voice events, and
the barge-in decisions of the client fed server events by hand (a stand-in for the socket that
answers a truncate and a retrieve as the gateway does)."""

from __future__ import annotations

import asyncio
import base64
import threading
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rtgw import ClientProtocol, RealtimeClient, TextDelta
from rtgw.audio import RealTimePlayer, read_wav, resample, silence, write_wav
from rtgw.protocol import ItemTruncated, TranscriptDelta
from rtgw.settings import merge_session, session_fields
from rtgw.sound import SoundDevicePlayer, microphone
from rtgw.voice_events import AudioDelta, InputTranscript, Interrupted, SpeechStarted


def test_voice_settings_become_the_ga_audio_object_and_merge_for_later_sessions() -> None:
    assert session_fields({"output_modalities": "audio", "voice": "marin", "turn_detection": "server_vad"}) == {
        "output_modalities": ["audio"], "audio": {"output": {"voice": "marin"},
                                                  "input": {"turn_detection": {"type": "server_vad"}}}}
    assert session_fields({"turn_detection": None, "instructions": "Be brief."}) == {
        "instructions": "Be brief.", "audio": {"input": {"turn_detection": None}}}
    kept: dict[str, Any] = {}
    merge_session(kept, session_fields({"voice": "ash", "output_modalities": ["audio"]}))
    merge_session(kept, session_fields({"turn_detection": None}))  # the voice stays
    assert kept == {"output_modalities": ["audio"], "audio": {"output": {"voice": "ash"},
                                                              "input": {"turn_detection": None}}}


def tone(hz: float, rate: int, seconds: float) -> np.ndarray:
    return np.sin(2 * np.pi * hz * np.arange(int(rate * seconds)) / rate)


def dominant_hz(pcm: bytes, rate: int = 24_000) -> float:
    x = np.frombuffer(pcm, "<i2").astype(np.float64)
    return float(np.argmax(np.abs(np.fft.rfft(x))) * rate / len(x))


def test_a_stereo_24_bit_wav_at_44_1_khz_becomes_24_khz_mono_pcm16(tmp_path: Path) -> None:
    left, right = tone(440, 44_100, 1.0) * 0.5, tone(440, 44_100, 1.0) * 0.5
    ints = (np.stack([left, right], axis=1).reshape(-1) * 8388607).astype(np.int32)
    raw = np.stack([ints & 0xFF, (ints >> 8) & 0xFF, (ints >> 16) & 0xFF], axis=1).astype(np.uint8).tobytes()
    path = tmp_path / "stereo.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(3)
        w.setframerate(44_100)
        w.writeframes(raw)
    pcm = read_wav(path)
    assert len(pcm) == 24_000 * 2  # one second at 24 kHz, 16-bit
    assert abs(dominant_hz(pcm) - 440) <= 1
    peak = np.abs(np.frombuffer(pcm, "<i2")[1000:-1000]).max() / 32768
    assert 0.45 < peak < 0.55  # the level kept (channels averaged, the filter's gain 1)


def test_going_down_in_rate_filters_what_the_new_rate_cannot_hold() -> None:
    # 15 kHz at 48 kHz cannot exist at 24 kHz (Nyquist 12 kHz): filtered, not folded down to 9 kHz.
    high = resample(tone(15_000, 48_000, 0.5), 48_000, 24_000)
    low = resample(tone(1_000, 48_000, 0.5), 48_000, 24_000)
    assert np.abs(high[500:-500]).max() < 0.02 and np.abs(low[500:-500]).max() > 0.95
    assert len(resample(tone(440, 16_000, 1.0), 16_000, 24_000)) == 24_000


def test_write_then_read_is_the_same_pcm(tmp_path: Path) -> None:
    pcm = (tone(300, 24_000, 0.2) * 20_000).astype("<i2").tobytes()
    assert read_wav(write_wav(tmp_path / "x.wav", pcm)) == pcm


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_real_time_player_plays_at_the_clock_and_runs_dry() -> None:
    clock = Clock()
    player = RealTimePlayer(clock)
    queued = bytes(range(256)) * 96  # 512 ms
    player.play(queued)
    clock.now += 0.25  # (steps a float holds exactly)
    assert player.played_ms == 250 and player.audio == queued[:250 * 48]
    clock.now += 1.0
    assert player.played_ms == 512  # ran dry at the end of the queue
    player.play(silence(100))
    clock.now += 0.0625
    assert player.played_ms == 574.5  # the gap did not count
    player.stop()
    assert player.played_ms == 0 and player.queued_ms == 0 and player.stops == 1
    clock.now += 1
    assert player.played_ms == 0 and player.audio == queued + silence(62.5)


def test_the_protocol_reads_audio_transcripts_and_speech_events() -> None:
    protocol = ClientProtocol()
    pcm = silence(20)
    assert protocol.receive({"type": "input_audio_buffer.speech_started", "audio_start_ms": 480,
                             "item_id": "item_u"}) == [SpeechStarted(480, "item_u")]
    protocol.receive({"type": "conversation.item.added", "item": {
        "id": "item_u", "type": "message", "role": "user", "content": [{"type": "input_audio", "transcript": None}]}})
    assert protocol.receive({"type": "conversation.item.input_audio_transcription.completed", "item_id": "item_u",
                             "content_index": 0, "transcript": "Hi there."}) == [InputTranscript("item_u", "Hi there.")]
    protocol.receive({"type": "response.created", "response": {"id": "resp_1"}})
    protocol.receive({"type": "conversation.item.added", "item": {
        "id": "item_a", "type": "message", "role": "assistant", "content": []}})
    assert protocol.receive({"type": "response.output_audio_transcript.delta", "response_id": "resp_1",
                             "item_id": "item_a", "delta": "Hello."}) == [TranscriptDelta("resp_1", "Hello.", "item_a")]
    b64 = {"type": "response.output_audio.delta", "response_id": "resp_1", "item_id": "item_a",
           "delta": base64.b64encode(pcm).decode()}
    assert protocol.receive(b64) == [AudioDelta("resp_1", "item_a", pcm)]  # JSON: base64
    assert protocol.receive({**b64, "delta": pcm}) == [AudioDelta("resp_1", "item_a", pcm)]  # msgpack: raw bytes
    assert protocol.receive({**b64, "response_id": "resp_0"}) == []  # not the active response's
    [done] = protocol.receive({"type": "response.done", "response": {"id": "resp_1", "status": "completed", "output": [
        {"id": "item_a", "type": "message", "content": [{"type": "output_audio", "transcript": "Hello."}]}]}})
    assert done.text == "Hello." and done.item_id == "item_a"
    assert [(i.role, i.text) for i in protocol.items] == [("user", "Hi there."), ("assistant", "Hello.")]
    # A spoken item cut by audio_end_ms: the words kept are the server's to say (read back by retrieve).
    assert protocol.receive({"type": "conversation.item.truncated", "item_id": "item_a", "content_index": 0,
                             "audio_end_ms": 300}) == [ItemTruncated("item_a", "Hello.", 300)]


class HandFed:
    """A client whose socket is a list: what it sends is kept, and the gateway's answers to a
    truncate (``truncated_text`` kept) and a retrieve are fed back as the gateway sends them."""

    def __init__(self, **options: Any) -> None:
        self.client = RealtimeClient("http://127.0.0.1:9", **options)
        self.sent: list[dict[str, Any]] = []
        self.truncated_text = ""
        self.client._conn.ws = object()
        self.client._conn.send = self._send  # type: ignore[method-assign]

    async def _send(self, event: dict[str, Any]) -> None:
        self.sent.append(event)
        loop = asyncio.get_running_loop()
        if event["type"] == "conversation.item.truncate":
            loop.call_soon(self.feed, {"type": "conversation.item.truncated", "item_id": event["item_id"],
                                       "content_index": 0, "audio_end_ms": event["audio_end_ms"]})
        elif event["type"] == "conversation.item.retrieve":
            loop.call_soon(self.feed, {"type": "conversation.item.retrieved", "item": {
                "id": event["item_id"], "type": "message", "role": "assistant",
                "content": [{"type": "output_audio", "transcript": self.truncated_text}]}})

    def feed(self, *events: dict[str, Any]) -> None:
        for event in events:
            self.client._dispatch(event)

    def answer(self, n_deltas: int, *, done: bool) -> None:
        """A spoken answer the server started by itself: ``n_deltas`` of 100 ms each."""
        self.feed({"type": "response.created", "response": {"id": "resp_1"}},
                  {"type": "conversation.item.added", "item": {"id": "item_a", "type": "message",
                                                               "role": "assistant", "content": []}},
                  {"type": "response.output_audio_transcript.delta", "response_id": "resp_1", "item_id": "item_a",
                   "delta": "One two three."})
        for _ in range(n_deltas):
            self.feed({"type": "response.output_audio.delta", "response_id": "resp_1", "item_id": "item_a",
                       "delta": base64.b64encode(silence(100)).decode()})
        if done:
            self.feed({"type": "response.done", "response": {"id": "resp_1", "status": "completed", "output": [
                {"id": "item_a", "type": "message", "content": [{"type": "output_audio",
                                                                 "transcript": "One two three."}]}]}})

    def speech_started(self) -> None:
        self.feed({"type": "input_audio_buffer.speech_started", "audio_start_ms": 0, "item_id": "item_u"})

    def truncates(self) -> list[int]:
        return [e["audio_end_ms"] for e in self.sent if e["type"] == "conversation.item.truncate"]


async def next_interrupted(client: RealtimeClient) -> Interrupted:
    async with asyncio.timeout(10):
        async for event in client.voice_events():
            if isinstance(event, Interrupted):
                return event
    raise AssertionError("no Interrupted event")


async def test_a_server_started_answer_is_a_turn_and_barge_in_truncates_to_the_players_count() -> None:
    clock = Clock()
    fed = HandFed(player=RealTimePlayer(clock))
    fed.truncated_text = "One"
    fed.answer(5, done=True)  # 500 ms received, and the response is over: it still plays
    turn = await fed.client.next_turn(timeout=1)
    assert [type(e) async for e in turn.events()] == [TranscriptDelta] + [AudioDelta] * 5
    clock.now += 0.3125
    fed.speech_started()
    interrupted = await next_interrupted(fed.client)
    assert fed.truncates() == [312] and interrupted == Interrupted("item_a", 312, "One")  # whole ms played
    assert fed.client.player is not None and fed.client.player.stops == 1  # type: ignore[attr-defined]
    assert fed.client.protocol.message("item_a").text == "One"  # type: ignore[union-attr]


async def test_no_truncate_once_the_answer_was_all_heard_or_when_nothing_counts_what_was() -> None:
    clock = Clock()
    fed = HandFed(player=RealTimePlayer(clock))
    fed.answer(3, done=True)
    clock.now += 1.0  # all 300 ms played
    fed.speech_started()
    assert fed.truncates() == [] and fed.client.player.stops == 0  # type: ignore[union-attr]

    unplayed = HandFed()  # no player, and the application never said what it played
    unplayed.answer(3, done=False)
    unplayed.speech_started()
    assert unplayed.truncates() == []


async def test_the_applications_own_count_decides_the_cut_without_a_player() -> None:
    fed = HandFed()
    fed.truncated_text = "One two"
    fed.answer(4, done=False)  # still coming
    fed.client.played(250)
    assert fed.client.played_ms == 250
    fed.speech_started()
    fed.feed({"type": "response.done", "response": {"id": "resp_1", "status": "cancelled",
                                                    "status_details": {"reason": "turn_detected"}, "output": []}})
    assert (await next_interrupted(fed.client)).audio_end_ms == 250 and fed.truncates() == [250]


def test_a_turn_reads_a_spoken_answer_as_text_too() -> None:
    async def run() -> list[str]:
        fed = HandFed()
        fed.answer(2, done=True)
        turn = await fed.client.next_turn(timeout=1)
        return [d.text async for d in turn if isinstance(d, TextDelta)]

    assert asyncio.run(run()) == ["One two three."]


class FakeSoundDevice:
    """sounddevice's raw streams, driven by hand: ``output`` is the player's stream (its callback
    pulls frames), an input stream sends ``recorded`` when started."""

    def __init__(self, recorded: list[bytes] = ()) -> None:  # type: ignore[assignment]
        self.recorded = list(recorded)
        self.output: Any = None
        test = self

        class Stream:
            latency = 0.01  # 10 ms in the device's buffers

            def __init__(self, **options: Any) -> None:
                self.options = options
                self.started = self.closed = False

            def start(self) -> None:
                self.started = True
                if "blocksize" in self.options:  # the microphone: its blocks, from PortAudio's thread
                    callback = self.options["callback"]
                    blocks = test.recorded
                    threading.Thread(target=lambda: [callback(b, len(b) // 2, None, None) for b in blocks]).start()

            def stop(self) -> None:
                self.started = False

            def close(self) -> None:
                self.closed = True

        class RawOutputStream(Stream):
            def __init__(self, **options: Any) -> None:
                super().__init__(**options)
                test.output = self

        self.RawOutputStream = RawOutputStream
        self.RawInputStream = Stream


def test_the_sound_device_player_counts_what_the_device_took_less_its_latency() -> None:
    sd = FakeSoundDevice()
    player = SoundDevicePlayer(sd=sd)
    player.play(b"\x01\x00" * 2400)  # 100 ms
    assert sd.output.options["samplerate"] == 24_000 and sd.output.started
    out = bytearray(960 * 2)  # the device asks for 40 ms
    sd.output.options["callback"](out, 960, None, None)
    assert bytes(out) == b"\x01\x00" * 960 and player.played_ms == pytest.approx(30)
    player.stop()  # what was queued is dropped; the count starts again
    sd.output.options["callback"](out, 960, None, None)
    assert bytes(out) == bytes(1920) and player.played_ms == 0  # silence when dry, not counted


async def test_the_microphone_yields_24_khz_chunks_until_left() -> None:
    blocks = [bytes([n]) * 4800 for n in range(3)]
    sd = FakeSoundDevice(blocks)
    got = []
    async with asyncio.timeout(10):
        async for chunk in microphone(sd=sd):
            got.append(chunk)
            if len(got) == 3:
                break
    assert got == blocks
