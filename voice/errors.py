"""The voice pipeline's errors, as ``llm_shared`` API errors so the gateway sends them as it sends
any other (``error.code``, a message for the client, never internals)."""

from __future__ import annotations

from llm_shared.errors import EngineError, InvalidRequestError, ModelFileError, OverloadedError


class AudioError(InvalidRequestError, ValueError):
    """Client audio that cannot be used (odd byte count, not base64, empty, too long). A
    ``ValueError`` too, so code that only knows the standard library can catch it; ``reason`` is a
    short stable word for metrics and tests, the message a sentence for the client."""

    code = "invalid_audio"

    def __init__(self, reason: str, message: str, *, param: str | None = "audio") -> None:
        super().__init__(message, param=param)
        self.reason = reason


class VoiceBusy(OverloadedError):
    """The voice worker pool's queue is full (in seconds of audio or in jobs): refused at once
    rather than queued without end, so voice sessions cannot starve each other or text ones."""

    code = "voice_busy"


class VoiceRateLimited(OverloadedError):
    """A session asked for recognition faster than its budget refills (``voice.pool``): this job
    is refused, the session's others and every other session's go on."""

    code = "recognition_rate_limited"


class VoiceTimeout(EngineError):
    """A recognition or synthesis job did not finish within its timeout."""

    code = "voice_timeout"


class VoiceModelError(ModelFileError):
    """A speech model or the synthesizer program is missing or unusable (raised at start-up)."""
