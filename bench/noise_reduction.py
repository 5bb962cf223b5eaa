"""Noise reduction for voice sessions, decided by measurement: does a CPU denoiser lower the
recognizer's word error on noisy speech, and at what cost? (issue 41)

    .venv/bin/python bench/noise_reduction.py [--sentences 8] [--noise-draws 1] [--noises white,pink,babble] [--smoke]

Speech is flite's (voices slt, rms, awb, kal16), at -25 dBFS RMS, resampled to the 24 kHz wire
rate, with 0.5 s before and 0.3 s after. Noise is mixed in at 24 kHz, the sum quantised to PCM16
(a client's microphone), then resampled to 16 kHz as the gateway does. Noise kinds: ``white``,
``pink`` (1/f, a fan or an air duct), ``babble`` (six other flite talkers at once, a cafe) and
``hum`` (50 Hz and its harmonics). SNR is speech power over noise power, speech measured over
flite's own samples.

Each clip is recognized whole (as a commit would send it) by the gateway's recognizer as the
gateway configures it by default (Whisper tiny.en, faster-whisper, int8, greedy, one thread),
without a denoiser (``none``) and after each candidate that is installed:

- ``webrtc``: WebRTC's noise suppressor (``webrtc-noise-gain``, Apache-2.0; level 2 of 0..4,
  automatic gain off), 10 ms frames at 16 kHz, streamed;
- ``speex``: speexdsp's preprocessor noise suppression (``speexdsp-ns``, BSD), 10 ms frames;
- ``rnnoise``: RNNoise (``pyrnnoise``'s bundled ``librnnoise.so``, BSD; called through ctypes
  without importing pyrnnoise, whose package imports audiolab and matplotlib), 10 ms frames at
  48 kHz, the resampling 16 -> 48 -> 16 kHz counted in its cost;
- ``noisereduce``: spectral gating (``noisereduce``, MIT, needs scipy), non-stationary, on the
  whole clip (it is not causal: it could only run at commit, on the pool).

DeepFilterNet is not a candidate: its package pins numpy < 2 and fetches its weights from the
network at first use.

Figures: ``wer_clean`` {arm: WER on the clean clips}; ``wer_by_snr`` {snr: {arm: WER}} over all
noise kinds, and ``wer_by_noise`` {kind: {snr: {arm: WER}}}; WER is word edits over reference
words, summed over clips, after lower-casing and dropping punctuation. ``denoiser_rtf`` {arm: CPU
seconds a second of audio, this thread only}; ``vad_false_starts_per_min`` {snr: {kind: {arm:
n}}}: Silero VAD (server_vad defaults) on 20 s of noise alone at the level of a 10 and a 0 dB SNR.
``decision``: ``apply:<arm>`` when an arm lowers the mean WER at 10 and 20 dB by at least 2
points and 20% and costs at most 5% of a core, else ``no-op``. ``missing``: candidates not
installed here (``pip install webrtc-noise-gain speexdsp-ns pyrnnoise noisereduce scipy``).

The last line is one JSON object with those keys and ``cpu``; details in
bench/out/noise_reduction.json. ``--smoke``: one sentence, pink noise at 10 dB (seconds).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench._common import SMOKE_HELP, cpu_facts, progress, result_path, write_json
from voice.asr import WhisperRecognizer
from voice.audio import REALTIME_RATE, SPEECH_RATE, Float32Array, resample, to_float32, to_int16
from voice.tts import FliteSynthesizer
from voice.vad import SileroVad, SpeechSegmenter, SpeechStarted

SENTENCES = [
    ("alloy", "The quick brown fox jumps over the lazy dog near the river bank."),
    ("ash", "Please remind me to call my sister when I get home this evening."),
    ("ballad", "What is the weather going to be like tomorrow morning in London?"),
    ("cedar", "Turn off the lights in the kitchen and lock the back door."),
    ("alloy", "Can you explain how a rainbow forms after a summer storm?"),
    ("ash", "I would like to order a large pizza with mushrooms and olives."),
    ("ballad", "Send a message to the team saying the meeting has moved to Friday."),
    ("cedar", "How long does it take to drive from the airport to the hotel?"),
]
BABBLE = [  # the talkers behind: other words, every voice
    ("alloy", "My grandmother used to grow tomatoes and beans in her garden every spring."),
    ("ash", "The train was late again so we waited on the platform for a long time."),
    ("ballad", "Nobody knew where the old map had gone after the library was closed."),
    ("cedar", "She painted the fence blue and then decided she liked it better green."),
    ("alloy", "After the concert everyone walked down to the harbour to watch the boats."),
    ("ash", "He forgot his umbrella at the office and got soaked on the way back."),
]
SNRS_DB = (20, 10, 5, 0)
NOISES = ("white", "pink", "babble", "hum")
SPEECH_DBFS = -25.0
REALISTIC_SNRS = (10, 20)
VAD_SNRS_DB = (10, 0)
CPU_BUDGET = 0.05  # of a core per real-time stream
MIN_GAIN_ABS, MIN_GAIN_REL = 0.02, 0.20
FRAME_16K = 160  # 10 ms


def normalise(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]", " ", text.lower()).split()


def word_edits(ref: list[str], hyp: list[str]) -> int:
    """Levenshtein distance over words (substitutions, deletions, insertions)."""
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1]


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64)))) or 1e-12


def speech_24k(synthesizer: FliteSynthesizer, voice: str, text: str) -> Float32Array:
    made = synthesizer.synthesize(text, voice)
    x = resample(made.samples, made.sample_rate, REALTIME_RATE)
    return (x * (10 ** (SPEECH_DBFS / 20) / rms(x))).astype(np.float32)


def make_noise(kind: str, n: int, rng: np.random.Generator, babble: list[Float32Array]) -> Float32Array:
    """``n`` samples at 24 kHz of unit RMS."""
    if kind == "white":
        x = rng.standard_normal(n)
    elif kind == "pink":  # white shaped by 1/sqrt(f) in power: 1/f
        spectrum = np.fft.rfft(rng.standard_normal(n))
        f = np.fft.rfftfreq(n, 1 / REALTIME_RATE)
        spectrum[1:] /= np.sqrt(f[1:] / f[1])
        spectrum[0] = 0
        x = np.fft.irfft(spectrum, n)
    elif kind == "babble":
        x = np.zeros(n)
        for talker in babble:
            looped = np.tile(talker, n // len(talker) + 2)
            start = int(rng.integers(0, len(talker)))
            x += looped[start:start + n]
    elif kind == "hum":
        t = np.arange(n) / REALTIME_RATE
        phase = rng.uniform(0, 2 * np.pi, 6)
        x = sum(np.sin(2 * np.pi * 50 * h * t + phase[h - 1]) / h for h in range(1, 7))
        x = x + 0.05 * rng.standard_normal(n)
    else:
        raise ValueError(f"unknown noise {kind!r}")
    x = np.asarray(x, np.float64)
    return (x / rms(x)).astype(np.float32)


def as_received(speech: Float32Array, noise: Float32Array | None, snr_db: float | None, at: int = 0) -> Float32Array:
    """Speech (with its silence) plus noise from sample ``at`` on at ``snr_db``, as PCM16 at 24 kHz,
    then at 16 kHz as the gateway hands it on."""
    before, after = int(0.5 * REALTIME_RATE), int(0.3 * REALTIME_RATE)
    x = np.concatenate([np.zeros(before, np.float32), speech, np.zeros(after, np.float32)])
    if noise is not None and snr_db is not None:
        x = x + noise[at:at + len(x)] * (rms(speech) / 10 ** (snr_db / 20))
    return resample(to_int16(x), REALTIME_RATE, SPEECH_RATE)


# The candidates: each makes a fresh stream (one session's state) and turns 16 kHz float32 audio
# into denoised 16 kHz float32 audio.
Denoise = Callable[[Float32Array], Float32Array]


def _framed(x: Float32Array, frame: int) -> np.ndarray:
    pcm = to_int16(x)
    return np.pad(pcm, (0, -len(pcm) % frame)).reshape(-1, frame)


def webrtc(x: Float32Array, level: int = 2) -> Float32Array:
    from webrtc_noise_gain import AudioProcessor

    processor = AudioProcessor(0, level)  # auto gain 0: off
    out = b"".join(processor.Process10ms(f.tobytes()).audio for f in _framed(x, FRAME_16K))
    return to_float32(np.frombuffer(out, np.int16))[:len(x)]


def speex(x: Float32Array) -> Float32Array:
    from speexdsp_ns import NoiseSuppression

    ns = NoiseSuppression.create(FRAME_16K, SPEECH_RATE)
    out = b"".join(ns.process(f.tobytes()) for f in _framed(x, FRAME_16K))
    return to_float32(np.frombuffer(out, np.int16))[:len(x)]


def _librnnoise() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("pyrnnoise")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "librnnoise.so"
    if not path.is_file():
        return None
    lib = ctypes.CDLL(str(path))
    lib.rnnoise_create.argtypes = [ctypes.c_void_p]
    lib.rnnoise_create.restype = ctypes.c_void_p
    lib.rnnoise_destroy.argtypes = [ctypes.c_void_p]
    lib.rnnoise_process_frame.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_float)]
    lib.rnnoise_process_frame.restype = ctypes.c_float
    return lib


def rnnoise_with(lib: ctypes.CDLL) -> Denoise:
    def rnnoise(x: Float32Array) -> Float32Array:
        state = lib.rnnoise_create(None)
        try:
            y = resample(x, SPEECH_RATE, 48_000) * np.float32(32768)  # RNNoise takes int16-scaled floats
            frames = np.ascontiguousarray(np.pad(y, (0, -len(y) % 480)).reshape(-1, 480), np.float32)
            ptr = ctypes.POINTER(ctypes.c_float)
            for frame in frames:
                p = frame.ctypes.data_as(ptr)
                lib.rnnoise_process_frame(state, p, p)
            out = frames.reshape(-1)[:len(y)] / np.float32(32768)
        finally:
            lib.rnnoise_destroy(state)
        return resample(out, 48_000, SPEECH_RATE)[:len(x)]
    return rnnoise


def noisereduce(x: Float32Array) -> Float32Array:
    import noisereduce as nr

    return np.asarray(nr.reduce_noise(y=x, sr=SPEECH_RATE, stationary=False, n_jobs=1, use_tqdm=False), np.float32)


def candidates() -> tuple[dict[str, Denoise], list[str]]:
    found: dict[str, Denoise] = {}
    missing = []
    for name, module, fn in (("webrtc", "webrtc_noise_gain", webrtc), ("speex", "speexdsp_ns", speex),
                             ("noisereduce", "noisereduce", noisereduce)):
        if importlib.util.find_spec(module) is not None and (name != "noisereduce" or importlib.util.find_spec("scipy")):
            found[name] = fn
        else:
            missing.append(name)
    lib = _librnnoise()
    if lib is not None:
        found["rnnoise"] = rnnoise_with(lib)
    else:
        missing.append("rnnoise")
    return found, missing


def vad_false_starts(vad: SileroVad, arms: dict[str, Denoise], noises: dict[str, Float32Array],
                     seconds: float) -> dict[str, dict[str, dict[str, float]]]:
    """Speech starts a minute on noise alone at the level of a 10 dB and a 0 dB SNR, fed in 20 ms
    appends: {snr: {kind: {arm: starts}}}."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    n = int(seconds * REALTIME_RATE)
    for snr in VAD_SNRS_DB:
        level = 10 ** ((SPEECH_DBFS - snr) / 20)
        for kind, noise in noises.items():
            x = resample(to_int16(noise[:n] * level), REALTIME_RATE, SPEECH_RATE)
            for arm, denoise in arms.items():
                y = denoise(x)
                segmenter = SpeechSegmenter(vad)
                starts = sum(isinstance(e, SpeechStarted) for at in range(0, len(y), 320)
                             for e in segmenter.feed(y[at:at + 320]))
                out.setdefault(str(snr), {}).setdefault(kind, {})[arm] = round(starts * 60 / seconds, 1)
    return out


def decide(wer_by_snr: dict[str, dict[str, float]], wer_clean: dict[str, float], rtf: dict[str, float]) -> str:
    realistic = [wer_by_snr[str(s)] for s in REALISTIC_SNRS if str(s) in wer_by_snr]
    if not realistic:
        return "no-op"
    base = float(np.mean([w["none"] for w in realistic]))
    best, best_gain = None, 0.0
    for arm in rtf:
        gain = base - float(np.mean([w[arm] for w in realistic]))
        if (rtf[arm] <= CPU_BUDGET and gain >= MIN_GAIN_ABS and gain >= MIN_GAIN_REL * base
                and wer_clean[arm] <= wer_clean["none"] + 0.01 and gain > best_gain):
            best, best_gain = arm, gain
    return f"apply:{best}" if best else "no-op"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=8, help=f"how many of the {len(SENTENCES)} sentences")
    parser.add_argument("--noises", default="white,pink,babble", help=f"comma-separated, of {','.join(NOISES)}")
    parser.add_argument("--snrs", default=",".join(map(str, SNRS_DB)), help="comma-separated, dB")
    parser.add_argument("--noise-draws", type=int, default=1,
                        help="noisy copies of each clip, each with another stretch of the noise")
    parser.add_argument("--vad-seconds", type=float, default=20.0)
    parser.add_argument("--denoisers", default="webrtc,speex,rnnoise,noisereduce",
                        help="comma-separated candidates to try, where installed")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    n_sentences, kinds, snrs = args.sentences, args.noises.split(","), [int(s) for s in args.snrs.split(",")]
    vad_seconds = args.vad_seconds
    if args.smoke:
        n_sentences, kinds, snrs, vad_seconds = 1, ["pink"], [10], 2.0
    cpu = cpu_facts()
    progress(f"CPU: {cpu['model']}, {cpu['cores']} cores")
    found, missing = candidates()
    found = {name: fn for name, fn in found.items() if name in args.denoisers.split(",")}
    arms: dict[str, Denoise] = {"none": lambda x: x, **found}
    progress(f"denoisers: {', '.join(found) or 'none installed'}" + (f"; missing: {', '.join(missing)}" if missing else ""))

    synthesizer = FliteSynthesizer()
    rng = np.random.default_rng(41)
    babble = [speech_24k(synthesizer, v, t) for v, t in BABBLE] if "babble" in kinds else []
    sentences = SENTENCES[:n_sentences]
    speech = [speech_24k(synthesizer, v, t) for v, t in sentences]
    longest = max(len(s) for s in speech) + REALTIME_RATE
    draws = 1 if args.smoke else args.noise_draws
    noise_len = max(longest * (draws + 1), int(vad_seconds * REALTIME_RATE))
    noises = {k: make_noise(k, noise_len, rng, babble) for k in kinds}
    recognizer = WhisperRecognizer(threads=1)
    for denoise in found.values():
        denoise(np.zeros(SPEECH_RATE // 10, np.float32))  # imports and first-call set-up, not timed

    edits: dict[tuple[str, int | None, str], list[int]] = {}  # (kind, snr, arm) -> [edits, words]
    cpu_s: dict[str, float] = {arm: 0.0 for arm in found}
    audio_s = 0.0
    examples: list[dict[str, object]] = []
    conditions: list[tuple[str, int | None]] = [("clean", None)] + [(k, s) for k in kinds for s in snrs]
    clips = [(text, clean, draw) for (_, text), clean in zip(sentences, speech, strict=True) for draw in range(draws)]
    for kind, snr in conditions:
        for text, clean, draw in clips:
            if snr is None and draw > 0:
                continue  # one clean copy is enough: it is the same audio
            x = as_received(clean, noises.get(kind), snr, at=draw * longest)
            ref = normalise(text)
            for arm, denoise in arms.items():
                started = time.thread_time()
                y = denoise(x)
                if arm != "none":
                    cpu_s[arm] += time.thread_time() - started
                hyp = recognizer.transcribe(y).text
                tally = edits.setdefault((kind, snr, arm), [0, 0])
                tally[0] += word_edits(ref, normalise(hyp))
                tally[1] += len(ref)
                if snr in (None, 10) and len(examples) < 40:
                    examples.append({"noise": kind, "snr": snr, "arm": arm, "ref": text, "hyp": hyp})
            audio_s += len(x) / SPEECH_RATE
        progress(f"{kind} {'' if snr is None else f'{snr} dB'}: "
                 + ", ".join(f"{a} {edits[(kind, snr, a)][0] / edits[(kind, snr, a)][1]:.3f}" for a in arms))

    def wer(keys: list[tuple[str, int | None, str]]) -> float:
        return round(sum(edits[k][0] for k in keys) / sum(edits[k][1] for k in keys), 4)

    wer_clean = {a: wer([("clean", None, a)]) for a in arms}
    wer_by_snr = {str(s): {a: wer([(k, s, a) for k in kinds]) for a in arms} for s in snrs}
    wer_by_noise = {k: {str(s): {a: wer([(k, s, a)]) for a in arms} for s in snrs} for k in kinds}
    rtf = {a: round(cpu_s[a] / audio_s, 4) for a in found}
    progress("VAD on noise alone")
    false_starts = vad_false_starts(SileroVad(), arms, noises, vad_seconds)
    results: dict[str, object] = {
        "wer_clean": wer_clean, "wer_by_snr": wer_by_snr, "wer_by_noise": wer_by_noise, "denoiser_rtf": rtf,
        "vad_false_starts_per_min": false_starts, "decision": decide(wer_by_snr, wer_clean, rtf),
        "missing": missing, "clips": len(sentences) * (1 + draws * (len(conditions) - 1)), "cpu": cpu["model"]}
    write_json(result_path("noise_reduction.json", args.smoke),
               {**results, "cpu_facts": cpu, "noises": kinds, "noise_draws": draws, "snrs_db": snrs, "sentences": [t for _, t in sentences],
                "speech_dbfs": SPEECH_DBFS, "examples": examples})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
