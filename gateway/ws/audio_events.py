"""The audio fields and events of the Realtime protocol, validated at the boundary.

GA shapes (``session.audio.input`` / ``.output``, ``output_modalities``) and the beta ones
(``modalities``, ``voice``, ``input_audio_format``, ``turn_detection``...) are both read into
one ``AudioPatch``: the fields a ``session.update`` or ``response.create`` gave, applied by
the session over the settings in force. Audio itself travels as base64 in JSON and as raw bytes
on the msgpack subprotocol; both are bounded here by ``SessionLimits.max_audio_append_bytes`` (the
wire's bytes, so decoding stays bounded; the session bounds the converted audio again).

Formats are ``voice.formats``': ``audio/pcm`` at 24 kHz (beta ``pcm16``), ``audio/pcmu`` and
``audio/pcma`` at 8 kHz (beta ``g711_ulaw``, ``g711_alaw``); a GA format's ``rate``, when given,
must be its own. An appended chunk is checked against the session's input format when the session
takes it, and converted to the session's clock there (PCM16 at 24 kHz, ``PCM_RATE``): every bound
that counts audio past this parse counts it on that clock, whatever the wire carries.

Two input settings are accepted with a difference, because voice frameworks send them by default
and one refused field fails their whole session: ``noise_reduction`` is echoed but no denoiser
runs (the session tells the client once, see ``NoiseReduction``), and ``semantic_vad`` is judged
by the gateway's turn model (Smart Turn v3, ``voice.semantic``) after a 200 ms pause, its
eagerness bounding the wait (``EAGERNESS_MAX_WAIT_MS``); ``silence_duration_ms`` by eagerness
(``EAGERNESS_SILENCE_MS``) remains the stand-in where no turn model runs (the on-device voice).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal, get_args

from gateway.ws.fields import Fields, ProtocolError
from voice.audio import bounded, decode_base64
from voice.config import MAX_PROMPT_CHARS
from voice.errors import AudioError
from voice.formats import BETA_FORMATS, FORMATS, PCM16, SESSION_BYTES_PER_MS, SESSION_RATE, AudioFormat

PCM_RATE = SESSION_RATE  # samples a second of a session's audio, in and out (PCM16 mono)
PCM_BYTES_PER_MS = SESSION_BYTES_PER_MS
VOICES = ("alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar")
MAX_VOICE_CHARS = 64


Eagerness = Literal["low", "medium", "high", "auto"]
EAGERNESS = get_args(Eagerness)
# semantic_vad's stand-in where no turn model runs (the client SDK's on-device voice mirrors this
# table): the silence that ends a turn, by eagerness ("auto" is "medium", as in the API). The
# API's turn model waits up to 8/4/2 s on an unfinished sentence; without one, a fixed silence is
# the honest approximation.
EAGERNESS_SILENCE_MS: dict[str, int] = {"low": 1000, "medium": 600, "auto": 600, "high": 300}
# semantic_vad with the turn model (the gateway's voice pipeline, voice/semantic.py): the silence
# after which a turn ends even when the model judges it unfinished. The API waits at most
# 8/4/2 s; these are shorter (low is Pipecat's 3 s fallback), within the API's bounds.
EAGERNESS_MAX_WAIT_MS: dict[str, int] = {"low": 3000, "medium": 2000, "auto": 2000, "high": 1000}
IDLE_TIMEOUT_MS = (5_000, 30_000)  # the API's range for turn_detection.idle_timeout_ms


@dataclass(frozen=True)
class ServerVad:
    """``turn_detection``: ``server_vad`` with the API's defaults, or ``semantic_vad`` (``kind``
    says which: the gateway's segmenter gives the semantic kind to the turn model)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    kind: Literal["server_vad", "semantic_vad"] = "server_vad"
    eagerness: Eagerness = "auto"  # semantic_vad only: what set silence_duration_ms
    idle_timeout_ms: int | None = None  # server_vad only: answer a silent user after this much audio

    def wire(self) -> dict[str, Any]:
        if self.kind == "semantic_vad":
            return {"type": "semantic_vad", "eagerness": self.eagerness, "create_response": self.create_response,
                    "interrupt_response": self.interrupt_response}
        return {"type": "server_vad", "threshold": self.threshold, "prefix_padding_ms": self.prefix_padding_ms,
                "silence_duration_ms": self.silence_duration_ms, "create_response": self.create_response,
                "interrupt_response": self.interrupt_response, "idle_timeout_ms": self.idle_timeout_ms}


@dataclass(frozen=True)
class NoiseReduction:
    """``audio.input.noise_reduction``: accepted and echoed, but no denoiser runs, so the audio
    reaches VAD and recognition as sent (the session says so once: ``x_warnings``). Measured
    (``bench/noise_reduction.py``, docs/voice.md): the CPU denoisers that install here did not
    lower Whisper's word error at 10-20 dB SNR and raised it on clean speech."""

    type: Literal["near_field", "far_field"]
    strength: float | None = None  # newer SDKs send it; echoed only when given

    def wire(self) -> dict[str, Any]:
        return {"type": self.type} if self.strength is None else {"type": self.type, "strength": self.strength}


@dataclass(frozen=True)
class Transcription:
    """``audio.input.transcription``: echoed as configured. The user's speech is transcribed
    whether or not it is set (the models here read text), with this server's recognizer."""

    model: str | None = None
    language: str | None = None
    prompt: str | None = None

    def wire(self) -> dict[str, Any]:
        return {"model": self.model, "language": self.language, "prompt": self.prompt}


@dataclass(frozen=True)
class AudioSettings:
    """A session's audio settings (or a response's, after its overrides)."""

    output_audio: bool = False  # output_modalities ["audio"]: speech with its transcript; else text
    voice: str = "alloy"
    transcription: Transcription | None = None
    turn_detection: ServerVad | None = ServerVad()  # None: push to talk (the client commits)
    noise_reduction: NoiseReduction | None = None  # echoed only: nothing filters the audio here
    input_format: AudioFormat = PCM16  # what appends carry
    output_format: AudioFormat = PCM16  # what audio deltas carry

    def apply(self, patch: AudioPatch | None) -> AudioSettings:
        if patch is None:
            return self
        changes = {name: value for name in PATCH_FIELDS if (value := getattr(patch, name)) is not _UNSET}
        return replace(self, **changes)

    def modalities(self) -> list[str]:
        return ["audio"] if self.output_audio else ["text"]


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


_UNSET: Any = _Unset()


@dataclass(frozen=True)
class AudioPatch:
    """The audio fields one event gave (``_UNSET`` where it gave none; ``None`` is a value:
    ``turn_detection: null`` turns detection off)."""

    output_audio: Any = _UNSET
    voice: Any = _UNSET
    transcription: Any = _UNSET
    turn_detection: Any = _UNSET
    input_format: Any = _UNSET
    output_format: Any = _UNSET
    noise_reduction: Any = _UNSET

    @property
    def empty(self) -> bool:
        return all(getattr(self, name) is _UNSET for name in PATCH_FIELDS)


PATCH_FIELDS = ("output_audio", "voice", "transcription", "turn_detection", "input_format", "output_format",
                "noise_reduction")


@dataclass(frozen=True)
class AudioAppend:
    type: ClassVar[str] = "input_audio_buffer.append"
    event_id: str | None
    audio: bytes  # in the session's input format, as sent (checked and converted by the session)


@dataclass(frozen=True)
class AudioCommit:
    type: ClassVar[str] = "input_audio_buffer.commit"
    event_id: str | None


@dataclass(frozen=True)
class AudioClear:
    type: ClassVar[str] = "input_audio_buffer.clear"
    event_id: str | None


AudioEvent = AudioAppend | AudioCommit | AudioClear

# Keys of a session object read here (the rest of the session is events.py's).
SESSION_AUDIO_KEYS = frozenset({"output_modalities", "modalities", "audio", "voice", "input_audio_format",
                                "output_audio_format", "input_audio_transcription", "turn_detection",
                                "input_audio_noise_reduction", "speed"})
RESPONSE_AUDIO_KEYS = frozenset({"output_modalities", "modalities", "audio", "voice", "output_audio_format"})


def session_audio(s: Fields) -> AudioPatch | None:
    """The audio fields of a ``session`` object, GA or beta; None when it has none."""
    fields: dict[str, Any] = {}
    _modalities(s, fields)
    if s.has("audio"):
        audio = Fields(s.raw("audio"), s.param("audio"))
        if audio.has("input"):
            _input(Fields(audio.raw("input"), audio.param("input")), fields)
        if audio.has("output"):
            _output(Fields(audio.raw("output"), audio.param("output")), fields)
        audio.done()
    if "voice" in s.obj and s.has("voice"):
        fields["voice"] = _voice(s, "voice")
    for key, name in (("input_audio_format", "input_format"), ("output_audio_format", "output_format")):
        if s.has(key):
            fields[name] = _beta_format(s, key)
    if "input_audio_transcription" in s.obj:
        fields["transcription"] = _transcription(s, "input_audio_transcription")
    if "turn_detection" in s.obj:
        fields["turn_detection"] = _turn_detection(s, "turn_detection")
    if "input_audio_noise_reduction" in s.obj:
        fields["noise_reduction"] = _noise_reduction(s, "input_audio_noise_reduction")
    _speed(s)
    return AudioPatch(**fields) if fields else None


def response_audio(r: Fields) -> AudioPatch | None:
    """The audio fields of a ``response`` object (modalities and voice; input settings are the
    session's)."""
    fields: dict[str, Any] = {}
    _modalities(r, fields)
    if r.has("audio"):
        audio = Fields(r.raw("audio"), r.param("audio"))
        if audio.has("output"):
            _output(Fields(audio.raw("output"), audio.param("output")), fields)
        audio.done()
    if r.has("voice"):
        fields["voice"] = _voice(r, "voice")
    if r.has("output_audio_format"):
        fields["output_format"] = _beta_format(r, "output_audio_format")
    return AudioPatch(**fields) if fields else None


def parse_audio_event(kind: str, f: Fields, event_id: str | None, max_append_bytes: int) -> AudioEvent:
    if kind == "input_audio_buffer.append":
        audio = decode_audio(f.raw("audio"), f.param("audio"), max_append_bytes)
        f.done()
        return AudioAppend(event_id=event_id, audio=audio)
    f.done()
    if kind == "input_audio_buffer.commit":
        return AudioCommit(event_id=event_id)
    if kind == "input_audio_buffer.clear":
        return AudioClear(event_id=event_id)
    raise ProtocolError("unsupported_feature", f"'{kind}' applies to WebRTC and SIP connections only, not to a "
                        "WebSocket session", "type")


AUDIO_EVENT_TYPES = frozenset({"input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear",
                               "output_audio_buffer.clear"})


def decode_audio(value: object, param: str, max_bytes: int) -> bytes:
    """Audio bytes from a base64 string (JSON) or raw bytes (msgpack), bounded and checked by
    ``voice.audio`` (its reasons become our codes: ``audio_too_large``, else ``invalid_audio``);
    an empty append is no audio, not an error. Whether they are the session's format is the
    session's check (``format_error``)."""
    if value is None:
        raise ProtocolError("missing_required_parameter", f"missing required parameter '{param}'", param)
    if not isinstance(value, str | bytes | bytearray):
        raise ProtocolError("invalid_type", f"'{param}' must be base64 audio (or bytes on msgpack)", param)
    if not value:
        return b""
    try:
        return decode_base64(value, max_bytes=max_bytes) if isinstance(value, str) else bounded(value, max_bytes)
    except AudioError as e:
        raise format_error(e, param) from None


def format_error(e: AudioError, param: str) -> ProtocolError:
    code = "audio_too_large" if e.reason == "too_long" else "invalid_audio"
    return ProtocolError(code, f"'{param}': {e.message}", param)


def _modalities(f: Fields, out: dict[str, Any]) -> None:
    for key in ("output_modalities", "modalities"):
        values = f.array(key, 2)
        if values is None:
            continue
        if any(not isinstance(v, str) for v in values):
            raise ProtocolError("invalid_type", f"'{f.param(key)}' must be an array of strings", f.param(key))
        # GA: ["text"] or ["audio"] (audio comes with its transcript); beta: ["text"] or ["text", "audio"].
        if sorted(values) in (["text"],):
            out["output_audio"] = False
        elif sorted(values) in (["audio"], ["audio", "text"]):
            out["output_audio"] = True
        else:
            raise ProtocolError("invalid_value", f"'{f.param(key)}' must be [\"text\"] or [\"audio\"]", f.param(key))


def _input(f: Fields, out: dict[str, Any]) -> None:
    if f.has("format"):
        out["input_format"] = _format(Fields(f.raw("format"), f.param("format")))
    if "transcription" in f.obj:
        out["transcription"] = _transcription(f, "transcription")
    if "turn_detection" in f.obj:
        out["turn_detection"] = _turn_detection(f, "turn_detection")
    if "noise_reduction" in f.obj:
        out["noise_reduction"] = _noise_reduction(f, "noise_reduction")
    f.done()


def _output(f: Fields, out: dict[str, Any]) -> None:
    if f.has("format"):
        out["output_format"] = _format(Fields(f.raw("format"), f.param("format")))
    if f.has("voice"):
        out["voice"] = _voice(f, "voice")
    _speed(f)
    f.done()


def _format(f: Fields) -> AudioFormat:
    kind = f.string("type", 32, required=True)
    fmt = FORMATS.get(kind)
    if fmt is None:
        raise ProtocolError("invalid_value", f"'{f.param('type')}' must be one of {sorted(FORMATS)}", f.param("type"))
    rate = f.integer("rate")
    if rate not in (None, fmt.rate):
        raise ProtocolError("invalid_value", f"'{f.param('rate')}' must be {fmt.rate}", f.param("rate"))
    f.done()
    return fmt


def _beta_format(f: Fields, key: str) -> AudioFormat:
    value = f.string(key, 32)
    fmt = BETA_FORMATS.get(value) if value is not None else PCM16
    if fmt is not None:
        return fmt
    raise ProtocolError("invalid_value", f"'{f.param(key)}' must be one of {sorted(BETA_FORMATS)}", f.param(key))


def _voice(f: Fields, key: str) -> str:
    value = f.raw(key)
    if isinstance(value, dict):
        raise ProtocolError("unsupported_feature", "custom voices are not supported: use one of "
                            f"{list(VOICES)}", f.param(key))
    voice = f.string(key, MAX_VOICE_CHARS)
    if voice not in VOICES:
        raise ProtocolError("invalid_value", f"'{f.param(key)}' must be one of {list(VOICES)}", f.param(key))
    return voice


def _transcription(f: Fields, key: str) -> Transcription | None:
    if not f.has(key):
        return None  # null: off (the speech is still transcribed for the model; see Transcription)
    t = Fields(f.raw(key), f.param(key))
    config = Transcription(model=t.string("model", 64), language=t.string("language", 16),
                           prompt=t.string("prompt", MAX_PROMPT_CHARS))
    if config.language not in (None, "en"):
        raise ProtocolError("unsupported_feature", "the recognizer here is English-only: 'language' must be \"en\"",
                            t.param("language"))
    t.done(frozenset({"delay", "keywords", "languages"}))
    return config


def _noise_reduction(f: Fields, key: str) -> NoiseReduction | None:
    if not f.has(key):
        return None  # null: off
    n = Fields(f.raw(key), f.param(key))
    kind = n.string("type", 32, required=True)
    if kind not in ("near_field", "far_field"):
        raise ProtocolError("invalid_value", f"'{n.param('type')}' must be \"near_field\" or \"far_field\"",
                            n.param("type"))
    strength = n.number("strength", 0.0, 1.0)
    n.done()
    return NoiseReduction(type=kind, strength=strength)  # type: ignore[arg-type]  # checked above


def _turn_detection(f: Fields, key: str) -> ServerVad | None:
    if not f.has(key):
        return None  # null: push to talk
    t = Fields(f.raw(key), f.param(key))
    kind = t.string("type", 32)
    if kind not in (None, "server_vad", "semantic_vad"):
        raise ProtocolError("invalid_value", f"'{t.param('type')}' must be \"server_vad\" or \"semantic_vad\"",
                            t.param("type"))
    defaults = ServerVad()
    create = _or(t.boolean("create_response"), defaults.create_response)
    interrupt = _or(t.boolean("interrupt_response"), defaults.interrupt_response)
    if kind == "semantic_vad":
        eagerness = _or(t.string("eagerness", 16), "auto")
        if eagerness not in EAGERNESS:
            raise ProtocolError("invalid_value", f"'{t.param('eagerness')}' must be one of {list(EAGERNESS)}",
                                t.param("eagerness"))
        for server_only in ("threshold", "prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms"):
            if t.has(server_only):
                raise ProtocolError("invalid_value", f"'{t.param(server_only)}' applies to server_vad only",
                                    t.param(server_only))
        t.done()
        return ServerVad(kind="semantic_vad", eagerness=eagerness, silence_duration_ms=EAGERNESS_SILENCE_MS[eagerness],
                         create_response=create, interrupt_response=interrupt)
    if t.has("eagerness"):
        raise ProtocolError("invalid_value", f"'{t.param('eagerness')}' applies to semantic_vad only",
                            t.param("eagerness"))
    idle = t.integer("idle_timeout_ms", minimum=IDLE_TIMEOUT_MS[0])
    if idle is not None and idle > IDLE_TIMEOUT_MS[1]:
        raise ProtocolError("invalid_value", f"'{t.param('idle_timeout_ms')}' must be between {IDLE_TIMEOUT_MS[0]} "
                            f"and {IDLE_TIMEOUT_MS[1]}", t.param("idle_timeout_ms"))
    vad = ServerVad(
        threshold=_or(t.number("threshold", 0.0, 1.0), defaults.threshold),
        prefix_padding_ms=_bounded_ms(t, "prefix_padding_ms", defaults.prefix_padding_ms, 0, 2_000),
        silence_duration_ms=_bounded_ms(t, "silence_duration_ms", defaults.silence_duration_ms, 100, 10_000),
        create_response=create,
        interrupt_response=interrupt,
        idle_timeout_ms=idle,
    )
    t.done()
    return vad


def _bounded_ms(f: Fields, key: str, default: int, low: int, high: int) -> int:
    value = f.integer(key, minimum=low)
    if value is None:
        return default
    if value > high:
        raise ProtocolError("invalid_value", f"'{f.param(key)}' must be between {low} and {high}", f.param(key))
    return value


def _speed(f: Fields) -> None:
    speed = f.number("speed", 0.25, 1.5)
    if speed is not None and speed != 1.0:
        raise ProtocolError("unsupported_feature", "only speed 1.0 is supported", f.param("speed"))


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value
