"""The asyncio client: one Realtime session with a gateway, kept alive across network drops.

    async with RealtimeClient("http://127.0.0.1:8000", api_key=KEY) as client:
        turn = await client.send("Hi!")
        async for delta in turn:          # TextDelta events as they stream
            print(delta.text, end="")
        result = await turn.result()      # TurnResult: status, text, metadata (x_tier), usage

Function calling: ``tools`` (and ``tool_choice``, ``parallel_tool_calls``) on the client, in
``update_session`` or per ``send``; a turn's calls come as ``FunctionCall`` events (``turn.events()``)
and in ``result.calls``, their arguments parsed; ``send_tool_output(call_id, output)`` answers one
and starts the next response (``send_tool_outputs`` answers several).

``cancel()`` stops the active turn; ``interrupt(heard_chars)`` is barge-in: cancel, then cut the
assistant's message down to what the user heard (our ``x_text_end`` truncate, or delete and
re-create it on a server without that extension), so the next turn's context holds only that.

Voice (``rtgw/voice.py``): audio in (``append_audio``, ``speak``, ``commit_audio``, ``respond``),
spoken answers out (``AudioDelta`` events, a ``player``), the answers server VAD starts
(``next_turn``), and barge-in that truncates to the audio played.

When the connection drops, the active turn ends ``failed`` (reason ``connection_lost``) and the
next operation reconnects with jittered exponential backoff, then restores the conversation on
the new session by re-sending its items with their ids. A drained gateway replica (1001 with a
reconnect hint) is left and come back to by the client itself, which then starts a turn the old
session had not begun, so the application sees no error (``rtgw/connection.py``).

When the gateway cannot be reached at all and an ``OfflineConfig`` is given, turns (and voice,
where the ``voice`` package and its models are installed) are served by the device from the same
conversation, marked ``offline`` with ``metadata["x_tier"] == "device"``; every ``retry_online_s``
a turn first tries the gateway again and, once it answers, carries the offline turns over to it
(``rtgw/device.py``).

Each part owns its state: the ``Connection`` (the socket, reconnects, acknowledgements), the
``SessionSettings``, the protocol core (the conversation), the ``Voice`` and the ``Device``. The
client owns the turn under way and routes calls to the parts and server events to the turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from rtgw.audio import CHUNK_MS, AudioSource, Player, check_pcm, stream_paced
from rtgw.connection import DEFAULT_BACKOFF, Backoff, Connection, realtime_url
from rtgw.device import Device
from rtgw.errors import GatewayError, GatewayUnreachable, TurnInProgress
from rtgw.framing import Framing
from rtgw.items import retrieve, truncate
from rtgw.offline import OfflineConfig, OfflineModel
from rtgw.protocol import (
    ClientProtocol,
    ConversationItem,
    FunctionCall,
    ItemRetrieved,
    ItemTruncated,
    ServerError,
    SessionInfo,
    TextDelta,
    TurnResult,
    new_id,
)
from rtgw.settings import SessionSettings
from rtgw.tools import ToolChoice, response_fields, tool_fields
from rtgw.turn import Turn
from rtgw.voice import Voice, VoiceEvent

log = logging.getLogger(__name__)


def _kept(part: str, name: str) -> Any:
    """A client attribute that one of its parts keeps: read and set on the client, owned there."""
    return property(lambda client: getattr(getattr(client, part), name),
                    lambda client, value: setattr(getattr(client, part), name, value))


class RealtimeClient:
    ws_url = _kept("_conn", "ws_url")
    api_key = _kept("_conn", "api_key")
    framing = _kept("_conn", "framing")
    connect_timeout = _kept("_conn", "connect_timeout")
    silence_timeout = _kept("_conn", "silence_timeout")
    request_timeout = _kept("_conn", "request_timeout")
    backoff = _kept("_conn", "backoff")
    retry_online_s = _kept("_conn", "retry_online_s")
    reconnects = _kept("_conn", "reconnects")  # sessions opened after the first
    player = _kept("_voice", "player")  # where spoken answers are played; None: the application plays them
    barge_in = _kept("_voice", "barge_in")  # truncate an answer to what was played when the user talks over it

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        *,
        api_key: str | None = None,
        model: str | None = None,
        framing: Framing = "json",
        instructions: str | None = None,
        connect_timeout: float = 10.0,
        silence_timeout: float = 60.0,
        request_timeout: float = 10.0,
        backoff: Backoff = DEFAULT_BACKOFF,
        offline: OfflineConfig | None = None,
        retry_online_s: float = 5.0,
        seed: int | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: ToolChoice | None = None,
        parallel_tool_calls: bool | None = None,
        player: Player | None = None,
        barge_in: bool = True,
    ) -> None:
        """``url``: the gateway's base URL (http(s) or ws(s)); ``silence_timeout``: the longest
        wait for a server event while a turn runs; ``request_timeout``: for acknowledgements
        (a truncate, the session's first event). ``tools``, ``tool_choice``, ``parallel_tool_calls``:
        the session's function calling (``tool_fields``), for every turn unless it says otherwise.
        ``player``: where spoken answers are played (``rtgw.audio.Player``); ``barge_in``: truncate
        an answer to what was played when the user starts speaking over it (``rtgw/voice.py``)."""
        if framing not in ("json", "msgpack"):
            raise ValueError("framing must be 'json' or 'msgpack'")
        self._conn = Connection(realtime_url(url, model), api_key=api_key, framing=framing,
                                connect_timeout=connect_timeout, silence_timeout=silence_timeout,
                                request_timeout=request_timeout, backoff=backoff, retry_online_s=retry_online_s,
                                seed=seed, on_event=self._dispatch, on_open=self._session_opened,
                                on_drain=self._drained, on_drain_over=self._drain_over, on_lost=self._lost,
                                busy=self._busy)
        self.protocol = ClientProtocol()
        self._settings = SessionSettings({"instructions": instructions} if instructions is not None else {})
        self._settings.fields.update(tool_fields(tools, tool_choice, parallel_tool_calls))
        self._turn: Turn | None = None
        # A turn a drained session never started (no response.created): started on the new one.
        self._resume: Turn | None = None
        self._voice = Voice(self._conn, self.protocol, player=player, barge_in=barge_in,
                            current_turn=lambda: self._turn, retrieve=self.retrieve_item, cut_on_device=self._cut)
        self._device = Device(OfflineModel(offline), self.protocol, self._settings, self._voice,
                              current_turn=lambda: self._turn, start_turn=self._offline_turn) \
            if offline is not None else None

    # --- lifecycle ------------------------------------------------------------------------

    @property
    def online(self) -> bool:
        return self._conn.online

    @property
    def conversation(self) -> list[ConversationItem]:
        return list(self.protocol.items)

    async def __aenter__(self) -> RealtimeClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open the session (with the reconnect policy). Without an offline model an unreachable
        gateway raises ``GatewayUnreachable``; with one, the client starts offline. A ``close()``
        before the session is open raises ``ClientClosed``; after ``close()``, this opens the
        client again."""
        self._conn.closed = False  # before the lock: a close() while we wait for it still counts
        async with self._conn.lock:
            await self._conn.ensure(required=self._device is None)

    async def close(self) -> None:
        """Cancel the active turn, end any reconnect under way and close the session. A
        ``connect()`` or ``send()`` still opening a session then fails with ``ClientClosed`` and
        closes what it opened: no session outlives this call."""
        self._conn.closed = True
        if self._turn is not None and not self._turn.done:
            with contextlib.suppress(GatewayError, ConnectionError):
                await self.cancel()
        await self._conn.stop_reconnect()
        await self._voice.close()
        if self._device is not None:
            self._device.stop_voice()
        await self._conn.drop()
        if self._device is not None:
            await self._device.model.close()

    async def wait_reconnected(self) -> bool:
        """Wait for a reconnect the gateway asked for (a drained session) to end; True when the
        client is online again, False when it is not (the reconnect failed, or ``close()`` ended
        it). Returns at once when none is under way."""
        return await self._conn.wait_reconnected()

    async def update_session(self, **fields: Any) -> None:
        """``session.update`` now and on every session after (instructions, temperature, model,
        tools, tool_choice, parallel_tool_calls...). The on-device fallback honours them too.
        Voice: ``output_modalities=["audio"]``, ``voice``, ``turn_detection`` (None: push to talk),
        ``transcription`` (``rtgw.settings.session_fields``)."""
        fields = self._settings.update(fields)
        if self._conn.ws is not None:
            await self._conn.send(self.protocol.session_update(**fields))

    # --- turns ------------------------------------------------------------------------------

    async def send(self, text: str, *, max_output_tokens: int | None = None, temperature: float | None = None,
                   tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: ToolChoice | None = None,
                   parallel_tool_calls: bool | None = None) -> Turn:
        """Start a turn with the user's ``text``; returns once it is on its way. Opens the session
        first when there is none, as ``connect()`` does (``ClientClosed`` included). ``tools``,
        ``tool_choice`` and ``parallel_tool_calls`` apply to this response only."""
        response = response_fields(max_output_tokens, temperature, tools, tool_choice, parallel_tool_calls)
        return await self._start_turn(lambda: self.protocol.user_turn(text, **response), response)

    async def send_tool_outputs(self, outputs: Mapping[str, Any], *, max_output_tokens: int | None = None,
                                temperature: float | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
                                tool_choice: ToolChoice | None = None,
                                parallel_tool_calls: bool | None = None) -> Turn:
        """Answer function calls and continue: a ``function_call_output`` item for each
        ``{call_id: output}`` (a string as it is, anything else as JSON), then the next response,
        returned as a ``Turn``. ValueError for a call id no call of the conversation has."""
        wire = {call_id: output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)
                for call_id, output in outputs.items()}
        response = response_fields(max_output_tokens, temperature, tools, tool_choice, parallel_tool_calls)
        self.protocol.check_tool_outputs(wire)  # before the turn starts: nothing to undo
        return await self._start_turn(lambda: self.protocol.tool_outputs(wire, **response), response)

    async def send_tool_output(self, call_id: str, output: Any, **options: Any) -> Turn:
        """``send_tool_outputs({call_id: output}, **options)``: answer one call and continue."""
        return await self.send_tool_outputs({call_id: output}, **options)

    async def _start_turn(self, events: Callable[[], list[dict[str, Any]]], response: dict[str, Any]) -> Turn:
        """A turn whose items ``events()`` adds to the conversation (and returns, with the
        response.create to send); online when the gateway can be reached, else on the device."""
        self._conn.closed = False  # before the lock, as in connect()
        async with self._conn.lock:
            if self._turn is not None and not self._turn.done:
                raise TurnInProgress("a turn is still running: cancel() it or await its result() first")
            online = await self._conn.ensure(required=self._device is None)
            if not online:
                events()  # the items join the conversation; the device answers from it
                return self._offline_turn(response)
            to_send = events()
            turn = self._turn = Turn()
            turn._response = response
            try:
                for event in to_send:
                    await self._conn.send(event)
            except GatewayUnreachable:
                if turn is not self._resume:  # a drained session: the turn starts on the next one
                    turn._finish(self.protocol.connection_lost() or _lost_result(turn))
            return turn

    async def ask(self, text: str, **options: Any) -> str:
        """Send a turn and return its whole text."""
        return await (await self.send(text, **options)).text()

    async def cancel(self) -> TurnResult | None:
        """Stop the active turn; returns its result (``cancelled``) once the server confirmed
        that the engine let go of it, or None when no turn was running."""
        turn = self._turn
        if turn is None or turn.done:
            return None
        if turn.offline:
            assert turn._task is not None
            turn._cancel_offline()
            return await turn.result()
        if turn is self._resume:  # waiting for a new session: it never started
            self._resume = None
            turn._finish(TurnResult(turn.response_id or "", "cancelled", "", reason="client_cancelled"))
            return await turn.result()
        # Sent even before response.created arrived: the server takes events in order, so the
        # response is active by the time it reads the cancel.
        if self._conn.ws is not None:
            with contextlib.suppress(GatewayUnreachable):
                await self._conn.send(self.protocol.event("response.cancel"))
        return await asyncio.wait_for(turn.result(), self._conn.silence_timeout)

    async def interrupt(self, heard_chars: int) -> TurnResult | None:
        """Barge-in: cancel the active turn (or take the last one, when it already finished
        streaming while its speech still played), then keep only the first ``heard_chars``
        characters of the assistant's message in the conversation. Returns that turn's result."""
        turn = self._turn
        result = await self.cancel()
        if result is None and turn is not None and turn.done:
            result = await turn.result()
        if result is not None:  # its message; none (cancelled before its first token, or only calls): nothing to cut
            item = self.protocol.message(result.item_id) if result.item_id else None
        else:
            item = self.protocol.last_assistant()
        if item is None:
            return result
        heard = max(0, min(heard_chars, len(item.text)))
        if self._conn.ws is None:  # offline (or between sessions): the next session is restored from this
            item.text = item.text[:heard]
            return result
        await truncate(self._conn, self.protocol, item, heard)
        return result

    async def retrieve_item(self, item_id: str) -> ConversationItem:
        """The server's copy of a conversation item (``conversation.item.retrieve``)."""
        return await retrieve(self._conn, self.protocol, item_id)

    # --- voice (rtgw/voice.py; on the device: rtgw/device.py) ----------------------------------------

    async def append_audio(self, pcm: bytes | bytearray | memoryview) -> None:
        """Send PCM16 24 kHz mono (whole samples; ValueError otherwise) to the input buffer,
        cut into appends the gateway accepts. Opens the session first when there is none; offline
        (an ``OfflineConfig`` and no gateway) the device takes it (``OfflineVoiceError`` when it
        cannot: the voice models are not installed)."""
        data = check_pcm(pcm)
        if await self._voice_on_device():
            assert self._device is not None
            await self._device.append(data)
            return
        await self._voice.append(data)

    async def speak(self, source: AudioSource, *, speed: float | None = 1.0, trailing_silence_ms: float = 1000,
                    chunk_ms: float = CHUNK_MS) -> float:
        """Stream ``source`` (a WAV file's path, PCM bytes, or an iterator or async iterator of
        PCM chunks, e.g. ``rtgw.sound.microphone()``) into the input buffer, ``speed`` times real
        time (None: as fast as it comes; the gateway allows 2x sustained, after a 10 s burst), then
        ``trailing_silence_ms`` of silence, so that server VAD hears the speech end as it would
        from a microphone that goes on. Returns the milliseconds of audio sent."""
        return await stream_paced(source, self.append_audio, speed=speed, trailing_silence_ms=trailing_silence_ms,
                                  chunk_ms=chunk_ms)

    async def commit_audio(self) -> str:
        """Push to talk: the input buffer becomes a user item (the server transcribes it); returns
        its id. ``GatewayError`` when the server refuses (less than 100 ms of audio)."""
        if await self._voice_on_device():
            assert self._device is not None
            return await self._device.commit()
        return await self._voice.commit()

    async def clear_audio(self) -> None:
        """Drop what the input buffer holds."""
        if await self._voice_on_device():
            assert self._device is not None
            await self._device.clear()
            return
        await self._voice.clear()

    async def respond(self, **response: Any) -> Turn:
        """Push to talk: commit the input buffer, then start the answer (``response.create`` with
        ``response``'s fields); returns its ``Turn``."""
        if await self._voice_on_device():  # the answer too: the speech it answers is on the device
            assert self._device is not None
            await self._device.commit()
            async with self._conn.lock:
                if self._turn is not None and not self._turn.done:
                    raise TurnInProgress("a turn is still running: cancel() it or await its result() first")
                return self._offline_turn(dict(response))
        await self.commit_audio()
        return await self._start_turn(lambda: [self.protocol.event("response.create", **(
            {"response": response} if response else {}))], response)

    async def next_turn(self, timeout: float | None = None) -> Turn:
        """The next answer the server started on its own (server VAD committed the user's speech),
        in order; waits for it (``TimeoutError`` after ``timeout`` seconds)."""
        return await self._voice.next_turn(timeout)

    def voice_events(self) -> AsyncIterator[VoiceEvent]:
        """Every voice event from now on (and the unread ones, up to 1,024): ``SpeechStarted``,
        ``SpeechStopped``, ``AudioCommitted``, ``InputTranscript``, ``TranscriptionFailed``,
        ``TurnStarted``, ``Interrupted``, ``AudioRefused``. One reader; runs until the loop is left."""
        return self._voice.events()

    def played(self, ms: float) -> None:
        """The application's count, when it plays the audio itself: ``ms`` of the answer's audio
        (the item whose ``AudioDelta`` came last) were heard."""
        self._voice.played(ms)

    @property
    def played_ms(self) -> float | None:
        """Of the spoken item received last: the milliseconds played, None when unknown."""
        return self._voice.played_ms

    def stop_playback(self) -> float | None:
        """Stop the player (dropping what is queued); returns the milliseconds played of the item."""
        return self._voice.stop_playback()

    async def _voice_on_device(self) -> bool:
        """Whether audio goes to the device now: an utterance is under way there, or there is an
        offline model and no gateway (tried again every ``retry_online_s``, as for text turns)."""
        if self._device is None:
            return False
        if self._device.holds_speech:
            return True
        if self._conn.ws is not None:
            return False
        async with self._conn.lock:
            online = await self._conn.ensure(required=False)
        return not online

    async def _cut(self, item_id: str, heard_ms: int, turn: Turn | None) -> bool:
        """A barge-in on an answer the device spoke: cut there (False: not spoken there)."""
        return self._device is not None and await self._device.cut(item_id, heard_ms, turn)

    # --- the connection's hooks -------------------------------------------------------------------

    def _busy(self) -> bool:
        return self._turn is not None and not self._turn.done

    async def _session_opened(self) -> None:
        """A new session: the settings, the conversation so far, and a turn a drained session had
        not begun."""
        if self._settings.fields:
            await self._conn.send(self.protocol.session_update(**self._settings.fields))
        restore = self.protocol.restore_events()
        for event in restore:
            await self._conn.send(event)
        if restore:
            log.info("restored %d conversation items on the new session", len(restore))
        turn, self._resume = self._resume, None
        if turn is not None and not turn.done:
            log.info("starting on the new session the turn the drained one had not begun")
            await self._conn.send(self.protocol.event("response.create", **({"response": turn._response}
                                                                              if turn._response else {})))

    def _drained(self) -> None:
        """The gateway drained the session: a turn whose request it never took starts on the next."""
        turn = self._turn
        if turn is not None and not turn.done and not turn.offline and self.protocol.active_response_id is None:
            self._resume = turn

    def _drain_over(self) -> None:
        turn, self._resume = self._resume, None  # still here: no session could start it
        if turn is not None and not turn.done:
            turn._finish(self.protocol.connection_lost() or _lost_result(turn))

    def _lost(self) -> None:
        turn = self._turn
        if turn is not None and not turn.done and not turn.offline and turn is not self._resume:
            turn._finish(self.protocol.connection_lost() or _lost_result(turn))

    # --- the server's events ----------------------------------------------------------------------

    def _dispatch(self, event: dict[str, Any]) -> None:
        turn = self._turn
        typed_events = self.protocol.receive(event)
        if event["type"] == "response.created" and self.protocol.active_response_id is not None:
            turn = self._response_started(self.protocol.active_response_id, turn)
        for typed in typed_events:
            if self._voice.dispatch(typed, turn):  # audio, transcripts, speech detection
                continue
            if isinstance(typed, SessionInfo):
                self._conn.resolve(("session", "created"), typed)
            elif isinstance(typed, TextDelta):
                if turn is not None and not turn.offline:
                    turn.response_id = typed.response_id
                    turn._push(typed.text)
            elif isinstance(typed, FunctionCall):
                if turn is not None and not turn.offline and not turn.done:
                    turn._call(typed)
            elif isinstance(typed, TurnResult):
                if turn is not None and not turn.offline and not turn.done:
                    turn.response_id = typed.response_id
                    turn._finish(typed)
            elif isinstance(typed, ItemTruncated):
                self._conn.resolve(("truncated", typed.item_id), typed)
            elif isinstance(typed, ItemRetrieved):
                self._conn.resolve(("retrieved", typed.item.id), typed.item)
            elif isinstance(typed, ServerError):
                self._on_error(typed)

    def _response_started(self, response_id: str, turn: Turn | None) -> Turn:
        """The client's turn gets its response id; a response nobody asked for (server VAD)
        becomes a turn of its own, for ``next_turn()``."""
        if turn is not None and not turn.done and not turn.offline:
            turn.response_id = turn.response_id or response_id
            return turn
        turn = self._turn = Turn()
        turn.response_id = response_id
        self._voice.turn_started(turn)
        return turn

    def _on_error(self, error: ServerError) -> None:
        if error.event_id and self._conn.resolve(("event", error.event_id), error):
            return
        if self._voice.refused(error):
            return
        turn = self._turn
        if turn is not None and not turn.done and not turn.offline and self.protocol.active_response_id is None:
            # The turn's own events were refused (e.g. rate limited) before a response started.
            turn._finish(TurnResult("", "failed", "", error={"type": "invalid_request_error", "code": error.code,
                                                             "message": error.message}))
            return
        log.warning("gateway error %s: %s", error.code, error.message)

    # --- offline ----------------------------------------------------------------------------

    def _offline_turn(self, response: dict[str, Any]) -> Turn:
        """A turn the device answers (``rtgw/device.py``), now the turn under way."""
        assert self._device is not None
        previous = self._turn  # still ending when speech cut it off (barge-in): this one starts after it
        turn = self._turn = Turn(offline=True)
        turn.response_id = new_id("resp")
        turn._task = self._device.answer(turn, response, previous)
        return turn


def _lost_result(turn: Turn) -> TurnResult:
    return TurnResult(turn.response_id or "", "failed", "", error={
        "type": "connection_error", "code": "connection_lost", "message": "the connection to the gateway was lost"})
