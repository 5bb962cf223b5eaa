"""Request and stream types shared by every engine tier (edge, torch) and the gateway.

Plain dataclasses with no heavy imports, so the gateway, the scheduler and the client SDK
can all use them without pulling in torch, llama.cpp or onnxruntime.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Literal, Protocol, get_args, runtime_checkable

from llm_shared.errors import InvalidRequestError, InvalidSamplingError

if TYPE_CHECKING:
    from llm_shared.tokenizer import Tokenizer

MAX_STOP_STRINGS = 8
MAX_STOP_STRING_CHARS = 256
MAX_TOP_LOGPROBS = 20
# Bounds on what crosses a trust boundary (the engine socket among them), so that one request's
# absurd value fails that request alone instead of a tensor op in a shared step.
MAX_TOP_K = 1 << 20
MAX_STOP_TOKEN_IDS = 64
MAX_TOKEN_ID = 2**31 - 1
MAX_MAX_TOKENS = 1 << 24
# A tier that speculates verifies a caller's draft of the output's first tokens (the cascade's
# held edge tokens) in its first pass; longer drafts are refused.
MAX_PREFIX_DRAFT_TOKENS = 64
# A cache salt names whose cached prefix state a request may reuse (``Engine.generate``); the
# gateway sends a 32-hex-digit digest per API key. Printable ASCII only, so every tier hashes
# the same bytes for it.
MAX_CACHE_SALT_CHARS = 64
# A request's output grammar (llm_shared.structured: tools, tool_choice and response_format made
# one llguidance grammar). Its schemas are bounded far below this where it is built; this bounds
# what any caller (the engine socket among them) can make a tier compile.
MAX_GRAMMAR_CHARS = 1 << 20


class Priority(IntEnum):
    """Scheduling class; lower value runs first. FCFS inside a class."""

    REALTIME = 0  # WebSocket session turns: a person is waiting and may interrupt
    INTERACTIVE = 1  # HTTP chat completions
    BATCH = 2  # offline work that may be preempted first


def check_cache_salt(salt: object) -> str:
    """``salt`` if it is a valid cache salt (a string of at most ``MAX_CACHE_SALT_CHARS``
    printable ASCII characters, "" for none), else InvalidRequestError naming ``cache_salt``."""
    if not isinstance(salt, str) or len(salt) > MAX_CACHE_SALT_CHARS or not (salt.isascii() and salt.isprintable()):
        raise InvalidRequestError(
            f"cache_salt must be a string of at most {MAX_CACHE_SALT_CHARS} printable ASCII characters",
            param="cache_salt")
    return salt


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` means greedy (top-p/top-k ignored)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None  # same seed, same output, whatever the batch
    max_tokens: int = 256
    stop: tuple[str, ...] = ()  # stop strings, not included in the output
    stop_token_ids: tuple[int, ...] = ()  # extra stop ids besides the model's EOS
    logprobs: int = 0  # number of top alternatives to report per token (0: chosen token only)
    ignore_eos: bool = False  # benchmarks fix output lengths with this
    grammar: str = ""  # the output must match it (an llguidance grammar, llm_shared.structured); "": free

    def __post_init__(self) -> None:
        def bad(param: str, why: str) -> InvalidSamplingError:
            return InvalidSamplingError(f"{param} {why}", param=param)

        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise bad("temperature", "must be a number")
        if not math.isfinite(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise bad("temperature", f"must be between 0 and 2, got {self.temperature}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise bad("top_p", "must be a number")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_TOP_K:
            raise bad("top_k", f"must be an integer in [0, {MAX_TOP_K}], got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise bad("seed", "must be in [0, 2**63)")
        if (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                or not 1 <= self.max_tokens <= MAX_MAX_TOKENS):
            raise bad("max_tokens", f"must be an integer in [1, {MAX_MAX_TOKENS}], got {self.max_tokens!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"allows at most {MAX_STOP_STRINGS} strings")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise bad("stop", f"entries must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"allows at most {MAX_STOP_TOKEN_IDS} ids")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
                raise bad("stop_token_ids", f"entries must be integers in [0, {MAX_TOKEN_ID}]")
        if isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int):
            raise bad("logprobs", "must be an integer")
        if not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise bad("logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}")
        if not isinstance(self.grammar, str) or len(self.grammar) > MAX_GRAMMAR_CHARS:
            raise bad("grammar", f"must be a string of at most {MAX_GRAMMAR_CHARS} characters")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


FinishReason = Literal["stop", "length", "abort", "error"]
FINISH_REASONS: tuple[FinishReason, ...] = get_args(FinishReason)


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. ``text`` is the newly printable text it completes; it is "" while
    the token ends inside a multi-byte UTF-8 character or a possible stop string."""

    token_id: int
    text: str
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class FinishEvent:
    """Last event of every stream, exactly once."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    text: str = ""  # held-back text released at the end (never part of a stop string)
    message: str = ""  # human-readable detail for "error" (no internals)
    tier: str = ""  # which engine served the turn ("edge", "gpu"), filled by the engine


StreamEvent = TokenEvent | FinishEvent


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    extra: dict[str, int] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """What the gateway needs of any tier: the edge backends and the torch engine's client.

    ``generate`` validates before yielding anything: a bad request raises an
    ``InvalidRequestError`` subclass (or ``OverloadedError``) from the first ``__anext__``.
    ``session_id`` names the conversation a request continues ("" for none): a tier may keep
    state for its next turn until ``end_session``. ``draft_ids`` (at most
    ``MAX_PREFIX_DRAFT_TOKENS``) are another model's guess at the output's first tokens: a tier
    that verifies drafts (the torch engine) checks them in the prompt's last pass and emits the
    prefix it agrees with at once; the output is what the tier would sample anyway. Other
    tiers ignore them.
    ``cache_salt`` (``check_cache_salt``: at most ``MAX_CACHE_SALT_CHARS`` printable ASCII
    characters, "" for none) keeps tenants apart: a tier reuses cached prefix state (KV blocks,
    a slot's or a snapshot's KV) only from requests that sent the same salt, so one tenant cannot
    learn from ``cached_tokens`` or the time to first token whether another sent a prompt. The
    gateway sends one salt per API key when ``server.isolate_prefix_cache`` is on.
    Every stream that starts ends with exactly one ``FinishEvent``. ``abort`` is idempotent;
    after it returns the request's KV is freed (edge: at once; torch: before the next step)
    and its stream ends with ``FinishEvent(reason="abort")``.
    """

    tier: str  # "edge" or "gpu"; reported to clients in response metadata

    @property
    @abstractmethod
    def tokenizer(self) -> Tokenizer: ...

    @property
    @abstractmethod
    def ready(self) -> bool: ...

    @abstractmethod
    def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        priority: Priority = Priority.INTERACTIVE,
        session_id: str = "",
        draft_ids: Sequence[int] = (),
        cache_salt: str = "",
    ) -> AsyncIterator[StreamEvent]: ...

    @abstractmethod
    async def probe(self) -> None:
        """A cheap round trip through the tier (its worker thread, its core process): returns
        when the tier answers, raises EngineUnavailableError when it cannot. Callers bound
        the wait with their own timeout; a wedged tier simply never returns."""

    @abstractmethod
    async def end_session(self, session_id: str) -> None:
        """The conversation ``session_id`` named in ``generate`` is over: state a tier kept for
        its next turn (the edge tier's idle KV and host snapshots) may go now. Idempotent."""

    @abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abstractmethod
    def stats(self) -> dict[str, float]: ...

    @abstractmethod
    async def close(self) -> None: ...


def engine_saturated(engine: object) -> bool:
    """Whether ``engine`` says it would refuse a new request for overload right now. Optional
    for a tier (``saturated() -> bool``, cheap, no I/O): the gateway asks before it encodes a
    prompt, so under overload a refusal costs no tokenizing. A tier without it is asked by
    generating; either way ``generate`` has the last word."""
    saturated = getattr(engine, "saturated", None)
    return bool(saturated()) if callable(saturated) else False


def engine_backlog(engine: object) -> float | None:
    """How full ``engine`` is for one more turn: (running + waiting + 1) / the turns it runs at
    once, from its stats (``running``, ``waiting``, ``max_running``); at most 1 means it would
    start that turn at its next step, more means the turn would queue behind others. None where
    the tier does not say how many it runs at once. Cheap (a stats read), no I/O."""
    stats = getattr(engine, "stats", None)
    if not callable(stats):
        return None
    try:
        numbers = stats()
        limit = float(numbers.get("max_running", 0.0))
        if limit <= 0:
            return None
        return (float(numbers.get("running", 0.0)) + float(numbers.get("waiting", 0.0)) + 1.0) / limit
    except (TypeError, ValueError):
        return None
