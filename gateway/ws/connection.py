"""The thin asyncio adapter around one ``RealtimeSession``.

Three kinds of task touch a connection: the handler task reads client frames
(``_read_loop``), one task per generation feeds engine events, and one writer task drains the
``Outbox``. All of them hand what they got to the sans-I/O session and then call ``_pump``,
which carries out the session's commands (start or abort an engine request) and queues its
events. Aborts are awaited before the events drained with them are queued, so a client that
sees ``response.done`` with ``cancelled`` knows the engine has let go of the request.

A server-side close runs in its own task (``close``, or ``drain``: close at the first moment
no response is in progress). From the moment it is decided no client frame is taken any more,
and the teardown waits for it, so what was queued before the close frame is still sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import WSMsgType, web

from gateway.auth import RateLimitedError
from gateway.cascade.router import Router
from gateway.config import ServerConfig
from gateway.limits import LimitsStore, LimitsUnavailableError
from gateway.metrics import GatewayMetrics
from gateway.shaping import Grammars
from gateway.turns import Turn
from gateway.ws.client_frames import ClientFrames
from gateway.ws.codec import FrameCodec
from gateway.ws.commands import AbortGeneration, AdmitResponse, DropForesight, Foresee, StartGeneration
from gateway.ws.foreseen import AnswersAhead
from gateway.ws.frame_gate import FrameGate
from gateway.ws.outbox import Outbox
from gateway.ws.server_events import ErrorEvent, ResponseDone, ServerEvent, TextDelta
from gateway.ws.session import RealtimeSession
from gateway.ws.transport_writer import TransportWriter
from gateway.ws.voice_link import VoiceLink, VoiceService
from llm_shared.contract import Engine, FinishEvent, Priority, StreamEvent, TokenEvent
from llm_shared.errors import EngineError, InvalidRequestError

log = logging.getLogger(__name__)

# How long teardown waits for aborted generations to end before cancelling their tasks.
ABORT_GRACE_S = 5.0
CLOSE_TIMEOUT_S = 2.0
END_SESSION_TIMEOUT_S = 5.0  # an engine that cannot forget a session in time only keeps a cache longer

WS_CLOSE_OK = 1000
WS_CLOSE_GOING_AWAY = 1001
WS_CLOSE_POLICY = 1008
WS_CLOSE_INTERNAL_ERROR = 1011


class RealtimeConnection:
    """One accepted WebSocket session. ``run`` returns when the connection is over and every
    engine request it started has been aborted or has finished."""

    def __init__(
        self,
        ws: web.WebSocketResponse,
        session: RealtimeSession,
        *,
        session_id: str,
        codec: FrameCodec,
        router: Router,
        limits: LimitsStore,
        key_id: str,
        metrics: GatewayMetrics,
        config: ServerConfig,
        transport: asyncio.Transport | None = None,
        grammars: Grammars | None = None,
        voice: VoiceService | None = None,
        gate: FrameGate | None = None,
    ) -> None:
        """``transport``: the request's, once the WebSocket is prepared; it gives the outbox its
        fast lane (without it every frame goes through the writer task). ``grammars``: the
        gateway's compilers, which turn a response's tools into the grammar its engine enforces
        (without them a response that may call tools is refused). ``voice``: speech recognition and
        synthesis (the session was made with its hooks; without it the session refuses audio).
        ``gate``: the frame gate in front of this socket's parser, which lets large appends in
        within the server's budget (without it every frame is as small as aiohttp allows)."""
        self.session = session
        self.session_id = session_id
        self.key_id = key_id
        self._ws = ws
        self._router = router
        self._limits = limits
        self._metrics = metrics
        self._config = config
        self._grammars = grammars
        self._outbox = Outbox(codec.encode_event, high=config.send_queue_high, limit=config.send_queue_limit,
                              max_bytes=config.send_queue_max_bytes,
                              direct=TransportWriter(ws, transport) if transport is not None else None)
        self._tasks: dict[str, asyncio.Task[None]] = {}  # response id -> its generation task
        self._turns: dict[str, Turn] = {}  # response id -> its turn, once created
        self._engines_used: set[Engine] = set()  # told at teardown that this conversation is over
        self._aborted: set[str] = set()  # aborted before the engine request started
        self._writer: asyncio.Task[None] | None = None
        self._closing = False  # set the moment a close is decided: no client frame is taken after it
        self._close_task: asyncio.Task[None] | None = None  # a server-side close: flush, then the close frame
        self._drain_reason: str | None = None  # draining: the close reason to use once no response is active
        self._pump_lock = asyncio.Lock()
        self._pump_task: asyncio.Task[None] | None = None  # a pump asked for by synchronous code
        self._too_slow_cancelled: str | None = None
        self._voice = (VoiceLink(voice, session, self._pump_soon, metrics,
                                 spend=lambda seconds: limits.spend_audio(key_id, seconds))
                       if voice is not None else None)
        self._ahead = AnswersAhead(self._turn, self._turns, on_engine=self._engines_used.add,
                                   deliver=self._engine_event, ended=self._pump_soon, speech=self._voice,
                                   counted=lambda outcome: metrics.foresight.labels(outcome).inc())
        self._gate = gate
        self._frames = ClientFrames(codec, gate, session, metrics, config.max_frame_bytes)
        if gate is not None:
            gate.on_refused = self._refusals_due

    @property
    def outbox(self) -> Outbox:
        return self._outbox

    # ----- lifecycle -------------------------------------------------------------------

    async def run(self) -> None:
        self._writer = asyncio.create_task(self._write_loop(), name=f"ws-writer-{self.session_id}")
        try:
            self.session.start()
            await self._pump()
            await self._read_loop()
        finally:
            # Shielded: a handler cancelled by a lost connection must still free engine work.
            await asyncio.shield(self._teardown())

    async def close(self, code: int, reason: str, *, cancel_reason: str | None = None) -> None:
        """Close from the server side: end any active response (its ``response.done`` is sent
        first, within the grace period), then the close frame with ``code`` and ``reason``.
        A close already under way (a drain's) is waited for instead."""
        if not self._closing:
            self._begin_close(code, reason, cancel_reason)
        if self._close_task is not None:
            await asyncio.shield(self._close_task)

    def drain(self, reason: str) -> None:
        """Close with 1001 and ``reason`` at the first moment no response is in progress: now when
        idle, else right after the active response's ``response.done`` (and whatever came with
        it) is queued. ``close`` still cancels a response that does not end in time."""
        if self._closing or self._drain_reason is not None:
            return
        self._drain_reason = reason
        self._close_if_drained()

    @property
    def closed(self) -> bool:
        """A close has been decided (by either side)."""
        return self._closing

    def _close_if_drained(self) -> None:
        # Not before ``run`` has started (a session accepted as the drain began): its first pump closes it.
        started = self._writer is not None
        if started and self._drain_reason is not None and not self._closing and self.session.active_response_id is None:
            self._begin_close(WS_CLOSE_GOING_AWAY, self._drain_reason, None)

    def _begin_close(self, code: int, reason: str, cancel_reason: str | None) -> None:
        self._closing = True  # synchronously, so the reader takes no client frame after this point
        self._close_task = asyncio.create_task(self._close(code, reason, cancel_reason),
                                               name=f"ws-close-{self.session_id}")

    async def _close(self, code: int, reason: str, cancel_reason: str | None) -> None:
        if cancel_reason is not None:
            self.session.cancel_active(cancel_reason)
        await self._pump()  # what the session produced before the close goes out before it
        self._outbox.close()
        if self._writer is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._writer), self._config.shutdown_grace_s)
            except TimeoutError:
                self._writer.cancel()  # the client is not reading; stop waiting for it
        with contextlib.suppress(TimeoutError, ConnectionError):
            await asyncio.wait_for(self._ws.close(code=code, message=reason.encode()), CLOSE_TIMEOUT_S)

    async def _teardown(self) -> None:
        self._closing = True
        if self._gate is not None:
            self._gate.close()  # the large frames this socket held go back to the server's budget
        if self._close_task is not None:
            # A server-side close is flushing the queue: let it finish (it is bounded) before
            # the queue is discarded, or the client would miss what came before the close frame.
            with contextlib.suppress(Exception):
                await asyncio.shield(self._close_task)
        # Whatever ended the connection, no generation outlives it (nor speech being made for it).
        self.session.cancel_active("client_disconnected")
        self.session.ended()
        self._outbox.discard()
        await self._pump()
        if self._voice is not None:
            await self._voice.close()
        self._ahead.drop()
        for response_id in list(self._turns):
            await self._abort(response_id)
        tasks = list(self._tasks.values()) + list(self._ahead.tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=ABORT_GRACE_S)
            for task in pending:
                log.warning("a generation did not end after abort; cancelling its task")
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        await self._end_session()
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
        if not self._ws.closed:
            with contextlib.suppress(TimeoutError, ConnectionError):
                await asyncio.wait_for(self._ws.close(code=WS_CLOSE_GOING_AWAY, message=b"session ended"),
                                       CLOSE_TIMEOUT_S)

    async def _end_session(self) -> None:
        """Let every tier that served this session drop what it kept for its next turn (the
        edge tier's idle KV and host snapshots), within a bounded wait each."""
        for engine in self._engines_used:
            try:
                await asyncio.wait_for(engine.end_session(self.session_id), END_SESSION_TIMEOUT_S)
            except TimeoutError:
                log.warning("the %s engine did not end session %s within %.0f s; its cache stays until evicted",
                            engine.tier, self.session_id, END_SESSION_TIMEOUT_S)
            except EngineError as e:
                log.warning("the %s engine did not end session %s: %s", engine.tier, self.session_id, e.message)
        self._engines_used.clear()

    # ----- reading ---------------------------------------------------------------------

    async def _read_loop(self) -> None:
        loop = asyncio.get_running_loop()
        idle = self._config.idle_timeout_s
        deadline = loop.time() + idle
        while not self._closing:
            # Backpressure: while the client is behind on reading, stop taking its events; one
            # that stays behind is closed (its queue is bounded in bytes, not only in frames).
            try:
                if self._outbox.writable:
                    # One client frame per turn of the event loop: a client that sent many at once
                    # must not hold the loop while other sessions' tokens wait. (A bare yield; a
                    # wait_for here made a task per frame.)
                    await asyncio.sleep(0)
                else:
                    await asyncio.wait_for(self._outbox.wait_writable(), self._config.slow_client_timeout_s)
            except TimeoutError:
                queued = self._outbox.queued_bytes
                log.info("session %s: client not reading (%d bytes queued); closing it", self.session_id, queued)
                self._metrics.cancels.labels("realtime", "client_too_slow").inc()
                await self.close(WS_CLOSE_POLICY, f"client too slow: {queued // 1024} KiB of events unread for "
                                 f"{self._config.slow_client_timeout_s:g} s", cancel_reason="client_too_slow")
                return
            if self._closing:
                return
            try:
                msg = await self._ws.receive(timeout=max(0.001, deadline - loop.time()))
            except TimeoutError:
                if self.session.active_response_id is not None:
                    deadline = loop.time() + idle  # a client waiting for output is not idle
                    continue
                await self.close(WS_CLOSE_OK, f"idle timeout: no client event for {idle:g} s")
                return
            if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                return  # CLOSE, CLOSING, CLOSED or ERROR (aiohttp already sent the close code, e.g. 1009)
            if self._closing:
                return  # the server is closing: this frame came too late to be taken
            # A large append's text must not outlive its decoding: the frame is handed over, not kept here.
            frame = [msg.data]
            kind = msg.type
            del msg
            await self._take(kind, frame)
            deadline = loop.time() + idle
            await self._pump()

    async def _take(self, kind: WSMsgType, frame: list[str | bytes]) -> None:
        """One client frame (taken out of ``frame``: its text is let go once decoded), through to
        the session (a ``response.create`` once the key admits it)."""
        event = self._frames.event(kind, frame.pop())
        try:
            if event is not None and (event.get("type") != "response.create" or await self._admit()):
                self.session.receive(event)
        finally:
            self._frames.handled()

    def _refusals_due(self) -> None:
        """The gate dropped a frame and nothing before it is still to be handled: tell the client now."""
        if not self._closing and self._frames.refusals():
            self._pump_soon()

    async def _admit(self) -> bool:
        """A ``response.create`` takes one of the key's requests (a round trip when the limits are
        shared; later frames wait behind it, so events keep their order); False after telling the
        session why not."""
        try:
            await self._limits.admit(self.key_id)
        except RateLimitedError as e:
            self._metrics.rate_limited.labels("realtime").inc()
            self.session.receive_invalid(e.code, e.message)
            self.session.rate_limits(self._limits.peek(self.key_id).rate_limits())
            return False
        except LimitsUnavailableError as e:
            self.session.receive_invalid(e.code, e.message)
            return False
        return True

    # ----- the session's commands and events ---------------------------------------------

    async def _pump(self) -> None:
        # One pump at a time: events drained before an awaited abort must be queued before
        # events another task drains meanwhile, or the client would see them out of order.
        if not self._pump_now():
            async with self._pump_lock:
                while await self._pump_once():
                    pass
        self._close_if_drained()  # a draining session closes right after its response.done

    def _pump_now(self) -> bool:
        """The common case (a token's events, no command) needs no lock: with no pump holding it,
        nothing can run between draining the session and queueing what it gave. True when
        nothing is left for a pump under the lock."""
        session = self.session
        if not self._pump_lock.locked() and not session.has_commands:
            self._queue(session.events_to_send())
        return not (session.has_commands or session.has_events)

    async def _pump_once(self) -> bool:
        commands = self.session.commands()
        events = self.session.events_to_send()
        if not commands and not events:
            return False
        for command in commands:
            if isinstance(command, StartGeneration):
                self._start(command)
            elif isinstance(command, AbortGeneration):
                await self._abort(command.response_id)
            elif isinstance(command, Foresee) and (command.request.constraints is None or self._grammars is not None):
                self._ahead.start(command)
            elif isinstance(command, Foresee | DropForesight):  # (one this server could not run replaces the last too)
                self._ahead.drop()
            elif isinstance(command, AdmitResponse):  # server VAD's turn: charged like a client's
                self.session.response_admitted(await self._admit())
            elif self._voice is not None:
                self._voice.run(command)
        events += self.session.events_to_send()  # what starting produced (an early refusal), in one write
        self._queue(events)
        return True

    def _queue(self, events: list[ServerEvent]) -> None:
        if not events:
            return
        outbox = self._outbox
        for event in events:
            if not isinstance(event, TextDelta):
                self._observe(event)
        merged = outbox.coalesced
        outbox.put_all(events)
        if outbox.coalesced > merged:
            self._metrics.coalesced.inc(outbox.coalesced - merged)
        active = self.session.active_response_id
        if outbox.over_limit and active is not None and active != self._too_slow_cancelled:
            self._too_slow_cancelled = active
            log.info("client too slow: cancelling %s with %d frames queued", active, len(outbox))
            self.session.cancel_active("client_too_slow")  # its events are drained next round

    def _observe(self, event: ServerEvent) -> None:
        if self._voice is not None and self._voice.observe(event):
            return
        if isinstance(event, ErrorEvent):
            self._metrics.errors.labels("realtime", event.code).inc()
        elif isinstance(event, ResponseDone):
            if event.status == "cancelled":
                self._metrics.cancels.labels("realtime", str(event.reason)).inc()
            elif event.status == "failed":
                self._metrics.errors.labels("realtime", str(event.error_code)).inc()

    def _turn(self, command: StartGeneration) -> Turn:
        return Turn(router=self._router, model=command.model, messages=command.messages, params=command.params,
                    priority=Priority.REALTIME, request_id=command.response_id, api="realtime",
                    metrics=self._metrics, limits=self._limits, key_id=self.key_id, session_id=self.session_id,
                    abort_timeout_s=self._config.engine_abort_timeout_s, grammars=self._grammars,
                    constraints=command.constraints, cuts=command.cuts)

    def _start(self, command: StartGeneration) -> None:
        rid = command.response_id
        if self._ahead.adopt(command, self.session):  # the answer started before the turn ended
            return
        if command.constraints is not None and self._grammars is None:
            # Never run a turn that may call tools without its grammar (its calls would be unchecked).
            self.session.engine_failed(rid, InvalidRequestError("this server cannot enforce tool calls",
                                                                param="tools"))
            return
        # With tools, the grammar is compiled at prepare for the chosen engine's tokenizer; a schema
        # it cannot enforce fails the response with an error naming the field (RealtimeSession.engine_failed).
        turn = self._turn(command)
        try:
            turn.choose()
        except EngineError as e:
            # Refused in the step that asked (overload, no tier ready): no task, no tokenizing, and
            # its response.done leaves with its response.created.
            self.session.engine_failed(rid, e)
            return
        except Exception:  # a bug in routing must end this response, not the connection
            log.exception("routing %s failed", rid)
            self.session.engine_failed(rid, EngineError("the gateway failed to route the response"))
            return
        task = asyncio.create_task(self._generate(turn), name=f"generate-{rid}")
        self._tasks[rid] = task
        task.add_done_callback(lambda _: self._tasks.pop(rid, None))

    async def _abort(self, response_id: str) -> None:
        if response_id in self._tasks:
            # Its task may not have started the engine request yet (an abort then is a no-op in
            # the engine); the task checks this set right before it does.
            self._aborted.add(response_id)
        turn = self._turns.get(response_id)
        if turn is not None:
            await turn.abort()

    async def _generate(self, turn: Turn) -> None:
        rid = turn.request_id
        if rid in self._aborted:
            self._aborted.discard(rid)
            return
        self._turns[rid] = turn
        try:
            try:
                self._engines_used.add(await turn.prepare())
                if turn.dropped and turn.sticky_cut:
                    self.session.context_truncated(turn.dropped)
                if rid in self._aborted:
                    return
                await turn.run(lambda event: self._engine_event(rid, turn, event))
            except EngineError as e:
                self.session.engine_failed(rid, e)
            except Exception:  # a bug in an engine must end this response, not the connection
                log.exception("generation %s failed", rid)
                self.session.engine_failed(rid, EngineError("the engine failed while generating"))
            await self._pump()
        finally:
            self._turns.pop(rid, None)
            self._aborted.discard(rid)
            await turn.aclose()

    def _engine_event(self, rid: str, turn: Turn, event: StreamEvent) -> None:
        """One engine event of ``turn`` (response ``rid``), called from the engine's step
        (``Turn.run``): into the session, and its events out at once."""
        session = self.session
        if type(event) is TokenEvent and not self._pump_lock.locked():
            # Most events: a token whose one event is its delta, with nothing ahead of it (no pump
            # holding drained events while it awaits an abort, nothing queued in the session).
            delta = session.engine_token(rid, event)
            if delta is not None:
                if self._outbox.send_now(delta):
                    return
                self._queue([delta])
                if not (session.has_commands or session.has_events):  # e.g. cancelled as too slow
                    return
        elif isinstance(event, FinishEvent):
            session.route(rid, turn.route.metadata())
            session.engine_event(rid, event)
            session.rate_limits(self._limits.peek(self.key_id).rate_limits())
        else:
            session.engine_event(rid, event)
        self._pump_soon()

    def _pump_soon(self) -> None:
        """``_pump`` from synchronous code: the events go out now in the common case (no command,
        no pump awaiting an abort); otherwise a pump task takes them, in order, after the one running."""
        if self._pump_now():
            self._close_if_drained()
        elif self._pump_task is None or self._pump_task.done():
            self._pump_task = asyncio.create_task(self._pump(), name=f"ws-pump-{self.session_id}")

    # ----- writing ---------------------------------------------------------------------

    async def _write_loop(self) -> None:
        ws = self._ws
        try:
            while (frame := await self._outbox.get()) is not None:
                if isinstance(frame, str):
                    await ws.send_str(frame)
                else:
                    await ws.send_bytes(frame)
        except ConnectionError:
            pass  # the client is gone; the reader sees the close next
        except Exception:
            log.exception("session %s: sending failed", self.session_id)
            with contextlib.suppress(TimeoutError, ConnectionError):
                await asyncio.wait_for(self._ws.close(code=WS_CLOSE_INTERNAL_ERROR, message=b"internal error"),
                                       CLOSE_TIMEOUT_S)
        finally:
            self._outbox.discard()  # nothing will send any more: the reader must not wait on the queue

