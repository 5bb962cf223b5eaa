"""The routing point: which engine serves a turn, from the model id the client named, and
under which prefix-cache salt (``cache_salt``: one per API key while the cache is isolated).

Every generation (a Realtime response or a chat completion) asks the router for a ``Route``.
A tier's own model id sends the turn to that tier and nowhere else (it fails when the tier is
down: the client asked for it). The cascade's id goes to the ``CascadeEngine``, after the rules
that need the messages rather than the token ids: a keyword in the last user message sends the
turn straight to the torch tier (or, with that tier down, to the edge, marked degraded).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from gateway.cascade.engine import CascadeEngine
from gateway.cascade.health import HealthMonitor
from gateway.cascade.route import Route, RouteInfo
from gateway.config.cascade import RouteKind
from llm_shared.contract import Engine, SamplingParams
from llm_shared.errors import EngineUnavailableError, UnknownModelError

KEYWORD_SCAN_CHARS = 4096  # rules look at the start of the last user message: bounded work per turn


def prompt_token_limit(engine: Engine, max_tokens: int, *, with_answer: bool = False) -> int | None:
    """The most prompt tokens ``engine`` could take with ``max_tokens`` of output, from what the
    tier says of its context; None where it says nothing. The torch tier counts the output in
    its context (``max_model_len``); the edge holds the prompt alone (``max_prompt_tokens``: it
    stops at its context with "length"). The cascade takes the larger of its tiers' limits,
    whatever their health: it sends what the edge cannot hold to the torch tier, and a tier that
    is down now may serve a retry. ``with_answer``: leave the edge room for the answer too (a
    prompt cut to fit, ``gateway.context_fit``, should not leave none), when it has that much room."""
    if isinstance(engine, CascadeEngine):
        limits = [prompt_token_limit(tier, max_tokens, with_answer=with_answer)
                  for tier in (engine.drafter.engine, engine.target.engine)]
        return None if None in limits else max(limit for limit in limits if limit is not None)
    max_model_len = getattr(engine, "max_model_len", 0)
    if isinstance(max_model_len, int) and max_model_len > 0:
        return max_model_len - max_tokens
    max_prompt_tokens = getattr(engine, "max_prompt_tokens", 0)
    if isinstance(max_prompt_tokens, int) and max_prompt_tokens > 0:
        return max_prompt_tokens - max_tokens if with_answer and max_prompt_tokens > 2 * max_tokens else max_prompt_tokens
    return None


class Router:
    def __init__(self, routes: Mapping[str, RouteKind], engines: Mapping[str, Engine],
                 cascade: CascadeEngine | None = None, keywords: Sequence[str] = (),
                 cache_salts: Mapping[str, str] | None = None) -> None:
        """``cache_salts``: key id -> its prefix-cache salt (``gateway.auth.cache_salts``); a key
        missing from it (all of them while the cache is shared) sends ""."""
        self.routes = dict(routes)
        self.engines = dict(engines)
        self.cascade = cascade
        self._cache_salts = dict(cache_salts or {})
        self._keywords = re.compile("|".join(f"(?:{k})" for k in keywords), re.IGNORECASE) if keywords else None

    def cache_salt(self, key_id: str) -> str:
        """The salt every tier gets with this key's turns: prefix-cache hits only among them."""
        return self._cache_salts.get(key_id, "")

    @property
    def health(self) -> HealthMonitor | None:
        return self.cascade.health if self.cascade is not None else None

    @property
    def ready(self) -> bool:
        """Some turn can be served: for the cascade, while either tier is up (the other's turns
        fall back); otherwise while every built tier is ready."""
        if self.cascade is not None:
            return self.cascade.ready
        return bool(self.engines) and all(engine.ready for engine in self.engines.values())

    def unavailable_message(self) -> str:
        """Why no turn can be served now (call when ``ready`` is False): each tier and why."""
        if self.cascade is not None:
            return self.cascade.health.unavailable_message()
        down = [engine.tier for engine in self.engines.values() if not engine.ready]
        return f"the {' and '.join(down) or 'configured'} engine is not ready (its process is gone or restarting); retry shortly"

    def why_down(self) -> dict[str, str]:
        """Tier -> why it is down, for the tiers that are."""
        health = self.health
        if health is not None:
            return {tier: health.why_down(tier) for tier in self.engines if not health.up(tier)}
        return {tier: "not ready" for tier, engine in self.engines.items() if not engine.ready}

    def tiers_up(self) -> dict[str, bool]:
        health = self.health
        return {tier: health.up(tier) if health is not None else engine.ready for tier, engine in self.engines.items()}

    def start(self) -> None:
        """Start what runs in the background (the tiers' health probes); needs a running loop."""
        if self.health is not None:
            self.health.start()

    async def close(self) -> None:
        if self.health is not None:
            await self.health.close()

    def choose(self, model: str, messages: Sequence[Mapping[str, str]], params: SamplingParams) -> Route:
        """The route for this turn. Raises UnknownModelError or EngineUnavailableError; never
        blocks (it runs on the event loop)."""
        kind = self.routes.get(model)
        if kind is None:
            raise UnknownModelError(f"The model '{model}' does not exist; available: {sorted(self.routes)}",
                                    param="model")
        if kind != "cascade":
            engine = self.engines[kind]
            if not engine.ready:
                raise EngineUnavailableError(f"the {engine.tier} engine is not ready; retry shortly")
            return Route(engine, RouteInfo(kind, "model"))
        cascade = self.cascade
        assert cascade is not None, "a cascade route needs the cascade engine"
        if self._keywords is not None and self._keywords.search(_last_user_text(messages)[:KEYWORD_SCAN_CHARS]):
            target, drafter = cascade.target, cascade.drafter
            if cascade.health.up(target.name):
                return Route(target.engine, RouteInfo(target.name, "pre_routed", reason="keyword"))
            if cascade.health.up(drafter.name) and "fallback" in drafter.roles:
                return Route(drafter.engine, RouteInfo(drafter.name, "fallback", degraded=True,
                                                       reason=f"{target.name}_unavailable"))
        if not cascade.ready:
            raise EngineUnavailableError(cascade.health.unavailable_message())
        return Route(cascade, RouteInfo(cascade.drafter.name, "confident"))  # refined by the cascade's own RouteInfo


def _last_user_text(messages: Sequence[Mapping[str, str]]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            return message.get("content", "")
    return ""
