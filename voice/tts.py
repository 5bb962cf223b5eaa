"""Speech synthesis: a small interface and the default, Debian's ``flite`` run as a subprocess.

flite (CMU Flite 2.2, BSD-style licence, ~13 MB with its voices; ``apt-get install flite``) speaks
offline with built-in voices; the 16 kHz ones are ``slt`` (female), ``rms``, ``awb`` and ``kal16``
(male); ``kal`` is 8 kHz and ``awb_time`` speaks only times of day. It sounds robotic, but Whisper
transcribes it exactly and it costs ~1% of real time here. It runs as a child process (one per
phrase, ~10-40 ms each), so it holds no GIL, shares no memory and a stuck one is killed by its
timeout. ``piper-tts`` sounds better but is GPL-3.0-or-later: it comes only as an optional
backend run as its own program (``voice.tts_piper``).

Timing: ``flite -psdur`` prints each phone with its end time, so the silence flite puts before and
after speech, and the pauses it makes at punctuation, are known; ``marks`` passes them on as
(character, sample) anchors for the text-to-audio alignment. flite prints no word boundaries, so
between anchors the alignment interpolates by characters.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
import wave
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from voice.audio import Int16Array
from voice.children import child_env
from voice.errors import VoiceModelError

Mark = tuple[int, int]  # (character offset in the phrase's text, sample offset in its audio)

# The Realtime API's voices onto flite's, fixed so a voice sounds the same in every session and
# release. flite has two clearly different voices (a female, slt; males rms, awb, kal16).
OPENAI_VOICES: dict[str, str] = {
    "alloy": "slt", "ash": "rms", "ballad": "awb", "coral": "slt", "echo": "rms",
    "sage": "slt", "shimmer": "slt", "verse": "awb", "marin": "slt", "cedar": "kal16",
}
FALLBACK_ORDER = ("slt", "rms", "awb", "kal16", "kal")  # when a mapped voice is not built in
MAX_TEXT_CHARS = 2000  # phrases are far shorter (voice.phrases bounds them); this only catches a caller's bug
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # NUL cannot go in argv; the rest means nothing spoken


@dataclass(frozen=True)
class Speech:
    samples: Int16Array  # mono PCM16 at sample_rate
    sample_rate: int
    # Anchors from the synthesizer's own timing, increasing in both offsets; empty when it gives
    # none (the alignment then spreads the text evenly over the samples).
    marks: tuple[Mark, ...] = ()
    seconds_taken: float = 0.0

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate

    @property
    def real_time_factor(self) -> float:
        return self.seconds_taken / self.seconds if len(self.samples) else 0.0


class Synthesizer(Protocol):
    """Text to speech. Called from worker threads; implementations must be thread-safe."""

    def synthesize(self, text: str, voice: str | None = None) -> Speech: ...

    def resolve_voice(self, voice: str | None) -> str: ...

    def close(self) -> None: ...


class FliteSynthesizer:
    def __init__(self, binary: str = "flite", *, default_voice: str = "alloy", timeout_s: float = 20.0) -> None:
        found = shutil.which(binary)
        if found is None:
            raise VoiceModelError(f"the speech synthesizer {binary!r} is not installed (Debian: apt-get install flite)")
        self.binary = found
        self.timeout_s = timeout_s
        self.voices = self._list_voices()
        # flite's text-to-phones program (same package): each word's phones, for word timing.
        self.t2p = shutil.which("t2p", path=str(Path(found).parent)) or shutil.which("t2p")
        usable = [v for v in FALLBACK_ORDER if v in self.voices]
        if not usable:
            raise VoiceModelError(f"{found} has none of the voices {list(FALLBACK_ORDER)} (it lists {self.voices})")
        self.default_voice = self._lookup(default_voice) or usable[0]
        # Temporary WAVs in memory where Linux offers it: flite writes its WAV to a file (stdout
        # carries the phone timings).
        self._tmpdir = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None

    def _list_voices(self) -> tuple[str, ...]:
        out = subprocess.run([self.binary, "-lv"], capture_output=True, text=True, timeout=self.timeout_s, check=False,
                             env=child_env())
        # "Voices available: kal awb_time kal16 awb rms slt "
        _, _, names = out.stdout.partition(":")
        return tuple(names.split())

    def resolve_voice(self, voice: str | None) -> str:
        """The flite voice for an API voice name (or a flite voice name); unknown names get the default."""
        return (self._lookup(voice) if voice is not None else None) or self.default_voice

    def _lookup(self, voice: str) -> str | None:
        name = OPENAI_VOICES.get(voice.lower(), voice.lower())
        return name if name in self.voices and name != "awb_time" else None

    def close(self) -> None:
        """Nothing to release: each phrase's flite process ends with it."""

    def synthesize(self, text: str, voice: str | None = None) -> Speech:
        if len(text) > MAX_TEXT_CHARS:
            raise ValueError(f"a phrase of {len(text)} characters; at most {MAX_TEXT_CHARS}")
        spoken = _CONTROL.sub(" ", text)
        if not spoken.strip():
            return Speech(np.zeros(0, np.int16), 16_000)
        started = time.perf_counter()
        fd, wav_path = tempfile.mkstemp(prefix="voice-", suffix=".wav", dir=self._tmpdir)
        os.close(fd)
        try:
            # -t: the text is an argument, never a file name or an option, whatever it starts with.
            run = subprocess.run([self.binary, "-voice", self.resolve_voice(voice), "-psdur", "-o", wav_path,
                                  "-t", spoken], capture_output=True, text=True, timeout=self.timeout_s, check=False,
                                 env=child_env())
            if run.returncode != 0:
                raise RuntimeError(f"flite exited with {run.returncode}: {run.stderr.strip()[:200]}")
            samples, rate = read_wav(Path(wav_path))
        finally:
            os.unlink(wav_path)
        phones = parse_phone_ends(run.stdout)
        marks = marks_from_phones(text, phones, rate, len(samples))
        if self.t2p is not None:
            marks = merge_marks(marks, word_marks(text, phones, self._word_phones(spoken), rate, len(samples)))
        return Speech(samples, rate, marks, time.perf_counter() - started)

    def phones(self, text: str) -> list[str] | None:
        """flite's phones for ``text`` (its letter-to-sound rules and lexicon, through ``t2p``):
        ``pau`` where it pauses, vowels with their stress digit (``eh1``); None without t2p or
        when it fails."""
        if self.t2p is None:
            return None
        # A leading space: t2p takes an argument starting with "-" ("-5 degrees", a clause cut at
        # " - ") as an option and prints only its usage; with the space it is read as text.
        run = subprocess.run([self.t2p, " " + text], capture_output=True, text=True, timeout=self.timeout_s,
                             check=False, env=child_env())
        return run.stdout.split() if run.returncode == 0 else None

    def _word_phones(self, text: str) -> list[int] | None:
        """How many phones each whitespace-separated word of ``text`` has, from ``t2p`` with the
        words set apart by commas (a pause between each); None when flite does not pause between
        every pair (an abbreviation such as "Mr." joins the next word) or t2p fails."""
        words = text.split()
        phones = self.phones(", ".join(words)) if words else None
        if phones is None:
            return None
        groups = [g.split() for g in " ".join(phones).split("pau")]
        counts = [len(g) for g in groups if g]
        return counts if len(counts) == len(words) else None


def read_wav(path: Path) -> tuple[Int16Array, int]:
    """A synthesizer's WAV; RuntimeError for a file that is empty or not a 16-bit mono WAV."""
    try:
        with wave.open(str(path), "rb") as w:
            if w.getsampwidth() != 2 or w.getnchannels() != 1:
                raise RuntimeError(f"expected 16-bit mono WAV, got {w.getsampwidth() * 8}-bit x {w.getnchannels()}")
            return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.int16), w.getframerate()
    except (wave.Error, EOFError) as e:
        raise RuntimeError(f"the synthesizer wrote no usable WAV: {e or 'empty file'}") from e


def parse_phone_ends(text: str) -> list[tuple[str, float]]:
    """``flite -psdur``'s output, ``pau:0.164 hh:0.255 ...``, as (phone, end in seconds)."""
    out = []
    for token in text.split():
        phone, sep, end = token.rpartition(":")
        if sep:
            try:
                out.append((phone, float(end)))
            except ValueError:
                continue
    return out


# Where flite pauses inside a phrase: after , ; : . ! ? ) or a dash or ellipsis, before more text.
_BREAK = re.compile(r"(?:[,;:.!?)]+|--+|\.\.\.)(?=\s+\S)")


def word_marks(text: str, phones: Sequence[tuple[str, float]], word_phones: Sequence[int] | None, rate: int,
               n_samples: int) -> tuple[Mark, ...]:
    """An anchor at the end of every word: (its last character, where its last phone ends), from
    each word's phone count (``word_phones``, in the order of the text's words) laid over the
    phrase's phones (pauses skipped). Nothing when the counts do not add up to the phones spoken
    (flite's rules made more or fewer phones than the words alone)."""
    spoken = [end for name, end in phones if name != "pau"]
    ends = [m.end() for m in re.finditer(r"\S+", text)]
    if not word_phones or len(word_phones) != len(ends) or sum(word_phones) != len(spoken):
        return ()
    marks: list[Mark] = []
    last = 0
    for char_end, count in zip(ends, word_phones, strict=True):
        last += count
        marks.append((char_end, min(max(round(spoken[last - 1] * rate), 0), n_samples)))
    return tuple(marks)


def merge_marks(*sets: Sequence[Mark]) -> tuple[Mark, ...]:
    """Anchors from several sources as one increasing sequence: by character, the earliest sample
    for a character given twice; a mark that would go back in time is dropped."""
    out: list[Mark] = []
    for char, sample in sorted({m for marks in sets for m in marks}):
        if out and char == out[-1][0]:
            continue
        if out and sample < out[-1][1]:
            continue
        out.append((char, sample))
    return tuple(out)


def marks_from_phones(text: str, phones: Sequence[tuple[str, float]], rate: int, n_samples: int) -> tuple[Mark, ...]:
    """Alignment anchors from flite's phone timings: speech starts after the leading pause and
    ends before the trailing one; each inside pause is tied to a punctuation break of the text
    when (and only when) the counts agree, since flite's rules for pausing (``e.g.`` pauses,
    ``Mr.`` does not) are not worth re-implementing. Anchors are (char, sample), increasing."""
    stripped = text.strip()
    if not phones or not stripped or n_samples == 0:
        return ()
    first = len(text) - len(text.lstrip())
    last = first + len(stripped)

    def at(seconds: float) -> int:
        return min(max(round(seconds * rate), 0), n_samples)

    # Each phone's span: starts where the previous one ended.
    spans = [(name, phones[i - 1][1] if i else 0.0, end) for i, (name, end) in enumerate(phones)]
    lead = 1 if spans[0][0] == "pau" else 0
    trail = 1 if len(spans) > lead and spans[-1][0] == "pau" else 0
    speech = spans[lead:len(spans) - trail]
    if not speech:
        return ()
    marks: list[Mark] = [(first, at(speech[0][1]))]
    pauses = [(s, e) for name, s, e in speech if name == "pau"]
    breaks = list(_BREAK.finditer(text))
    if pauses and len(pauses) == len(breaks):
        for (start_s, end_s), br in zip(pauses, breaks, strict=True):
            next_word = br.end() + len(text[br.end():]) - len(text[br.end():].lstrip())
            marks += [(br.end(), at(start_s)), (next_word, at(end_s))]
    marks.append((last, at(speech[-1][2])))
    # Keep them strictly increasing in characters and never decreasing in samples.
    clean: list[Mark] = []
    for char, sample in marks:
        if clean and (char <= clean[-1][0] or sample < clean[-1][1]):
            continue
        clean.append((char, sample))
    return tuple(clean)
