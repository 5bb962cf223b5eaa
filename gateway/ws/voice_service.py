"""The voice pipeline of one gateway process, as its Realtime sessions use it (``VoiceService``
of ``gateway.ws.voice_link``), on ``voice.service.VoiceService``.

Built from ``[voice]`` once at start-up (models load in a thread): the Silero VAD model (shared;
each session gets its own segmenter state, on the event loop: a 32 ms window costs ~60 µs,
docs/voice.md), Whisper for recognition and flite (or the opt-in piper) for synthesis behind one
bounded worker pool, so recognition and synthesis never run on the event loop and a burst of
voice sessions is told ``voice_busy`` instead of starving text sessions. Everything crossing
into the session is PCM16 mono at 24 kHz.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Hashable

import numpy as np

from gateway.ws.audio_events import EAGERNESS_MAX_WAIT_MS, ServerVad
from gateway.ws.audio_input import (
    SpeechEndProposed,
    SpeechEvent,
    SpeechPaused,
    SpeechResumed,
    SpeechStarted,
    SpeechStopped,
)
from gateway.ws.voice_input import VoiceHooks, VoiceSeats
from gateway.ws.voice_link import Heard
from voice.alignment import Mark
from voice.config import VoiceConfig
from voice.pool import JobFigures
from voice.semantic import SemanticEvent, SemanticSegmenter
from voice.semantic import SpeechEndProposed as VadProposed
from voice.service import VoiceService
from voice.vad import SpeechPaused as VadPaused
from voice.vad import SpeechResumed as VadResumed
from voice.vad import SpeechSegmenter, VadParams
from voice.vad import SpeechStarted as VadStarted

log = logging.getLogger(__name__)


class _Segmenter:
    """Server VAD over the session's 24 kHz stream: resampled to 16 kHz as it comes. For
    ``semantic_vad``, the turn model judges a pause's audio (``voice.semantic``) and, with the text
    turn model, proposes the end (``SpeechEndProposed``) that the words of the transcription
    started at the pause confirm (``confirm_end``); else the eagerness's longest wait ends it."""

    def __init__(self, service: VoiceService, vad: ServerVad) -> None:
        self._resampler = service.input_resampler()
        self._segmenter: SpeechSegmenter | SemanticSegmenter
        if vad.kind == "semantic_vad" and service.turn is not None:  # without it: server VAD, silence by eagerness
            self._segmenter = service.semantic_segmenter(
                VadParams(threshold=vad.threshold, prefix_padding_ms=vad.prefix_padding_ms),
                EAGERNESS_MAX_WAIT_MS[vad.eagerness])
            return
        eager = service.config.eager_transcribe_ms
        self._segmenter = service.segmenter(VadParams(
            threshold=vad.threshold, prefix_padding_ms=vad.prefix_padding_ms,
            silence_duration_ms=vad.silence_duration_ms,
            pause_ms=eager if eager < vad.silence_duration_ms else 0))

    def feed(self, pcm: bytes) -> list[SpeechEvent]:
        return [_speech_event(e) for e in self._segmenter.feed(self._resampler.feed(np.frombuffer(pcm, dtype="<i2")))]

    def confirm_end(self, speech_end_ms: int) -> SpeechStopped | None:
        if not isinstance(self._segmenter, SemanticSegmenter):
            return None
        stopped = self._segmenter.confirm_end(speech_end_ms)
        return None if stopped is None else SpeechStopped(stopped.audio_end_ms, stopped.speech_end_ms)


def _speech_event(event: SemanticEvent) -> SpeechEvent:
    """``voice``'s segmenter event as the session's (the same fields, the gateway's own types)."""
    if isinstance(event, VadStarted):
        return SpeechStarted(event.audio_start_ms)
    if isinstance(event, VadPaused):
        return SpeechPaused(event.speech_end_ms)
    if isinstance(event, VadResumed):
        return SpeechResumed(event.speech_end_ms)
    if isinstance(event, VadProposed):
        return SpeechEndProposed(event.speech_end_ms, event.audio_end_ms)
    return SpeechStopped(event.audio_end_ms, event.speech_end_ms)


class GatewayVoice:
    """``VoiceService`` (the gateway's protocol) on the models of ``voice``. Blocking to build."""

    def __init__(self, config: VoiceConfig, observer: Callable[[JobFigures], None] | None = None) -> None:
        started = time.perf_counter()
        self.service = service = VoiceService(config, observer=observer)
        self.seats = VoiceSeats(config.voice_sessions(len(os.sched_getaffinity(0))))
        self.hooks = VoiceHooks(segmenters=lambda vad: _Segmenter(service, vad), phrases=service.phrase_splitter,
                                seats=self.seats, answer_ahead=config.answer_ahead)
        turns = ("Smart Turn" + (f" with the words read by {service.text_turn.path.name}" if service.text_turn else "")
                 if service.turn is not None else "no turn model")
        log.info("voice ready in %.1f s: Silero VAD, Whisper (%s), %s; semantic_vad: %s", time.perf_counter() - started,
                 service.recognizer.model_dir, config.tts_backend, turns)

    async def transcribe(self, audio: bytes, owner: Hashable = None,
                         on_piece: Callable[[str], None] | None = None, speculative: bool = False,
                         judge_end: bool = False, prompt: str | None = None) -> Heard:
        relay = None
        if on_piece is not None:  # the recognizer decodes on a worker thread; the session lives on this loop
            loop = asyncio.get_running_loop()

            def relay(text: str) -> None:
                loop.call_soon_threadsafe(on_piece, text)

        # VoiceBusy, VoiceRateLimited, VoiceTimeout pass through: their messages are for the client
        result = await self.service.transcribe(np.frombuffer(audio, dtype="<i2"), owner, relay, speculative,
                                               judge_end, prompt)
        return Heard(result.text, result.seconds_of_audio, result.finished)

    async def synthesize(self, text: str, voice: str, owner: Hashable = None) -> tuple[bytes, tuple[Mark, ...]]:
        phrase = await self.service.speak(text, voice, owner)
        return phrase.pcm.astype("<i2", copy=False).tobytes(), phrase.marks

    def close(self) -> None:
        self.service.close()
