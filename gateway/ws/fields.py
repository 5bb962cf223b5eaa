"""Typed reads of untrusted JSON objects, and the error they raise.

``Fields`` wraps one object of a client event and reads each field with its type and bound,
remembering which keys were read so that ``done`` can refuse the unknown ones. Every
failure is a ``ProtocolError`` whose ``param`` is the dotted path of the field.
"""

from __future__ import annotations

from typing import Any

from llm_shared.errors import APIError


class ProtocolError(APIError):
    """A client event we refuse. Becomes an ``error`` server event; the session goes on."""

    def __init__(self, code: str, message: str, param: str | None = None, *,
                 type: str = "invalid_request_error", event_id: str | None = None) -> None:
        super().__init__(message, code=code, param=param, type=type)
        self.event_id = event_id  # the client event it answers, echoed in the error event


class Fields:
    """Typed reads from one JSON object, remembering which keys were used."""

    def __init__(self, obj: object, path: str) -> None:
        if not isinstance(obj, dict):
            raise ProtocolError("invalid_type", f"{path or 'event'} must be an object", path or None)
        for key in obj:
            if not isinstance(key, str):
                raise ProtocolError("invalid_type", f"keys of {path or 'the event'} must be strings", path or None)
        self.obj: dict[str, Any] = obj
        self.path = path
        self.used: set[str] = set()

    def param(self, key: str) -> str:
        key = printable(key)
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        self.used.add(key)
        return self.obj.get(key) is not None  # JSON null means "not given", as in the API

    def raw(self, key: str) -> Any:
        self.used.add(key)
        return self.obj.get(key)

    def missing(self, key: str) -> ProtocolError:
        return ProtocolError("missing_required_parameter", f"missing required parameter '{self.param(key)}'",
                             self.param(key))

    def string(self, key: str, max_chars: int, *, required: bool = False) -> str | None:
        if not self.has(key):
            if required:
                raise self.missing(key)
            return None
        value = self.obj[key]
        if not isinstance(value, str):
            raise ProtocolError("invalid_type", f"'{self.param(key)}' must be a string", self.param(key))
        if len(value) > max_chars:
            raise ProtocolError("string_above_max_length",
                                f"'{self.param(key)}' is too long: {len(value)} characters, at most {max_chars}",
                                self.param(key))
        if not is_unicode(value):
            raise ProtocolError("invalid_value", f"'{self.param(key)}' is not valid Unicode (lone surrogate)",
                                self.param(key))
        return value

    def integer(self, key: str, *, required: bool = False, minimum: int = 0) -> int | None:
        if not self.has(key):
            if required:
                raise self.missing(key)
            return None
        value = self.obj[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError("invalid_type", f"'{self.param(key)}' must be an integer", self.param(key))
        if value < minimum:
            raise ProtocolError("invalid_value", f"'{self.param(key)}' must be >= {minimum}", self.param(key))
        return value

    def number(self, key: str, low: float, high: float) -> float | None:
        if not self.has(key):
            return None
        value = self.obj[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError("invalid_type", f"'{self.param(key)}' must be a number", self.param(key))
        # Compare before converting: NaN fails the comparison, and a huge int cannot be a float.
        if not low <= value <= high:
            raise ProtocolError("invalid_value", f"'{self.param(key)}' must be between {low} and {high}",
                                self.param(key))
        return float(value)

    def boolean(self, key: str) -> bool | None:
        if not self.has(key):
            return None
        value = self.obj[key]
        if not isinstance(value, bool):
            raise ProtocolError("invalid_type", f"'{self.param(key)}' must be a boolean", self.param(key))
        return value

    def array(self, key: str, max_len: int) -> list[Any] | None:
        if not self.has(key):
            return None
        value = self.obj[key]
        if not isinstance(value, list):
            raise ProtocolError("invalid_type", f"'{self.param(key)}' must be an array", self.param(key))
        if len(value) > max_len:
            raise ProtocolError("array_above_max_length",
                                f"'{self.param(key)}' has {len(value)} entries, at most {max_len}", self.param(key))
        return value

    def done(self, ignored: frozenset[str] = frozenset()) -> None:
        for key in self.obj:
            if key not in self.used and key not in ignored:
                raise ProtocolError("unknown_parameter", f"unknown parameter '{self.param(key)}'", self.param(key))


def is_unicode(text: str) -> bool:
    """False for strings holding lone surrogates (JSON allows "\\ud800"): they cannot be
    encoded to UTF-8, so neither echoed to the client nor tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def printable(key: str) -> str:
    """A client-chosen key, made safe to quote in an error message."""
    return key[:64].encode("utf-8", "replace").decode("utf-8")
