"""What ``session.update`` sets for one Realtime session: the model, instructions, sampling
defaults, tools and audio. An update is checked whole before anything changes, so a refused one
leaves the session as it was; ``response.create`` overrides are checked by the same rules."""

from __future__ import annotations

from dataclasses import replace

from gateway.ws.audio_events import AudioPatch, AudioSettings
from gateway.ws.events import ProtocolError, SessionLimits, SessionUpdate, ToolsPatch
from gateway.ws.wire import SessionView
from llm_shared.errors import InvalidRequestError
from llm_shared.structured import OutputConstraints, ToolCallFamily, parse_realtime_constraints
from llm_shared.structured.parse import REALTIME_DEFAULT

DEFAULT_TEMPERATURE = 0.8  # the Realtime API's default
NO_DENOISER = ("noise reduction is accepted but not applied: this server has no denoiser, so the audio reaches "
               "turn detection and transcription as sent")


class SessionSettings:
    def __init__(self, *, session_id: str, model: str, models: frozenset[str], limits: SessionLimits,
                 family: ToolCallFamily | None, voice: bool) -> None:
        """``models``: the ids ``session.update`` may switch to; ``family``: the served model's
        tool-call syntax (None: tools that could be called are refused); ``voice``: whether the
        server speaks (else audio output is refused)."""
        self.view = SessionView(id=session_id, model=model, instructions="",
                                max_output_tokens=limits.default_max_output_tokens, temperature=DEFAULT_TEMPERATURE,
                                constraints=REALTIME_DEFAULT, audio=AudioSettings())
        self.family = family
        self._models = models | {model}
        self._voice = voice
        self._told_no_denoiser = False  # the warning about noise_reduction is given once a session

    def warnings(self, beta: bool) -> list[dict[str, str]]:
        """What the settings in force do differently from what was asked, not said before
        (``x_warnings`` of ``session.updated``, our extension)."""
        if self.view.audio.noise_reduction is None or self._told_no_denoiser:
            return []
        self._told_no_denoiser = True
        param = "session.input_audio_noise_reduction" if beta else "session.audio.input.noise_reduction"
        return [{"code": "noise_reduction_not_applied", "message": NO_DENOISER, "param": param}]

    def update(self, event: SessionUpdate) -> None:
        if event.model is not None and event.model not in self._models:
            raise ProtocolError("invalid_value", f"model {event.model!r} is not served here; available: "
                                f"{sorted(self._models)}", "session.model")
        view = self.view
        changes: dict[str, object] = {"audio": self.audio(event.audio, "session")}
        if event.tools is not None:
            changes["constraints"] = self.tools(event.tools, "session", view.constraints)
        for name in ("model", "instructions", "max_output_tokens", "temperature", "truncation"):  # the model picks later routes
            if getattr(event, name) is not None:
                changes[name] = getattr(event, name)
        self.view = replace(view, **changes)

    def audio(self, patch: AudioPatch | None, prefix: str) -> AudioSettings:
        """The session's audio settings with ``patch``; refused where the server has no voice."""
        audio = self.view.audio.apply(patch)
        if audio.output_audio and not self._voice:
            raise ProtocolError("unsupported_feature", "voice is not enabled on this server: use "
                                "output_modalities [\"text\"]", f"{prefix}.output_modalities")
        return audio

    def tools(self, patch: ToolsPatch, prefix: str, base: OutputConstraints) -> OutputConstraints:
        """``base`` with the patch's tools, tool_choice and parallel_tool_calls; a ProtocolError
        naming the field (``session.tools[0].parameters``, ``response.tool_choice.name``...) when
        they are malformed, do not fit together, or could be called by a model that cannot call."""
        try:
            constraints = parse_realtime_constraints(patch.raw, param_prefix=prefix, base=base)
        except InvalidRequestError as e:  # SchemaError included: a schema past its bounds
            raise ProtocolError(e.code, e.message, e.param) from None
        if patch.parallel_tool_calls is not None:
            constraints = replace(constraints, parallel_tool_calls=patch.parallel_tool_calls)
        if constraints.calls_allowed and self.family is None:
            raise ProtocolError("unsupported_feature", "this model has no known tool-call format, so it cannot "
                                "call tools; set tool_choice \"none\" or no tools", f"{prefix}.tools")
        return constraints
