"""What routing decided for one turn, and how clients see it.

The router decides what it can before generation (``Route``: an engine and what is known);
the cascade refines it once the edge's first tokens are scored, by yielding a ``RouteInfo``
in its stream before the turn's first token. Clients see the final one in the Realtime
``response.metadata`` (string values, ``x_`` keys) and in a chat completion's ``x_route``
field, both marked as our extensions in docs/protocol.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from llm_shared.contract import Engine

# How a turn reached its tier:
#   model      the client named a tier's model id
#   confident  the cascade scored the edge's first tokens at or above the threshold
#   escalated  ... below it: the torch tier took over, verifying the held tokens first
#   pre_routed a rule sent it straight to the torch tier (prompt length, keyword)
#   fallback   the tier the cascade wanted was down; the other served it
#   spilled    the tier the cascade wanted could not start it now; the other could (reason
#              edge_busy: sent straight to the torch tier; gpu_busy: kept on the edge)
RouteName = Literal["model", "confident", "escalated", "pre_routed", "fallback", "spilled"]


@dataclass(frozen=True)
class RouteInfo:
    tier: str  # the name of the tier serving the turn ("edge" or "gpu" in the shipped configs)
    route: RouteName
    confidence: float | None = None  # the edge's score, when the cascade scored it
    threshold: float | None = None  # the effective (load-aware) threshold it was compared with
    degraded: bool = False  # the torch tier was wanted but down: the edge answered instead
    reason: str = ""  # which rule pre-routed it, or why the fallback or spill happened

    @property
    def escalated(self) -> bool:
        return self.route == "escalated"

    @property
    def cascaded(self) -> bool:
        """True when the cascade, not the client's choice of model, picked the tier."""
        return self.route != "model"

    def metadata(self) -> dict[str, str]:
        """The Realtime ``response.metadata`` extension keys (values are strings there)."""
        out = {"x_tier": self.tier}
        if not self.cascaded:
            return out
        out.update(x_route=self.route, x_escalated=str(self.escalated).lower(), x_degraded=str(self.degraded).lower())
        if self.confidence is not None:
            out["x_confidence"] = f"{self.confidence:.4f}"
        if self.threshold is not None:
            out["x_threshold"] = f"{self.threshold:.4f}"
        if self.reason:
            out["x_route_reason"] = self.reason
        return out

    def wire(self) -> dict[str, Any]:
        """The chat completion's ``x_route`` object."""
        return {"tier": self.tier, "route": self.route, "escalated": self.escalated, "degraded": self.degraded,
                "confidence": self.confidence, "threshold": self.threshold, "reason": self.reason or None}


@dataclass(frozen=True)
class Route:
    """The router's answer: the engine to call and what is known before it runs. ``engine`` may
    be the cascade itself, whose stream then yields the final ``RouteInfo`` first."""

    engine: Engine
    info: RouteInfo


Role = Literal["drafter", "target", "fallback"]


@dataclass(frozen=True)
class Tier:
    """A named engine with the parts it plays in the cascade: the ``drafter`` starts every turn
    (its held tokens are the target's first draft), the ``target`` takes the turns the drafter is
    not confident of, a ``fallback`` serves when the one wanted is down. The names are the
    configuration's (``edge``, ``gpu``) and what clients see in ``x_tier``."""

    name: str
    engine: Engine
    roles: frozenset[Role]


def with_role(tiers: Sequence[Tier], role: Role) -> Tier:
    """The one tier playing ``role``; ValueError when none or several do."""
    found = [tier for tier in tiers if role in tier.roles]
    if len(found) != 1:
        raise ValueError(f"the cascade needs exactly one {role} tier, got {[t.name for t in found]}")
    return found[0]
