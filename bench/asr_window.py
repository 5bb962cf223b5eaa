"""Whisper's encoder window: the full 30 s against a window of the utterance's own length.

    .venv/bin/python bench/asr_window.py [--repeats 2] [--smoke]

faster-whisper pads every utterance to Whisper's 30 s window, so a 1.5 s question costs the
encoder as much as 30 s of speech. ``voice.asr.WhisperRecognizer(window="auto")`` encodes an
utterance that fits in ``encoder_window_s`` of it (its length plus a margin, rounded up) instead.
This runs both recognizers (Whisper tiny.en, int8, one thread) on the same clips, alternating
clip by clip: ``full`` is faster-whisper as it comes (30 s: the recognizer before issue 42),
``auto`` the gateway's (the shortened window). Two more arms: ``prompted``, the shortened window
with ``voice.asr.ASSISTANT_PROMPT`` read as said before the speech (``[voice] asr_prompt``), and
``tight``, the shortened window on a 4 s floor instead of 12 s and no loop check (what a window
hugging the utterance does). For each:

- CPU milliseconds per utterance (``time.process_time``: this process's CPU, not wall time, so
  another job on the cores does not count), median over the short utterances (1-3 s, questions
  and commands) and over the long ones (5-10 s);
- WER: word edits (substitutions, deletions, insertions) over reference words, after lower-casing
  and dropping punctuation, over all clips and by condition.

Speech: flite's four built-in voices (slt, rms, awb, kal16; espeak-ng is not installed here),
at -25 dBFS with 0.5 s of silence before and 0.3 s after, sent as PCM16 at 24 kHz and resampled to
16 kHz as the gateway does; clean, and with white noise at 20 and 10 dB SNR.

The last line is one JSON object: ``asr_cpu_ms_per_utterance_p50`` (the gateway's, short
utterances) beside ``asr_cpu_ms_per_utterance_p50_full`` (and ``_prompted``, ``_tight``), the long
utterances' figures, ``asr_wer`` beside ``asr_wer_full`` (and ``_prompted``, ``_tight``), word errors
and words, WER by condition, ``decision`` and ``cpu``;
details (every transcript) in bench/out/asr_window.json. ``--smoke``: a few clips (seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable

import numpy as np

from bench._common import SMOKE_HELP, cpu_facts, median, progress, result_path, write_json
from bench.noise_reduction import as_received, make_noise, normalise, speech_24k, word_edits
from voice.asr import (
    ASSISTANT_PROMPT,
    FULL_WINDOW_S,
    WINDOW_MARGIN_S,
    WINDOW_STEP_S,
    WhisperRecognizer,
    encoder_window_s,
)
from voice.audio import SPEECH_RATE, Float32Array
from voice.tts import FliteSynthesizer

VOICES = ("alloy", "ash", "ballad", "cedar")  # flite slt, rms, awb, kal16
SHORT = [
    "What time is it?",
    "Turn on the lights.",
    "Call my mother.",
    "What's the weather today?",
    "Play some jazz music.",
    "How far away is the moon?",
    "Set a timer for ten minutes.",
    "Where did I leave my keys?",
]
LONG = [
    "Please remind me to call my sister when I get home this evening, and then book a table for "
    "two people at seven.",
    "Can you explain how a rainbow forms after a summer storm, and why the colours always appear in "
    "the same order?",
    "Send a message to the team saying the meeting has moved to Friday afternoon, and ask everyone "
    "to bring their notes.",
]
CONDITIONS: tuple[tuple[str, float | None], ...] = (("clean", None), ("snr20", 20.0), ("snr10", 10.0))
SHORT_RANGE_S = (1.0, 3.0)
LONG_RANGE_S = (5.0, 10.0)
ARMS = ("full", "auto", "prompted", "tight")
TIGHT_MIN_WINDOW_S = 4.0


def clips(synthesizer: FliteSynthesizer, texts: list[str], voices: tuple[str, ...],
          conditions: tuple[tuple[str, float | None], ...]) -> list[dict[str, object]]:
    made = []
    rng = np.random.default_rng(0)
    for text in texts:
        for voice in voices:
            speech = speech_24k(synthesizer, voice, text)
            noise = make_noise("white", len(speech) + 24_000, rng, [])
            for condition, snr in conditions:
                audio = as_received(speech, noise if snr is not None else None, snr)
                made.append({"text": text, "voice": voice, "condition": condition, "audio": audio,
                             "seconds": round(len(audio) / SPEECH_RATE, 2)})
    return made


Recognize = Callable[[Float32Array], str]


def arms(full: WhisperRecognizer, auto: WhisperRecognizer) -> dict[str, Recognize]:
    """``full`` and ``auto`` as configured (no prompt), ``prompted`` with ``ASSISTANT_PROMPT``; ``tight``:
    the shortened window with a 4 s floor instead of 12 s and no loop check, to show why the floor is 12 s."""
    def tight(audio: Float32Array) -> str:
        seconds = len(audio) / SPEECH_RATE
        window_s = max(TIGHT_MIN_WINDOW_S, math.ceil((seconds + WINDOW_MARGIN_S) / WINDOW_STEP_S) * WINDOW_STEP_S)
        if window_s >= FULL_WINDOW_S:
            return full.transcribe(audio).text
        return "".join(s.text for s in auto._short_window_segments(audio, window_s)).strip()

    return {"full": lambda a: full.transcribe(a).text, "auto": lambda a: auto.transcribe(a).text,
            "prompted": lambda a: auto.transcribe(a, prompt=ASSISTANT_PROMPT).text, "tight": tight}


def run_arms(recognizers: dict[str, Recognize], made: list[dict[str, object]],
             repeats: int) -> list[dict[str, object]]:
    rows = []
    for i, c in enumerate(made):
        audio = c["audio"]
        assert isinstance(audio, np.ndarray)
        row = {k: v for k, v in c.items() if k != "audio"}
        for arm in (ARMS if i % 2 == 0 else ARMS[::-1]):  # alternate which goes first
            cpu = []
            for _ in range(repeats):
                started = time.process_time()
                text = recognizers[arm](audio)
                cpu.append(time.process_time() - started)
            ref, hyp = normalise(str(c["text"])), normalise(text)
            row[arm] = {"text": text, "cpu_ms": round(median(cpu) * 1e3, 2), "edits": word_edits(ref, hyp),
                        "words": len(ref)}
        row["window_s"] = encoder_window_s(float(c["seconds"]))  # type: ignore[arg-type]
        rows.append(row)
    return rows


def summary(rows: list[dict[str, object]]) -> dict[str, object]:
    def arm_rows(arm: str, lo: float, hi: float) -> list[dict[str, float]]:
        return [r[arm] for r in rows if lo <= float(r["seconds"]) <= hi]  # type: ignore[misc]

    def p50(arm: str, bounds: tuple[float, float]) -> float | None:
        picked = arm_rows(arm, *bounds)
        return round(median([r["cpu_ms"] for r in picked]), 1) if picked else None

    def wer(arm: str, condition: str | None = None) -> float:
        picked = [r[arm] for r in rows if condition is None or r["condition"] == condition]  # type: ignore[misc]
        return round(sum(p["edits"] for p in picked) / sum(p["words"] for p in picked), 4)

    out: dict[str, object] = {}
    for arm in ARMS:
        tail = "" if arm == "auto" else f"_{arm}"
        out[f"asr_cpu_ms_per_utterance_p50{tail}"] = p50(arm, SHORT_RANGE_S)
        out[f"asr_cpu_ms_long_p50{tail}"] = p50(arm, LONG_RANGE_S)
        out[f"asr_wer{tail}"] = wer(arm)
        out[f"asr_word_errors{tail}"] = sum(r[arm]["edits"] for r in rows)  # type: ignore[index]
    out["asr_words"] = sum(r["full"]["words"] for r in rows)  # type: ignore[index]
    conditions = sorted({str(r["condition"]) for r in rows})
    out["asr_wer_by_condition"] = {c: {arm: wer(arm, c) for arm in ARMS} for c in conditions}
    return out


def decide(s: dict[str, object]) -> str:
    """The shortened window is the default only if it makes no more word errors on the set and at
    least halves the CPU of a short utterance."""
    short, full = s["asr_cpu_ms_per_utterance_p50"], s["asr_cpu_ms_per_utterance_p50_full"]
    if not isinstance(short, float) or not isinstance(full, float):
        return "no short utterances measured"
    fewer_or_same = s["asr_word_errors"] <= s["asr_word_errors_full"]  # type: ignore[operator]
    halved = short * 2 <= full
    return ("auto: no more word errors, CPU at most half" if fewer_or_same and halved else
            f"full: {'more word errors' if not fewer_or_same else 'CPU not halved'} with the shortened window")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="timed recognitions of each clip per arm (median)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    cpu = cpu_facts()
    progress(f"CPU: {cpu['model']}, {cpu['cores']} cores")
    synthesizer = FliteSynthesizer()
    if args.smoke:
        repeats = 1
        made = (clips(synthesizer, SHORT[:2], VOICES[:2], CONDITIONS[::2])
                + clips(synthesizer, LONG[:1], VOICES[:1], CONDITIONS[:1]))
    else:
        repeats = args.repeats
        made = clips(synthesizer, SHORT, VOICES, CONDITIONS) + clips(synthesizer, LONG, VOICES[:2], CONDITIONS)
    recognizers = arms(WhisperRecognizer(threads=1, window="full"), WhisperRecognizer(threads=1, window="auto"))
    for recognize in recognizers.values():  # first-call set-up, not timed
        recognize(made[0]["audio"])  # type: ignore[arg-type]
    progress(f"{len(made)} clips, {repeats} timed run(s) of each per arm")
    rows = run_arms(recognizers, made, repeats)
    results = summary(rows)
    results["decision"] = decide(results)
    results["clips"] = len(rows)
    results["cpu"] = cpu["model"]
    progress(f"short utterance CPU ms p50: full {results['asr_cpu_ms_per_utterance_p50_full']}, "
             f"auto {results['asr_cpu_ms_per_utterance_p50']}; WER full {results['asr_wer_full']}, "
             f"auto {results['asr_wer']}, auto with the prompt {results['asr_wer_prompted']}")
    write_json(result_path("asr_window.json", args.smoke), {**results, "cpu_facts": cpu, "repeats": repeats,
                                                            "rows": rows})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
