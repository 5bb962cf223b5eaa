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

Voice (``rtgw/voice.py``, a mixin of this class): audio in (``append_audio``, ``speak``,
``commit_audio``, ``respond``), spoken answers out (``AudioDelta`` events, a ``player``), the
answers server VAD starts (``next_turn``), and barge-in that truncates to the audio played.

When the connection drops, the active turn ends ``failed`` (reason ``connection_lost``) and the
next operation reconnects with jittered exponential backoff, then restores the conversation on
the new session by re-sending its items with their ids. A gateway replica that is going away
(drained) closes with 1001 and a reconnect hint once no response is in progress: the client
then reconnects by itself after the time it names, restores the conversation the same way, and
starts there a turn that the old session had not begun, so the application sees no error.

When the gateway cannot be reached at all (refused, DNS, timeout, TLS, a 5xx at the handshake)
and an ``OfflineConfig`` is given, turns are served by the on-device model from the same
conversation, marked ``offline`` with ``metadata["x_tier"] == "device"``; every
``retry_online_s`` a turn first tries the gateway again and, once it answers, carries the
offline turns over to it. Voice works offline too where the ``voice`` package and its models are
installed (``rtgw/offline_voice.py``): speech is segmented, transcribed and answered on the device,
and spoken back when the session asks for audio.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import ssl
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import websockets
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from rtgw.audio import Player
from rtgw.errors import (
    ClientClosed,
    FrameError,
    GatewayError,
    GatewayRefused,
    GatewayUnreachable,
    OfflineModelError,
    OfflineRequestError,
    TurnInProgress,
)
from rtgw.framing import MSGPACK_SUBPROTOCOL, Framing, decode, encode
from rtgw.offline import OfflineConfig, OfflineModel
from rtgw.offline_voice import OfflineVoiceClient
from rtgw.protocol import (
    ClientProtocol,
    ConversationItem,
    FunctionCall,
    Item,
    ItemRetrieved,
    ItemTruncated,
    ServerError,
    SessionInfo,
    TextDelta,
    TurnResult,
    new_id,
    reconnect_hint,
)
from rtgw.tools import ToolChoice, normalize_tools, response_fields, tool_fields
from rtgw.turn import Turn
from rtgw.voice import VoiceClient, merge_session, session_fields

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Backoff:
    """Reconnect delays: ``initial`` doubling up to ``max_delay``, each drawn uniformly from
    [(1 - jitter) * d, d] so that many clients dropped at once do not return at once."""

    initial: float = 0.25
    factor: float = 2.0
    max_delay: float = 8.0
    jitter: float = 0.5
    attempts: int = 5  # connection attempts per operation, the first one immediate

    def delays(self, rng: random.Random) -> Iterator[float]:
        delay = self.initial
        for _ in range(self.attempts - 1):
            yield delay * (1.0 - self.jitter * rng.random())
            delay = min(self.max_delay, delay * self.factor)


@dataclass
class _Session:
    """Settings to apply again on every new session."""

    fields: dict[str, Any] = field(default_factory=dict)


class RealtimeClient(VoiceClient, OfflineVoiceClient):
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
        backoff: Backoff = Backoff(),  # frozen
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
        self.ws_url = realtime_url(url, model)
        self.api_key = api_key
        self.framing = framing
        self.connect_timeout = connect_timeout
        self.silence_timeout = silence_timeout
        self.request_timeout = request_timeout
        self.backoff = backoff
        self.retry_online_s = retry_online_s
        self.protocol = ClientProtocol()
        self._session = _Session({"instructions": instructions} if instructions is not None else {})
        self._session.fields.update(tool_fields(tools, tool_choice, parallel_tool_calls))
        self._offline = OfflineModel(offline) if offline is not None else None
        self._rng = random.Random(seed)
        self._ws: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._turn: Turn | None = None
        self._waiters: dict[tuple[str, str], asyncio.Future[Any]] = {}
        self._last_online_try = -float("inf")
        self._lock = asyncio.Lock()  # one connect / send at a time
        self.reconnects = 0  # sessions opened after the first
        self._sessions = 0
        self._closed = False
        # A drained session (1001 with a reconnect hint): when to come back, the task that does,
        # and a turn the old session never started (no response.created), started on the new one.
        self._reconnect_at: float | None = None
        self._reconnect_task: asyncio.Task[None] | None = None
        self._resume: Turn | None = None
        self._init_voice(player, barge_in)
        self._init_offline_voice()

    # --- lifecycle ------------------------------------------------------------------------

    @property
    def online(self) -> bool:
        return self._ws is not None

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
        self._closed = False  # before the lock: a close() while we wait for it still counts
        async with self._lock:
            await self._ensure_session(required=self._offline is None)

    async def close(self) -> None:
        """Cancel the active turn, end any reconnect under way and close the session. A
        ``connect()`` or ``send()`` still opening a session then fails with ``ClientClosed`` and
        closes what it opened: no session outlives this call."""
        self._closed = True
        if self._turn is not None and not self._turn.done:
            with contextlib.suppress(GatewayError, ConnectionError):
                await self.cancel()
        task, self._reconnect_task = self._reconnect_task, None
        self._reconnect_at = None  # a later connect() need not wait for the drained gateway's time
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._close_voice()
        await self._drop_connection()
        if self._offline is not None:
            await self._offline.close()

    async def wait_reconnected(self) -> bool:
        """Wait for a reconnect the gateway asked for (a drained session) to end; True when the
        client is online again, False when it is not (the reconnect failed, or ``close()`` ended
        it). Returns at once when none is under way."""
        task = self._reconnect_task
        if task is not None:
            # Not shield(): close() cancels the task, and that is an answer (False), not our cancel.
            # wait() neither raises when the task is cancelled nor cancels it when we are.
            await asyncio.wait({task})
            if task.cancelled():
                return False
            task.result()  # a failure the reconnect did not expect surfaces here, as it did
        return self.online

    async def update_session(self, **fields: Any) -> None:
        """``session.update`` now and on every session after (instructions, temperature, model,
        tools, tool_choice, parallel_tool_calls...). The on-device fallback honours them too.
        Voice: ``output_modalities=["audio"]``, ``voice``, ``turn_detection`` (None: push to talk),
        ``transcription`` (``rtgw.voice.session_fields``)."""
        if fields.get("tools") is not None:
            fields["tools"] = normalize_tools(fields["tools"])
        fields = session_fields(fields)
        merge_session(self._session.fields, fields)
        if "audio" in fields:  # the whole audio object: an update of its voice keeps its turn detection
            fields["audio"] = self._session.fields["audio"]
        if self._ws is not None:
            await self._send(self.protocol.session_update(**fields))

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
        self._closed = False  # before the lock, as in connect()
        async with self._lock:
            if self._turn is not None and not self._turn.done:
                raise TurnInProgress("a turn is still running: cancel() it or await its result() first")
            online = await self._ensure_session(required=self._offline is None)
            if not online:
                events()  # the items join the conversation; the device answers from it
                return self._offline_turn(response)
            to_send = events()
            turn = self._turn = Turn()
            turn._response = response
            try:
                for event in to_send:
                    await self._send(event)
            except GatewayUnreachable:
                if turn is not self._resume:  # a drained session: the turn starts on the next one
                    turn._finish(self.protocol.connection_lost() or _lost(turn))
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
        if self._ws is not None:
            with contextlib.suppress(GatewayUnreachable):
                await self._send(self.protocol.event("response.cancel"))
        return await asyncio.wait_for(turn.result(), self.silence_timeout)

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
        if self._ws is None:  # offline (or between sessions): the next session is restored from this
            item.text = item.text[:heard]
            return result
        await self._truncate(item, heard)
        return result

    async def retrieve_item(self, item_id: str) -> ConversationItem:
        """The server's copy of a conversation item (``conversation.item.retrieve``)."""
        if self._ws is None:
            raise GatewayUnreachable("not connected to the gateway")
        event = self.protocol.event("conversation.item.retrieve", item_id=item_id)
        retrieved = self._expect(("retrieved", item_id))
        refused = self._expect(("event", event["event_id"]))
        await self._send(event)
        try:
            finished, _ = await asyncio.wait({retrieved, refused}, timeout=self.request_timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
        finally:
            for key in (("retrieved", item_id), ("event", event["event_id"])):
                self._waiters.pop(key, None)
        if retrieved in finished:
            return retrieved.result()
        if refused in finished:
            error = refused.result()
            raise GatewayError(f"the gateway could not retrieve {item_id!r}: {error.code}: {error.message}")
        raise GatewayUnreachable("the gateway did not answer the retrieve in time")

    # --- the session ------------------------------------------------------------------------

    async def _ensure_session(self, *, required: bool) -> bool:
        """True once a session is open; False when it cannot be and ``required`` is False."""
        self._raise_if_closed()  # close() was called while this call waited for the lock
        if self._ws is not None:
            return True
        if self._reconnect_at is not None:
            return await self._reconnect_as_asked(required=required)
        now = time.monotonic()
        if not required and now - self._last_online_try < self.retry_online_s:
            return False  # offline, and the gateway was tried a moment ago
        self._last_online_try = now
        try:
            await self._open_with_backoff(attempts=self.backoff.attempts if required else 1)
        except GatewayUnreachable:
            if required:
                raise
            log.info("the gateway is unreachable: serving turns on the device")
            return False
        return True

    async def _reconnect_as_asked(self, *, required: bool) -> bool:
        """A drained session: wait until the time the gateway named, then reconnect with the
        whole backoff (another replica is there to take us, so the fallback is not tried first)."""
        assert self._reconnect_at is not None
        await asyncio.sleep(max(0.0, self._reconnect_at - time.monotonic()))
        self._reconnect_at = None
        self._last_online_try = time.monotonic()
        try:
            await self._open_with_backoff(attempts=self.backoff.attempts)
        except GatewayUnreachable:
            if required:
                raise
            log.info("the gateway is unreachable after a drain: serving turns on the device")
            return False
        return True

    async def _reconnect_after_drain(self) -> None:
        async with self._lock:
            try:
                await self._ensure_session(required=True)
            except ClientClosed:
                pass  # close() ended the reconnect: nothing to report
            except GatewayError as e:
                log.warning("could not reconnect after the gateway closed this session for a drain: %s", e)
        turn, self._resume = self._resume, None  # still here: no session could start it
        if turn is not None and not turn.done:
            turn._finish(self.protocol.connection_lost() or _lost(turn))

    async def _open_with_backoff(self, attempts: int) -> None:
        delays = self.backoff.delays(self._rng)
        for attempt in range(attempts):
            self._raise_if_closed()  # close() during the wait before this attempt
            try:
                await self._open()
                return
            except GatewayUnreachable:
                self._raise_if_closed()  # close() dropped the session this attempt was setting up
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(next(delays, self.backoff.max_delay))

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise ClientClosed()

    async def _open(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        subprotocols = [MSGPACK_SUBPROTOCOL] if self.framing == "msgpack" else None
        try:
            ws = await websockets.connect(self.ws_url, additional_headers=headers, subprotocols=subprotocols,
                                          open_timeout=self.connect_timeout, max_size=MAX_FRAME_BYTES,
                                          close_timeout=self.request_timeout)
        except InvalidStatus as e:
            status = e.response.status_code
            body = e.response.body.decode("utf-8", "replace")[:500] if e.response.body else ""
            if status >= 500:
                raise GatewayUnreachable(f"the gateway is not serving (HTTP {status}): {body}") from e
            raise GatewayRefused(status, body) from e
        except (OSError, TimeoutError, ssl.SSLError, InvalidHandshake, InvalidURI) as e:
            raise GatewayUnreachable(f"cannot reach the gateway at {self.ws_url}: {e}") from e
        if self._closed:  # close() returned while we connected: it could not close this one
            await _close_quietly(ws, self.request_timeout)
            raise ClientClosed()
        if self.framing == "msgpack" and ws.subprotocol != MSGPACK_SUBPROTOCOL:
            await ws.close()
            raise GatewayRefused(400, "the gateway does not speak msgpack framing")
        self._ws = ws
        created = self._expect(("session", "created"))
        self._reader = asyncio.create_task(self._read_loop(ws), name="rtgw-reader")
        try:
            await asyncio.wait_for(created, self.request_timeout)
        except (TimeoutError, GatewayUnreachable) as e:
            await self._drop_connection()
            raise GatewayUnreachable("the gateway accepted the connection but sent no session") from e
        if self._sessions:
            self.reconnects += 1
        self._sessions += 1
        if self._session.fields:
            await self._send(self.protocol.session_update(**self._session.fields))
        restore = self.protocol.restore_events()
        for event in restore:
            await self._send(event)
        if restore:
            log.info("restored %d conversation items on the new session", len(restore))
        turn, self._resume = self._resume, None
        if turn is not None and not turn.done:
            log.info("starting on the new session the turn the drained one had not begun")
            await self._send(self.protocol.event("response.create", **({"response": turn._response}
                                                                         if turn._response else {})))
        if self._closed:  # close() began while the session was set up (it waits on an offline turn)
            await self._drop_connection()
            raise ClientClosed()

    async def _drop_connection(self) -> None:
        ws, self._ws = self._ws, None
        reader, self._reader = self._reader, None
        if ws is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(), self.request_timeout)
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _send(self, event: dict[str, Any]) -> None:
        ws = self._ws
        if ws is None:
            raise GatewayUnreachable("not connected to the gateway")
        try:
            await asyncio.wait_for(ws.send(encode(event, self.framing)), self.request_timeout)
        except (ConnectionClosed, OSError, TimeoutError) as e:
            await self._lost(ws)
            raise GatewayUnreachable(f"the connection to the gateway was lost: {e}") from e

    def _expect(self, key: tuple[str, str]) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiters[key] = future
        return future

    def _resolve(self, key: tuple[str, str], value: Any) -> bool:
        future = self._waiters.pop(key, None)
        if future is None or future.done():
            return False
        future.set_result(value)
        return True

    async def _read_loop(self, ws: Any) -> None:
        try:
            while True:
                timeout = self.silence_timeout if self._turn is not None and not self._turn.done else None
                try:
                    frame = await asyncio.wait_for(ws.recv(), timeout)
                except TimeoutError:
                    log.warning("no server event for %.0f s during a turn: dropping the connection",
                                self.silence_timeout)
                    break
                try:
                    event = decode(frame)
                except FrameError as e:
                    log.warning("%s", e)
                    continue
                self._dispatch(event)
        except ConnectionClosed:
            pass
        finally:
            if self._ws is ws:
                self._ws = None
                self._after_close(ws)
                asyncio.get_running_loop().create_task(_close_quietly(ws, self.request_timeout))
            self._fail_pending(ws)

    async def _lost(self, ws: Any) -> None:
        if self._ws is ws:
            self._ws = None
            self._after_close(ws)
            await _close_quietly(ws, self.request_timeout)
        self._fail_pending(ws)

    def _after_close(self, ws: Any) -> None:
        """The session on ``ws`` is over. A gateway replica going away says so with 1001 and a
        reconnect hint, sent only once no response is in progress: come back after the time it
        names (to the same URL: the load balancer routes to a replica that stays), and keep a
        turn whose request the old session never took to start it on the new one."""
        rcvd = getattr(getattr(ws, "protocol", None), "close_rcvd", None)  # the server's close frame
        after_ms = reconnect_hint(rcvd.code, rcvd.reason) if rcvd is not None else None
        if after_ms is None or self._closed:
            return
        log.info("the gateway is draining this session: reconnecting in %d ms", after_ms)
        self._reconnect_at = time.monotonic() + after_ms / 1000
        turn = self._turn
        if turn is not None and not turn.done and not turn.offline and self.protocol.active_response_id is None:
            self._resume = turn
        if self._reconnect_task is None or self._reconnect_task.done():
            self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect_after_drain(),
                                                                          name="rtgw-reconnect")

    def _fail_pending(self, ws: Any) -> None:
        turn = self._turn
        if turn is not None and not turn.done and not turn.offline and turn is not self._resume:
            turn._finish(self.protocol.connection_lost() or _lost(turn))
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(GatewayUnreachable("the connection to the gateway was lost"))
        self._waiters.clear()

    def _dispatch(self, event: dict[str, Any]) -> None:
        turn = self._turn
        typed_events = self.protocol.receive(event)
        if event["type"] == "response.created" and self.protocol.active_response_id is not None:
            turn = self._response_started(self.protocol.active_response_id, turn)
        for typed in typed_events:
            if self._voice_dispatch(typed, turn):  # audio, transcripts, speech detection
                continue
            if isinstance(typed, SessionInfo):
                self._resolve(("session", "created"), typed)
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
                self._resolve(("truncated", typed.item_id), typed)
            elif isinstance(typed, ItemRetrieved):
                self._resolve(("retrieved", typed.item.id), typed.item)
            elif isinstance(typed, ServerError):
                self._on_error(typed)

    def _on_error(self, error: ServerError) -> None:
        if error.event_id and self._resolve(("event", error.event_id), error):
            return
        if self._voice_error(error):
            return
        turn = self._turn
        if turn is not None and not turn.done and not turn.offline and self.protocol.active_response_id is None:
            # The turn's own events were refused (e.g. rate limited) before a response started.
            turn._finish(TurnResult("", "failed", "", error={"type": "invalid_request_error", "code": error.code,
                                                             "message": error.message}))
            return
        log.warning("gateway error %s: %s", error.code, error.message)

    async def _truncate(self, item: Item, heard: int) -> None:
        event = self.protocol.truncate(item.id, heard)
        done = self._expect(("truncated", item.id))
        refused = self._expect(("event", event["event_id"]))
        await self._send(event)
        finished, _ = await asyncio.wait({done, refused}, timeout=self.request_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        for key, future in ((("truncated", item.id), done), (("event", event["event_id"]), refused)):
            if future not in finished:
                future.cancel()
            if self._waiters.get(key) is future:
                del self._waiters[key]
        if done in finished and done.exception() is None:
            return
        if refused in finished and refused.exception() is None:
            # A server without our x_text_end: replace the message with what was heard.
            log.info("the gateway refused the text truncate (%s); replacing the message instead",
                     refused.result().message)
            for replace in self.protocol.replace_events(item.id, item.text[:heard]):
                await self._send(replace)
            return
        raise GatewayUnreachable("the gateway did not confirm the truncate in time")

    # --- offline ----------------------------------------------------------------------------

    def _offline_turn(self, response: dict[str, Any]) -> Turn:
        previous = self._turn  # still ending when speech cut it off (barge-in): this one starts after it
        turn = self._turn = Turn(offline=True)
        turn.response_id = new_id("resp")
        instructions = str(self._session.fields.get("instructions") or "")
        turn._task = asyncio.create_task(self._run_offline(turn, instructions, list(self.protocol.items),
                                                           dict(self._session.fields), response, previous))
        return turn

    async def _run_offline(self, turn: Turn, instructions: str, history: list[ConversationItem],
                           session: dict[str, Any], response: dict[str, Any], previous: Turn | None = None) -> None:
        """The device's answer, told as the gateway's events (``DeviceResponse``) and received by the
        protocol core: its text, calls, result and conversation items are the online ones. Spoken
        when the session asks for audio (``rtgw/offline_voice.py``)."""
        model = self._offline
        assert model is not None
        try:
            await self._device_settle(previous)
        except asyncio.CancelledError:  # cancelled before it began: no events
            turn._finish(TurnResult(turn.response_id or "", "cancelled", "", reason=turn._cancel_reason, offline=True))
            return
        out = self._device_output(turn, session, response)
        device = out.device
        metadata = {"x_tier": "device"}
        self._offline_events(turn, device.created())
        parser = None
        status, reason, error, usage = "completed", None, None, {}
        try:
            await out.ready()  # a spoken answer: the voice models
            await self._device_transcripts()  # speech committed on the device: its words are the prompt's
            request = await model.prepare(instructions, history, session, response)
            parser = request.parser
            async for delta, finish in model.generate(request, max_output_tokens=response.get("max_output_tokens"),
                                                      temperature=response.get("temperature")):
                await out.write(parser.feed(delta) if parser else delta)
                if finish is not None:
                    status = {"stop": "completed", "length": "incomplete"}.get(finish, "failed")
                    reason = "max_output_tokens" if finish == "length" else None
                    usage = dict(model.last_usage)
            if parser is not None:
                held, parser = parser.finish(), None
                await out.write(held)  # held-back text; a call cut short
            await out.flush()  # the last phrase said
        except asyncio.CancelledError:
            status, reason = "cancelled", turn._cancel_reason
        except OfflineRequestError as e:  # what the gateway would refuse: failed, as a refused response online
            status, error = "failed", e.error
        except Exception as e:  # a broken local model ends this turn, not the client, and says why
            failure = e if isinstance(e, OfflineModelError) else OfflineModelError(f"the on-device model failed: {e}")
            log.error("%s", failure)
            turn._error = failure
            status, error = "failed", {"type": "device_error", "code": "offline_failed", "message": str(failure)}
        out.close()  # speech not sent yet is not said
        if parser is not None:
            out.leftover(parser.finish())  # ended early: held-back text; a call cut short
        self._offline_events(turn, device.finish(status, reason=reason, error=error, usage=usage, metadata=metadata))

    def _offline_events(self, turn: Turn | None, events: list[dict[str, Any]]) -> None:
        for event in events:
            for typed in self.protocol.receive(event):
                if self._device_voice_event(typed, turn):  # speech and transcripts (device voice)
                    continue
                if turn is None:
                    continue
                if isinstance(typed, TextDelta):
                    turn._push(typed.text)
                elif isinstance(typed, FunctionCall):
                    turn._call(typed)
                elif isinstance(typed, TurnResult):
                    turn._finish(replace(typed, offline=True))


def _lost(turn: Turn) -> TurnResult:
    return TurnResult(turn.response_id or "", "failed", "", error={
        "type": "connection_error", "code": "connection_lost", "message": "the connection to the gateway was lost"})


async def _close_quietly(ws: Any, timeout: float) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ws.close(), timeout)


def realtime_url(url: str, model: str | None) -> str:
    """``http://host:port`` (or ws://, or a full /v1/realtime URL) -> the session's ws(s) URL."""
    parts = urllib.parse.urlsplit(url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise ValueError(f"not a gateway URL: {url!r}")
    path = parts.path.rstrip("/")
    if not path.endswith("/realtime"):
        path = (path if path.endswith("/v1") else path + "/v1") + "/realtime"
    query = urllib.parse.parse_qs(parts.query)
    if model:
        query["model"] = [model]
    return urllib.parse.urlunsplit((scheme, parts.netloc, path, urllib.parse.urlencode(query, doseq=True), ""))
