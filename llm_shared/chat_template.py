"""Chat templates: validating chat messages and rendering them with the model's Jinja template.

Templates come from model files, so they run in Jinja's immutable sandbox with the
conventions Hugging Face's ``apply_chat_template`` established (``raise_exception``,
``trim_blocks``/``lstrip_blocks``, a ``tojson`` that keeps non-ASCII, ``bos_token``/``eos_token``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llm_shared.errors import EmptyPromptError, InvalidRequestError, ModelFileError

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
MESSAGE_KEYS = frozenset({"role", "content"})


class TemplateRaisedError(Exception):
    """The template called ``raise_exception``: the conversation breaks one of its rules."""


def _raise_exception(message: str) -> NoReturn:
    raise TemplateRaisedError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # Jinja's own tojson HTML-escapes and sorts keys; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def validate_messages(messages: Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    """Check chat messages from a client and return plain-dict copies the template may read."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidRequestError("messages must be a list of {role, content} objects", param="messages")
    if not messages:
        raise EmptyPromptError("messages must not be empty", param="messages")
    checked: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"{where} must be an object with role and content", param=where)
        extra = set(message) - MESSAGE_KEYS
        if extra:
            # Unknown fields would reach the template unescaped; refuse rather than drop them silently.
            raise InvalidRequestError(f"{where} has unsupported fields {sorted(map(str, extra))}", param=where)
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"{where}.role must be one of {sorted(CHAT_ROLES)}, got {role!r}", param=f"{where}.role"
            )
        content = message.get("content")
        if not isinstance(content, str):
            raise InvalidRequestError(f"{where}.content must be a string", param=f"{where}.content")
        checked.append({"role": role, "content": content})
    return checked


class ChatTemplate:
    """A compiled chat template. Rendering is thread-safe (the sandbox is immutable)."""

    def __init__(self, source: str, *, bos_token: str, eos_token: str) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelFileError(f"the model's chat template does not compile: {e.message} (line {e.lineno})") from e
        self.source = source
        self._bos_token = bos_token
        self._eos_token = eos_token

    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
        """Render already-validated messages; a rule the template enforces becomes InvalidRequestError."""
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
            )
        except TemplateRaisedError as e:
            raise InvalidRequestError(f"the model's chat template rejected the messages: {e}", param="messages") from e
        except jinja2.TemplateError as e:
            # A template that fails on valid messages is the model's fault, not the client's,
            # but the client must still learn that this conversation cannot be rendered.
            raise InvalidRequestError(
                "the model's chat template cannot render these messages", param="messages"
            ) from e
