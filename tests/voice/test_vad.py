"""Server VAD on real speech (flite's, through the 24 kHz wire rate) with the real Silero model:
one start and one stop where the voice is, the API's padding and silence rules, nothing in
silence or noise, and the same events however the audio is chunked."""

from __future__ import annotations

import numpy as np
import pytest
from voice_clips import Clip, clip, noise, speech

from voice.tts import FliteSynthesizer
from voice.vad import (
    CONTEXT,
    WINDOW,
    SileroVad,
    SpeechPaused,
    SpeechResumed,
    SpeechSegmenter,
    SpeechStarted,
    SpeechStopped,
    VadEvent,
    VadParams,
    VadState,
)

FOX = "The quick brown fox jumps over the lazy dog."
JUGS = "Pack my box with five dozen liquor jugs."
# Silero's decision lags the sound by a window or two, and flite's first and last phones are
# quiet; measured here: starts within 40 ms of the first loud sample, stops 30-60 ms after the last.
START_TOLERANCE_MS = 100
END_TOLERANCE_MS = 150


@pytest.fixture(scope="module")
def one_sentence(synthesizer: FliteSynthesizer) -> Clip:
    return clip(1.0, speech(synthesizer, FOX), 1.5)


@pytest.fixture(scope="module")
def two_sentences(synthesizer: FliteSynthesizer) -> Clip:
    # About a second of silence between them (0.7 s added to flite's own trailing and leading pauses).
    return clip(0.5, speech(synthesizer, FOX), 0.7, speech(synthesizer, JUGS), 1.5)


def all_events(model: SileroVad, samples: np.ndarray, params: VadParams | None = None,
               chunk: int | None = None) -> list[VadEvent]:
    segmenter = SpeechSegmenter(model, params)
    if chunk is None:
        return segmenter.feed(samples)
    out: list[VadEvent] = []
    for at in range(0, len(samples), chunk):
        out += segmenter.feed(samples[at:at + chunk])
    return out


def events(model: SileroVad, samples: np.ndarray, params: VadParams | None = None,
           chunk: int | None = None) -> list[SpeechStarted | SpeechStopped]:
    """The starts and stops (the API's events; pauses are tested on their own)."""
    return [e for e in all_events(model, samples, params, chunk) if not isinstance(e, SpeechPaused | SpeechResumed)]


def test_a_pause_is_reported_before_the_stop_it_may_become(vad_model: SileroVad, two_sentences: Clip) -> None:
    found = all_events(vad_model, two_sentences.samples, VadParams(silence_duration_ms=1500, pause_ms=160))
    kinds = [type(e) for e in found]
    # A pause after each sentence: the first one is resumed (the second sentence), the last one stops.
    assert kinds == [SpeechStarted, SpeechPaused, SpeechResumed, SpeechPaused, SpeechStopped]
    first, resumed, last, stopped = found[1], found[2], found[3], found[4]
    assert isinstance(first, SpeechPaused) and isinstance(last, SpeechPaused) and isinstance(stopped, SpeechStopped)
    assert isinstance(resumed, SpeechResumed) and resumed.speech_end_ms == first.speech_end_ms  # that pause is over
    assert first.speech_end_ms < last.speech_end_ms == stopped.speech_end_ms
    # Chunking changes nothing, and pause_ms 0 reports none.
    assert all_events(vad_model, two_sentences.samples, VadParams(silence_duration_ms=1500), chunk=640) == found
    assert all(not isinstance(e, SpeechPaused | SpeechResumed)
               for e in all_events(vad_model, two_sentences.samples, VadParams(pause_ms=0)))


def test_one_sentence_gives_one_start_and_one_stop_at_the_speech(vad_model: SileroVad, one_sentence: Clip) -> None:
    found = events(vad_model, one_sentence.samples, VadParams(prefix_padding_ms=300, silence_duration_ms=500))
    assert [type(e) for e in found] == [SpeechStarted, SpeechStopped]
    started, stopped = found
    assert isinstance(started, SpeechStarted) and isinstance(stopped, SpeechStopped)
    assert abs(started.speech_start_ms - one_sentence.speech_start_ms) <= START_TOLERANCE_MS
    assert -50 <= stopped.speech_end_ms - one_sentence.speech_end_ms <= END_TOLERANCE_MS
    # The API's fields: the start includes the prefix padding, the end the silence duration.
    assert started.audio_start_ms == started.speech_start_ms - 300
    assert stopped.audio_end_ms == stopped.speech_end_ms + 500


def test_prefix_padding_is_floored_at_the_stream_start(vad_model: SileroVad, synthesizer: FliteSynthesizer) -> None:
    short_lead = clip(speech(synthesizer, FOX), 1.0)  # flite's own leading pause is ~0.2 s
    started = events(vad_model, short_lead.samples, VadParams(prefix_padding_ms=1000))[0]
    assert isinstance(started, SpeechStarted)
    assert started.speech_start_ms > 0 and started.audio_start_ms == 0


def test_silence_duration_decides_whether_a_pause_ends_speech(vad_model: SileroVad, two_sentences: Clip) -> None:
    patient = events(vad_model, two_sentences.samples, VadParams(silence_duration_ms=1500))
    assert [type(e) for e in patient] == [SpeechStarted, SpeechStopped]
    quick = events(vad_model, two_sentences.samples, VadParams(silence_duration_ms=300))
    assert [type(e) for e in quick] == [SpeechStarted, SpeechStopped, SpeechStarted, SpeechStopped]
    # The one long segment spans both sentences: it starts with the first and stops after the second.
    assert patient[0] == quick[0]
    assert isinstance(patient[1], SpeechStopped) and isinstance(quick[3], SpeechStopped)
    assert patient[1].speech_end_ms == quick[3].speech_end_ms
    assert patient[1].audio_end_ms == quick[3].speech_end_ms + 1500


def test_a_start_never_reaches_back_before_the_previous_stop(vad_model: SileroVad, two_sentences: Clip) -> None:
    found = events(vad_model, two_sentences.samples, VadParams(prefix_padding_ms=2000, silence_duration_ms=300))
    first_stop, second_start = found[1], found[2]
    assert isinstance(first_stop, SpeechStopped) and isinstance(second_start, SpeechStarted)
    assert second_start.audio_start_ms == first_stop.audio_end_ms


@pytest.mark.parametrize("level", [0.0, 0.003, 0.03])  # silence, -50 and -30 dBFS white noise
def test_silence_and_low_noise_give_no_events(vad_model: SileroVad, level: float) -> None:
    assert events(vad_model, noise(5.0, level)) == []


def test_a_steady_tone_is_not_speech(vad_model: SileroVad) -> None:
    t = np.arange(3 * 16_000) / 16_000
    assert events(vad_model, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)) == []


@pytest.mark.parametrize("chunk", [37, 512, 1000, 7919])
def test_chunk_size_does_not_change_the_events(vad_model: SileroVad, two_sentences: Clip, chunk: int) -> None:
    params = VadParams(silence_duration_ms=300)
    assert events(vad_model, two_sentences.samples, params, chunk) == events(vad_model, two_sentences.samples, params)


def test_sessions_share_the_model_but_not_the_state(vad_model: SileroVad, one_sentence: Clip) -> None:
    alone = all_events(vad_model, one_sentence.samples)
    a, b = SpeechSegmenter(vad_model), SpeechSegmenter(vad_model)
    quiet = np.zeros_like(one_sentence.samples)
    got_a: list[VadEvent] = []
    got_b: list[VadEvent] = []
    for at in range(0, len(quiet), 4800):  # interleaved appends, as two sessions would send them
        got_a += a.feed(one_sentence.samples[at:at + 4800])
        got_b += b.feed(quiet[at:at + 4800])
    assert got_a == alone and got_b == []


def test_int16_input_is_scaled(vad_model: SileroVad, one_sentence: Clip) -> None:
    as_int16 = np.clip(np.rint(one_sentence.samples * 32768), -32768, 32767).astype(np.int16)
    assert [type(e) for e in events(vad_model, as_int16)] == [SpeechStarted, SpeechStopped]


def test_batched_windows_score_as_one_at_a_time(vad_model: SileroVad, one_sentence: Clip) -> None:
    """The property the segmenter's batching rests on: the LSTM runs along the batch axis."""
    n = len(one_sentence.samples) // WINDOW * WINDOW
    audio = one_sentence.samples[:n]
    batched = vad_model.probabilities(audio, VadState())
    state, single = VadState(), []
    for at in range(0, n, WINDOW):
        single += vad_model.probabilities(audio[at:at + WINDOW], state).tolist()
    assert np.allclose(batched, single, atol=1e-5)
    assert batched.max() > 0.9 and batched[:20].max() < 0.1  # speech found, and not in the lead-in silence
    assert state.context.shape == (CONTEXT,)


def test_speech_shorter_than_min_speech_ms_does_not_count(vad_model: SileroVad, synthesizer: FliteSynthesizer) -> None:
    # min_speech_ms: the same speech counts only once it lasts long enough.
    fox = speech(synthesizer, FOX)
    assert events(vad_model, clip(1.0, fox, 1.0).samples, VadParams(min_speech_ms=5000)) == []
    assert len(events(vad_model, clip(1.0, fox, 1.0).samples, VadParams(min_speech_ms=64))) == 2


@pytest.mark.parametrize("bad", [{"threshold": 1.5}, {"threshold": -0.1}, {"prefix_padding_ms": -1},
                                 {"silence_duration_ms": 70_000}])
def test_params_are_validated(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        VadParams(**bad)  # type: ignore[arg-type]


def test_ms_fed_counts_every_sample(vad_model: SileroVad) -> None:
    segmenter = SpeechSegmenter(vad_model)
    segmenter.feed(np.zeros(700, np.float32))
    segmenter.feed(np.zeros(900, np.float32))
    assert segmenter.ms_fed == 100 and not segmenter.in_speech
