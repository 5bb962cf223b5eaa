"""What a Realtime session asks its adapter to do: the commands ``RealtimeSession.commands()``
returns. Each is a frozen record; the adapter runs it and reports back through the session's
methods (engine events, transcripts, speech)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.context_fit import PromptCuts
from llm_shared.contract import SamplingParams
from llm_shared.structured import OutputConstraints


@dataclass(frozen=True)
class StartGeneration:
    """Command: the adapter must start an engine request under ``response_id``."""

    response_id: str
    messages: list[dict[str, str]]  # chat messages in order, rendered for the model family (tools listed)
    params: SamplingParams
    metadata: dict[str, Any]  # response.create's metadata, for logs and routing
    model: str = ""  # the session's model id when the response was created: the router's choice of route
    # The tools the response may call (Turn compiles their grammar at prepare); None when it may
    # call none, so an unconstrained turn compiles nothing.
    constraints: OutputConstraints | None = None
    # How the prompt may shrink to fit the serving tier's context (the session's truncation); None: disabled.
    cuts: PromptCuts | None = None
    # This very request was started before the turn ended (``Foresee``, under this response id):
    # the adapter hands that engine request to this response instead of starting one. False: start
    # one (and drop any answer started ahead: it was for another turn).
    foreseen: bool = False


@dataclass(frozen=True)
class AbortGeneration:
    """Command: the adapter must abort the engine request of ``response_id`` now."""

    response_id: str




@dataclass(frozen=True)
class Foresee:
    """Command: start ``request`` now, before the user's turn has ended (at a pause whose
    transcript came), and hold its engine events: the response the turn will start if it ends
    there takes them over (``StartGeneration.foreseen``, under the same response id). Nothing of it reaches
    the client unless taken over; a new ``Foresee`` or ``DropForesight`` ends the one held."""

    request: StartGeneration  # its ``response_id``: the one the turn's response gets if it takes it over
    voice: str | None = None  # the answer is spoken in this voice: its first phrase is spoken ahead too


@dataclass(frozen=True)
class DropForesight:
    """Command: the answer started ahead is moot (the user went on, the buffer was cleared): abort it."""


@dataclass(frozen=True)
class AdmitResponse:
    """Command: the session wants to start a response of its own (server VAD heard the end of a
    turn). The adapter charges it to the key as it charges a client's ``response.create``, then
    reports with ``RealtimeSession.response_admitted(ok)``: every generation passes one admission."""

    item_id: str  # the user's speech that it answers, for logs


@dataclass(frozen=True)
class Transcribe:
    """Command: transcribe a user item's speech (PCM16, 24 kHz) and report it with
    ``RealtimeSession.transcribed`` (or ``transcription_failed``)."""

    item_id: str
    audio: bytes
    # Which cut of the item's speech this is (its end, in session ms): a job started at a pause is
    # replaced by one for a later cut if the user goes on speaking (the adapter cancels the older).
    tag: int = 0
    # semantic_vad: also judge whether the words are a finished turn (``transcribed``'s
    # ``finished``), which confirms or holds an end the turn model proposed at this pause.
    judge_end: bool = False
    # the session's audio.input.transcription.prompt ("" for none); None: the server's own
    prompt: str | None = None

    @property
    def at_pause(self) -> bool:
        """Started at a pause of speech still going on (the turn may not end there)."""
        return self.tag != 0


@dataclass(frozen=True)
class CancelTranscription:
    """Command: the item was deleted: drop its transcription job (queued, it never runs)."""

    item_id: str


@dataclass(frozen=True)
class Synthesize:
    """Command: speak phrase ``index`` of ``response_id`` and hand its audio (PCM16, 24 kHz) to
    ``RealtimeSession.speech_ready`` (or ``speech_failed``). Phrases may come back in any order."""

    response_id: str
    index: int
    text: str
    voice: str


@dataclass(frozen=True)
class CancelSpeech:
    """Command: drop the phrases of ``response_id`` not synthesized yet (it ended)."""

    response_id: str


Command = (StartGeneration | AbortGeneration | Foresee | DropForesight | AdmitResponse | Transcribe
           | CancelTranscription | Synthesize | CancelSpeech)
