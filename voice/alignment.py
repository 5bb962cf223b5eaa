"""Which text was spoken up to a point of the audio: the answer to ``conversation.item.truncate``.

As speech is made, each phrase's text and its sample count at the output rate are appended in
order. A cut at ``audio_end_ms`` keeps every phrase whose audio ended by then, and of the phrase
being played the words whose estimated end the cut reached. Within a phrase a word's end is
placed by interpolating over characters between anchors: the phrase's start and end, and the
synthesizer's own timing where it gives some (flite: where speech starts after its leading
silence, ends before its trailing one, and its pauses at punctuation; see ``voice.tts``).

The result is always a prefix of the text fed, cut after a whole word, so the conversation keeps
exactly what the listener heard, rounded down to a word.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass

Mark = tuple[int, int]  # (character offset in the phrase, sample offset in its audio)
_WORD = re.compile(r"\S+")


def scale_marks(marks: Sequence[Mark], from_rate: int, to_rate: int) -> tuple[Mark, ...]:
    """Anchors from a synthesizer's rate to the output rate (samples rounded down)."""
    return tuple((char, sample * to_rate // from_rate) for char, sample in marks)


@dataclass(frozen=True)
class AlignedPhrase:
    text: str
    start_char: int  # in the whole text
    start_sample: int  # in the whole audio, at the output rate
    n_samples: int
    word_ends: tuple[tuple[int, int], ...]  # (char offset after the word, sample offset of its end), in the phrase


class Alignment:
    """One spoken item's text and audio, phrase by phrase, at ``sample_rate`` (the output rate)."""

    def __init__(self, sample_rate: int) -> None:
        if sample_rate <= 0:
            raise ValueError("sample_rate must be > 0")
        self.sample_rate = sample_rate
        self.phrases: list[AlignedPhrase] = []
        self._starts: list[int] = []  # each phrase's start_sample, for bisect
        self._chars = 0
        self._samples = 0
        self._texts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._texts)

    @property
    def total_samples(self) -> int:
        return self._samples

    @property
    def total_ms(self) -> float:
        return self._samples * 1000.0 / self.sample_rate

    def add(self, text: str, n_samples: int, marks: Sequence[Mark] = ()) -> None:
        """The next phrase: its text, its length in output samples, and the synthesizer's anchors
        (already at the output rate; ``scale_marks``). A phrase with no audio (only whitespace or
        punctuation) still counts as text: it is spoken once the audio before it is."""
        if n_samples < 0:
            raise ValueError("n_samples must be >= 0")
        phrase = AlignedPhrase(text, self._chars, self._samples, n_samples, _word_ends(text, n_samples, marks))
        self.phrases.append(phrase)
        self._starts.append(self._samples)
        self._texts.append(text)
        self._chars += len(text)
        self._samples += n_samples

    def spoken_chars(self, audio_end_ms: float) -> int:
        """Characters of the text heard by ``audio_end_ms`` (ms of this item's audio)."""
        cut = int(max(audio_end_ms, 0.0) * self.sample_rate // 1000)
        if cut >= self._samples:
            return self._chars
        # The phrase playing at `cut`: the last one starting at or before it (an empty one
        # starting exactly there is not yet spoken: bisect_right lands after it, so step back).
        i = bisect.bisect_right(self._starts, cut) - 1
        while i > 0 and self.phrases[i].start_sample == cut:
            i -= 1
        phrase = self.phrases[i]
        if cut >= phrase.start_sample + phrase.n_samples:
            return phrase.start_char + len(phrase.text)
        local = cut - phrase.start_sample
        spoken = 0
        for char_end, sample_end in phrase.word_ends:
            if sample_end > local:
                break
            spoken = char_end
        return phrase.start_char + spoken

    def spoken_text(self, audio_end_ms: float) -> str:
        """The text heard by ``audio_end_ms``: whole phrases, then whole words of the phrase playing."""
        return self.text[:self.spoken_chars(audio_end_ms)]


def _word_ends(text: str, n_samples: int, marks: Sequence[Mark]) -> tuple[tuple[int, int], ...]:
    """Each word's end in the phrase as (char, sample), by linear interpolation over characters
    between the anchors (start, the synthesizer's marks, end)."""
    anchors: list[Mark] = [(0, 0)]
    for char, sample in marks:
        if anchors[-1][0] < char <= len(text) and anchors[-1][1] <= sample <= n_samples:
            anchors.append((char, sample))
    if anchors[-1][0] < len(text):
        anchors.append((len(text), n_samples))
    chars = [a[0] for a in anchors]
    out = []
    for m in _WORD.finditer(text):
        end = m.end()
        j = min(bisect.bisect_left(chars, end), len(anchors) - 1)
        (c0, s0), (c1, s1) = anchors[max(j - 1, 0)], anchors[j]
        sample = s1 if c1 == c0 else s0 + (s1 - s0) * (end - c0) // (c1 - c0)
        out.append((end, min(sample, n_samples)))
    return tuple(out)
