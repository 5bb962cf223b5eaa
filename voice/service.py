"""What the gateway holds: the models loaded once, the worker pool, and the per-session pieces,
built from a ``VoiceConfig``, speaking the wire's 24 kHz PCM16 on both sides.

    service = await asyncio.to_thread(VoiceService, config)   # loads models: ~0.5 s, off the loop
    segmenter = service.segmenter(VadParams(...))             # per session, used on the loop
    segmenter = service.semantic_segmenter(VadParams(), 2000)  # semantic_vad: the turn models decide
    to_16k = service.input_resampler()                        # per session, used on the loop
    events = segmenter.feed(to_16k.feed(pcm_24k))             # each append
    text = (await service.transcribe(committed_pcm_24k)).text  # on the pool; VoiceBusy past its bound
    phrase = await service.speak("Hello there.", voice)        # 24 kHz PCM16 + alignment marks

Recognition and synthesis (with their resampling) run on the pool's threads, never the loop;
VAD and input resampling are cheap enough for the loop (``voice.vad``, ``voice.audio``); so, at
~25 ms a judgement made only in a pause, is the turn model (``voice.turn``, ``voice.semantic``).
The text turn model (``voice.text_turn``) judges a transcript on the worker that made it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np

from llm_shared.errors import EngineError
from voice.alignment import Mark, scale_marks
from voice.asr import Transcription, WhisperRecognizer, encoder_window_s
from voice.audio import REALTIME_RATE, SPEECH_RATE, Int16Array, StreamResampler, resample, to_int16
from voice.config import VoiceConfig
from voice.errors import VoiceModelError
from voice.phrases import PhraseBounds, PhraseSplitter
from voice.pool import SPOKEN_CHARS_PER_S, JobFigures, VoicePool
from voice.semantic import SemanticSegmenter
from voice.text_turn import TextTurnJudge
from voice.tts import FliteSynthesizer, Synthesizer
from voice.turn import TurnModel
from voice.vad import SileroVad, SpeechSegmenter, VadParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpokenPhrase:
    text: str
    pcm: Int16Array  # 24 kHz PCM16 mono, ready for response.output_audio.delta
    marks: tuple[Mark, ...]  # alignment anchors at 24 kHz, for Alignment.add(text, len(pcm), marks)
    seconds_taken: float  # synthesis and resampling, on the worker


class VoiceService:
    """One per gateway process. Construction loads the models (blocking: call it in a thread)."""

    def __init__(self, config: VoiceConfig, *, observer: Callable[[JobFigures], None] | None = None) -> None:
        self.config = config
        self.vad = SileroVad(config.vad_model)
        try:
            self.turn: TurnModel | None = TurnModel(config.turn_model)
        except VoiceModelError as e:  # semantic_vad can do without it: server VAD with its eagerness's silence
            log.warning("no turn model (%s): semantic_vad runs as server VAD, its silence by eagerness", e.message)
            self.turn = None
        self.text_turn: TextTurnJudge | None = None
        if self.turn is not None and config.text_turn_model != "none":
            try:
                self.text_turn = TextTurnJudge(config.text_turn_model)
            except VoiceModelError as e:  # the audio model decides alone, as before it
                log.warning("no end-of-turn text model (%s): semantic_vad ends turns on the audio alone", e.message)
        self.recognizer = WhisperRecognizer(config.asr_model, threads=config.asr_threads, workers=config.pool_threads,
                                            beam_size=config.asr_beam_size, compute_type=config.asr_compute_type,
                                            window=config.asr_window, prompt=config.asr_prompt)
        self.synthesizer = make_synthesizer(config)
        self.pool = VoicePool(threads=config.pool_threads, max_outstanding_audio_s=config.max_queued_audio_s,
                              max_outstanding_jobs=config.max_queued_jobs, job_timeout_s=config.job_timeout_s,
                              max_jobs_per_owner=config.max_session_jobs,
                              recognition_rate_s=config.recognition_rate_s or None,
                              recognition_burst_s=config.recognition_burst_s, observer=observer)
        self.phrase_bounds = PhraseBounds(first_max_chars=config.first_phrase_max_chars,
                                          max_chars=config.phrase_max_chars)

    def segmenter(self, params: VadParams | None = None) -> SpeechSegmenter:
        return SpeechSegmenter(self.vad, params)

    def semantic_segmenter(self, params: VadParams, max_wait_ms: int) -> SemanticSegmenter:
        """``semantic_vad``: the VAD proposes an end after a short pause, the turn model decides
        (and with a text turn model, proposes the end for the transcript to confirm: ``transcribe``
        with ``judge_end``), and ``max_wait_ms`` of silence ends a turn whatever they say. Only
        with a turn model."""
        assert self.turn is not None, "no turn model: semantic_vad runs as server VAD (see __init__)"
        return SemanticSegmenter(self.vad, self.turn, params, max_wait_ms, confirm=self.text_turn is not None)

    def input_resampler(self) -> StreamResampler:
        """The wire's 24 kHz to the VAD's 16 kHz, one per session (it keeps the filter's history)."""
        return StreamResampler(REALTIME_RATE, SPEECH_RATE)

    def phrase_splitter(self) -> PhraseSplitter:
        """One per spoken response."""
        return PhraseSplitter(self.phrase_bounds)

    async def transcribe(self, pcm_24k: Int16Array, owner: Hashable = None,
                         on_piece: Callable[[str], None] | None = None, speculative: bool = False,
                         judge_end: bool = False, prompt: str | None = None) -> Transcription:
        """A committed input buffer's text, in ``owner``'s (its session's) turn. It counts against
        the pool's bound as the window Whisper encodes for it (``encoder_window_s``: 30 s, or
        with asr_window "auto" the utterance's own length rounded up, at least 12 s; audio longer
        than a window counts as itself), its figures as the audio it had. ``on_piece``: each piece of text as it is
        decoded, called on the worker thread. ``speculative``: started at a pause the user may go on
        from (``VoicePool.run``). ``judge_end``: the text turn model (if any) also judges whether the
        words are a finished turn (``Transcription.finished``), on the same worker. ``prompt``: the
        session's transcription prompt ("" for none; None: ``[voice] asr_prompt``). Raises
        ``VoiceBusy``, ``VoiceRateLimited``, ``VoiceTimeout``."""
        pcm = np.array(pcm_24k, np.int16)  # the session's buffer is cleared and reused while this waits
        recognizer = self.recognizer
        seconds = len(pcm) / REALTIME_RATE
        judge = self.text_turn if judge_end else None

        def job() -> Transcription:
            samples = resample(pcm, REALTIME_RATE, SPEECH_RATE)
            heard = recognizer.transcribe(samples, on_piece, prompt=prompt)
            return heard if judge is None else dataclasses.replace(heard, finished=self._finished(judge, heard.text))

        window_s = encoder_window_s(seconds, self.config.asr_window)
        return await self.pool.run("asr", job, audio_s=max(seconds, window_s), measure=lambda _: seconds, owner=owner,
                                   speculative=speculative)

    def _finished(self, judge: TextTurnJudge, text: str) -> bool | None:
        try:
            p = judge.end_probability(text)
        except EngineError:  # a judgement that fails leaves the decision to the audio
            log.exception("the end-of-turn text model failed on a transcript")
            return None
        return None if p is None else p >= self.config.text_turn_threshold

    async def speak(self, text: str, voice: str | None = None, owner: Hashable = None) -> SpokenPhrase:
        """One phrase as 24 kHz audio. Each phrase is resampled whole: flite starts and ends every
        phrase in silence, so no filter edge is heard at the joins. Raises ``VoiceBusy``,
        ``VoiceTimeout``; cancelling the caller drops the phrase if it has not started."""
        synthesizer = self.synthesizer

        def job() -> SpokenPhrase:
            started = time.perf_counter()
            made = synthesizer.synthesize(text, voice)
            pcm = to_int16(resample(made.samples, made.sample_rate, REALTIME_RATE))
            marks = scale_marks(made.marks, made.sample_rate, REALTIME_RATE)
            return SpokenPhrase(text, pcm, marks, time.perf_counter() - started)

        estimate = max(len(text.strip()), 1) / SPOKEN_CHARS_PER_S
        return await self.pool.run("tts", job, audio_s=estimate, measure=lambda p: len(p.pcm) / REALTIME_RATE,
                                   owner=owner)

    def close(self) -> None:
        self.pool.close()
        self.synthesizer.close()
        if self.text_turn is not None:
            self.text_turn.close()


def make_synthesizer(config: VoiceConfig) -> Synthesizer:
    """The configured backend; piper's module is imported only when chosen (it imports no piper
    code itself either: piper runs as its own program)."""
    if config.tts_backend == "piper":
        from voice.tts_piper import PiperSynthesizer

        return PiperSynthesizer(config.tts_model, processes=config.pool_threads, timeout_s=config.job_timeout_s)
    return FliteSynthesizer(config.tts_library, default_voice=config.voice, timeout_s=config.job_timeout_s,
                            processes=config.pool_threads)
