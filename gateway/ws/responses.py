"""The server events of one response, in the order the Realtime API defines.

``ResponseStream`` owns one response from ``response.created`` to ``response.done``: it opens
the assistant message on the first text, streams deltas into it (and into the conversation
when the response belongs to it), and closes everything with exactly one ``response.done``.
After that it emits nothing more; the session drops it and ignores whatever arrives late.

An audio response (``output_modalities: ["audio"]``) speaks its text instead: the text is cut
into phrases (``SpeechOut``), each phrase's audio is asked of the adapter, and the phrases go out
in order as ``response.output_audio_transcript.delta`` with their ``response.output_audio.delta``s.
Its ``response.done`` waits for the last phrase's audio; events that follow text still being
spoken (a tool call after it) wait with it, so output items stay sequential. A cancel ends it at
once with the text whose audio was sent.

A response that may call tools has its output parsed by the model family's parser
(``CallStream``): answer text goes to the message as above, and each call becomes an output
item of its own (``function_call``), its arguments streamed as
``response.function_call_arguments.delta`` and closed with ``.done``. Output items are
sequential, as in the API: a message is done before the first call after it is added.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from gateway.shaping import CallStream
from gateway.ws.audio_events import PCM_RATE, AudioSettings
from gateway.ws.commands import Synthesize
from gateway.ws.conversation import AnyItem, Conversation, FunctionCall, Item
from gateway.ws.server_events import Emitter, TextDelta
from gateway.ws.speech_out import SpeechOut, audio_ms
from gateway.ws.wire import item_wire, response_wire, usage_wire
from llm_shared.contract import FinishEvent
from llm_shared.realtime_order import ResponseOrder
from llm_shared.structured import ArgumentsDelta, CallDone, CallStarted, ToolCallEvent
from llm_shared.structured import TextDelta as ParsedText
from voice.alignment import Alignment, Mark

AUDIO_CHUNK_MS = 500  # audio deltas of at most half a second


class ResponseStream:
    def __init__(
        self,
        *,
        response_id: str,
        conversation: Conversation | None,  # None: out-of-band (conversation "none")
        conversation_id: str,
        max_output_tokens: int | str,  # as reported ("inf" or int)
        temperature: float,
        metadata: dict[str, str] | None,
        beta: bool,
        ids: Callable[[str], str],
        events: Emitter,
        calls: CallStream | None = None,  # the output may hold tool calls: parse it
        audio: AudioSettings | None = None,  # the session's audio settings with this response's overrides
        speech: Callable[[Callable[[int, str], None]], SpeechOut] | None = None,  # makes the phrase queue
    ) -> None:
        self.id = response_id
        self.item: Item | None = None  # the message being written (opened on the first text, closed before a call)
        self.output: list[AnyItem] = []  # every output item, in order (response.done's output)
        self.tokens = 0  # tokens seen, the usage of a response cancelled before the engine reports
        self.done = False
        self._conversation = conversation
        self._conversation_id = conversation_id
        self._max_output_tokens = max_output_tokens
        self._temperature = temperature
        self._metadata = metadata
        self._extra_metadata: dict[str, str] = {}
        self._beta = beta
        self._ids = ids
        self._events = events
        self._order = ResponseOrder(response_id, lambda ga_type, fields: events.emit(ga_type, **fields), beta=beta)
        self._calls = calls
        self._call_ids = calls  # kept after the parser is done: calls waiting for speech still need their ids
        self._message_index = 0  # output_index of the open message
        self._open_calls: dict[int, tuple[FunctionCall, int]] = {}  # parser index -> (item, output_index)
        self._audio = audio
        self.voice = audio.voice if audio is not None else ""
        self.in_conversation = conversation is not None
        self.held = False  # created, not started: its prompt waits for a transcript
        # Speaking: the phrases it asks for wait for the session to take them (``take_phrases``).
        self._phrases: list[Synthesize] = []
        self._speech = speech(lambda i, text: self._phrases.append(
            Synthesize(response_id=self.id, index=i, text=text, voice=self.voice))) \
            if speech is not None and audio is not None and audio.output_audio else None
        self._speaks = self._speech is not None
        self._waiting: list[ToolCallEvent] = []  # parsed events behind text still being spoken
        self._final: tuple[str, str | None, dict[str, str] | None, tuple[int, int, int]] | None = None
        self.audio_ms = 0  # speech sent

    def take_phrases(self) -> list[Synthesize]:
        """The phrases asked to be spoken since the last call, as commands."""
        phrases, self._phrases = self._phrases, []
        return phrases

    @property
    def needs_slot(self) -> bool:
        """True while this response will still add its first item to the conversation."""
        return self._conversation is not None and not self.output and not self.done

    def owns(self, item_id: str) -> bool:
        """``item_id`` is one of this response's output items."""
        return any(item.id == item_id for item in self.output)

    def created(self) -> None:
        self._events.emit("response.created", response=self._wire("in_progress", None, None))

    @property
    def speaks(self) -> bool:
        """An audio response (from its creation to its end)."""
        return self._speaks

    @property
    def speaking(self) -> bool:
        """Phrases were asked for whose audio has not been sent."""
        return self._speech is not None and self._speech.pending

    def token(self, text: str) -> None:
        self.tokens += 1
        if text:
            self._output(text)

    def token_delta(self, text: str) -> TextDelta | None:
        """``token`` in the common case, a token with text once the message is open: its one event,
        the delta, is returned rather than queued (the caller sends it next). None where ``token``
        would queue something else too (the message's opening events, a parsed call) or nothing."""
        item = self.item
        if item is None or not text or self._calls is not None or self._speech is not None:
            self.token(text)
            return None
        self.tokens += 1
        return self._text(item, text)

    def annotate(self, metadata: dict[str, str]) -> None:
        """Extension keys added to the client's metadata in ``response.done``."""
        self._extra_metadata.update(metadata)

    def engine_finished(self, event: FinishEvent) -> None:
        if event.text:
            self._output(event.text)
        if event.tier:
            self._extra_metadata["x_tier"] = event.tier
        tokens = (event.prompt_tokens, event.completion_tokens, event.cached_tokens)
        if event.reason == "stop":
            final: tuple[str, str | None, dict[str, str] | None] = ("completed", None, None)
        elif event.reason == "length":
            final = ("incomplete", "max_output_tokens", None)
        elif event.reason == "abort":
            # Our own aborts end the response before the engine confirms them; an abort we did
            # not ask for is the engine giving up (e.g. shutting down).
            final = ("cancelled", "engine_aborted", None)
        else:
            final = ("failed", None, {"type": "server_error", "code": "engine_error",
                                      "message": event.message or "the engine failed while generating"})
        speech = self._speech
        if speech is not None and final[0] in ("completed", "incomplete"):
            # The rest of the text is spoken before the end: held-back text out of the parser
            # (a call cut short stays open until then), the last phrase out of the splitter.
            calls, self._calls = self._calls, None
            if calls is not None:
                self._parsed(calls, calls.finish())
            if not self._waiting:
                speech.flush()
            self._final = (*final, tokens)
            self._end_when_spoken()
            return
        status, reason, error = final
        self._finish(status, self._usage(tokens), reason=reason, error=error)

    def spoken(self, index: int, audio: bytes, marks: Sequence[Mark] = ()) -> None:
        """Phrase ``index``'s audio (PCM16, 24 kHz): sent with its transcript once every earlier
        phrase was; then what waited for the speech, and the end once the engine is done."""
        speech = self._speech
        if speech is None or self.done:
            return
        assert self._audio is not None  # (it speaks)
        wire = self._audio.output_format
        for text, pcm, phrase_marks in speech.arrived(index, audio, marks):
            # Whole wire samples (silence up to 2 session samples at 8 kHz), so the ms the item
            # counts are the ms the client plays: truncation offsets stay exact at any rate.
            pcm += bytes(-(len(pcm) // 2) % wire.ratio * 2)
            item = self.item or self._open_item()
            item.parts[0] += text
            assert item.speech is not None
            item.speech.add(text, len(pcm) // 2, phrase_marks)
            self.audio_ms += audio_ms(pcm)
            ids = {"response_id": self.id, "item_id": item.id, "output_index": self._message_index,
                   "content_index": 0}
            self._events.emit("response.output_audio_transcript.delta", **ids, delta=text)
            # A phrase converted whole: a codec's filter meets no edge but the phrase's own
            encoded, chunk = wire.from_session(pcm), AUDIO_CHUNK_MS * wire.bytes_per_ms
            for start in range(0, len(encoded), chunk):
                self._events.audio_delta(self.id, item.id, self._message_index, 0, encoded[start:start + chunk])
        if not speech.pending and self._waiting:
            waiting, self._waiting = self._waiting, []
            self._dispatch(waiting)
            if not self._waiting and self._calls is None:
                speech.flush()  # the engine finished while these waited: its last text is a phrase now
        self._end_when_spoken()

    def speech_failed(self, message: str, code: str = "speech_failed") -> None:
        self.fail({"type": "server_error", "code": code, "message": message})

    def _end_when_spoken(self) -> None:
        final = self._final
        if final is None or self.speaking or self._waiting:
            return
        status, reason, error, tokens = final
        self._finish(status, self._usage(tokens), reason=reason, error=error)

    def _usage(self, tokens: tuple[int, int, int]) -> dict[str, Any]:
        return usage_wire(*tokens, self._beta, audio_ms=self.audio_ms)

    def cancel(self, reason: str) -> None:
        # Input tokens are unknown until the engine finishes; report what was streamed.
        self._finish("cancelled", self._streamed_usage(), reason=reason)

    def fail(self, error: dict[str, str], usage: dict[str, Any] | None = None) -> None:
        """End ``failed`` with ``error`` (its type, code and message, as sent)."""
        self._finish("failed", usage or self._streamed_usage(), error=error)

    def _streamed_usage(self) -> dict[str, Any]:
        return usage_wire(0, self.tokens, 0, self._beta, audio_ms=self.audio_ms)

    # ----- output ---------------------------------------------------------------------------

    def _output(self, text: str) -> None:
        calls = self._calls
        if calls is None:
            self._delta(text)
        else:
            self._parsed(calls, calls.feed(text))

    def _parsed(self, calls: CallStream, events: list[ToolCallEvent]) -> None:
        self._dispatch(events)

    def _dispatch(self, events: list[ToolCallEvent]) -> None:
        speech = self._speech
        for n, event in enumerate(events):
            if speech is not None and not isinstance(event, ParsedText):
                speech.flush()  # the text before a call is a phrase of its own
            if speech is not None and (self._waiting or (speech.pending and not isinstance(event, ParsedText))):
                # A call after text still being spoken waits for the speech, with all after it.
                self._waiting.extend(events[n:])
                return
            if isinstance(event, ParsedText):
                if event.text:
                    self._delta(event.text)
            elif isinstance(event, CallStarted):
                self._open_call(self._call_ids.call_id(event.index), event)
            elif isinstance(event, ArgumentsDelta):
                self._arguments(event)
            elif isinstance(event, CallDone):
                self._close_call(event.index, event.arguments, complete=event.complete)

    def _added(self, item: AnyItem) -> tuple[dict[str, Any], str | bool | None]:
        """``item`` joins the output (and the conversation, when the response belongs to it): its
        wire form as it joins, and the conversation item before it (False: not in the conversation)."""
        self.output.append(item)
        wire = item_wire(item, self._beta)
        return wire, self._conversation.insert(item) if self._conversation is not None else False

    def _previous(self, item: AnyItem) -> str | bool | None:
        """The conversation item before ``item`` (False where it is not in the conversation)."""
        conversation = self._conversation
        return conversation.previous_id(item.id) if conversation is not None and item.id in conversation else False

    def _open_item(self) -> Item:
        speaks = self._speech is not None
        item = Item(id=self._ids("item"), role="assistant", parts=[], status="in_progress", audio=speaks,
                    speech=Alignment(PCM_RATE) if speaks else None)
        self.item = item
        self._message_index = len(self.output)
        wire, previous_id = self._added(item)
        item.parts.append("")
        self._order.message_opened(wire, self._message_index, previous_id, audio=speaks)
        return item

    def _delta(self, text: str) -> None:
        if self._speech is not None:
            self._speech.feed(text)  # the item opens with the first phrase's audio
            return
        self._events.queue(self._text(self.item or self._open_item(), text))

    def _text(self, item: Item, text: str) -> TextDelta:
        """``text`` added to the open message, and its delta event (not queued)."""
        item.parts[0] += text
        return self._events.text_delta(self.id, item.id, self._message_index, 0, text)

    def _close_message(self, status: str) -> None:
        """The open message's done events; the next text, if any, opens a new message."""
        item = self.item
        if item is None:
            return
        self.item = None
        item.status = "completed" if status == "completed" else "incomplete"
        text = item.parts[0] if item.parts else ""
        self._order.message_closed(item_wire(item, self._beta), self._message_index, text, self._previous(item),
                                   audio=item.audio)

    def _open_call(self, call_id: str, event: CallStarted) -> None:
        self._close_message("completed")  # the text before a call is complete: the call follows it
        item = FunctionCall(id=self._ids("item"), call_id=call_id, name=event.name, arguments="",
                            status="in_progress")
        output_index = len(self.output)
        self._open_calls[event.index] = (item, output_index)
        wire, previous_id = self._added(item)
        self._order.item_opened(wire, output_index, previous_id)

    def _arguments(self, event: ArgumentsDelta) -> None:
        item, output_index = self._open_calls[event.index]
        item.arguments += event.delta
        self._events.emit("response.function_call_arguments.delta", response_id=self.id, item_id=item.id,
                          output_index=output_index, call_id=item.call_id, delta=event.delta)

    def _close_call(self, index: int, arguments: str, *, complete: bool) -> None:
        """A call's ``.done`` events: ``complete`` False for a call the output ended inside (a
        length limit, a cancel), whose item then ends ``incomplete`` with what was generated."""
        item, output_index = self._open_calls.pop(index)
        item.arguments = arguments
        item.status = "completed" if complete else "incomplete"
        self._order.call_closed(item_wire(item, self._beta), output_index, item.call_id, item.name, item.arguments,
                                self._previous(item))

    # ----- the end ----------------------------------------------------------------------------

    def _finish(self, status: str, usage: dict[str, Any], *, reason: str | None = None,
                error: dict[str, str] | None = None) -> None:
        """Close the open items, then ``response.done``; nothing is emitted after it.
        ``reason`` explains a cancelled or incomplete response, ``error`` a failed one."""
        if self.done:
            return
        calls, self._calls = self._calls, None  # nothing is parsed after the end, even if this fails
        if self._speech is not None:
            # Text not spoken yet was never heard: it is dropped, and so are events behind it.
            self._speech = None
            self._waiting = []
            calls = None
        if calls is not None:
            # Held-back text comes out; a call the output ended inside is cut short (incomplete).
            self._parsed(calls, calls.finish())
        if not self.output and status in ("completed", "incomplete"):
            self._open_item()  # a finished turn always has its (maybe empty) message
        self._close_message(status)
        for index, (item, _) in list(self._open_calls.items()):  # calls the parser left open (none expected)
            self._close_call(index, item.arguments, complete=False)
        self.done = True
        details: dict[str, Any] | None = None
        if error is not None:
            details = {"type": status, "error": error}
        elif reason is not None:
            details = {"type": status, "reason": reason}
        self._events.response_done(self._wire(status, details, usage), status, reason=reason,
                                   error_code=error["code"] if error is not None else None)

    def _wire(self, status: str, details: dict[str, Any] | None, usage: dict[str, Any] | None) -> dict[str, Any]:
        metadata = self._metadata
        if self._extra_metadata:
            metadata = {**(metadata or {}), **self._extra_metadata}
        return response_wire(
            response_id=self.id, status=status, status_details=details,
            output=[item_wire(item, self._beta) for item in self.output],
            conversation_id=self._conversation_id if self._conversation is not None else None,
            max_output_tokens=self._max_output_tokens, temperature=self._temperature,
            metadata=metadata, usage=usage, beta=self._beta,
            audio=self._audio if self._audio is not None and self._audio.output_audio else None,
        )
