"""Typed errors shared by the engines and mapped to protocol errors by the gateway.

Every error carries a stable ``code`` (sent to clients as ``error.code``) and, when one
input field is at fault, ``param``. Messages are written for the person who sent the
request and never contain internals (paths of the server are fine only for start-up errors).
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of all engine errors."""

    code = "engine_error"
    type = "server_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(EngineError):
    """The request itself is wrong; retrying it unchanged will fail again."""

    code = "invalid_request"
    type = "invalid_request_error"


class EmptyPromptError(InvalidRequestError):
    code = "empty_prompt"


class PromptTooLongError(InvalidRequestError):
    code = "context_length_exceeded"


class InvalidSamplingError(InvalidRequestError):
    code = "invalid_sampling_params"


class UnknownModelError(InvalidRequestError):
    code = "model_not_found"


class DuplicateRequestError(InvalidRequestError):
    code = "duplicate_request_id"


class OverloadedError(EngineError):
    """Admission control said no; retry later."""

    code = "overloaded"
    type = "server_error"


class EngineUnavailableError(EngineError):
    """The engine process is gone or not ready."""

    code = "engine_unavailable"


class ModelFileError(EngineError):
    """A model file is missing or unreadable. Raised at start-up, so it may name paths."""

    code = "model_file_error"


class ConfigError(Exception):
    """A configuration file or value is invalid; the message names the key and the fix."""
