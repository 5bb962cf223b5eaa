"""A turn's output shape: tools, tool_choice and response_format, the same for a chat completion
and a Realtime response.

The API adapters parse the request's fields into ``OutputConstraints`` and its history into
``Message``s (text, or an assistant's calls, or a tool's result), which
``llm_shared.structured.render_messages`` writes as the model family reads them. Here:

- ``Grammars``: the gateway's compilers, one per tokenizer (llguidance's tokenizer view built off
  the event loop, once), so a schema that cannot be enforced is refused with the field named
  before any generation, and the grammar text travels to the tier in ``SamplingParams.grammar``.
  Compiles run on threads of their own (``COMPILE_THREADS``, a quarter of the cores), never on the event loop: a client
  sending a new, hard schema per request (128 tools, a failed compile that names each one) costs
  those threads, not every session's streams, Redis calls and timers; a compile (with its wait for
  a thread) past ``compile_timeout_s`` is refused (``grammar_too_complex``). Each key has a budget
  of compile time (``compile_s_per_minute``, a bucket of the compile thread's CPU seconds charged
  after each compile, holding ten seconds' worth): a key past it is refused with ``rate_limit_exceeded`` before its compile queues, so
  one key's flood holds the compile thread for its share and another key's next schema waits for
  at most the compile running. The compile threads run at a lower CPU priority (``COMPILE_NICE``)
  than the loop and the engines' threads: a compile is paid once per schema, a token stream's step
  every few milliseconds, so under contention the compiles wait;
- ``CallStream``: one response's output split into answer text and tool calls (with the ids the
  APIs give them), for adapters to turn into SSE chunks or session events.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gateway.auth import RateLimitedError
from llm_shared.content import ContentPart
from llm_shared.errors import InvalidRequestError
from llm_shared.structured import (
    ArgumentsDelta,
    CallDone,
    CallStarted,
    CompiledGrammar,
    GrammarCompiler,
    Message,
    OutputConstraints,
    TextDelta,
    ToolCall,
    ToolCallFamily,
    ToolCallParser,
    get_family,
    grammar_source,
)
from llm_shared.token_bucket import TokenBucket
from llm_shared.tokenizer import Tokenizer

# Grammar compiles at once per process, more wait for one (within the time cap): a quarter of the
# cores, at least one, so a flood of hard schemas cannot take the cores that stream tokens.
COMPILE_THREADS = max(1, (os.cpu_count() or 1) // 4)
COMPILE_TIMEOUT_S = 5.0  # a turn's compile, its wait for a thread included (llguidance's fuel bounds the rest)
COMPILE_S_PER_MINUTE = 3.0  # a key's compile CPU a minute: 5% of a thread, hundreds of new schemas (1-35 ms each)
COMPILE_BURST_S = 10.0  # ...of which it may spend this many seconds' worth at once (0.5 s at the default)
COMPILE_NICE = 10  # added to the compile threads' nice value (Linux: per thread)


def lower_priority() -> None:
    """Make the calling thread yield the CPU to the others under contention (``COMPILE_NICE``);
    where a thread's priority cannot be set, it stays as it is."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + COMPILE_NICE)
    except (AttributeError, OSError):
        pass


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class Grammars:
    """The gateway's grammar compilers, one per tokenizer object (every tier of one served model
    shares a tokenizer family; each engine process compiles the text again with its own)."""

    def __init__(self, family: str, *, compile_timeout_s: float = COMPILE_TIMEOUT_S,
                 compile_s_per_minute: float = COMPILE_S_PER_MINUTE, clock: Callable[[], float] = time.monotonic) -> None:
        self.family = get_family(family) if family else None
        self.compile_timeout_s = compile_timeout_s
        self.compile_s_per_minute = compile_s_per_minute  # 0: no budget per key
        self._clock = clock
        self._budgets: dict[str, TokenBucket] = {}  # key id -> its compile time (keys are configured: bounded)
        self._compilers: dict[int, tuple[Tokenizer, GrammarCompiler]] = {}
        self._building: dict[int, asyncio.Future[GrammarCompiler]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile",
                                                           initializer=lower_priority)

    async def compiler(self, tokenizer: Tokenizer, provider: object = None) -> GrammarCompiler:
        """The compiler for ``tokenizer``; the first call builds it in a thread (~0.1 s), or takes
        the one ``provider`` (the engine) offers as ``grammar_compiler()`` for the same tokenizer:
        the in-process edge tier's, so the process keeps one cache and the tier finds each grammar
        the gateway checked already compiled."""
        key = id(tokenizer)
        known = self._compilers.get(key)
        if known is not None and known[0] is tokenizer:
            return known[1]
        building = self._building.get(key)
        if building is None:
            building = self._building[key] = asyncio.ensure_future(
                asyncio.to_thread(self._build, tokenizer, provider))
        try:
            compiler = await asyncio.shield(building)
        finally:
            if building.done():
                self._building.pop(key, None)
        self._compilers[key] = (tokenizer, compiler)
        return compiler

    def _build(self, tokenizer: Tokenizer, provider: object) -> GrammarCompiler:
        offered = getattr(provider, "grammar_compiler", None)
        if callable(offered):
            shared = offered()
            if shared.tokenizer is tokenizer:  # compile_source takes the family's grammar text: any family
                return shared
        return GrammarCompiler(tokenizer, family=self.family)

    async def compile(self, tokenizer: Tokenizer, constraints: OutputConstraints,
                      provider: object = None, key_id: str = "") -> CompiledGrammar | None:
        """The turn's compiled grammar (None: nothing constrains it); raises SchemaError naming the
        field that cannot be enforced, InvalidRequestError when the model cannot call tools, or
        RateLimitedError when ``key_id`` has used its compile time. ``provider``: the turn's
        engine, whose compiler the gateway shares where it has one."""
        source = grammar_source(constraints, self.family)
        if source is None:  # nothing constrains the output: no compiler needed
            return None
        budget = self._budget(key_id)
        compiler = await self.compiler(tokenizer, provider)
        loop = asyncio.get_running_loop()
        spent: list[float] = []

        def timed() -> CompiledGrammar:
            started = time.thread_time()  # the CPU it takes: a lowered thread waits longer under load, unpaid
            try:
                return compiler.compile_source(source)
            finally:
                spent.append(time.thread_time() - started)

        def charge(_: concurrent.futures.Future[CompiledGrammar]) -> None:
            if budget is not None and spent:
                try:
                    loop.call_soon_threadsafe(lambda: budget.debit(spent[0], self._clock()))
                except RuntimeError:  # the loop closed while the thread compiled: nothing to charge
                    pass

        submitted = self._pool.submit(timed)
        submitted.add_done_callback(charge)  # when it ends, even after this turn stopped waiting
        try:
            return await asyncio.wait_for(asyncio.wrap_future(submitted, loop=loop), self.compile_timeout_s)
        except TimeoutError:
            # The thread finishes its compile (it cannot be stopped) and its result is cached;
            # this turn is refused now, so its key learns at once.
            raise InvalidRequestError(
                f"the output grammar did not compile within {self.compile_timeout_s:g} s (the server's compile "
                "threads are busy, or the schemas are too large); simplify them or retry",
                code="grammar_too_complex", param="tools" if source.calls else "response_format") from None

    def _budget(self, key_id: str) -> TokenBucket | None:
        """``key_id``'s compile budget, or RateLimitedError while it is in debt."""
        if self.compile_s_per_minute <= 0:
            return None
        budget = self._budgets.get(key_id)
        if budget is None:
            rate = self.compile_s_per_minute / 60.0
            budget = self._budgets[key_id] = TokenBucket(rate, rate * COMPILE_BURST_S, self._clock())
        if not budget.take(0.0, self._clock()):
            wait = budget.retry_after_s(0.0)
            raise RateLimitedError(
                f"this key's grammar compiles used the {self.compile_s_per_minute:g} s of compile time it has a "
                f"minute (new schemas, or ones that fail to compile, each cost one); retry in {wait:.1f}s",
                bucket="requests", retry_after_s=wait)
        return budget


@dataclass
class CallStream:
    """One response's output through its family's parser: answer text and tool calls, each call
    given an id when it starts. ``feed`` each text delta, then ``finish``; ``calls`` holds every
    call, complete or cut short, in order."""

    parser: ToolCallParser
    calls: list[ToolCall] = field(default_factory=list)
    _ids: dict[int, str] = field(default_factory=dict)
    _names: dict[int, str] = field(default_factory=dict)

    def feed(self, text: str) -> list[TextDelta | CallStarted | ArgumentsDelta | CallDone]:
        return self._note(self.parser.feed(text)) if text else []

    def finish(self) -> list[TextDelta | CallStarted | ArgumentsDelta | CallDone]:
        return self._note(self.parser.finish())

    def call_id(self, index: int) -> str:
        return self._ids[index]

    def _note(self, events: list) -> list:
        for event in events:
            if isinstance(event, CallStarted):
                self._ids[event.index] = new_call_id()
                self._names[event.index] = event.name
            elif isinstance(event, CallDone):
                self.calls.append(ToolCall(self._ids[event.index], event.name, event.arguments))
        return events


def call_stream(compiled: CompiledGrammar | None, family: ToolCallFamily | None) -> CallStream | None:
    """A ``CallStream`` when the turn's grammar allows tool calls, else None (text passes as it is)."""
    if compiled is None or not compiled.calls or family is None:
        return None
    return CallStream(family.new_parser())


def tool_calls_wire(calls: Sequence[ToolCall]) -> list[dict[str, object]]:
    """Calls in chat completions' ``message.tool_calls`` form."""
    return [{"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def message_from_wire(role: str, content: tuple[ContentPart, ...] | str, raw_calls: object, tool_call_id: str, where: str) -> Message:
    """A chat ``messages[i]`` (already checked for role and content) with its ``tool_calls``;
    ValueError says what is malformed."""
    calls: list[ToolCall] = []
    if raw_calls is not None:
        if role != "assistant" or not isinstance(raw_calls, list):
            raise ValueError(f"'{where}.tool_calls' must be a list, on an assistant message")
        for i, raw in enumerate(raw_calls):
            at = f"{where}.tool_calls[{i}]"
            fn = raw.get("function") if isinstance(raw, Mapping) else None
            if not isinstance(raw, Mapping) or raw.get("type", "function") != "function" or not isinstance(fn, Mapping):
                raise ValueError(f"'{at}' must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                                 "\"arguments\"}}}}")
            name, arguments, call_id = fn.get("name"), fn.get("arguments"), raw.get("id", "")
            if not isinstance(name, str) or not name or not isinstance(arguments, str) or not isinstance(call_id, str):
                raise ValueError(f"'{at}.function' needs a string 'name' and a string 'arguments'")
            calls.append(ToolCall(call_id, name, arguments))
    return Message(role, content, tuple(calls), tool_call_id)
