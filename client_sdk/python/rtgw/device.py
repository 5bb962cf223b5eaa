"""The on-device fallback as a client runs it: when the gateway cannot be reached and an
``OfflineConfig`` is given, turns are answered by the device's model (``offline.py``) and the audio
an application streams is handled in this process as the gateway would handle it. Both are told to
the client's protocol core as the gateway's events (``DeviceResponse``), so an offline turn's
deltas, calls, result and conversation items are the online ones, and the application sees the
same ``SpeechStarted`` ... ``TurnStarted``, ``InputTranscript``, ``TranscriptDelta``, ``AudioDelta``
and ``Interrupted``, the same player and the same barge-in.

    appended audio ──► DeviceVoice: input buffer, server VAD (voice.vad) ──► speech_started / speech_stopped
                            │ commit (VAD, or commit_audio)
                            ▼
             user item ◄── Whisper on the voice workers (voice.asr) ──► input_audio_transcription.completed
                            │ create_response (VAD) or respond()
                            ▼
    the offline text path (offline.py: the same conversation, tools) ──► SpokenOutput: phrases, flite
    on the voice workers ──► output_audio_transcript.delta + output_audio.delta ──► the turn, the player

Speech that starts while an answer plays cancels it (``interrupt_response``; the turn ends
``cancelled``, reason ``turn_detected``), stops the player, and cuts the answer in the local
conversation to the words played (``voice.alignment``), reported as ``Interrupted``.

``Device`` is that part of a ``RealtimeClient``: it owns the model and the device's voice, and gets
from the client its protocol core, its session settings, its ``Voice`` (the player and the voice
events) and its turn under way; ``rtgw.device_voice`` holds the voice's parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from rtgw.device_response import DeviceResponse
from rtgw.device_voice import (
    DeviceVoice,
    SpokenOutput,
    Started,
    TextOutput,
    load_voice,
    speaks,
    turn_detection,
    voice_name,
)
from rtgw.errors import GatewayError, OfflineModelError, OfflineRequestError
from rtgw.offline import OfflineModel
from rtgw.protocol import ClientProtocol, ConversationItem, FunctionCall, TextDelta, TurnResult, new_id
from rtgw.settings import SessionSettings
from rtgw.turn import Turn
from rtgw.voice import Voice
from rtgw.voice_events import AudioRefused, Interrupted

log = logging.getLogger(__name__)


class Device:
    """Turns and voice on the device, told as the gateway's events."""

    def __init__(self, model: OfflineModel, protocol: ClientProtocol, settings: SessionSettings, voice: Voice, *,
                 current_turn: Callable[[], Turn | None], start_turn: Callable[[dict[str, Any]], Turn]) -> None:
        """``current_turn``: the client's turn under way; ``start_turn``: an offline turn made the
        client's turn under way (and answered by ``answer``), for the speech server VAD ends here."""
        self.model = model
        self._protocol = protocol
        self._settings = settings
        self._voice = voice
        self._current_turn = current_turn
        self._start_turn = start_turn
        self.device_voice: DeviceVoice | None = None  # the voice models, once a voice turn needed them
        self._device_voice_loading: asyncio.Lock | None = None

    @property
    def holds_speech(self) -> bool:
        """An utterance is under way on the device: its audio goes there until it ends."""
        device = self.device_voice
        return device is not None and device.holds_speech

    async def _device_voice_ready(self) -> DeviceVoice:
        """The voice models, loaded in a worker thread the first time (``OfflineVoiceError``)."""
        if self.device_voice is None:
            if self._device_voice_loading is None:
                self._device_voice_loading = asyncio.Lock()
            async with self._device_voice_loading:
                if self.device_voice is None:
                    service = await asyncio.to_thread(load_voice, self.model.config.voice_threads)
                    self.device_voice = DeviceVoice(service, new_id)
        return self.device_voice

    # --- audio in -------------------------------------------------------------------------------

    async def append(self, pcm: bytes) -> None:
        device = await self._device_voice_ready()
        vad = turn_detection(self._settings.fields)
        device.configure(vad)
        try:
            found = device.append(pcm)
        except ValueError as e:  # the buffer is full: this chunk is refused, the session goes on
            self._voice.report(AudioRefused("input_audio_buffer_full", str(e)))
            return
        for speech in found:
            assert vad is not None  # only server VAD finds speech
            if isinstance(speech, Started):
                self._events([{"type": "input_audio_buffer.speech_started", "item_id": speech.item_id,
                               "audio_start_ms": speech.audio_start_ms}])
                if vad.interrupt_response:
                    self._barge_in()
                continue
            self._events([{"type": "input_audio_buffer.speech_stopped", "item_id": speech.item_id,
                           "audio_end_ms": speech.audio_end_ms}])
            self._commit_audio(device, speech.item_id, speech.audio)
            turn = self._current_turn()
            if vad.create_response and (turn is None or turn.done or turn._cancelling):
                self._voice.turn_started(self._start_turn({}))

    async def commit(self) -> str:
        """Push to talk on the device: the buffer becomes a user item, transcribed on the workers."""
        device = await self._device_voice_ready()
        device.configure(turn_detection(self._settings.fields))
        try:
            item_id, audio = device.commit()
        except ValueError as e:
            raise GatewayError(f"the device refused input_audio_buffer.commit: {e}") from None
        self._commit_audio(device, item_id, audio)
        return item_id

    async def clear(self) -> None:
        device = await self._device_voice_ready()
        device.clear()
        self._events([{"type": "input_audio_buffer.cleared"}])

    def _commit_audio(self, device: DeviceVoice, item_id: str, audio: bytes) -> None:
        """The user's speech joins the conversation now; its words when Whisper has them."""
        items = self._protocol.items
        previous = items[-1].id if items else None
        item = {"id": item_id, "object": "realtime.item", "type": "message", "status": "completed", "role": "user",
                "content": [{"type": "input_audio", "transcript": None}]}
        self._events([{"type": "input_audio_buffer.committed", "previous_item_id": previous, "item_id": item_id},
                      {"type": "conversation.item.added", "previous_item_id": previous, "item": item}])
        device.transcribing[item_id] = asyncio.get_running_loop().create_task(
            self._transcribe(device, item_id, audio), name="rtgw-device-transcribe")

    async def _transcribe(self, device: DeviceVoice, item_id: str, audio: bytes) -> None:
        try:
            text = await device.transcribe(audio)
        except Exception as e:  # busy, timed out, a broken model: the item stays without words, as online
            log.warning("on-device transcription of %s failed: %s", item_id, e)
            event = {"type": "conversation.item.input_audio_transcription.failed", "item_id": item_id,
                     "content_index": 0, "error": {"type": "device_error", "code": "transcription_failed",
                                                   "message": str(e)}}
        else:
            event = {"type": "conversation.item.input_audio_transcription.completed", "item_id": item_id,
                     "content_index": 0, "transcript": text}
        finally:
            device.transcribing.pop(item_id, None)
        self._events([event])

    async def _transcripts(self) -> None:
        """Wait for the words of speech committed on the device (an answer's prompt needs them).
        A cancelled answer does not cancel them: the user's item still gets its words."""
        device = self.device_voice
        if device is not None and device.transcribing:
            await asyncio.wait(list(device.transcribing.values()))

    # --- answers --------------------------------------------------------------------------------

    def answer(self, turn: Turn, response: dict[str, Any], previous: Turn | None) -> asyncio.Task[None]:
        """Start the device's answer in ``turn``, from the conversation and settings as they are
        now; ``previous``: the turn before it, perhaps still ending."""
        return asyncio.create_task(self._answer(turn, self._settings.instructions, list(self._protocol.items),
                                                dict(self._settings.fields), response, previous))

    async def _answer(self, turn: Turn, instructions: str, history: list[ConversationItem],
                      session: dict[str, Any], response: dict[str, Any], previous: Turn | None = None) -> None:
        """The device's answer, told as the gateway's events (``DeviceResponse``) and received by the
        protocol core: its text, calls, result and conversation items are the online ones. Spoken
        when the session asks for audio."""
        model = self.model
        try:
            await self._settle(previous)
        except asyncio.CancelledError:  # cancelled before it began: no events
            turn._finish(TurnResult(turn.response_id or "", "cancelled", "", reason=turn._cancel_reason, offline=True))
            return
        out = self._output(turn, session, response)
        device = out.device
        metadata = {"x_tier": "device"}
        self._tell(turn, device.created())
        parser = None
        status, reason, error, usage = "completed", None, None, {}
        try:
            await out.ready()  # a spoken answer: the voice models
            await self._transcripts()  # speech committed on the device: its words are the prompt's
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
        self._tell(turn, device.finish(status, reason=reason, error=error, usage=usage, metadata=metadata))

    def _output(self, turn: Turn, session: Mapping[str, Any], response: Mapping[str, Any]) -> TextOutput:
        """Where an offline answer goes: text events, or speech when the session (or the response)
        asks for audio."""
        def emit(events: list[dict[str, Any]]) -> None:
            self._tell(turn, events)

        items = self._protocol.items
        after = items[-1].id if items else None  # the response's items follow it in the conversation
        if speaks(session, response):
            out = SpokenOutput(DeviceResponse(turn.response_id or "", audio=True, after=after), emit,
                               self._device_voice_ready,
                               voice_name(session, response))
            turn._stop_speech = out.close
            return out
        return TextOutput(DeviceResponse(turn.response_id or "", after=after), emit)

    async def _settle(self, previous: Turn | None) -> None:
        """An answer started while the one before it is still ending (cancelled by the speech it
        answers) waits for it, and for the barge-in's cut of it: its prompt holds only what was heard,
        and the protocol core sees one response at a time."""
        waits = {task for task in (previous._task if previous is not None else None, self._voice.cutting)
                 if task is not None and not task.done()}
        if waits:
            await asyncio.wait(waits)

    def _barge_in(self) -> None:
        """The device's part of ``interrupt_response``: the answer under way stops now."""
        turn = self._current_turn()
        if turn is not None and turn.offline and not turn.done:
            turn._cancel_offline("turn_detected")

    async def cut(self, item_id: str, heard_ms: int, turn: Turn | None) -> bool:
        """Barge-in on an answer spoken here: once it ended, keep in the conversation the words
        played by ``heard_ms``. False when the item was not spoken on the device."""
        device = self.device_voice
        if device is None or item_id not in device.spoken:
            return False
        if turn is not None:
            with contextlib.suppress(OfflineModelError):  # its failure is the turn's to report
                await turn.result()
        text = device.heard(item_id, heard_ms) or ""
        local = self._protocol.message(item_id)
        if local is not None:
            local.text = text
        self._voice.report(Interrupted(item_id, heard_ms, text))
        return True

    # --- events ---------------------------------------------------------------------------------

    def _events(self, events: list[dict[str, Any]]) -> None:
        """Events of the device's voice outside an answer's own task: to the offline turn under way."""
        turn = self._current_turn()
        self._tell(turn if turn is not None and turn.offline and not turn.done else None, events)

    def _tell(self, turn: Turn | None, events: list[dict[str, Any]]) -> None:
        """The device's events to the protocol core, as if they came off the socket; what it makes
        of them to ``turn`` and (speech, transcripts) to the voice."""
        for event in events:
            for typed in self._protocol.receive(event):
                if self._voice.dispatch(typed, turn, device=True):  # speech and transcripts (device voice)
                    continue
                if turn is None:
                    continue
                if isinstance(typed, TextDelta):
                    turn._push(typed.text)
                elif isinstance(typed, FunctionCall):
                    turn._call(typed)
                elif isinstance(typed, TurnResult):
                    turn._finish(replace(typed, offline=True))

    def stop_voice(self) -> None:
        device, self.device_voice = self.device_voice, None
        if device is not None:
            device.close()
