"""Typed errors shared by the engines and mapped to protocol errors by the gateway.

Every error a client can be told about is an ``APIError``: a stable ``code`` (sent to clients
as ``error.code``), a ``type`` (OpenAI's error type), a ``message`` and, when one input field
is at fault, ``param``. Messages are written for the person who sent the request and never
contain internals (paths of the server are fine only for start-up errors).
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """The fields of an OpenAI error object. Subclasses fix ``code`` and ``type`` as class
    attributes; an instance may override either (one class standing for several codes)."""

    code = "server_error"
    type = "server_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if type is not None:
            self.type = type

    def to_dict(self) -> dict[str, Any]:
        """The error object as the OpenAI APIs send it (``{"error": ...}``'s value)."""
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}


class EngineError(APIError):
    """Base of all engine errors."""

    code = "engine_error"
    type = "server_error"


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
