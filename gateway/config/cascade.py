"""The ``[routing]`` and ``[cascade]`` tables: which model ids clients may name, and how the
cascade decides per turn.

Three served ids: one per tier (the client picks that tier, nothing else decides) and one for
the cascade (the edge model starts the turn, escalating to the torch tier by confidence).
``routing.default`` names what a client gets when it names no model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from llm_shared.configtools import require
from llm_shared.contract import MAX_PREFIX_DRAFT_TOKENS
from llm_shared.errors import ConfigError

RouteKind = Literal["cascade", "edge", "gpu"]
MAX_MODEL_ID_CHARS = 64
MAX_KEYWORD_RULES = 64


@dataclass(frozen=True)
class RoutingConfig:
    default: RouteKind = "edge"  # the route of a client that names no model
    cascade_model: str = "cascade"  # served id of the cascade (only when default = "cascade")
    edge_model: str = "edge"  # served id of the edge tier alone
    gpu_model: str = "gpu"  # served id of the torch tier alone

    def __post_init__(self) -> None:
        ids = (self.cascade_model, self.edge_model, self.gpu_model)
        for name, value in zip(("cascade_model", "edge_model", "gpu_model"), ids, strict=True):
            require(0 < len(value) <= MAX_MODEL_ID_CHARS and value.isprintable() and " " not in value,
                    f"routing.{name} must be 1..{MAX_MODEL_ID_CHARS} printable characters without spaces")
        require(len(set(ids)) == 3, f"routing.cascade_model, edge_model and gpu_model must differ, got {ids}")

    @property
    def tiers(self) -> tuple[str, ...]:
        """The engine tiers to build: both for the cascade, else the one named."""
        return tuple(self.roles())

    def roles(self) -> dict[str, frozenset[str]]:
        """Each tier to build and the parts it plays (``gateway.cascade.route.Tier``): in the
        cascade the edge drafts and the torch tier is the target, each the other's fallback."""
        if self.default == "cascade":
            return {"edge": frozenset({"drafter", "fallback"}), "gpu": frozenset({"target", "fallback"})}
        return {self.default: frozenset({"target"})}

    def served(self) -> dict[str, RouteKind]:
        """Model id -> route, for every id this configuration serves."""
        ids: dict[str, RouteKind] = {self.edge_model: "edge", self.gpu_model: "gpu"}
        if self.default == "cascade":
            ids[self.cascade_model] = "cascade"
        return {model: kind for model, kind in ids.items() if kind == "cascade" or kind in self.tiers}

    @property
    def default_model(self) -> str:
        return {"cascade": self.cascade_model, "edge": self.edge_model, "gpu": self.gpu_model}[self.default]


@dataclass(frozen=True)
class CascadeConfig:
    hold_tokens: int = 8  # edge tokens held back while the turn's confidence is scored
    threshold: float = 0.22  # confidence at or above which the edge keeps the turn (calibrate it)
    scorer: str = "quantile"  # "quantile", "mean", "min", or "package.module:factory" (a learned probe)
    quantile: float = 0.1  # the quantile scorer's q: a low quantile of the held tokens' probabilities
    load_aware: bool = True  # relax the threshold as the torch tier's queue and KV fill up
    min_threshold: float = 0.1  # the most it relaxes to
    queue_full: int = 16  # torch-tier requests waiting at which the relaxation is complete
    kv_relax_from: float = 0.7  # torch-tier KV use (fraction) where relaxation starts; complete at 1.0
    escalate_prompt_tokens: int = 0  # longer prompts go straight to the torch tier (0: only what the edge cannot hold)
    escalate_keywords: tuple[str, ...] = ()  # regexes (case-insensitive) on the last user message
    probe_interval_s: float = 2.0  # each tier's stats looked at, and a probe kept in flight, this often
    # a tier with work whose step counter has not moved this long, or a probe unanswered this long,
    # is down (how fast it answers otherwise is not evidence: a busy host makes steps slow)
    stall_timeout_s: float = 30.0
    # spill: a turn the edge cannot start now (no free sequence slot) goes straight to the torch
    # tier when that one can, and a turn that would escalate stays on the edge while the torch tier
    # cannot start it now
    spill: bool = True
    # ...and a turn also goes straight to the torch tier while the edge, busy with others (or idle
    # beside a torch tier computing on cores the two share), would take over this many times as
    # long to its first token (its recent hold-and-score time, scaled by its queue, plus the torch
    # tier's start for the share of turns escalating lately) as the torch tier to start one (1:
    # whichever answers first; larger keeps more turns cascading)
    spill_slack: float = 1.0
    # ...and the edge counts as full for the cascade at this many of its turns there, whatever its
    # slots (0: its slots): the pinned edge model id may batch 32 conversations, but on a CPU whose
    # torch tier out-serves the edge past a few sequences, a burst of cascade turns all started on
    # the edge before its pace is known would wait on it (docs/benchmarks.md, "A wider edge batch")
    spill_edge_turns: int = 8

    def __post_init__(self) -> None:
        require(1 <= self.hold_tokens <= MAX_PREFIX_DRAFT_TOKENS,
                f"cascade.hold_tokens must be 1..{MAX_PREFIX_DRAFT_TOKENS}, got {self.hold_tokens}")
        for name in ("threshold", "min_threshold", "kv_relax_from"):
            require(0.0 <= getattr(self, name) <= 1.0, f"cascade.{name} must be between 0 and 1")
        require(0.0 < self.quantile < 1.0, "cascade.quantile must be between 0 and 1 (exclusive)")
        require(self.min_threshold <= self.threshold, "cascade.min_threshold must be <= cascade.threshold")
        require(self.kv_relax_from < 1.0, "cascade.kv_relax_from must be below 1")
        require(self.queue_full >= 1, "cascade.queue_full must be >= 1")
        require(self.escalate_prompt_tokens >= 0, "cascade.escalate_prompt_tokens must be >= 0")
        require(len(self.escalate_keywords) <= MAX_KEYWORD_RULES,
                f"cascade.escalate_keywords allows at most {MAX_KEYWORD_RULES} patterns")
        for pattern in self.escalate_keywords:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"cascade.escalate_keywords: {pattern!r} is not a valid regex ({e})") from e
        require(1.0 <= self.spill_slack <= 1000.0, "cascade.spill_slack must be in [1, 1000]")
        require(0 <= self.spill_edge_turns <= 100_000, "cascade.spill_edge_turns must be in 0..100000 (0: the edge's slots)")
        require(0 < self.probe_interval_s <= 3600, "cascade.probe_interval_s must be in (0, 3600]")
        require(self.probe_interval_s <= self.stall_timeout_s <= 86_400,
                "cascade.stall_timeout_s must be >= probe_interval_s (and at most a day)")
