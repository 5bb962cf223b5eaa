"""A response's prompt: its instructions, items and tools rendered for the model family, bounded
in characters (``max_conversation_chars``), and the cuts truncation may make to it."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.context_fit import Messages, PromptCuts
from gateway.ws.conversation import AnyItem, Item, to_history
from gateway.ws.fields import ProtocolError
from gateway.ws.truncation import Truncation
from llm_shared.structured import OutputConstraints, ToolCallFamily, render_messages


class ResponsePrompt:
    """Rendered when the response starts (after any transcript it waits for), so the items'
    latest text is what the model reads."""

    def __init__(self, instructions: str, items: Sequence[AnyItem], constraints: OutputConstraints,
                 family: ToolCallFamily | None, *, max_chars: int, param: str | None) -> None:
        self.items = list(items)
        self._instructions = instructions
        self._constraints = constraints
        self._family = family
        self._max_chars = max_chars
        self._param = param  # the field a prompt over ``max_chars`` is blamed on (None: the conversation)

    def of(self, items: Sequence[AnyItem]) -> Messages:
        # The tools are listed in the system prompt only when they may be called (render_messages).
        return render_messages(to_history(self._instructions, items), self._constraints, self._family)

    def render(self) -> Messages:
        messages = self.of(self.items)
        chars = sum(len(m["content"]) for m in messages)
        if chars > self._max_chars:
            raise ProtocolError("conversation_limit_exceeded", f"the prompt has {chars} characters, more than this "
                                f"server's limit of {self._max_chars}; delete items or shorten the instructions",
                                self._param)
        return messages

    def cuts(self, truncation: Truncation, *, sticky: bool) -> PromptCuts | None:
        """The cuts this prompt may take: at each user turn after the first item, up to the newest
        (never dropped); None when truncation is disabled. ``sticky``: the items are the session's
        conversation (a cut holds for its later responses)."""
        if truncation.type == "disabled":
            return None
        items = self.items
        starts = [i for i, item in enumerate(items) if i > 0 and isinstance(item, Item) and item.role == "user"]
        instructions = [m for m in self.of(()) if m["role"] == "system"]
        return PromptCuts(count=len(starts), render=lambda k: self.of(items[starts[k - 1]:]),
                          dropped=lambda k: tuple(item.id for item in items[:starts[k - 1]]),
                          instructions=instructions, retention_ratio=truncation.retention_ratio,
                          post_instructions=truncation.post_instructions, sticky=sticky)
