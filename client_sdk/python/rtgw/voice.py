"""Voice on a ``RealtimeClient``: audio in, spoken answers out, and barge-in.

    async with RealtimeClient(url, player=RealTimePlayer()) as client:
        await client.update_session(output_modalities=["audio"], voice="marin")  # server VAD is on by default
        await client.speak("question.wav")           # streamed as a microphone would, in real time
        turn = await client.next_turn()              # the answer the server started when the speech ended
        async for event in turn.events():            # TranscriptDelta, AudioDelta, InputTranscript
            ...

A mixin of ``RealtimeClient`` (its state, its socket); ``rtgw.voice_events`` has the event types.

**In**: ``append_audio`` sends PCM16 24 kHz mono (base64 in JSON, raw bytes on msgpack);
``speak`` streams a source (a WAV file, PCM bytes, an iterator of chunks, a microphone) paced at
real time (``speed``); ``commit_audio`` / ``clear_audio`` and ``respond`` (commit, then answer)
are push-to-talk (``turn_detection=None``). With server VAD the server commits the speech and
starts the answer itself: such a turn comes from ``next_turn()`` (and as ``TurnStarted`` in
``voice_events()``, with ``SpeechStarted``, ``SpeechStopped``, ``AudioCommitted``,
``InputTranscript``, ``Interrupted``).

**Out**: a spoken answer's ``AudioDelta`` events are in its turn and, when the client has a
``player``, played as they arrive. The client counts what was played of the answer's item: the
player's ``played_ms`` or, with no player, the ``played(ms)`` counter the application updates.

**Barge-in**: when the server hears speech start while an answer plays (or is still being
made), the server cancels the response (``turn_detected``) and the client stops the player and
sends ``conversation.item.truncate`` with ``audio_end_ms`` = the milliseconds of the item
actually played, so the conversation keeps the words the user heard; the kept text is read back
(``Interrupted``). Without a player and without ``played`` calls the client does not know what
was heard and truncates nothing.

**Offline**: with an ``OfflineConfig`` and no gateway, all of this runs on the device
(``rtgw/offline_voice.py``): the same calls, events, player and barge-in.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from rtgw.audio import CHUNK_MS, AudioSource, Player, check_pcm, pcm_chunks, silence, source_chunks
from rtgw.errors import GatewayError, GatewayUnreachable
from rtgw.protocol import Event, ServerError, TranscriptDelta
from rtgw.turn import Turn
from rtgw.voice_events import (
    AUDIO_ERROR_CODES,
    AudioCleared,
    AudioCommitted,
    AudioDelta,
    AudioRefused,
    InputTranscript,
    Interrupted,
    SpeechStarted,
    SpeechStopped,
    TranscriptionFailed,
    TurnStarted,
    VoiceEvent,
    pcm_ms,
)

if TYPE_CHECKING:
    from rtgw.client import RealtimeClient

log = logging.getLogger(__name__)

MAX_APPEND_BYTES = 128 * 1024  # per append: under the gateway's default bound (256 KiB) and its frame limit
MAX_QUEUED_EVENTS = 1024  # voice events nobody reads: the oldest are dropped past this
MAX_QUEUED_TURNS = 64

# Shortcuts of update_session() that live in the GA session's ``audio`` object.
_AUDIO_FIELDS = {"voice": ("output", "voice"), "speed": ("output", "speed"),
                 "turn_detection": ("input", "turn_detection"), "transcription": ("input", "transcription"),
                 "noise_reduction": ("input", "noise_reduction")}

T = TypeVar("T")


def session_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """``update_session`` keywords as the GA session object: ``voice``, ``speed``,
    ``turn_detection`` (a dict, ``"server_vad"``, or None for push to talk), ``transcription`` and
    ``noise_reduction`` go into ``audio``; ``output_modalities="audio"`` becomes ``["audio"]``."""
    out = {k: v for k, v in fields.items() if k not in _AUDIO_FIELDS}
    if isinstance(out.get("output_modalities"), str):
        out["output_modalities"] = [out["output_modalities"]]
    audio = {side: dict(values) for side, values in (out.pop("audio", None) or {}).items()}
    for name, (side, key) in _AUDIO_FIELDS.items():
        if name in fields:
            value = fields[name]
            audio.setdefault(side, {})[key] = {"type": value} if name == "turn_detection" and isinstance(value, str) \
                else value
    if audio:
        out["audio"] = audio
    return out


def merge_session(kept: dict[str, Any], update: Mapping[str, Any]) -> None:
    """``update`` into the settings ``kept`` for later sessions; ``audio`` is merged key by key."""
    for key, value in update.items():
        if key == "audio" and isinstance(kept.get("audio"), dict):
            for side, values in value.items():
                kept["audio"].setdefault(side, {}).update(values)
        else:
            kept[key] = value


class _Queue(Generic[T]):
    """Bounded, for one reader: past ``limit`` unread items the oldest is dropped."""

    def __init__(self, limit: int) -> None:
        self._items: collections.deque[T] = collections.deque(maxlen=limit)
        self._ready = asyncio.Event()

    def put(self, item: T) -> None:
        self._items.append(item)
        self._ready.set()

    async def get(self) -> T:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


@dataclass
class _Playing:
    """The spoken item whose audio the client received last, and what of it was played."""

    item_id: str
    response_id: str
    start_ms: float  # where its audio begins in what the player was given since its last stop
    received_ms: float = 0.0
    heard_ms: float | None = None  # the application's count (``played``), when it keeps one


class VoiceClient:
    """Voice methods of ``RealtimeClient``; ``self`` is the client."""

    player: Player | None  # where spoken answers are played; None: the application plays them
    barge_in: bool  # truncate an answer to what was played when the user talks over it

    def _init_voice(self: RealtimeClient, player: Player | None, barge_in: bool) -> None:
        self.player = player
        self.barge_in = barge_in
        self._voice_queue: _Queue[VoiceEvent] = _Queue(MAX_QUEUED_EVENTS)
        self._turn_queue: _Queue[Turn] = _Queue(MAX_QUEUED_TURNS)
        self._playing: _Playing | None = None
        self._given_ms = 0.0  # audio given to the player since its last stop
        self._barge_task: asyncio.Task[None] | None = None

    # --- audio in -------------------------------------------------------------------------------

    async def append_audio(self: RealtimeClient, pcm: bytes | bytearray | memoryview) -> None:
        """Send PCM16 24 kHz mono (whole samples; ValueError otherwise) to the input buffer,
        cut into appends the gateway accepts. Opens the session first when there is none; offline
        (an ``OfflineConfig`` and no gateway) the device takes it (``OfflineVoiceError`` when it
        cannot: the voice models are not installed)."""
        data = check_pcm(pcm)
        if await self._voice_on_device():
            await self._device_append(data)
            return
        if self._ws is None:
            async with self._lock:
                await self._ensure_session(required=True)
        for start in range(0, len(data), MAX_APPEND_BYTES):
            piece = data[start:start + MAX_APPEND_BYTES]
            audio: str | bytes = piece if self.framing == "msgpack" else base64.b64encode(piece).decode("ascii")
            await self._send(self.protocol.event("input_audio_buffer.append", audio=audio))

    async def speak(self: RealtimeClient, source: AudioSource, *, speed: float | None = 1.0,
                    trailing_silence_ms: float = 1000, chunk_ms: float = CHUNK_MS) -> float:
        """Stream ``source`` (a WAV file's path, PCM bytes, or an iterator or async iterator of
        PCM chunks, e.g. ``rtgw.sound.microphone()``) into the input buffer, ``speed`` times real
        time (None: as fast as it comes; the gateway allows 2x sustained, after a 10 s burst), then
        ``trailing_silence_ms`` of silence, so that server VAD hears the speech end as it would
        from a microphone that goes on. Returns the milliseconds of audio sent."""
        started = time.monotonic()
        sent_ms = 0.0

        async def send(chunk: bytes) -> None:
            nonlocal sent_ms
            if speed is not None:  # pacing, not waiting for an event: a microphone's clock
                await asyncio.sleep(max(0.0, started + sent_ms / 1000 / speed - time.monotonic()))
            await self.append_audio(chunk)
            sent_ms += pcm_ms(len(chunk))

        async for chunk in source_chunks(source, chunk_ms):
            if chunk:
                await send(chunk)
        for chunk in pcm_chunks(silence(trailing_silence_ms), chunk_ms):
            await send(chunk)
        return sent_ms

    async def commit_audio(self: RealtimeClient) -> str:
        """Push to talk: the input buffer becomes a user item (the server transcribes it); returns
        its id. ``GatewayError`` when the server refuses (less than 100 ms of audio)."""
        if await self._voice_on_device():
            return await self._device_commit()
        event = self.protocol.event("input_audio_buffer.commit")
        committed = await self._voice_request(event, ("committed", ""))
        return str(committed.item_id)

    async def clear_audio(self: RealtimeClient) -> None:
        """Drop what the input buffer holds."""
        if await self._voice_on_device():
            await self._device_clear()
            return
        await self._voice_request(self.protocol.event("input_audio_buffer.clear"), ("cleared", ""))

    async def respond(self: RealtimeClient, **response: Any) -> Turn:
        """Push to talk: commit the input buffer, then start the answer (``response.create`` with
        ``response``'s fields); returns its ``Turn``."""
        if await self._voice_on_device():  # the answer too: the speech it answers is on the device
            await self._device_commit()
            return await self._device_respond(response)
        await self.commit_audio()
        return await self._start_turn(lambda: [self.protocol.event("response.create", **(
            {"response": response} if response else {}))], response)

    async def _voice_request(self: RealtimeClient, event: dict[str, Any], key: tuple[str, str]) -> Any:
        if self._ws is None:
            async with self._lock:
                await self._ensure_session(required=True)
        done = self._expect(key)
        refused = self._expect(("event", event["event_id"]))
        try:
            await self._send(event)
            finished, _ = await asyncio.wait({done, refused}, timeout=self.request_timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
        finally:
            for k, future in ((key, done), (("event", event["event_id"]), refused)):
                future.cancel()
                if self._waiters.get(k) is future:
                    del self._waiters[k]
        if done in finished:
            return done.result()
        if refused in finished:
            error: ServerError = refused.result()
            raise GatewayError(f"the gateway refused {event['type']}: {error.code}: {error.message}")
        raise GatewayUnreachable(f"the gateway did not answer {event['type']} in time")

    # --- turns the server starts, and voice events --------------------------------------------------

    async def next_turn(self: RealtimeClient, timeout: float | None = None) -> Turn:
        """The next answer the server started on its own (server VAD committed the user's speech),
        in order; waits for it (``TimeoutError`` after ``timeout`` seconds)."""
        return await asyncio.wait_for(self._turn_queue.get(), timeout)

    async def voice_events(self: RealtimeClient) -> AsyncIterator[VoiceEvent]:
        """Every voice event from now on (and the unread ones, up to 1,024): ``SpeechStarted``,
        ``SpeechStopped``, ``AudioCommitted``, ``InputTranscript``, ``TranscriptionFailed``,
        ``TurnStarted``, ``Interrupted``, ``AudioRefused``. One reader; runs until the loop is left."""
        while True:
            yield await self._voice_queue.get()

    # --- what was played --------------------------------------------------------------------------

    def played(self: RealtimeClient, ms: float) -> None:
        """The application's count, when it plays the audio itself: ``ms`` of the answer's audio
        (the item whose ``AudioDelta`` came last) were heard."""
        if self._playing is not None:
            self._playing.heard_ms = max(0.0, ms)

    @property
    def played_ms(self: RealtimeClient) -> float | None:
        """Of the spoken item received last: the milliseconds played, None when unknown."""
        playing = self._playing
        if playing is None:
            return None
        if playing.heard_ms is not None:
            return min(playing.heard_ms, playing.received_ms)
        if self.player is None:
            return None
        return min(max(0.0, self.player.played_ms - playing.start_ms), playing.received_ms)

    def stop_playback(self: RealtimeClient) -> float | None:
        """Stop the player (dropping what is queued); returns the milliseconds played of the item."""
        heard = self.played_ms
        if self.player is not None:
            self.player.stop()
        self._given_ms = 0.0
        self._playing = None
        return heard

    # --- from the reader ------------------------------------------------------------------------

    def _response_started(self: RealtimeClient, response_id: str, turn: Turn | None) -> Turn:
        """The client's turn gets its response id; a response nobody asked for (server VAD)
        becomes a turn of its own, for ``next_turn()``."""
        if turn is not None and not turn.done and not turn.offline:
            turn.response_id = turn.response_id or response_id
            return turn
        turn = self._turn = Turn()
        turn.response_id = response_id
        self._turn_queue.put(turn)
        self._voice_queue.put(TurnStarted(turn))
        return turn

    def _voice_dispatch(self: RealtimeClient, typed: Event, turn: Turn | None) -> bool:
        """A voice event from the protocol core: to the turn, the player, the voice events."""
        live = turn is not None and not turn.offline and not turn.done
        if isinstance(typed, (TranscriptDelta, AudioDelta)):
            if live and turn is not None and turn.response_id in (None, typed.response_id):
                turn.response_id = typed.response_id
                turn._voice(typed)
            if isinstance(typed, AudioDelta):
                self._play(typed)
            return True
        if not isinstance(typed, (SpeechStarted, SpeechStopped, AudioCommitted, AudioCleared, InputTranscript,
                                  TranscriptionFailed)):
            return False
        if isinstance(typed, AudioCommitted):
            self._resolve(("committed", ""), typed)
        elif isinstance(typed, AudioCleared):
            self._resolve(("cleared", ""), typed)
        elif isinstance(typed, InputTranscript) and live and turn is not None:
            turn._voice(typed)
        elif isinstance(typed, SpeechStarted):
            self._speech_started()
        self._voice_queue.put(typed)
        return True

    def _voice_error(self: RealtimeClient, error: ServerError) -> bool:
        if error.code not in AUDIO_ERROR_CODES:
            return False
        log.warning("the gateway refused audio: %s: %s", error.code, error.message)
        self._voice_queue.put(AudioRefused(error.code, error.message))
        return True

    def _play(self: RealtimeClient, delta: AudioDelta) -> None:
        playing = self._playing
        if playing is None or playing.item_id != delta.item_id:
            playing = self._playing = _Playing(delta.item_id, delta.response_id, self._given_ms)
        playing.received_ms += delta.ms
        self._given_ms += delta.ms
        if self.player is not None:
            self.player.play(delta.pcm)

    def _speech_started(self: RealtimeClient) -> None:
        """The user talks: if an answer is playing (or still coming), stop it and truncate its
        item to what was played."""
        playing = self._playing
        if not self.barge_in or playing is None:
            return
        heard = self.played_ms
        turn = self._turn
        coming = turn is not None and not turn.done and turn.response_id == playing.response_id
        if heard is None or not (coming or heard < playing.received_ms):
            return  # not known, or it was all heard: nothing to cut
        self.stop_playback()
        if self._barge_task is not None and not self._barge_task.done():
            return  # one at a time; the user started again within the last truncate's round trip
        self._barge_task = asyncio.get_running_loop().create_task(
            self._truncate_heard(playing, int(heard + 1e-6), turn if coming else None), name="rtgw-barge-in")

    async def _truncate_heard(self: RealtimeClient, playing: _Playing, heard_ms: int, turn: Turn | None) -> None:
        if await self._device_truncate(playing.item_id, heard_ms, turn):  # spoken on the device
            return
        event = self.protocol.event("conversation.item.truncate", item_id=playing.item_id, content_index=0,
                                    audio_end_ms=heard_ms)
        try:
            await self._voice_request(event, ("truncated", playing.item_id))
            if turn is not None:  # the server cancelled it (turn_detected): its end sets the item's text
                await asyncio.wait_for(turn.result(), self.silence_timeout)
            kept = await self.retrieve_item(playing.item_id)
        except (GatewayError, ConnectionError, TimeoutError) as e:
            log.warning("barge-in: could not truncate %s to the %d ms played: %s", playing.item_id, heard_ms, e)
            return
        text = getattr(kept, "text", "")
        local = self.protocol.message(playing.item_id)
        if local is not None:
            local.text = text
        self._voice_queue.put(Interrupted(playing.item_id, heard_ms, text))

    async def _close_voice(self: RealtimeClient) -> None:
        task, self._barge_task = self._barge_task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._close_device_voice()
