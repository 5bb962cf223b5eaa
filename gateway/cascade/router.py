"""The routing point: which engine tier serves a turn.

Every generation (a Realtime response or a chat completion) asks the router for an engine.
Until the confidence cascade lands, ``SingleTierRouter`` sends everything to the one tier
named by ``routing.default``; the cascade will implement the same ``Router`` protocol.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from llm_shared.contract import Engine, SamplingParams
from llm_shared.errors import EngineUnavailableError


class Router(Protocol):
    def choose(self, messages: Sequence[Mapping[str, str]], params: SamplingParams) -> Engine:
        """The engine for this turn. Raises an EngineError (e.g. EngineUnavailableError) when
        no tier can serve it; must not block (it runs on the event loop)."""
        ...


class SingleTierRouter:
    """Every turn goes to one engine."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def engine(self) -> Engine:
        return self._engine

    def choose(self, messages: Sequence[Mapping[str, str]], params: SamplingParams) -> Engine:
        if not self._engine.ready:
            raise EngineUnavailableError(f"the {self._engine.tier} engine is not ready; retry shortly")
        return self._engine
