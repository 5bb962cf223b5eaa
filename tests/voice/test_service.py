"""The gateway's entry point on the wire's 24 kHz: speech made, segmented, recognised and aligned."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import numpy as np
import pytest

from voice.alignment import Alignment
from voice.audio import REALTIME_RATE, decode_pcm16, encode_pcm16
from voice.config import VoiceConfig
from voice.pool import JobFigures
from voice.service import VoiceService
from voice.vad import SpeechStarted, SpeechStopped, VadParams

# Words flite says clearly enough for tiny.en (its "can" is heard as "can't"; digits come back as digits).
ANSWER = "Sure, I will help with that. The train leaves early in the morning, from the north platform."


@pytest.fixture
async def service() -> AsyncIterator[tuple[VoiceService, list[JobFigures]]]:
    figures: list[JobFigures] = []
    s = VoiceService(VoiceConfig(pool_threads=2), observer=figures.append)
    yield s, figures
    s.close()


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z ]", " ", text.lower()).split()


async def test_an_answer_spoken_phrase_by_phrase_is_heard_back(service: tuple[VoiceService, list[JobFigures]]) -> None:
    voice, figures = service
    splitter = voice.phrase_splitter()
    phrases = [p for i in range(0, len(ANSWER), 7) for p in splitter.feed(ANSWER[i:i + 7])] + splitter.flush()
    assert phrases[0] == "Sure, I will help with that." and len(phrases) >= 2
    alignment = Alignment(REALTIME_RATE)
    audio = []
    for phrase in phrases:
        spoken = await voice.speak(phrase, "alloy")
        assert spoken.pcm.dtype == np.int16 and spoken.text == phrase
        alignment.add(phrase, len(spoken.pcm), spoken.marks)
        audio.append(spoken.pcm)
    pcm = np.concatenate(audio)
    assert alignment.total_samples == len(pcm) and alignment.text == ANSWER
    assert alignment.spoken_text(alignment.total_ms) == ANSWER

    # As a client would send it back: the bytes on the wire, through the session's VAD path.
    wire = decode_pcm16(encode_pcm16(pcm), max_bytes=len(pcm) * 2)
    to_16k, segmenter = voice.input_resampler(), voice.segmenter(VadParams(silence_duration_ms=800, pause_ms=0))
    events = []
    for at in range(0, len(wire), 480):  # 20 ms appends
        events += segmenter.feed(to_16k.feed(wire[at:at + 480]))
    events += segmenter.feed(np.zeros(16_000, np.float32))
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped]

    heard = await voice.transcribe(wire)
    assert words(heard.text) == words(ANSWER)
    assert heard.seconds_of_audio == pytest.approx(len(pcm) / REALTIME_RATE)
    stats = voice.pool.stats()
    assert stats.by_kind["tts"].jobs == len(phrases) and stats.by_kind["asr"].jobs == 1
    assert 0 < stats.by_kind["asr"].real_time_factor < 1 and 0 < stats.by_kind["tts"].real_time_factor < 1
    # The observer heard of every job (its callback runs on the loop before the awaiting task resumes).
    assert [(f.kind, f.outcome) for f in figures] == [("tts", "done")] * len(phrases) + [("asr", "done")]


async def test_a_cut_in_the_second_phrase_keeps_the_first_and_whole_words(
        service: tuple[VoiceService, list[JobFigures]]) -> None:
    voice, _ = service
    alignment = Alignment(REALTIME_RATE)
    first = await voice.speak("Sure, I will help with that.")
    second = await voice.speak(" The train leaves early in the morning.")
    alignment.add(first.text, len(first.pcm), first.marks)
    alignment.add(second.text, len(second.pcm), second.marks)
    halfway = (len(first.pcm) + len(second.pcm) // 2) * 1000 / REALTIME_RATE
    kept = alignment.spoken_text(halfway)
    assert kept.startswith("Sure, I will help with that. The")
    assert ANSWER.startswith(kept) and kept != "Sure, I will help with that. The train leaves early in the morning."
    assert kept[-1].isalpha()  # cut after a whole word


class Session:
    """An owner of pool jobs, as a Realtime session is (the pool keeps a budget per owner)."""


async def test_a_short_utterance_costs_the_recognizers_whole_window(
        service: tuple[VoiceService, list[JobFigures]]) -> None:
    """Admission counts the window Whisper encodes, not the utterance (issue 39, item 2): the
    shortened window (12 s) for a 1 s utterance, as the config says (issue 42); the figures count
    the audio there was."""
    import asyncio

    from voice.asr import MIN_WINDOW_S

    s, figures = service
    assert s.config.asr_window == "auto"
    one_second = np.zeros(24_000, np.int16)
    job = asyncio.ensure_future(s.transcribe(one_second, owner=Session()))
    await asyncio.sleep(0)
    assert s.pool.stats().outstanding_audio_s == MIN_WINDOW_S
    await asyncio.wait_for(job, 60)
    assert figures[-1].kind == "asr" and abs(figures[-1].audio_s - 1.0) < 0.01
