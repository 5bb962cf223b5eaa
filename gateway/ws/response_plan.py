"""What a ``response.create`` asks the engine for: its prompt, sampling and output constraints,
worked out from the event and the session's settings without starting anything.

One function for both the response the session starts and the one it starts ahead of a turn's
end (``gateway.ws.foresight``): the answer started ahead is handed over only when the two plans
give the same request, so they must be computed the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.context_fit import Messages, PromptCuts
from gateway.ws.audio_events import AudioSettings
from gateway.ws.commands import StartGeneration
from gateway.ws.conversation import AnyItem
from gateway.ws.events import ResponseCreate, SessionLimits
from gateway.ws.prompt import ResponsePrompt
from gateway.ws.settings import SessionSettings
from llm_shared.contract import SamplingParams
from llm_shared.structured import OutputConstraints, ToolCallFamily


@dataclass(frozen=True)
class ResponsePlan:
    prompt: ResponsePrompt
    audio: AudioSettings
    params: SamplingParams
    max_output: Any  # response.max_output_tokens as the client sees it (a number or "inf")
    family: ToolCallFamily | None  # the tool-call syntax its output is parsed for (None: no calls)
    constraints: OutputConstraints
    cuts: PromptCuts | None
    model: str
    metadata: dict[str, str]

    def command(self, response_id: str, messages: Messages) -> StartGeneration:
        return StartGeneration(response_id=response_id, messages=messages, params=self.params,
                               metadata=dict(self.metadata), model=self.model,
                               constraints=self.constraints if self.family is not None else None, cuts=self.cuts)


def plan_response(settings: SessionSettings, limits: SessionLimits, event: ResponseCreate, items: Sequence[AnyItem],
                  *, in_conversation: bool) -> ResponsePlan:
    """The plan of ``event`` over ``items`` (the conversation in context, or the event's own
    input); raises the ``ProtocolError`` a field of it earns."""
    view = settings.view
    constraints = view.constraints
    if event.tools is not None:
        constraints = settings.tools(event.tools, "response", constraints)
    audio = settings.audio(event.audio, "response")
    prompt = ResponsePrompt(view.instructions if event.instructions is None else event.instructions, items,
                            constraints, settings.family, max_chars=limits.max_conversation_chars,
                            param="response.input" if event.input is not None else None)
    max_output = event.max_output_tokens if event.max_output_tokens is not None else view.max_output_tokens
    max_tokens = limits.max_output_tokens if max_output == "inf" else int(max_output)
    temperature = view.temperature if event.temperature is None else event.temperature
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=event.ignore_eos)
    # The grammar Turn compiles allows calls exactly when the constraints do (build_grammar), so
    # the output is parsed for calls from the first token, before the grammar exists.
    # (_apply_tools refused callable tools already where the model has no family.)
    family = settings.family if constraints.calls_allowed else None
    cuts = prompt.cuts(view.truncation, sticky=in_conversation and event.input is None)
    return ResponsePlan(prompt, audio, params, max_output, family, constraints, cuts, view.model,
                        dict(event.metadata or {}))
