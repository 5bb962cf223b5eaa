"""Speech out of one audio response: phrases asked for in order, sent in order.

An audio response's text is cut into phrases as it streams (``PhraseSplitter``); each phrase
is synthesized by the adapter (a ``Synthesize`` command) and comes back as PCM16 at 24 kHz,
possibly out of order when synthesis runs on several workers. ``SpeechOut`` hands the phrases
back in order once their audio is there, so that the transcript and the audio sent stay in
step; each assistant item keeps a ``voice.alignment.Alignment`` of which text was said by which
millisecond (the synthesizer's timing marks included), so that ``conversation.item.truncate``
can cut the item to what the listener heard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from gateway.ws.audio_events import PCM_BYTES_PER_MS
from voice.alignment import Alignment, Mark


class PhraseSplitter(Protocol):
    """Text deltas in, complete phrases out (``voice.phrases``)."""

    def feed(self, text: str) -> list[str]: ...

    def flush(self) -> list[str]: ...


def truncated(speech: Alignment, audio_end_ms: int) -> Alignment:
    """``speech`` cut at ``audio_end_ms`` (a truncate): the phrases heard, and of the phrase
    playing then the words heard, each keeping its word timing so a later cut lands the same."""
    kept = speech.spoken_chars(audio_end_ms)
    cut_samples = audio_end_ms * speech.sample_rate // 1000
    out = Alignment(speech.sample_rate)
    for phrase in speech.phrases:
        if phrase.start_char >= kept:
            break
        chars = min(len(phrase.text), kept - phrase.start_char)
        samples = min(phrase.n_samples, max(cut_samples - phrase.start_sample, 0))
        out.add(phrase.text[:chars], samples, [(c, t) for c, t in phrase.word_ends if c <= chars and t <= samples])
    return out


class SpeechOut:
    """The phrases of one response between the model and the wire."""

    def __init__(self, splitter: PhraseSplitter, request: Callable[[int, str], None]) -> None:
        self._splitter = splitter
        self._request = request  # (index, text): ask for the phrase's audio
        self._texts: dict[int, str] = {}  # asked for, not yet sent
        self._audio: dict[int, tuple[bytes, Sequence[Mark]]] = {}  # arrived, waiting for an earlier phrase
        self._next = 0  # index of the next phrase to ask for
        self._sent = 0  # index of the next phrase to send

    @property
    def pending(self) -> bool:
        """Phrases were asked for whose audio has not been sent yet."""
        return self._sent < self._next

    def feed(self, text: str) -> None:
        for phrase in self._splitter.feed(text):
            self._ask(phrase)

    def flush(self) -> None:
        """The text held for a longer phrase is a phrase now (before a call, at the end)."""
        for phrase in self._splitter.flush():
            self._ask(phrase)

    def arrived(self, index: int, audio: bytes, marks: Sequence[Mark] = ()) -> list[tuple[str, bytes, Sequence[Mark]]]:
        """The audio of phrase ``index`` (and its timing marks, at 24 kHz); the phrases now ready to
        send, in order (text, audio, marks)."""
        if index not in self._texts or index in self._audio:
            return []  # not asked for (or already here): a late or repeated answer
        self._audio[index] = (audio[:len(audio) - len(audio) % 2], marks)
        ready = []
        while self._sent in self._audio:
            pcm, phrase_marks = self._audio.pop(self._sent)
            ready.append((self._texts.pop(self._sent), pcm, phrase_marks))
            self._sent += 1
        return ready

    def _ask(self, phrase: str) -> None:
        if not phrase.strip():
            return
        index, self._next = self._next, self._next + 1
        self._texts[index] = phrase
        self._request(index, phrase)


def audio_ms(audio: bytes) -> int:
    return len(audio) // PCM_BYTES_PER_MS

