"""The error a bad ``tools`` / ``tool_choice`` / ``response_format`` becomes.

A subclass of the shared ``InvalidRequestError``, so the gateway maps it like any other 400 (or
Realtime ``error`` event) and its ``param`` names the field at fault; a class of its own so a
caller can tell "this schema cannot be enforced" from other bad input (and count it).
"""

from __future__ import annotations

from llm_shared.errors import InvalidRequestError


class SchemaError(InvalidRequestError):
    """A schema is malformed, too large or too deep, uses something the grammar compiler does not
    support, or cannot be compiled within the compiler's limits."""

    code = "invalid_schema"
