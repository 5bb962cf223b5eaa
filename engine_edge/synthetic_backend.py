"""A synthetic engine: real tokens at a fixed rate per stream, no model arithmetic.

For measuring the gateway itself (``bench/load.py``, ``bench/faults.py``): how many streams one
gateway process carries, what overload and cancels do, whether KV accounting leaks, without the
model's compute hiding the server's costs. It behaves like an engine where that matters: one
step loop emits a token to every running stream each ``1 / tokens_per_s`` seconds (a batch, not
a timer per stream); admission is bounded (``max_streams``, then ``OverloadedError`` at once);
each stream holds KV cells for its prompt and output, freed when it ends or is aborted; stop
strings and max tokens work through the same ``TextStream`` as the real tiers. The tokenizer is
the configured model's, so prompts are encoded as for real. Every stream answers the same text
(``ANSWER``), so two synthetic tiers agree token for token.

The engine's own work per token is kept off the figures it is for: the answer's ``TokenEvent``
objects are made once, and a stream without stop strings is handed those, shared, instead of
detokenizing its own copy (which was a fifth of the gateway process's CPU a delta under load:
a real tier detokenizes in its worker thread or its engine process, not on the gateway's loop).
A stream with stop strings goes through its own ``TextStream`` as before.

It serves either tier. ``SyntheticBackend`` is the edge tier's (``[edge] backend =
"synthetic"``); ``SyntheticEngine(tier="gpu")`` stands in for the torch tier (``[engine] backend =
"synthetic"``), which makes the cascade measurable under load: like the torch engine it takes
``draft_ids`` (the cascade's held edge tokens), and the leading run it agrees with streams in the
request's first step, with one token of its own, as a verifying pass would. Neither ever serves
users' turns in production.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine_edge.base import Draft, EdgeBackend, check_draft_ids, check_prompt
from engine_edge.config import EdgeConfig
from llm_shared.channel import EventChannel
from llm_shared.contract import (
    FinishEvent,
    FinishReason,
    Priority,
    SamplingParams,
    TokenEvent,
    check_cache_salt,
)
from llm_shared.errors import DuplicateRequestError, EngineError, EngineUnavailableError, OverloadedError
from llm_shared.load_cache import LoadCache
from llm_shared.modelfile import check_gguf
from llm_shared.textstream import TextStream
from llm_shared.tokenizer import Tokenizer

ANSWER = ("The quick brown fox jumps over the lazy dog while the river runs quietly past the old mill, "
          "and the town wakes slowly under a pale morning sky. ")
CONTEXT_TOKENS = 8192
KV_BLOCK_CELLS = 16  # the torch tier's stats count KV in blocks of this many cells


@dataclass
class _Stream:
    prompt_tokens: int
    params: SamplingParams
    text: TextStream | None  # only with stop strings; without, the answer's shared events are sent
    events: EventChannel
    produced: int = 0
    finished: bool = False
    verified: int = 0  # draft tokens it agreed with: they stream in its first step


class SyntheticEngine:
    """The engine (see the module's doc) on ``tokenizer``, for the tier named ``tier``."""

    def __init__(self, tokenizer: Tokenizer, *, tokens_per_s: float, max_streams: int, tier: str = "edge") -> None:
        """``tokens_per_s`` and ``max_streams`` as ``[edge]`` and ``[engine]`` bound them."""
        self.tier = tier
        self._tokenizer = tokenizer
        self._answer = self._tokenizer.encode(ANSWER)
        self._answer_events = self._token_events(self._answer)
        self._interval = 1.0 / tokens_per_s
        self._max_streams = max_streams
        self._streams: dict[str, _Stream] = {}
        self._ticker: asyncio.Task[None] | None = None
        self._closed = False
        self._steps = 0
        self._generated = 0

    def _token_events(self, answer: Sequence[int]) -> tuple[TokenEvent, ...] | None:
        """The events of the answer's tokens, as a stream without stop strings sends them (the
        answer repeats: a token's text is taken in its second round, after the answer's own end).
        None, and every stream detokenizes, if the texts do not join to the answer exactly."""
        text = TextStream(self._tokenizer)
        for token_id in answer:
            text.push(token_id)
        events = tuple(TokenEvent(token_id, text.push(token_id)[0], -0.1) for token_id in answer)
        exact = "".join(e.text for e in events) == self._tokenizer.decode(answer, skip_special=True)
        return events if exact and text.finish() == "" else None

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def ready(self) -> bool:
        return not self._closed

    @property
    def max_prompt_tokens(self) -> int:
        return CONTEXT_TOKENS - 1

    def saturated(self) -> bool:
        """Would a request be refused for overload now? The gateway asks before it encodes the
        prompt, so a refusal under overload costs no tokenizing (generate still decides)."""
        return len(self._streams) >= self._max_streams

    def generate(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                 priority: Priority = Priority.INTERACTIVE, session_id: str = "",
                 draft_ids: Sequence[int] = (), cache_salt: str = "") -> EventChannel:
        """``cache_salt`` is checked and has nothing to separate: no KV outlives its turn here.
        ``draft_ids``: the leading run that matches this engine's answer streams in the first step."""
        try:
            if self._closed:
                raise EngineUnavailableError("the synthetic engine is closed")
            prompt = check_prompt(prompt_ids, self._tokenizer.vocab_size, self.max_prompt_tokens)
            drafts = check_draft_ids(draft_ids, self._tokenizer.vocab_size)
            check_cache_salt(cache_salt)
            if request_id in self._streams:
                raise DuplicateRequestError(f"request {request_id!r} is already running", param="request_id")
            if len(self._streams) >= self._max_streams:
                raise OverloadedError(f"the engine is at its {self._max_streams} streams; retry shortly")
        except EngineError as e:
            return EventChannel.refused(e)
        # A consumer that left early frees its cells now.
        events = EventChannel(on_close=lambda _finished: self._left(request_id, events))
        text = TextStream(self._tokenizer, params.stop) if params.stop or self._answer_events is None else None
        self._streams[request_id] = _Stream(len(prompt), params, text, events, verified=self._agreeing(drafts))
        self._ensure_ticker()
        return events

    def _agreeing(self, drafts: Sequence[int]) -> int:
        """How many of ``drafts`` lead the answer (what a verifying pass would accept)."""
        answer = self._answer
        n = 0
        while n < len(drafts) and drafts[n] == answer[n % len(answer)]:
            n += 1
        return n

    def _left(self, request_id: str, events: EventChannel) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and stream.events is events:
            del self._streams[request_id]

    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._run(), name="synthetic-engine")

    async def _run(self) -> None:
        """The step loop: one token for every running stream per interval."""
        loop = asyncio.get_running_loop()
        next_step = loop.time()
        while self._streams:
            next_step += self._interval
            await asyncio.sleep(max(0.0, next_step - loop.time()))
            self._steps += 1
            for request_id, stream in list(self._streams.items()):
                # A token a step; a first step also streams the drafts it agreed with.
                for _ in range(1 + stream.verified):
                    if stream.finished:
                        break
                    self._step(request_id, stream)
                stream.verified = 0

    def _step(self, request_id: str, stream: _Stream) -> None:
        at = stream.produced % len(self._answer)
        stream.produced += 1
        self._generated += 1
        if stream.text is None:
            assert self._answer_events is not None
            stream.events.put(self._answer_events[at])
            stopped = False
        else:
            text, stopped = stream.text.push(self._answer[at])
            stream.events.put(TokenEvent(self._answer[at], text, -0.1))
        if stopped:
            self._finish(request_id, stream, "stop")
        elif stream.produced >= stream.params.max_tokens:
            self._finish(request_id, stream, "length")

    def _finish(self, request_id: str, stream: _Stream, reason: FinishReason) -> None:
        stream.finished = True
        text = stream.text.finish() if stream.text is not None and reason != "abort" else ""
        # Its cells are free as soon as it ends: putting the finish releases it (``_left``).
        stream.events.put(FinishEvent(reason, stream.prompt_tokens, stream.produced, text=text, tier=self.tier))

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and not stream.finished:
            self._finish(request_id, stream, "abort")

    async def end_session(self, session_id: str) -> None:
        """Nothing is kept between turns."""

    async def probe(self) -> None:
        if self._closed:
            raise EngineUnavailableError("the synthetic engine is closed")

    async def propose(self, context_ids: Sequence[int], k: int) -> Draft:
        tokens = tuple(self._answer[i % len(self._answer)] for i in range(k))
        return Draft(tokens, tuple(0.9 for _ in tokens))

    def stats(self) -> dict[str, float]:
        """The edge tier's keys, and the torch tier's KV blocks (the cascade's load-aware threshold reads them)."""
        held = [s.prompt_tokens + s.produced for s in self._streams.values()]
        return {"running": float(len(self._streams)), "waiting": 0.0, "max_running": float(self._max_streams),
                "kv_cells_used": float(sum(held)),
                "kv_cells_total": float(self._max_streams * CONTEXT_TOKENS),
                "kv_blocks_in_use": float(sum(-(-cells // KV_BLOCK_CELLS) for cells in held)),
                "kv_blocks_total": float(self._max_streams * CONTEXT_TOKENS // KV_BLOCK_CELLS),
                "steps": float(self._steps), "generated_tokens": float(self._generated)}

    async def close(self) -> None:
        self._closed = True
        for request_id in list(self._streams):
            await self.abort(request_id)
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker


class SyntheticBackend(SyntheticEngine, EdgeBackend):
    """The edge tier's synthetic backend (``[edge] backend = "synthetic"``), on the GGUF's tokenizer."""

    def __init__(self, model_path: Path, config: EdgeConfig) -> None:
        self.config = config
        tokenizer = Tokenizer.from_gguf(check_gguf(Path(model_path)), cache=LoadCache.from_env())
        super().__init__(tokenizer, tokens_per_s=config.synthetic_tokens_per_s,
                         max_streams=config.synthetic_max_streams, tier="edge")
