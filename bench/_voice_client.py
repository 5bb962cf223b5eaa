"""A voice client for bench/voice_sessions.py: a real-time microphone and a simulated speaker on one
Realtime WebSocket (JSON frames, base64 audio, as the official SDKs send it).

The microphone task sends ``CHUNK_MS`` of audio every ``CHUNK_MS`` of wall time, on absolute
deadlines (no drift): silence, or the utterance queued by ``turn``; in the session's format both
ways (PCM16 at 24 kHz, or G.711 at 8 kHz as a phone line sends it: ``wire_format``). The reader task
records when each response's first audio arrives and what the answer said. A turn measures
``first_audio_ms`` from the moment its last speech sample left; a barge-in turn speaks again
400 ms into the answer and measures until the answer's cancelled ``response.done``, then
truncates the answer at what a real-time player would have played and reads back what the
server kept.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import websockets

from bench._common import BenchError
from voice.formats import G711, PCM16, SESSION_BYTES_PER_MS, AudioFormat

CHUNK_MS = 40
ONSET_LEVEL = 328  # -40 dBFS: where a clip's voice begins
# The user talks over the answer this long after it starts playing, turn after turn: the cut lands
# in the first word, mid-sentence, and later.
BARGE_AFTER_S = (0.4, 0.9, 1.5, 2.2)
TURN_TIMEOUT_S = 120.0
LONG_ANSWER_TOKENS = 400  # a barge-in turn's answer: still being generated when the user talks over it
# After an answer has played, the user replies this much later (people take turns ~0.2-0.5 s apart
# in conversation; a voice app's user, thinking of the next question, rather more).
REPLY_GAP_S = 0.5


def speech_clips(texts: list[str]) -> dict[str, bytes]:
    """flite's speech for each text, as 24 kHz PCM16 (a client's microphone rate), from its
    first audible sample (flite leads with ~0.2 s of silence: a barge-in is timed from the voice)."""
    from voice.audio import REALTIME_RATE, resample, to_int16
    from voice.tts import FliteSynthesizer

    flite = FliteSynthesizer()
    clips = {}
    for text in texts:
        made = flite.synthesize(text, "alloy")
        samples = to_int16(resample(made.samples, made.sample_rate, REALTIME_RATE))
        loud = np.flatnonzero(np.abs(samples.astype(np.int32)) > ONSET_LEVEL)
        clips[text] = samples[loud[0] if loud.size else 0:].astype("<i2").tobytes()
    return clips


def session_pcm(fmt: AudioFormat, audio: bytes) -> bytes:
    """Audio as received, as 24 kHz PCM16 for the aligners: G.711 decoded and resampled whole
    (no delay, unlike a session's streaming filter, so word ends keep their ms)."""
    if not isinstance(fmt, G711):
        return audio
    from voice.audio import REALTIME_RATE, resample, to_int16

    return to_int16(resample(fmt.decode(audio), fmt.rate, REALTIME_RATE)).astype("<i2").tobytes()


@dataclass
class Cut:
    played_ms: int  # where the client truncated the answer
    # All of the answer's audio that arrived (past the cut too: an aligner shown only the audio up
    # to the cut hears the word being said there as a whole word ending at the cut)
    audio: bytes  # 24 kHz PCM16, whatever the wire carried
    transcript: str  # the text of that audio (its transcript deltas)
    stored: str  # the transcript the server kept


@dataclass
class TurnResult:
    first_audio_ms: float
    # from the end of speech: the server's speech_stopped, its transcript (what the first audio waited for)
    stopped_ms: float | None = None
    transcribed_ms: float | None = None
    barge_in_ms: float | None = None
    cut: Cut | None = None
    heard: str | None = None  # the question's transcript, when it came before the first audio


@dataclass
class _Response:
    first_audio_at: float | None = None
    audio: bytearray = field(default_factory=bytearray)
    transcript: str = ""
    item_id: str | None = None
    done: asyncio.Future[dict[str, Any]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    first_audio: asyncio.Event = field(default_factory=asyncio.Event)
    commits: int = 0  # input_audio_buffer.committed events seen before it was created


class VoiceSession:
    def __init__(self, url: str, model: str, *, silence_ms: int, max_output_tokens: int,
                 api_key: str | None = None, wire_format: AudioFormat = PCM16,
                 eagerness: str | None = None, listen: bool = True) -> None:
        """``eagerness``: turn detection by ``semantic_vad`` with it (else server VAD with ``silence_ms``);
        ``listen``: a turn ends once its answer has played (else at its ``response.done``)."""
        self._listen = listen
        self._url = f"{url.replace('http', 'ws', 1)}/v1/realtime?model={model}"
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._silence_ms = silence_ms
        self._eagerness = eagerness
        self._commits = 0  # input_audio_buffer.committed events seen
        self._max_output_tokens = max_output_tokens
        self._format = wire_format
        self._ws: websockets.ClientConnection | None = None
        self._speech = bytearray()  # queued for the microphone
        self._spoken = asyncio.Event()  # the queued speech has been sent
        self._speech_started_at: float | None = None
        self._responses: dict[str, _Response] = {}
        self._new_response: asyncio.Queue[str] = asyncio.Queue()
        self._answers: dict[str, asyncio.Future[dict[str, Any]]] = {}  # event type -> the next one
        self._tasks: list[asyncio.Task[None]] = []
        self.error: str | None = None
        self._heard: str | None = None  # the last transcript
        self._barges = 0
        self._stopped_at: float | None = None  # the latest speech_stopped
        self._transcribed_at: float | None = None  # the latest transcript

    async def __aenter__(self) -> VoiceSession:
        self._ws = await websockets.connect(self._url, max_size=None, open_timeout=60,
                                            additional_headers=self._headers)
        await self._send({"type": "session.update", "session": {
            "type": "realtime", "output_modalities": ["audio"],
            "instructions": "You are a voice assistant. Answer in one short sentence.",
            "max_output_tokens": self._max_output_tokens,
            "audio": {"input": {"format": self._format.wire()}, "output": {"format": self._format.wire()}}}})
        await self._send(self._vad_update(create_response=True))
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._microphone())]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, websockets.ConnectionClosed):
                await task
        if self._ws is not None:
            await self._ws.close()

    async def turn(self, question: bytes, interruption: bytes | None = None) -> TurnResult:
        """One spoken question and its spoken answer; with ``interruption``, the user talks over the
        answer. Its answer must still be running then, so that turn asks for it itself: a long
        one (``x_ignore_eos``), where server VAD would have created a short one."""
        loop = asyncio.get_running_loop()
        self._heard = None
        if interruption is not None:
            await self._send(self._vad_update(create_response=False))
            committed = self._expect("input_audio_buffer.committed")
        end_of_speech = await self._say(question)
        if interruption is not None:
            await self._wait(committed)
            await self._send({"type": "response.create", "response": {"x_ignore_eos": True,
                                                                        "max_output_tokens": LONG_ANSWER_TOKENS}})
            await self._send(self._vad_update(create_response=True))  # the interruption gets its answer
        rid = await self._wait(self._new_response.get())
        response = self._responses[rid]
        await self._wait(response.first_audio.wait())
        assert response.first_audio_at is not None
        result = TurnResult(first_audio_ms=(response.first_audio_at - end_of_speech) * 1000,
                            stopped_ms=_since(self._stopped_at, end_of_speech),
                            transcribed_ms=_since(self._transcribed_at, end_of_speech), heard=self._heard)
        if interruption is None:
            await self._wait(response.done)
            await self._hear_out(response)
            return result
        await asyncio.sleep(BARGE_AFTER_S[self._barges % len(BARGE_AFTER_S)])
        self._barges += 1
        self._speech_started_at = None
        speaking = asyncio.create_task(self._say(interruption))
        self._tasks.append(speaking)
        done = await self._wait(response.done)
        if done["status"] != "cancelled":
            raise BenchError(f"a barge-in did not cancel the answer: it ended {done['status']}")
        assert self._speech_started_at is not None
        result.barge_in_ms = (loop.time() - self._speech_started_at) * 1000
        played = min(int((self._speech_started_at - response.first_audio_at) * 1000),
                     len(response.audio) // self._format.bytes_per_ms)
        await self._send({"type": "conversation.item.truncate", "item_id": response.item_id, "content_index": 0,
                          "audio_end_ms": played})
        await self._answer("conversation.item.truncated")
        await self._send({"type": "conversation.item.retrieve", "item_id": response.item_id})
        item = await self._answer("conversation.item.retrieved")
        result.cut = Cut(played, session_pcm(self._format, bytes(response.audio)), response.transcript,
                         item["item"]["content"][0]["transcript"])
        await speaking
        follow_up = await self._wait(self._new_response.get())  # the interruption is answered too
        await self._wait(self._responses[follow_up].done)
        await self._hear_out(self._responses[follow_up])
        return result

    async def paused_turn(self, before: bytes, pause_ms: int, after: bytes) -> bool:
        """One question said with a pause inside it (``before``, ``pause_ms`` of silence, ``after``),
        then its answer. True when the turn ended inside the pause: a commit came before the rest
        of the sentence was said (a false endpoint; the answer to the whole sentence is waited for)."""
        commits = self._commits
        await self._say(before)
        await asyncio.sleep(pause_ms / 1000)  # the microphone sends silence meanwhile
        await self._say(after)
        false_end = self._commits > commits  # a commit before the last word was said
        committed = self._expect("input_audio_buffer.committed")  # the whole sentence's (after a silence)
        await self._wait(committed)
        final = self._commits
        while True:  # answers started by a false endpoint come first in the queue: passed over
            rid = await self._wait(self._new_response.get())
            if self._responses[rid].commits >= final:
                await self._wait(self._responses[rid].done)
                return false_end

    # ----- internals ------------------------------------------------------------------------

    async def _hear_out(self, response: _Response) -> None:
        """Until ``response`` has played in real time from its first audio, and the user's reply
        gap after it (nothing when the client does not listen)."""
        if not self._listen or response.first_audio_at is None:
            return
        loop = asyncio.get_running_loop()
        played_at = response.first_audio_at + len(response.audio) / self._format.bytes_per_ms / 1000
        await asyncio.sleep(max(0.0, played_at + REPLY_GAP_S - loop.time()))

    async def _wait(self, awaitable: Any) -> Any:
        try:
            return await asyncio.wait_for(awaitable, TURN_TIMEOUT_S)
        except TimeoutError:
            raise BenchError(f"no answer within {TURN_TIMEOUT_S:.0f} s ({self.error or 'no error seen'})") from None

    def _expect(self, kind: str) -> asyncio.Future[dict[str, Any]]:
        """The next event of ``kind`` (ask before what causes it)."""
        future = self._answers[kind] = asyncio.get_running_loop().create_future()
        return future

    async def _answer(self, kind: str) -> dict[str, Any]:
        return await self._wait(self._expect(kind))

    def _vad_update(self, *, create_response: bool) -> dict[str, Any]:
        vad: dict[str, Any] = ({"type": "semantic_vad", "eagerness": self._eagerness} if self._eagerness else
                               {"type": "server_vad", "silence_duration_ms": self._silence_ms})
        return {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": {
            **vad, "create_response": create_response}}}}}

    async def _say(self, pcm: bytes) -> float:
        """Queue ``pcm`` (24 kHz) for the microphone; when its last sample was sent (loop time)."""
        self._spoken.clear()
        self._speech += self._format.from_session(pcm)
        await self._spoken.wait()
        return asyncio.get_running_loop().time()

    async def _send(self, event: dict[str, Any]) -> None:
        assert self._ws is not None
        await self._ws.send(json.dumps(event))

    async def _microphone(self) -> None:
        loop = asyncio.get_running_loop()
        size = CHUNK_MS * self._format.bytes_per_ms
        silence = self._format.from_session(bytes(CHUNK_MS * SESSION_BYTES_PER_MS))
        deadline = loop.time()
        while True:
            if self._speech:
                chunk, self._speech = bytes(self._speech[:size]), self._speech[size:]
                if self._speech_started_at is None:
                    self._speech_started_at = loop.time()
                chunk += silence[len(chunk):]
            else:
                chunk = silence
            await self._send({"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()})
            if not self._speech:
                self._spoken.set()
            deadline += CHUNK_MS / 1000
            await asyncio.sleep(max(deadline - loop.time(), 0))

    async def _read(self) -> None:
        assert self._ws is not None
        loop = asyncio.get_running_loop()
        async for frame in self._ws:
            event = json.loads(frame)
            kind = event["type"]
            if kind == "response.created":
                rid = event["response"]["id"]
                self._responses[rid] = _Response(commits=self._commits)
                self._new_response.put_nowait(rid)
            elif kind == "response.output_audio.delta":
                response = self._responses[event["response_id"]]
                if response.first_audio_at is None:
                    response.first_audio_at = loop.time()
                    response.item_id = event["item_id"]
                    response.first_audio.set()
                response.audio += base64.b64decode(event["delta"])
            elif kind == "response.output_audio_transcript.delta":
                self._responses[event["response_id"]].transcript += event["delta"]
            elif kind == "response.done":
                response = self._responses[event["response"]["id"]]
                if not response.done.done():
                    response.done.set_result(event["response"])
                if event["response"]["status"] == "failed":
                    self.error = str(event["response"]["status_details"])
            elif kind == "input_audio_buffer.committed":
                self._commits += 1
            elif kind == "input_audio_buffer.speech_stopped":
                self._stopped_at = loop.time()
            elif kind == "conversation.item.input_audio_transcription.completed":
                self._transcribed_at = loop.time()
                self._heard = event["transcript"]
            elif kind == "error":
                self.error = f"{event['error']['code']}: {event['error']['message']}"
            future = self._answers.pop(kind, None)
            if future is not None and not future.done():
                future.set_result(event)


def _since(at: float | None, start: float) -> float | None:
    return (at - start) * 1000 if at is not None and at >= start else None

