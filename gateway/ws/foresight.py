"""Answering ahead: the response a voice turn will start, started at the pause before the turn ends.

Server VAD ends a turn once the user has been silent ``silence_duration_ms`` (500 by default).
The transcript of the speech is started at the pause (``[voice] eager_transcribe_ms``) and is
usually in some 300 ms before the turn ends; from then on the answer the turn would start is
known exactly: the conversation, with that transcript as its last item. Under load the first
phrase of an answer takes several decode steps of a shared batch, so that time is worth having.

The session asks the adapter to start that request at once (``Foresee``) and its engine events
are held. When the turn does end there, its response is planned as always (``response_plan``)
and, when the plan gives the same request (the same items, messages, sampling and
constraints), it takes the engine request over (``StartGeneration.foreseen``): the tokens made
so far come at once, and the response has the id the request was started under (drawn at the
pause: the engine's request id is the response's, as for any response). Anything else drops it (``DropForesight``, or a ``StartGeneration`` that
names none): the user went on speaking, the buffer was cleared, the item deleted, a client's own
``response.create`` came first. Nothing of it reaches the client before the turn ended, and the
conversation holds only what the user said: the session creates the response as always, and the
client sees the same events in the same order, only sooner.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.ws.commands import Command, DropForesight, Foresee, StartGeneration


def _same_request(command: StartGeneration, item_ids: Sequence[str]) -> tuple[Any, ...]:
    """What makes two commands the same request (not their response id, nor the metadata kept for logs)."""
    cuts = command.cuts
    return (tuple(item_ids), command.messages, command.params, command.model, command.constraints,
            None if cuts is None else (cuts.count, cuts.retention_ratio, cuts.post_instructions, cuts.sticky))


class Foresight:
    """The session's side: at most one answer started ahead, and the request it was for."""

    def __init__(self, commands: list[Command]) -> None:
        self._commands = commands
        self._held: tuple[str, tuple[Any, ...]] | None = None  # (its response id, the request it was started for)

    def start(self, command: StartGeneration, item_ids: Sequence[str], voice: str | None) -> None:
        """Start ``command`` ahead (replacing any held: the adapter holds one); its ``response_id``
        is the id the turn's response will have if it takes the answer over; ``voice``: the
        answer is spoken in it (its first phrase is spoken ahead too)."""
        self._held = (command.response_id, _same_request(command, item_ids))
        self._commands.append(Foresee(command, voice))

    def drop(self) -> None:
        if self._held is not None:
            self._held = None
            self._commands.append(DropForesight())

    def take(self, command: StartGeneration, item_ids: Sequence[str]) -> str | None:
        """The response id the answer started ahead was started under, where ``command`` (its own
        id aside) is the same request: the response gets that id and its ``StartGeneration`` says
        ``foreseen``. None otherwise (and the adapter drops what it held at that start)."""
        held, self._held = self._held, None
        if held is not None and held[1] == _same_request(command, item_ids):
            return held[0]
        return None
