"""The adapter's side of answering ahead (``gateway.ws.foresight``): the engine request started
before a turn ended, its events held until the turn's response takes it over.

One is held per connection. Its events wait in a list bounded by the request's own
``max_tokens`` (one ``TokenEvent`` a token, a few bytes of text each, then the ``FinishEvent``);
it is aborted when dropped, when another is started, when the response started is another
request, when the connection ends, and when nothing took it over within ``hold_s``. A request
that fails before it is taken over is forgotten (the response then starts its own, which says
why). The tokens it made count against the key's budget like any turn's (``Turn`` settles them),
taken over or not: a client cannot make the server compute for free by pausing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from gateway.turns import Turn
from gateway.ws.commands import Foresee, StartGeneration
from gateway.ws.session import RealtimeSession
from gateway.ws.speech_out import PhraseSplitter, SpeechOut
from llm_shared.contract import Engine, FinishEvent, StreamEvent, TokenEvent
from llm_shared.errors import EngineError

log = logging.getLogger(__name__)

# Longer than any wait for a turn's end (server VAD's silence_duration_ms is at most 10 s,
# semantic_vad's bound 3 s): a turn that ends never finds its answer expired (whose id it then
# could not reuse while the engine was still aborting it), and one that never ends frees it.
HOLD_S = 30.0


class ForeseenAnswer:
    """One engine request started ahead: ``adopt`` hands its events, held and to come, to a response."""

    def __init__(self, turn: Turn, *, on_engine: Callable[[Engine], None], hold_s: float = HOLD_S,
                 speech: SpeechOut | None = None) -> None:
        """``on_engine``: told the engine chosen (the connection ends the session there at its end);
        ``speech``: where the answer will be spoken, its phrases cut as the response's will be: the
        held tokens are fed to it until it asks for its first phrase (to speak that one ahead)."""
        self.turn = turn
        self._speech = speech
        self.failed = False
        self._held: list[StreamEvent] = []
        self._deliver: Callable[[StreamEvent], None] | None = None
        self._fail: Callable[[EngineError], None] | None = None
        self._ended: Callable[[], None] | None = None
        self._on_engine = on_engine
        loop = asyncio.get_running_loop()
        self.task = loop.create_task(self._run(), name=f"foresee-{turn.request_id}")
        self._expiry = loop.call_later(hold_s, self.drop)

    @property
    def adopted(self) -> bool:
        return self._deliver is not None

    def adopt(self, deliver: Callable[[StreamEvent], None], fail: Callable[[EngineError], None],
              ended: Callable[[], None]) -> bool:
        """From now on its events go to ``deliver`` (those held first, at once), a failure to
        ``fail``, and ``ended`` is called once the request is over (at once if it is already).
        False where it cannot be taken over (it failed, or was dropped)."""
        if self.failed or self.task.cancelled() or (self.task.done() and not self._held):
            return False
        self._expiry.cancel()
        self._deliver, self._fail, self._ended = deliver, fail, ended
        held, self._held = self._held, []
        for event in held:
            deliver(event)
        if self.task.done():
            ended()
        return True

    def drop(self) -> None:
        """Not taken over: abort the engine request (the task's clean-up does) and forget the events."""
        self._expiry.cancel()
        if self._deliver is None:
            self._held.clear()
            self.task.cancel()

    async def _run(self) -> None:
        turn = self.turn
        try:
            self._on_engine(await turn.prepare())
            if turn.aborted:
                return  # taken over, then cancelled while its prompt was being prepared
            await turn.run(self._event)
        except EngineError as e:
            self._failed(e)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug in an engine must end this request, not the connection
            log.exception("answer ahead %s failed", turn.request_id)
            self._failed(EngineError("the engine failed while generating"))
        finally:
            await turn.aclose()  # shielded: a dropped answer frees its engine work
            if self._ended is not None:
                self._ended()

    def _event(self, event: StreamEvent) -> None:
        if self._deliver is not None:
            self._deliver(event)
            return
        self._held.append(event)
        speech = self._speech
        if speech is None:
            return
        if isinstance(event, TokenEvent):
            speech.feed(event.text)
        elif isinstance(event, FinishEvent) and event.reason in ("stop", "length"):
            speech.feed(event.text or "")
            speech.flush()  # the rest is the last phrase, as at a response's end
        if speech.pending:
            self._speech = None  # its first phrase is asked for: the rest is the response's

    def _failed(self, error: EngineError) -> None:
        if self._fail is not None:
            self._fail(error)
        else:
            self.failed = True
            self._held.clear()


class SpeechAhead(Protocol):
    """The connection's voice, as an answer started ahead speaks its first phrase (``VoiceLink``)."""

    def phrases(self) -> PhraseSplitter: ...

    def speak_ahead(self, response_id: str, text: str, voice: str) -> None: ...

    def drop_ahead(self) -> None: ...


class AnswersAhead:
    """A connection's answer started ahead (at most one) and the tasks of those still ending."""

    def __init__(self, make_turn: Callable[[StartGeneration], Turn], turns: dict[str, Turn], *,
                 on_engine: Callable[[Engine], None], deliver: Callable[[str, Turn, StreamEvent], None],
                 ended: Callable[[], None], counted: Callable[[str], None], hold_s: float = HOLD_S,
                 speech: SpeechAhead | None = None) -> None:
        """``make_turn``: the connection's turn for a request; ``turns``: the connection's turns
        by response id (an answer taken over joins them until it ends); ``deliver(response_id,
        turn, event)``: an engine event into the session; ``ended``: a response's request ended
        (the connection pumps); ``counted(outcome)``: the metric; ``speech``: where a spoken
        answer's first phrase is spoken ahead (None: the server has no voice)."""
        self._speech = speech
        self._make_turn = make_turn
        self._turns = turns
        self._deliver = deliver
        self._ended = ended
        self._on_engine = on_engine
        self._counted = counted
        self._hold_s = hold_s
        self._held: ForeseenAnswer | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    def start(self, command: Foresee) -> None:
        self.drop()
        turn = self._make_turn(command.request)
        try:
            turn.choose()
        except EngineError:  # no room now: the response, if the turn ends, asks again
            self._counted("refused")
            return
        held = ForeseenAnswer(turn, on_engine=self._on_engine, hold_s=self._hold_s,
                              speech=self._speech_out(turn.request_id, command.voice))
        self._held = held
        self.tasks.add(held.task)
        held.task.add_done_callback(self.tasks.discard)

    def _speech_out(self, response_id: str, voice: str | None) -> SpeechOut | None:
        """For an answer spoken in ``voice``: phrases cut as its response will cut them, the first
        one spoken ahead (None: not spoken, or no voice on this server)."""
        speech = self._speech
        if speech is None or voice is None:
            return None

        def first_phrase(index: int, text: str) -> None:
            if index == 0:
                speech.speak_ahead(response_id, text, voice)

        return SpeechOut(speech.phrases(), first_phrase)

    def drop(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.drop()
            if self._speech is not None:
                self._speech.drop_ahead()
            self._counted("dropped")

    def adopt(self, command: StartGeneration, session: RealtimeSession) -> bool:
        """``command``'s response takes over the answer started ahead where the session says it is
        that request (``foreseen``, the same response id); any other is dropped. False: start the
        response's own request."""
        held = self._held
        if held is None or not command.foreseen or held.turn.request_id != command.response_id:
            self.drop()
            return False
        self._held = None
        rid, turn = command.response_id, held.turn
        self._turns[rid] = turn
        if turn.dropped and turn.sticky_cut:
            session.context_truncated(turn.dropped)

        def ended() -> None:
            self._turns.pop(rid, None)
            self._ended()

        if not held.adopt(lambda event: self._deliver(rid, turn, event),
                          lambda error: session.engine_failed(rid, error), ended):
            self._turns.pop(rid, None)
            self._counted("failed")
            return False
        self._counted("adopted")
        return True
