"""The gateway's grammar compiles leave the event loop (issue 39, item 3): they run on the
compile threads, a compile past its time cap is refused with a clear error, and the loop keeps
serving meanwhile. The real tokenizer of the embedded model; the compile itself is the library's."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from gateway.auth import RateLimitedError
from gateway.shaping import COMPILE_NICE, COMPILE_THREADS, Grammars
from llm_shared.errors import InvalidRequestError
from llm_shared.modelfile import default_gguf_path
from llm_shared.structured import GrammarCompiler, parse_chat_constraints
from llm_shared.tokenizer import Tokenizer

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf_path())


def weather(name: str = "get_weather") -> dict[str, object]:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def constraints(*tools: dict[str, object]) -> object:
    return parse_chat_constraints({"tools": list(tools), "tool_choice": "required"})


async def test_a_compile_runs_on_a_compile_thread_never_on_the_event_loop(tokenizer: Tokenizer,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    compile_source = GrammarCompiler.compile_source

    def recorded(self: GrammarCompiler, source: object) -> object:
        threads.append(threading.current_thread().name)
        return compile_source(self, source)

    monkeypatch.setattr(GrammarCompiler, "compile_source", recorded)
    grammars = Grammars("smollm2")
    compiled = await grammars.compile(tokenizer, constraints(weather()))
    assert compiled is not None and compiled.calls
    assert threads and threads[0].startswith("grammar-compile"), threads
    assert threading.current_thread().name not in threads


async def test_compiles_yield_the_cores_to_the_loop_and_the_engines(tokenizer: Tokenizer,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile threads run at a lower priority than the thread that serves the streams."""
    niceness: list[int] = []
    compile_source = GrammarCompiler.compile_source

    def recorded(self: GrammarCompiler, source: object) -> object:
        niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return compile_source(self, source)

    monkeypatch.setattr(GrammarCompiler, "compile_source", recorded)
    assert await Grammars("smollm2").compile(tokenizer, constraints(weather("nice"))) is not None
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert niceness and niceness[0] >= min(mine + COMPILE_NICE, 19), (niceness, mine)


async def test_a_compile_past_its_cap_is_refused_and_the_loop_goes_on(tokenizer: Tokenizer,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    compile_source = GrammarCompiler.compile_source

    def stuck(self: GrammarCompiler, source: object) -> object:
        release.wait(60)  # a compile that takes as long as the test says
        return compile_source(self, source)

    monkeypatch.setattr(GrammarCompiler, "compile_source", stuck)
    grammars = Grammars("smollm2", compile_timeout_s=0.5)
    await grammars.compiler(tokenizer)  # built once, beforehand
    ticks = 0

    async def ticking() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(ticking())
    try:
        # every compile thread stuck, and one more request waiting for a thread
        attempts = [grammars.compile(tokenizer, constraints(weather(f"tool_{i}"))) for i in range(COMPILE_THREADS + 1)]
        results = await asyncio.gather(*attempts, return_exceptions=True)
    finally:
        release.set()
        ticker.cancel()
    for result in results:
        assert isinstance(result, InvalidRequestError) and result.code == "grammar_too_complex", result
        assert result.param == "tools" and "did not compile within 0.5 s" in result.message
    assert ticks >= 5, "the event loop was blocked while the compiles ran"
    # the threads come back: the next compile is served
    monkeypatch.setattr(GrammarCompiler, "compile_source", compile_source)
    grammars.compile_timeout_s = 60
    assert await grammars.compile(tokenizer, constraints(weather("later"))) is not None


async def test_a_key_past_its_compile_time_is_refused_before_compiling_and_other_keys_are_not(
        tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 39: one key sending a new hard schema per request gets its share of the compile
    thread (``compile_s_per_minute``), then 429s that cost no compile, until its budget refills;
    another key's schemas compile as ever."""
    compiled: list[str] = []
    compile_source = GrammarCompiler.compile_source

    def costly(self: GrammarCompiler, source: object) -> object:
        end = time.thread_time() + 0.05  # a compile that takes 50 ms of CPU, whatever this machine's speed
        while time.thread_time() < end:
            pass
        compiled.append("x")
        return compile_source(self, source)

    monkeypatch.setattr(GrammarCompiler, "compile_source", costly)
    now = [0.0]
    grammars = Grammars("smollm2", compile_s_per_minute=0.18, clock=lambda: now[0])  # 0.03 s at once
    assert await grammars.compile(tokenizer, constraints(weather("first")), key_id="flood") is not None
    with pytest.raises(RateLimitedError) as refused:
        await grammars.compile(tokenizer, constraints(weather("second")), key_id="flood")
    assert refused.value.code == "rate_limit_exceeded" and "0.18 s of compile time" in refused.value.message
    assert refused.value.retry_after_s > 0
    assert len(compiled) == 1  # the refusal compiled nothing
    assert await grammars.compile(tokenizer, constraints(weather("theirs")), key_id="other") is not None
    now[0] += 60.0  # a minute refills the budget
    assert await grammars.compile(tokenizer, constraints(weather("second")), key_id="flood") is not None
    assert len(compiled) == 3


async def test_the_gateway_shares_the_in_process_edge_tiers_compiler(tokenizer: Tokenizer) -> None:
    """One grammar cache per process (issue 39, item 3): the gateway compiles with the compiler its
    engine offers, so the edge tier finds each grammar the gateway checked already compiled."""

    class Edge:
        def __init__(self) -> None:
            self.compiler = GrammarCompiler(tokenizer, family=None)

        def grammar_compiler(self) -> GrammarCompiler:
            return self.compiler

    edge = Edge()
    grammars = Grammars("smollm2")
    compiled = await grammars.compile(tokenizer, constraints(weather()), edge)
    assert compiled is not None
    assert await grammars.compiler(tokenizer) is edge.compiler
    before = edge.compiler.cache_stats()
    edge.compiler.text_matcher(compiled.text, 64)  # what the edge tier does with the request's grammar
    after = edge.compiler.cache_stats()
    assert (after.hits - before.hits, after.misses - before.misses) == (1, 0)
    other = Grammars("smollm2")  # an engine without a compiler (the torch tier's client): the gateway's own
    assert await other.compiler(tokenizer, object()) is not edge.compiler
