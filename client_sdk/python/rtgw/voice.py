"""Voice on a ``RealtimeClient``: audio in, spoken answers out, and barge-in.

    async with RealtimeClient(url, player=RealTimePlayer()) as client:
        await client.update_session(output_modalities=["audio"], voice="marin")  # server VAD is on by default
        await client.speak("question.wav")           # streamed as a microphone would, in real time
        turn = await client.next_turn()              # the answer the server started when the speech ended
        async for event in turn.events():            # TranscriptDelta, AudioDelta, InputTranscript
            ...

``Voice`` is the part of a ``RealtimeClient`` that owns this: the player, what was played, the
voice events and the turns the server started. It gets from the client its connection, its
protocol core and the few things it asks of it (the turn under way, a retrieve, the device's cut
of an answer spoken there); the client's voice methods choose between it and the device.
``rtgw.voice_events`` has the server's event types; ``VoiceEvent`` here is every one ``voice_events()``
yields.

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
(``rtgw/device.py``): the same calls, events, player and barge-in.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from rtgw.audio import Player
from rtgw.connection import Connection, Key
from rtgw.errors import GatewayError, GatewayUnreachable
from rtgw.protocol import ClientProtocol, ConversationItem, Event, ServerError, TranscriptDelta
from rtgw.turn import Turn, TurnStarted
from rtgw.voice_events import (
    AUDIO_ERROR_CODES,
    AudioCleared,
    AudioCommitted,
    AudioDelta,
    AudioRefused,
    InputTranscript,
    Interrupted,
    ServerVoiceEvent,
    SpeechStarted,
    SpeechStopped,
    TranscriptionFailed,
)

log = logging.getLogger(__name__)

MAX_APPEND_BYTES = 128 * 1024  # per append: under the gateway's default bound (256 KiB) and its frame limit
MAX_QUEUED_EVENTS = 1024  # voice events nobody reads: the oldest are dropped past this
MAX_QUEUED_TURNS = 64

VoiceEvent = ServerVoiceEvent | TurnStarted | Interrupted | AudioRefused

T = TypeVar("T")


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


class Voice:
    """A client's voice: audio to the gateway, spoken answers played, barge-in, and the voice
    events and server-started turns for the application."""

    def __init__(self, conn: Connection, protocol: ClientProtocol, *, player: Player | None, barge_in: bool,
                 current_turn: Callable[[], Turn | None],
                 retrieve: Callable[[str], Awaitable[ConversationItem]],
                 cut_on_device: Callable[[str, int, Turn | None], Awaitable[bool]]) -> None:
        """``current_turn``: the client's turn under way; ``retrieve``: the server's copy of an item;
        ``cut_on_device``: a barge-in on an answer spoken on the device (False: not spoken there)."""
        self.player = player  # where spoken answers are played; None: the application plays them
        self.barge_in = barge_in  # truncate an answer to what was played when the user talks over it
        self._conn = conn
        self._protocol = protocol
        self._current_turn = current_turn
        self._retrieve = retrieve
        self._cut_on_device = cut_on_device
        self._events: _Queue[VoiceEvent] = _Queue(MAX_QUEUED_EVENTS)
        self._turns: _Queue[Turn] = _Queue(MAX_QUEUED_TURNS)
        self._playing: _Playing | None = None
        self._given_ms = 0.0  # audio given to the player since its last stop
        self._barge_task: asyncio.Task[None] | None = None

    @property
    def cutting(self) -> asyncio.Task[None] | None:
        """The barge-in's cut of an answer, while it runs (an answer to the speech waits for it)."""
        task = self._barge_task
        return task if task is not None and not task.done() else None

    # --- audio in, to the gateway ---------------------------------------------------------------

    async def append(self, data: bytes) -> None:
        """Checked PCM to the gateway's input buffer, in appends it accepts."""
        conn = self._conn
        if conn.ws is None:
            async with conn.lock:
                await conn.ensure(required=True)
        for start in range(0, len(data), MAX_APPEND_BYTES):
            piece = data[start:start + MAX_APPEND_BYTES]
            audio: str | bytes = piece if conn.framing == "msgpack" else base64.b64encode(piece).decode("ascii")
            await conn.send(self._protocol.event("input_audio_buffer.append", audio=audio))

    async def commit(self) -> str:
        committed = await self._request(self._protocol.event("input_audio_buffer.commit"), ("committed", ""))
        return str(committed.item_id)

    async def clear(self) -> None:
        await self._request(self._protocol.event("input_audio_buffer.clear"), ("cleared", ""))

    async def _request(self, event: dict[str, Any], key: Key) -> Any:
        conn = self._conn
        if conn.ws is None:
            async with conn.lock:
                await conn.ensure(required=True)
        done = conn.expect(key)
        refused = conn.expect(("event", event["event_id"]))
        try:
            await conn.send(event)
            finished, _ = await asyncio.wait({done, refused}, timeout=conn.request_timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
        finally:
            for k, future in ((key, done), (("event", event["event_id"]), refused)):
                future.cancel()
                conn.forget(k, future)
        if done in finished:
            return done.result()
        if refused in finished:
            error: ServerError = refused.result()
            raise GatewayError(f"the gateway refused {event['type']}: {error.code}: {error.message}")
        raise GatewayUnreachable(f"the gateway did not answer {event['type']} in time")

    # --- turns the server starts, and voice events --------------------------------------------------

    def report(self, event: VoiceEvent) -> None:
        """A voice event for ``voice_events()``."""
        self._events.put(event)

    def turn_started(self, turn: Turn) -> None:
        """A turn nobody asked for (server VAD): for ``next_turn()``, and as ``TurnStarted``."""
        self._turns.put(turn)
        self._events.put(TurnStarted(turn))

    async def next_turn(self, timeout: float | None = None) -> Turn:
        return await asyncio.wait_for(self._turns.get(), timeout)

    async def events(self) -> AsyncIterator[VoiceEvent]:
        while True:
            yield await self._events.get()

    # --- what was played --------------------------------------------------------------------------

    def played(self, ms: float) -> None:
        if self._playing is not None:
            self._playing.heard_ms = max(0.0, ms)

    @property
    def played_ms(self) -> float | None:
        playing = self._playing
        if playing is None:
            return None
        if playing.heard_ms is not None:
            return min(playing.heard_ms, playing.received_ms)
        if self.player is None:
            return None
        return min(max(0.0, self.player.played_ms - playing.start_ms), playing.received_ms)

    def stop_playback(self) -> float | None:
        heard = self.played_ms
        if self.player is not None:
            self.player.stop()
        self._given_ms = 0.0
        self._playing = None
        return heard

    # --- voice events in --------------------------------------------------------------------------

    def dispatch(self, typed: Event, turn: Turn | None, *, device: bool = False) -> bool:
        """A voice event from the protocol core: to the turn, the player, the voice events. False:
        not a voice event. ``device``: the device told it (its own turn, answered offline; no
        acknowledgement of the gateway's to resolve), else the gateway did."""
        live = turn is not None and not turn.done and (device or not turn.offline)
        if isinstance(typed, (TranscriptDelta, AudioDelta)):
            if live and turn is not None and (device or turn.response_id in (None, typed.response_id)):
                if not device:
                    turn.response_id = typed.response_id
                turn._voice(typed)
            if isinstance(typed, AudioDelta):
                self._play(typed)
            return True
        if not isinstance(typed, (SpeechStarted, SpeechStopped, AudioCommitted, AudioCleared, InputTranscript,
                                  TranscriptionFailed)):
            return False
        if isinstance(typed, AudioCommitted) and not device:
            self._conn.resolve(("committed", ""), typed)
        elif isinstance(typed, AudioCleared) and not device:
            self._conn.resolve(("cleared", ""), typed)
        elif isinstance(typed, InputTranscript) and live and turn is not None:
            turn._voice(typed)
        elif isinstance(typed, SpeechStarted):
            self._speech_started()
        self._events.put(typed)
        return True

    def refused(self, error: ServerError) -> bool:
        """An error about the audio sent: reported, the session goes on. False: not one."""
        if error.code not in AUDIO_ERROR_CODES:
            return False
        log.warning("the gateway refused audio: %s: %s", error.code, error.message)
        self._events.put(AudioRefused(error.code, error.message))
        return True

    def _play(self, delta: AudioDelta) -> None:
        playing = self._playing
        if playing is None or playing.item_id != delta.item_id:
            playing = self._playing = _Playing(delta.item_id, delta.response_id, self._given_ms)
        playing.received_ms += delta.ms
        self._given_ms += delta.ms
        if self.player is not None:
            self.player.play(delta.pcm)

    def _speech_started(self) -> None:
        """The user talks: if an answer is playing (or still coming), stop it and truncate its
        item to what was played."""
        playing = self._playing
        if not self.barge_in or playing is None:
            return
        heard = self.played_ms
        turn = self._current_turn()
        coming = turn is not None and not turn.done and turn.response_id == playing.response_id
        if heard is None or not (coming or heard < playing.received_ms):
            return  # not known, or it was all heard: nothing to cut
        self.stop_playback()
        if self._barge_task is not None and not self._barge_task.done():
            return  # one at a time; the user started again within the last truncate's round trip
        self._barge_task = asyncio.get_running_loop().create_task(
            self._truncate_heard(playing, int(heard + 1e-6), turn if coming else None), name="rtgw-barge-in")

    async def _truncate_heard(self, playing: _Playing, heard_ms: int, turn: Turn | None) -> None:
        if await self._cut_on_device(playing.item_id, heard_ms, turn):  # spoken on the device
            return
        event = self._protocol.event("conversation.item.truncate", item_id=playing.item_id, content_index=0,
                                     audio_end_ms=heard_ms)
        try:
            await self._request(event, ("truncated", playing.item_id))
            if turn is not None:  # the server cancelled it (turn_detected): its end sets the item's text
                await asyncio.wait_for(turn.result(), self._conn.silence_timeout)
            kept = await self._retrieve(playing.item_id)
        except (GatewayError, ConnectionError, TimeoutError) as e:
            log.warning("barge-in: could not truncate %s to the %d ms played: %s", playing.item_id, heard_ms, e)
            return
        text = getattr(kept, "text", "")
        local = self._protocol.message(playing.item_id)
        if local is not None:
            local.text = text
        self._events.put(Interrupted(playing.item_id, heard_ms, text))

    async def close(self) -> None:
        task, self._barge_task = self._barge_task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
