"""Speech synthesis: a small interface and the default, Debian's flite, served by child processes.

flite (CMU Flite 2.2, BSD-style licence, ~13 MB with its voices; ``apt-get install flite``) speaks
offline with built-in voices; the 16 kHz ones are ``slt`` (female), ``rms``, ``awb`` and ``kal16``
(male); ``kal`` is 8 kHz. It sounds robotic, but Whisper transcribes it exactly and it costs ~1%
of real time here. Its library runs in long-lived child processes (``voice/flite_child.py``, one
per pool thread): a phrase costs a pipe round trip, not a process start and a voice load as the
``flite`` program did (~20 ms a short phrase that way, ~9 ms this way, and the word timing, which
took a ``t2p`` run of 2-4 ms, now comes with the phrase). A child holds no GIL and shares no
memory with the gateway; one that fails, or outlives its timeout, is killed and replaced (flite
ends its process on an internal error, which is why it is not loaded into the gateway's).
``piper-tts`` sounds better but is GPL-3.0-or-later: it comes only as an optional backend run as
its own program (``voice.tts_piper``).

Timing: each phrase comes with its phones and their end times, so the silence flite puts before
and after speech, and the pauses it makes at punctuation, are known; ``marks`` passes them on as
(character, sample) anchors for the text-to-audio alignment, with one at the end of every word
(the phones of each of flite's tokens, its whitespace-separated words, counted in the utterance
it spoke).
"""

from __future__ import annotations

import json
import os
import re
import select
import struct
import subprocess
import sys
import time
import wave
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from voice.audio import Int16Array
from voice.children import ChildPool, child_env
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
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # NUL would end flite's C string; the rest means nothing spoken
CHILD = Path(__file__).with_name("flite_child.py")
START_TIMEOUT_S = 30.0  # a child's start (~0.1 s; far more on a busy machine)
MAX_HEADER_BYTES = 1 << 20  # a phrase's phones: ~20 bytes each
MAX_SAMPLE_BYTES = 16 << 20  # MAX_TEXT_CHARS spoken: ~3 min of 16 kHz PCM16, ~6 MB


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


class _FliteChild:
    """One ``voice/flite_child.py`` process: a phrase out, its reply in, each within a deadline."""

    def __init__(self, python: str, library: str, timeout_s: float) -> None:
        self.process = subprocess.Popen([python, "-I", str(CHILD), library], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0, env=child_env())
        self.hello = self._frame(time.monotonic() + timeout_s, MAX_HEADER_BYTES)

    def speak(self, text: str, voice: str, timeout_s: float) -> tuple[dict, bytes]:
        """The header and samples of one phrase; RuntimeError when the child fails, lies or is late."""
        assert self.process.stdin is not None
        body = json.dumps({"text": text, "voice": voice}).encode()
        try:
            self.process.stdin.write(struct.pack(">I", len(body)) + body)
        except OSError as e:
            raise RuntimeError(f"the flite process is gone ({e})") from e
        deadline = time.monotonic() + timeout_s
        try:
            header = json.loads(self._frame(deadline, MAX_HEADER_BYTES))
        except ValueError as e:
            raise RuntimeError("the flite process sent a header that is not JSON") from e
        return header, self._frame(deadline, MAX_SAMPLE_BYTES)

    def _frame(self, deadline: float, limit: int) -> bytes:
        (size,) = struct.unpack(">I", self._read(4, deadline))
        if size > limit:
            raise RuntimeError(f"the flite process sent a frame of {size} bytes (at most {limit})")
        return self._read(size, deadline)

    def _read(self, n: int, deadline: float) -> bytes:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        data = bytearray()
        while len(data) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise RuntimeError("the flite process did not answer in time")
            chunk = os.read(fd, n - len(data))
            if not chunk:  # its pipe closed: it has exited, or is about to (never waited on unbounded)
                try:
                    code = self.process.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    raise RuntimeError("the flite process closed its pipe") from None
                raise RuntimeError(f"the flite process exited with {code}")
            data += chunk
        return bytes(data)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


class FliteSynthesizer:
    """flite's voices through ``processes`` long-lived children (``voice/flite_child.py``), one
    phrase at a time each: set ``processes`` to the pool's thread count. A child that fails or
    outlives ``timeout_s`` is killed and replaced. ``library``: ``libflite.so``'s path, or
    ``"auto"`` for the system's (Debian's ``flite`` package brings it)."""

    def __init__(self, library: str = "auto", *, default_voice: str = "alloy", timeout_s: float = 20.0,
                 processes: int = 1, python: str = sys.executable) -> None:
        if library != "auto" and not Path(library).is_file():
            raise VoiceModelError(f"no flite library at {library} (Debian: apt-get install flite)")
        self.library = library
        self.timeout_s = timeout_s
        self._python = python
        self._pool: ChildPool[_FliteChild] = ChildPool("flite", self._start, timeout_s)
        try:
            for _ in range(max(processes, 1)):
                self._pool.add(self._start())
        except (OSError, RuntimeError, ValueError) as e:
            self.close()
            raise VoiceModelError(f"flite did not start: {e} (Debian: apt-get install flite)") from e
        usable = [v for v in FALLBACK_ORDER if v in self.voices]
        if not usable:
            self.close()
            raise VoiceModelError(f"flite has none of the voices {list(FALLBACK_ORDER)} (it lists {self.voices})")
        self.default_voice = self._lookup(default_voice) or usable[0]

    def _start(self) -> _FliteChild:
        child = _FliteChild(self._python, self.library, max(self.timeout_s, START_TIMEOUT_S))
        try:
            hello = json.loads(child.hello)
            if "error" in hello:
                raise RuntimeError(str(hello["error"])[:300])
            voices = hello["voices"]
            if not isinstance(voices, list) or not all(isinstance(v, str) for v in voices):
                raise RuntimeError("the flite process listed its voices wrongly")
        except (RuntimeError, ValueError, KeyError, TypeError):
            child.kill()
            raise
        self.voices = tuple(voices)
        return child

    def resolve_voice(self, voice: str | None) -> str:
        """The flite voice for an API voice name (or a flite voice name); unknown names get the default."""
        return (self._lookup(voice) if voice is not None else None) or self.default_voice

    def _lookup(self, voice: str) -> str | None:
        name = OPENAI_VOICES.get(voice.lower(), voice.lower())
        return name if name in self.voices else None

    def close(self) -> None:
        self._pool.close()

    def child_pids(self) -> list[int]:
        """The idle children's process ids (for tests and diagnostics)."""
        return [child.process.pid for child in self._pool.idle()]

    def synthesize(self, text: str, voice: str | None = None) -> Speech:
        header, samples, started = self._speak(text, voice)
        if header is None:
            return Speech(np.zeros(0, np.int16), 16_000)
        rate, phones, words = header
        marks = merge_marks(marks_from_phones(text, phones, rate, len(samples)),
                            word_marks(text, phones, words, rate, len(samples)))
        return Speech(samples, rate, marks, time.perf_counter() - started)

    def phones(self, text: str) -> list[str] | None:
        """The phones flite speaks ``text`` with (its lexicon and letter-to-sound rules), ``pau``
        where it pauses; None when it cannot speak it."""
        try:
            header, _, _ = self._speak(text, None)
        except RuntimeError:
            return None
        return [] if header is None else [name for name, _ in header[1]]

    def _speak(self, text: str, voice: str | None) -> tuple[SpokenReply | None, Int16Array, float]:
        if len(text) > MAX_TEXT_CHARS:
            raise ValueError(f"a phrase of {len(text)} characters; at most {MAX_TEXT_CHARS}")
        spoken = _CONTROL.sub(" ", text)
        started = time.perf_counter()
        if not spoken.strip():
            return None, np.zeros(0, np.int16), started
        name = self.resolve_voice(voice)

        def job(child: _FliteChild) -> tuple[SpokenReply, bytes]:
            header, samples = child.speak(spoken, name, self.timeout_s)
            return check_reply(header, samples), samples

        reply, samples = self._pool.run(job)
        return reply, np.frombuffer(samples, np.int16).copy(), started


SpokenReply = tuple[int, list[tuple[str, float]], list[int]]  # rate, phone ends, phones per token


def check_reply(header: dict, samples: bytes) -> SpokenReply:
    """A child's reply as trusted types; RuntimeError for an error it reports or a reply out of shape."""
    if not isinstance(header, dict):
        raise RuntimeError("the flite process sent a header that is not an object")
    if "error" in header:
        raise RuntimeError(str(header["error"])[:300])
    rate, phones, words = header.get("rate"), header.get("phones"), header.get("words")
    if not isinstance(rate, int) or not 8_000 <= rate <= 48_000 or len(samples) % 2:
        raise RuntimeError(f"the flite process sent audio of rate {rate!r} and {len(samples)} bytes")
    if (not isinstance(phones, list) or not isinstance(words, list)
            or not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                       and isinstance(p[1], int | float) for p in phones)
            or not all(isinstance(w, int) and w >= 0 for w in words)):
        raise RuntimeError("the flite process sent phones or words out of shape")
    return rate, [(name, float(end)) for name, end in phones], words


def read_wav(path: Path) -> tuple[Int16Array, int]:
    """A synthesizer's WAV; RuntimeError for a file that is empty or not a 16-bit mono WAV."""
    try:
        with wave.open(str(path), "rb") as w:
            if w.getsampwidth() != 2 or w.getnchannels() != 1:
                raise RuntimeError(f"expected 16-bit mono WAV, got {w.getsampwidth() * 8}-bit x {w.getnchannels()}")
            return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.int16), w.getframerate()
    except (wave.Error, EOFError) as e:
        raise RuntimeError(f"the synthesizer wrote no usable WAV: {e or 'empty file'}") from e


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
        if count == 0:
            continue  # a word flite does not say (a dash on its own): no time of its own
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
