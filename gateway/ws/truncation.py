"""The session's ``truncation``: what happens when the conversation outgrows the model's context.

- ``"auto"`` (the API's default): the oldest turns are left out of the prompt, instructions kept,
  the newest turn kept whole. Here it cuts in chunks like a ``retention_ratio`` of
  ``AUTO_RETENTION``, so the prefix caches survive from one cut to the next (the API's own
  ``auto`` cuts just enough each turn, which rebuilds them every turn).
- ``{"type": "retention_ratio", "retention_ratio": r}``: each cut keeps at most ``r`` of the room
  the context has for the turns (``token_limits.post_instructions`` caps that room).
- ``"disabled"``: the response fails with ``context_length_exceeded``, as the API's does.

The tokens are counted where the serving tier is known (``gateway.context_fit``); this module
parses the field, and ``gateway.ws.prompt`` offers a response's cuts: at each user turn, oldest first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from gateway.ws.fields import Fields, ProtocolError

AUTO_RETENTION = 0.8


@dataclass(frozen=True)
class Truncation:
    type: Literal["auto", "disabled", "retention_ratio"] = "auto"
    retention_ratio: float = AUTO_RETENTION
    post_instructions: int | None = None  # token_limits.post_instructions: the turns' room, at most

    def wire(self) -> str | dict[str, Any]:
        if self.type != "retention_ratio":
            return self.type
        wire: dict[str, Any] = {"type": "retention_ratio", "retention_ratio": self.retention_ratio}
        if self.post_instructions is not None:
            wire["token_limits"] = {"post_instructions": self.post_instructions}
        return wire


AUTO = Truncation()


def parse_truncation(s: Fields) -> Truncation | None:
    """The session's ``truncation``; None when not given."""
    if not s.has("truncation"):
        return None
    value, param = s.raw("truncation"), s.param("truncation")
    if value in ("auto", "disabled"):
        return Truncation(type=value)
    if not isinstance(value, dict):
        raise ProtocolError("invalid_value", f"'{param}' must be \"auto\", \"disabled\" or "
                            "{\"type\": \"retention_ratio\", \"retention_ratio\": r}", param)
    t = Fields(value, param)
    if t.string("type", 32, required=True) != "retention_ratio":
        raise ProtocolError("invalid_value", f"'{t.param('type')}' must be \"retention_ratio\"", t.param("type"))
    ratio = t.number("retention_ratio", 0.0, 1.0)
    if ratio is None:
        raise t.missing("retention_ratio")
    post = None
    if t.has("token_limits"):
        limits = Fields(t.raw("token_limits"), t.param("token_limits"))
        post = limits.integer("post_instructions", minimum=1)
        limits.done()
    t.done()
    return Truncation(type="retention_ratio", retention_ratio=ratio, post_instructions=post)
