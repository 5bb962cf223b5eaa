"""Tool-call syntaxes, one module per model family, found by the family name a model's config
gives (``[models.<id>] family``). Imported on first use, so a family's module costs nothing until
a model of that family serves a request with tools."""

from __future__ import annotations

import importlib

from llm_shared.structured.families.base import (
    ArgumentsDelta,
    CallDone,
    CallStarted,
    TextDelta,
    ToolCallEvent,
    ToolCallFamily,
    ToolCallParser,
)

# family name -> "module:class"
FAMILIES: dict[str, str] = {
    "smollm2": "llm_shared.structured.families.smollm2:SmolLM2",
}


def get_family(name: str) -> ToolCallFamily | None:
    """The family's syntax, or None where we know none (its models can still be constrained by a
    ``response_format``, but not call tools). Families are stateless, so a new instance per call
    is as good as a shared one and needs no module state."""
    target = FAMILIES.get(name)
    if target is None:
        return None
    module, _, cls = target.partition(":")
    family: ToolCallFamily = getattr(importlib.import_module(module), cls)()
    return family


__all__ = [
    "FAMILIES",
    "ArgumentsDelta",
    "CallDone",
    "CallStarted",
    "TextDelta",
    "ToolCallEvent",
    "ToolCallFamily",
    "ToolCallParser",
    "get_family",
]
