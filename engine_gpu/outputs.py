"""What one engine step produces for one request. Pure Python: the client imports it too."""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_shared.contract import FinishEvent, TokenEvent


@dataclass
class RequestOutput:
    """New tokens of one request in one step, and its finish if the request ended in this step."""

    request_id: str
    tokens: list[TokenEvent] = field(default_factory=list)
    finish: FinishEvent | None = None  # set exactly once per request, on its last output
