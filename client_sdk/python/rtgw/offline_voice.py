"""Voice on the on-device fallback: when the gateway cannot be reached (the condition the text
fallback uses) and an ``OfflineConfig`` is given, the audio an application streams is handled in
this process as the gateway would handle it, and told to the client as the gateway's events, so
the application sees the same ``SpeechStarted`` ... ``TurnStarted``, ``InputTranscript``,
``TranscriptDelta``, ``AudioDelta`` and ``Interrupted``, the same player and the same barge-in.

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

A mixin of ``RealtimeClient`` (its state); ``rtgw.device_voice`` holds the parts, ``rtgw.voice``
calls in here when the voice goes to the device.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

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
from rtgw.errors import GatewayError, OfflineModelError, OfflineVoiceError, TurnInProgress
from rtgw.protocol import Event, TranscriptDelta, new_id
from rtgw.turn import Turn
from rtgw.voice_events import (
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
)

if TYPE_CHECKING:
    from rtgw.client import RealtimeClient

log = logging.getLogger(__name__)

__all__ = ["OfflineVoiceClient"]


class OfflineVoiceClient:
    """Voice on the device; ``self`` is the client."""

    def _init_offline_voice(self: RealtimeClient) -> None:
        self._device_voice: DeviceVoice | None = None
        self._device_voice_loading: asyncio.Lock | None = None

    async def _voice_on_device(self: RealtimeClient) -> bool:
        """Whether audio goes to the device now: an utterance is under way there, or there is an
        offline model and no gateway (tried again every ``retry_online_s``, as for text turns)."""
        if self._offline is None:
            return False
        device = self._device_voice
        if device is not None and device.holds_speech:
            return True
        if self._ws is not None:
            return False
        async with self._lock:
            online = await self._ensure_session(required=False)
        return not online

    async def _device_voice_ready(self: RealtimeClient) -> DeviceVoice:
        """The voice models, loaded in a worker thread the first time (``OfflineVoiceError``)."""
        if self._device_voice is None:
            if self._device_voice_loading is None:
                self._device_voice_loading = asyncio.Lock()
            async with self._device_voice_loading:
                if self._device_voice is None:
                    threads = self._offline.config.voice_threads if self._offline is not None else 1
                    service = await asyncio.to_thread(load_voice, threads)
                    self._device_voice = DeviceVoice(service, new_id)
        return self._device_voice

    # --- audio in -------------------------------------------------------------------------------

    async def _device_append(self: RealtimeClient, pcm: bytes) -> None:
        device = await self._device_voice_ready()
        vad = turn_detection(self._session.fields)
        device.configure(vad)
        try:
            found = device.append(pcm)
        except ValueError as e:  # the buffer is full: this chunk is refused, the session goes on
            self._voice_queue.put(AudioRefused("input_audio_buffer_full", str(e)))
            return
        for speech in found:
            assert vad is not None  # only server VAD finds speech
            if isinstance(speech, Started):
                self._device_events([{"type": "input_audio_buffer.speech_started", "item_id": speech.item_id,
                                      "audio_start_ms": speech.audio_start_ms}])
                if vad.interrupt_response:
                    self._device_barge_in()
                continue
            self._device_events([{"type": "input_audio_buffer.speech_stopped", "item_id": speech.item_id,
                                  "audio_end_ms": speech.audio_end_ms}])
            self._device_commit_audio(device, speech.item_id, speech.audio)
            if vad.create_response and (self._turn is None or self._turn.done or self._turn._cancelling):
                turn = self._offline_turn({})
                self._turn_queue.put(turn)
                self._voice_queue.put(TurnStarted(turn))

    async def _device_commit(self: RealtimeClient) -> str:
        """Push to talk on the device: the buffer becomes a user item, transcribed on the workers."""
        device = await self._device_voice_ready()
        device.configure(turn_detection(self._session.fields))
        try:
            item_id, audio = device.commit()
        except ValueError as e:
            raise GatewayError(f"the device refused input_audio_buffer.commit: {e}") from None
        self._device_commit_audio(device, item_id, audio)
        return item_id

    async def _device_clear(self: RealtimeClient) -> None:
        device = await self._device_voice_ready()
        device.clear()
        self._device_events([{"type": "input_audio_buffer.cleared"}])

    async def _device_respond(self: RealtimeClient, response: Mapping[str, Any]) -> Turn:
        async with self._lock:
            if self._turn is not None and not self._turn.done:
                raise TurnInProgress("a turn is still running: cancel() it or await its result() first")
            return self._offline_turn(dict(response))

    def _device_commit_audio(self: RealtimeClient, device: DeviceVoice, item_id: str, audio: bytes) -> None:
        """The user's speech joins the conversation now; its words when Whisper has them."""
        previous = self.protocol.items[-1].id if self.protocol.items else None
        item = {"id": item_id, "object": "realtime.item", "type": "message", "status": "completed", "role": "user",
                "content": [{"type": "input_audio", "transcript": None}]}
        self._device_events([{"type": "input_audio_buffer.committed", "previous_item_id": previous, "item_id": item_id},
                             {"type": "conversation.item.added", "previous_item_id": previous, "item": item}])
        device.transcribing[item_id] = asyncio.get_running_loop().create_task(
            self._device_transcribe(device, item_id, audio), name="rtgw-device-transcribe")

    async def _device_transcribe(self: RealtimeClient, device: DeviceVoice, item_id: str, audio: bytes) -> None:
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
        self._device_events([event])

    async def _device_transcripts(self: RealtimeClient) -> None:
        """Wait for the words of speech committed on the device (an answer's prompt needs them).
        A cancelled answer does not cancel them: the user's item still gets its words."""
        device = self._device_voice
        if device is not None and device.transcribing:
            await asyncio.wait(list(device.transcribing.values()))

    # --- answers --------------------------------------------------------------------------------

    def _device_output(self: RealtimeClient, turn: Turn, session: Mapping[str, Any],
                       response: Mapping[str, Any]) -> TextOutput:
        """Where an offline answer goes: text events, or speech when the session (or the response)
        asks for audio."""
        def emit(events: list[dict[str, Any]]) -> None:
            self._offline_events(turn, events)

        if speaks(session, response):
            out = SpokenOutput(DeviceResponse(turn.response_id or "", audio=True), emit, self._device_voice_ready,
                               voice_name(session, response))
            turn._stop_speech = out.close
            return out
        return TextOutput(DeviceResponse(turn.response_id or ""), emit)

    async def _device_settle(self: RealtimeClient, previous: Turn | None) -> None:
        """An answer started while the one before it is still ending (cancelled by the speech it
        answers) waits for it, and for the barge-in's cut of it: its prompt holds only what was heard,
        and the protocol core sees one response at a time."""
        waits = {task for task in (previous._task if previous is not None else None, self._barge_task)
                 if task is not None and not task.done()}
        if waits:
            await asyncio.wait(waits)

    def _device_barge_in(self: RealtimeClient) -> None:
        """The device's part of ``interrupt_response``: the answer under way stops now."""
        turn = self._turn
        if turn is not None and turn.offline and not turn.done:
            turn._cancel_offline("turn_detected")

    async def _device_truncate(self: RealtimeClient, item_id: str, heard_ms: int, turn: Turn | None) -> bool:
        """Barge-in on an answer spoken here: once it ended, keep in the conversation the words
        played by ``heard_ms``. False when the item was not spoken on the device."""
        device = self._device_voice
        if device is None or item_id not in device.spoken:
            return False
        if turn is not None:
            with contextlib.suppress(OfflineModelError):  # its failure is the turn's to report
                await turn.result()
        text = device.heard(item_id, heard_ms) or ""
        local = self.protocol.message(item_id)
        if local is not None:
            local.text = text
        self._voice_queue.put(Interrupted(item_id, heard_ms, text))
        return True

    # --- events ---------------------------------------------------------------------------------

    def _device_events(self: RealtimeClient, events: list[dict[str, Any]]) -> None:
        """Events of the device's voice outside an answer's own task: to the offline turn under way."""
        turn = self._turn
        self._offline_events(turn if turn is not None and turn.offline and not turn.done else None, events)

    def _device_voice_event(self: RealtimeClient, typed: Event, turn: Turn | None) -> bool:
        """A voice event the device told: to the turn, the player and the voice events, as
        ``_voice_dispatch`` does for the gateway's."""
        if isinstance(typed, (TranscriptDelta, AudioDelta)):
            if turn is not None and not turn.done:
                turn._voice(typed)
            if isinstance(typed, AudioDelta):
                self._play(typed)
            return True
        if not isinstance(typed, (SpeechStarted, SpeechStopped, AudioCommitted, AudioCleared, InputTranscript,
                                  TranscriptionFailed)):
            return False
        if isinstance(typed, InputTranscript) and turn is not None and not turn.done:
            turn._voice(typed)
        elif isinstance(typed, SpeechStarted):
            self._speech_started()
        self._voice_queue.put(typed)
        return True

    def _close_device_voice(self: RealtimeClient) -> None:
        device, self._device_voice = self._device_voice, None
        if device is not None:
            device.close()
