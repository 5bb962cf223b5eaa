"""A deterministic in-process Engine for the gateway's fast tests.

It follows the ``Engine`` protocol's contract (validation before the first event, exactly one
FinishEvent, idempotent abort that frees KV at once) and keeps KV-block accounting like a
paged engine, so tests can assert that every aborted request gave its blocks back.
"""

from __future__ import annotations

import asyncio
import math
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from llm_shared.channel import EventChannel
from llm_shared.chat_template import validate_messages
from llm_shared.contract import FinishEvent, Priority, SamplingParams, TokenEvent
from llm_shared.errors import (
    DuplicateRequestError,
    EmptyPromptError,
    EngineError,
    EngineUnavailableError,
    PromptTooLongError,
)


class FakeTokenizer:
    """One token per character (id = code point); the chat prompt is ``<role>content\\n`` lines."""

    vocab_size = 0x110000
    bos_id = None
    eos_id = 0

    max_token_bytes = 4  # one UTF-8 character per token

    def __init__(self, chat_delay_s: float = 0.0) -> None:
        self.chat_delay_s = chat_delay_s  # a slow encode_chat, as a real tokenizer is on a long prompt
        self.chat_encodes = 0  # encode_chat calls (a prompt refused before tokenizing adds none)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        return self._render(validate_messages(messages), add_generation_prompt)

    def min_tokens(self, text: str) -> int:
        """The real tokenizer's lower bound: the text's UTF-8 bytes over the longest token's."""
        return -(-len(text.encode("utf-8", errors="surrogatepass")) // self.max_token_bytes)

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def encode_chat(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True,
                    rendered: str | None = None) -> list[int]:
        checked = validate_messages(messages)
        self.chat_encodes += 1
        if self.chat_delay_s:
            time.sleep(self.chat_delay_s)  # the gateway runs long prompts in a worker thread
        return self.encode(self._render(checked, add_generation_prompt))

    @staticmethod
    def _render(checked: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in checked)
        return text + ("<assistant>" if add_generation_prompt else "")

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return "".join(chr(i) for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        return chr(token_id).encode("utf-8", errors="surrogatepass")


def token_id_of(text: str) -> int:
    """A stable id for a fake token's text (ids below 1000 are left to the tokenizer's characters)."""
    return 1000 + zlib.crc32(text.encode("utf-8", "surrogatepass")) % 1_000_000


def default_reply(prompt_ids: Sequence[int], params: SamplingParams) -> list[str]:
    """Eight word tokens that depend on the prompt length, so different prompts differ."""
    return [f"w{(len(prompt_ids) + i) % 97} " for i in range(8)]


@dataclass
class _Request:
    prompt: list[int]
    priority: Priority
    params: SamplingParams
    events: EventChannel = field(default_factory=EventChannel)
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    blocks: int = 0
    producer: asyncio.Task[None] | None = None


class FakeEngine:
    def __init__(
        self,
        *,
        tier: str = "edge",
        tokenizer: object | None = None,
        reply: Callable[[Sequence[int], SamplingParams], list[str]] = default_reply,
        tokens_per_second: float | None = None,
        block_size: int = 16,
        num_blocks: int = 4096,
        n_ctx: int = 65536,
        logprob: float | Callable[[Sequence[int], int], float] = -0.5,
    ) -> None:
        """``logprob``: each token's log-probability, or a function of (prompt, index) giving it
        (the cascade scores its confidence from these). Token ids derive from the token's text,
        so two engines that agree on a token agree on its id."""
        self.tier = tier
        self._logprob = logprob
        self._tokenizer = tokenizer or FakeTokenizer()
        self._reply = reply
        self._interval = 1.0 / tokens_per_second if tokens_per_second else 0.0
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.n_ctx = n_ctx
        self.is_ready = True
        self._requests: dict[str, _Request] = {}
        self._last_prompt: dict[str, list[int]] = {}  # cache salt -> the latest prompt under it
        self.prefix_cache_hits = 0
        self.started: list[tuple[str, Priority]] = []  # (request id, priority) of every admitted request
        self.sessions: dict[str, str] = {}  # request id -> the session id it named
        self.ended_sessions: list[str] = []  # session ids passed to end_session, in order
        self.prompts: dict[str, list[int]] = {}  # request id -> the prompt ids it was given
        self.drafts: dict[str, list[int]] = {}  # request id -> the draft ids it was given
        self.salts: dict[str, str] = {}  # request id -> the cache salt it was given
        self.probes = 0  # probe() calls answered
        self.probe_hangs = False  # probe() never returns (a wedged tier)
        self.abort_hangs = False  # abort() never returns (a wedged tier); the request runs on
        self.refuse: EngineError | None = None  # generate() raises this before any event (e.g. overload)
        self.extra_stats: dict[str, float] = {}  # merged into stats() (a queue, KV use)
        self.aborts: list[str] = []  # request ids aborted while running
        self.finished: dict[str, str] = {}  # request id -> finish reason, once its last event is made
        self.closed = False
        self.admitted = asyncio.Condition()  # notified on every admission (tests wait on it)

    @property
    def tokenizer(self) -> FakeTokenizer:
        return self._tokenizer  # type: ignore[return-value]

    @property
    def ready(self) -> bool:
        return self.is_ready and not self.closed

    async def probe(self) -> None:
        if self.probe_hangs:
            await asyncio.Event().wait()
        if not self.ready:
            raise EngineUnavailableError("the fake engine is not ready")
        self.probes += 1

    @property
    def max_prompt_tokens(self) -> int:
        return self.n_ctx - 1

    async def end_session(self, session_id: str) -> None:
        self.ended_sessions.append(session_id)

    @property
    def blocks_in_use(self) -> int:
        return sum(r.blocks for r in self._requests.values())

    def channel_of(self, request_id: str) -> EventChannel:
        """The stream of a running request (a test can fail it as a lost engine would)."""
        return self._requests[request_id].events

    def blocks_of(self, request_id: str) -> int:
        """KV blocks a request holds now (0 once it finished or was aborted)."""
        request = self._requests.get(request_id)
        return request.blocks if request is not None else 0

    @property
    def running(self) -> int:
        return len(self._requests)

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def _cached(self, prompt: list[int], salt: str) -> int:
        """Like a prefix cache: the prompt's full blocks shared with the latest prompt of the same salt."""
        common = 0
        for a, b in zip(prompt, self._last_prompt.get(salt, []), strict=False):
            if a != b:
                break
            common += 1
        self._last_prompt[salt] = prompt
        cached = (min(common, len(prompt) - 1) // self.block_size) * self.block_size
        if cached:
            self.prefix_cache_hits += 1
        return cached

    def generate(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                 priority: Priority = Priority.INTERACTIVE, session_id: str = "",
                 draft_ids: Sequence[int] = (), cache_salt: str = "") -> EventChannel:
        """Like a real engine, tokens are made by the engine's own task, not by the reader of
        this stream: a reader that goes away without ``abort`` leaves the request running. The
        stream is an ``EventChannel``, like the edge tier's: the gateway takes its tokens by callback."""
        try:
            self._admit(request_id, prompt_ids, params)
        except EngineError as e:
            return EventChannel.refused(e)
        request = _Request(list(prompt_ids), priority, params, blocks=self._blocks_for(len(prompt_ids)))
        self._requests[request_id] = request
        self.started.append((request_id, priority))
        self.sessions[request_id] = session_id
        self.prompts[request_id] = list(prompt_ids)
        self.drafts[request_id] = list(draft_ids)
        self.salts[request_id] = cache_salt
        request.producer = asyncio.create_task(self._produce(request_id, request))
        return request.events

    def _admit(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if not self.ready:
            raise EngineUnavailableError("the fake engine is not ready")
        if self.refuse is not None:
            raise self.refuse
        if request_id in self._requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already running", param="request_id")
        if not prompt_ids:
            raise EmptyPromptError("the prompt is empty", param="messages")
        if len(prompt_ids) + params.max_tokens > self.n_ctx:
            raise PromptTooLongError(f"prompt of {len(prompt_ids)} tokens does not fit {self.n_ctx}",
                                     param="messages")

    async def _produce(self, request_id: str, request: _Request) -> None:
        async with self.admitted:
            self.admitted.notify_all()
        prompt, params = request.prompt, request.params
        cached = self._cached(prompt, self.salts.get(request_id, ""))
        texts = self._reply(prompt, params)[: params.max_tokens]
        produced = 0
        try:
            for i, text in enumerate(texts):
                if self._interval:
                    try:
                        await asyncio.wait_for(request.aborted.wait(), self._interval)
                    except TimeoutError:
                        pass
                else:
                    await asyncio.sleep(0)  # one "step": lets other requests and aborts run
                if request.aborted.is_set():
                    break
                produced += 1
                request.blocks = self._blocks_for(len(prompt) + produced)
                logprob = self._logprob(prompt, i) if callable(self._logprob) else self._logprob
                token_id = token_id_of(text)
                request.events.put(TokenEvent(
                    token_id=token_id, text=text, logprob=logprob,
                    top_logprobs=tuple((token_id + k, logprob - k) for k in range(params.logprobs))))
            if request.aborted.is_set():
                reason = "abort"
            else:
                reason = "length" if len(texts) >= params.max_tokens else "stop"
            request.events.put(FinishEvent(reason, len(prompt), produced, cached_tokens=cached,
                                                  tier=self.tier))
            self.finished[request_id] = reason
        finally:
            request.blocks = 0
            self._requests.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        if self.abort_hangs:
            await asyncio.Event().wait()
        request = self._requests.get(request_id)
        if request is None or request.aborted.is_set():
            return
        request.aborted.set()
        request.blocks = 0  # freed at once, before the next "step"
        self.aborts.append(request_id)

    def stats(self) -> dict[str, float]:
        return {
            "running": float(len(self._requests)),  # the names the real tiers use
            "waiting": 0.0,
            "kv_blocks_in_use": float(self.blocks_in_use),
            "kv_blocks_total": float(self.num_blocks),
            "prefix_cache_hits": float(self.prefix_cache_hits),
            **self.extra_stats,
        }

    async def close(self) -> None:
        self.closed = True
        for request_id in list(self._requests):
            await self.abort(request_id)
