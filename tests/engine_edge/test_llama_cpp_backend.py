"""The llama.cpp edge backend on the embedded model: streaming, batching, cancel, drafting, bad input."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

import engine_edge.llama_cpp_worker as worker_module
from engine_edge import create_backend
from engine_edge.config import EdgeConfig
from engine_edge.llama_cpp_backend import LlamaCppBackend
from llm_shared.contract import Engine, FinishEvent, Priority, SamplingParams, StreamEvent, TokenEvent
from llm_shared.errors import (
    DuplicateRequestError,
    EmptyPromptError,
    EngineUnavailableError,
    InvalidRequestError,
    InvalidSamplingError,
    ModelFileError,
    OverloadedError,
    PromptTooLongError,
)
from llm_shared.modelfile import default_gguf_path

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def backend() -> Iterator[LlamaCppBackend]:
    # Separate streams: batched outputs equal solo ones bit for bit, which the tests below check.
    # One thread: llama.cpp's threads meet at a barrier after every graph node, so on a CPU
    # shared with other test runs two threads can be 10x slower than one. The "small"
    # backend below keeps the default (all cores).
    engine = create_backend(EdgeConfig(kv_cache_mib=202.5, kv_layout="per_sequence", n_seq_max=8, n_threads=1), default_gguf_path())
    assert isinstance(engine, LlamaCppBackend)
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def small() -> Iterator[LlamaCppBackend]:
    """One sequence slot and two queue places, to reach the limits quickly; a stream of 256 cells
    each for it and the drafter (23,040 bytes a cell)."""
    engine = LlamaCppBackend(default_gguf_path(), EdgeConfig(kv_cache_mib=11.25, kv_layout="per_sequence",
                                                             n_seq_max=1, max_queued=2))
    yield engine
    asyncio.run(engine.close())


def chat(engine: LlamaCppBackend, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


async def collect(engine: LlamaCppBackend, request_id: str, prompt: Sequence[int],
                  params: SamplingParams = GREEDY) -> tuple[list[TokenEvent], FinishEvent]:
    tokens: list[TokenEvent] = []
    events: list[StreamEvent] = [e async for e in engine.generate(request_id, prompt, params)]
    *tokens, finish = events  # type: ignore[assignment]
    assert all(isinstance(e, TokenEvent) for e in tokens)
    assert isinstance(finish, FinishEvent)
    return tokens, finish


async def no_orphan_kv(engine: LlamaCppBackend) -> dict[str, dict[int, int]]:
    """Every generation slot holding KV is running or a cache entry of exactly that many cells."""
    state = await engine.kv_state()
    assert state["held"] == {**state["cached"], **state["running"]}
    return state


PROMPTS = [
    "What is the capital of Japan?",
    "Name three fruits.",
    "Write one sentence about dogs.",
    "What color is the sky on a clear day?",
    "What is 2 + 2?",
    "Say hello.",
    "Describe a cat in five words.",
    "Why do leaves change color in autumn?",
]


async def test_implements_the_engine_protocol(backend: LlamaCppBackend) -> None:
    assert isinstance(backend, Engine)
    assert backend.tier == "edge" and backend.ready
    # Separate KV streams: 202.5 MiB is 9,216 cells of 23,040 bytes, 1,024 for each of the 8
    # request slots and the drafter (test_long_context covers the default shared pool).
    assert backend.n_ctx == 9216 and backend.kv_cache_bytes == 9216 * 23040
    assert backend.n_ctx_seq == 1024 and backend.max_prompt_tokens == 1023


async def test_streams_a_coherent_chat_reply(backend: LlamaCppBackend) -> None:
    prompt = chat(backend, "What is the capital of Japan?")
    tokens, finish = await collect(backend, "capital", prompt, SamplingParams(temperature=0.0, max_tokens=40))
    text = "".join(t.text for t in tokens) + finish.text
    assert "Tokyo" in text
    assert text == backend.tokenizer.decode([t.token_id for t in tokens], skip_special=True)
    assert finish.reason == "stop"  # the model ends its short answer with <|im_end|>
    assert finish.prompt_tokens == len(prompt) and finish.completion_tokens == len(tokens)
    assert finish.tier == "edge"
    assert all(t.logprob <= 0.0 for t in tokens)


async def test_reports_top_logprobs(backend: LlamaCppBackend) -> None:
    tokens, _ = await collect(backend, "lp", chat(backend, "Name three fruits."),
                              SamplingParams(temperature=0.0, max_tokens=4, logprobs=3))
    for t in tokens:
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0][0] == t.token_id  # greedy picks the most likely token
        assert math.isclose(t.top_logprobs[0][1], t.logprob, rel_tol=1e-9)
        assert t.top_logprobs[0][1] >= t.top_logprobs[1][1] >= t.top_logprobs[2][1]


async def test_stop_string_and_stop_token(backend: LlamaCppBackend) -> None:
    prompt = chat(backend, "What color is the sky on a clear day?")
    tokens, _ = await collect(backend, "free", prompt, SamplingParams(temperature=0.0, max_tokens=24))
    full = "".join(t.text for t in tokens)
    assert "blue" in full
    stopped, finish = await collect(backend, "stop-str", prompt,
                                    SamplingParams(temperature=0.0, max_tokens=24, stop=("blue",)))
    assert finish.reason == "stop"
    assert "".join(t.text for t in stopped) + finish.text == full[: full.index("blue")]

    ids = [t.token_id for t in tokens]
    cut = ids.index(ids[5])  # first occurrence of the sixth token
    stopped, finish = await collect(backend, "stop-id", prompt,
                                    SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=(ids[5],)))
    assert finish.reason == "stop" and [t.token_id for t in stopped] == ids[:cut]


async def test_max_tokens_ends_with_length(backend: LlamaCppBackend) -> None:
    tokens, finish = await collect(backend, "len", chat(backend, "Say hello."),
                                   SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert len(tokens) == 5 and finish.reason == "length" and finish.completion_tokens == 5


async def test_eight_concurrent_sequences_equal_their_solo_outputs(backend: LlamaCppBackend) -> None:
    prompts = [chat(backend, p) for p in PROMPTS]
    solo = []
    for i, p in enumerate(prompts):
        tokens, _ = await collect(backend, f"solo-{i}", p)
        solo.append([t.token_id for t in tokens])
    steps_before = backend.stats()["steps"]
    results = await asyncio.gather(*(collect(backend, f"batch-{i}", p) for i, p in enumerate(prompts)))
    steps = backend.stats()["steps"] - steps_before
    assert [[t.token_id for t in tokens] for tokens, _ in results] == solo
    # Batched, not taken in turns: 8 x 16 tokens need about 16 steps (a few more if some
    # prompts arrive while others decode), not 128.
    assert steps <= 2 * GREEDY.max_tokens


async def test_staggered_arrivals_equal_solo(backend: LlamaCppBackend) -> None:
    """Sequences joining while others decode share steps with them (prompt chunk plus decode tokens)."""
    prompts = [chat(backend, p) for p in PROMPTS[:4]]
    solo = [[t.token_id for t in (await collect(backend, f"s-solo-{i}", p))[0]] for i, p in enumerate(prompts)]

    async def late(i: int, started: asyncio.Event, previous: asyncio.Event | None) -> list[int]:
        if previous is not None:
            await previous.wait()
        ids: list[int] = []
        async for event in backend.generate(f"s-{i}", prompts[i], GREEDY):
            if isinstance(event, TokenEvent):
                ids.append(event.token_id)
                started.set()
        return ids

    gates = [asyncio.Event() for _ in prompts]
    outs = await asyncio.gather(*(late(i, gates[i], gates[i - 1] if i else None) for i in range(len(prompts))))
    assert outs == solo


async def test_same_seed_same_output_whatever_the_batch(backend: LlamaCppBackend) -> None:
    prompt = chat(backend, "Write one sentence about dogs.")
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone, _ = await collect(backend, "seed-a", prompt, params)
    crowd = await asyncio.gather(
        collect(backend, "seed-b", prompt, params),
        *(collect(backend, f"noise-{i}", chat(backend, p), SamplingParams(temperature=1.0, max_tokens=16))
          for i, p in enumerate(PROMPTS[:5])),
    )
    assert [t.token_id for t in crowd[0][0]] == [t.token_id for t in alone]
    others = [await collect(backend, f"seed-{s}", prompt, replace(params, seed=s)) for s in (1, 2, 3)]
    assert any([t.token_id for t in o[0]] != [t.token_id for t in alone] for o in others)


async def test_abort_stops_within_one_step_and_frees_kv(backend: LlamaCppBackend) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    keep_going = backend.generate("survivor", chat(backend, "Name three fruits."), params)
    await anext(keep_going)  # running, with KV
    events: list[StreamEvent] = []
    after_abort = 0
    async for event in backend.generate("victim", chat(backend, "Say hello."), params):
        events.append(event)
        if len(events) == 3:
            await backend.abort("victim")
            after_abort = len(events)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    finish = events[-1]
    assert isinstance(finish, FinishEvent) and finish.reason == "abort"
    assert finish.completion_tokens == len(tokens) < 20
    # Tokens after the abort call: at most one already emitted but unread, plus the one step
    # that was running when the command arrived.
    assert len(events) - 1 - after_abort <= 2
    state = await no_orphan_kv(backend)
    assert len(state["running"]) == 1  # only the survivor still computes; the victim's KV is cache
    await backend.abort("survivor")
    rest = [e async for e in keep_going]
    assert isinstance(rest[-1], FinishEvent) and rest[-1].reason == "abort"
    assert (await no_orphan_kv(backend))["running"] == {}
    await backend.abort("survivor")  # idempotent, and unknown ids are fine
    await backend.abort("never-existed")


async def test_a_finished_turn_is_out_of_the_stats_before_its_finish_is_sent(
        backend: LlamaCppBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whoever reads a FinishEvent sees stats without its request. The worker used to publish them
    at the end of its step, after the event had gone to the event loop: a reader could still count
    the finished turn as running with its cells in use (a loaded machine did). Recorded here at the
    moment the worker builds the FinishEvent, so the check does not depend on thread timing."""
    at_finish: list[dict[str, float]] = []
    real = worker_module.FinishEvent

    def recording(*args: object, **kwargs: object) -> FinishEvent:
        at_finish.append(backend._worker.snapshot)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(worker_module, "FinishEvent", recording)
    await collect(backend, "stats-at-finish", chat(backend, "Say hello."))
    assert at_finish and at_finish[-1]["running"] == 0.0
    assert at_finish[-1]["kv_cells_used"] == backend.stats()["kv_cells_used"]


async def test_consumer_leaving_frees_the_sequence(backend: LlamaCppBackend) -> None:
    stream = backend.generate("leaver", chat(backend, "Say hello."),
                              SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True))
    await anext(stream)
    await stream.aclose()
    assert (await no_orphan_kv(backend))["running"] == {}


async def test_propose_equals_greedy_and_reuses_the_prefix(backend: LlamaCppBackend) -> None:
    context = chat(backend, "Why do leaves change color in autumn?")
    draft = await backend.propose(context, 6)
    tokens, _ = await collect(backend, "greedy-6", context, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert list(draft.token_ids) == [t.token_id for t in tokens]
    for prob, t in zip(draft.probs, tokens, strict=True):
        assert 0.0 < prob <= 1.0
        assert math.isclose(prob, math.exp(t.logprob), abs_tol=2e-3)

    # The verifier accepted 3 drafts and added its own token: only that tail is new.
    own = 11 if draft.token_ids[3] != 11 else 12
    extended = [*context, *draft.token_ids[:3], own]
    before = backend.stats()["draft_prefill_tokens"]
    second = await backend.propose(extended, 4)
    assert second.reused_tokens == len(context) + 3
    assert backend.stats()["draft_prefill_tokens"] - before == 1
    tokens, _ = await collect(backend, "greedy-ext", extended, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert list(second.token_ids) == [t.token_id for t in tokens]

    # A shorter, different context: the cache is cut back to the common prefix.
    third = await backend.propose(context[:10], 2)
    assert third.reused_tokens == 9


async def test_bad_inputs_raise_typed_errors(backend: LlamaCppBackend) -> None:
    async def first(prompt: object, params: object = GREEDY, request_id: object = "bad") -> None:
        await anext(backend.generate(request_id, prompt, params))  # type: ignore[arg-type]

    with pytest.raises(EmptyPromptError):
        await first([])
    with pytest.raises(PromptTooLongError):
        await first([1] * (backend.max_prompt_tokens + 1))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        await first([1, backend.n_vocab])
    with pytest.raises(InvalidRequestError):
        await first([1, -3])
    with pytest.raises(InvalidSamplingError):
        await first([1, 2], {"temperature": 0.5})
    with pytest.raises(InvalidSamplingError):
        SamplingParams(temperature=-1.0)
    with pytest.raises(InvalidRequestError):
        await first([1, 2], request_id="")
    for salt in ("s" * 65, 7, "caf\u00e9"):
        with pytest.raises(InvalidRequestError) as info:
            await anext(backend.generate("bad", [1, 2], GREEDY, cache_salt=salt))  # type: ignore[arg-type]
        assert info.value.param == "cache_salt"
    with pytest.raises(InvalidRequestError) as info:
        await backend.propose([1, 2], 0)
    assert info.value.param == "k"
    with pytest.raises(PromptTooLongError):
        await backend.propose([1] * 1020, 8)

    running = backend.generate("dup", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True))
    await anext(running)
    with pytest.raises(DuplicateRequestError):
        await first([1, 2], request_id="dup")
    await backend.abort("dup")
    assert isinstance([e async for e in running][-1], FinishEvent)
    assert backend.ready and backend.stats()["errors"] == 0


async def test_overloaded_when_the_queue_is_full_and_priority_orders_the_queue(small: LlamaCppBackend) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    running = small.generate("r", [1, 2, 3], params, Priority.BATCH)
    await anext(running)
    finished: list[str] = []

    async def queued(request_id: str, priority: Priority) -> list[StreamEvent]:
        events = [e async for e in small.generate(request_id, [1, 2, 3], replace(params, max_tokens=3), priority)]
        finished.append(request_id)
        return events

    batch = asyncio.ensure_future(queued("q-batch", Priority.BATCH))
    realtime = asyncio.ensure_future(queued("q-realtime", Priority.REALTIME))
    await asyncio.sleep(0)  # one loop turn runs both validations; neither can start while "r" holds the slot
    assert small.stats()["open_streams"] == 3
    with pytest.raises(OverloadedError):
        await anext(small.generate("x", [1, 2, 3], params))
    with pytest.raises(InvalidRequestError):
        await anext(small.generate("y", [1, 2, 3], params, 7))  # type: ignore[arg-type]
    await small.abort("r")
    assert isinstance([e async for e in running][-1], FinishEvent)
    await asyncio.gather(batch, realtime)
    assert finished == ["q-realtime", "q-batch"]  # the realtime turn jumped the earlier batch one


async def test_abort_while_waiting(small: LlamaCppBackend) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    running = small.generate("r", [1, 2, 3], params)
    await anext(running)
    waiting = small.generate("w", [1, 2, 3], params)
    first = asyncio.ensure_future(anext(waiting))
    await asyncio.sleep(0)
    await small.abort("w")
    event = await first
    assert isinstance(event, FinishEvent) and event.reason == "abort" and event.completion_tokens == 0
    await small.abort("r")
    assert isinstance([e async for e in running][-1], FinishEvent)


async def test_a_failing_step_fails_only_its_requests(small: LlamaCppBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise FloatingPointError("injected")

    monkeypatch.setattr(worker_module, "sample", broken)
    tokens, finish = await collect(small, "doomed", [1, 2, 3])
    assert tokens == [] and finish.reason == "error" and "injected" not in finish.message
    assert (await small.kv_pos_max()) == [-1, -1]  # a failed request's KV is never kept
    monkeypatch.undo()
    tokens, finish = await collect(small, "fine", [1, 2, 3])
    assert len(tokens) == GREEDY.max_tokens and finish.reason == "length"
    assert (await no_orphan_kv(small))["running"] == {}


async def test_sequence_stops_at_its_context(small: LlamaCppBackend) -> None:
    # 256 cells per stream here (512 over 2 streams): a 250-token prompt leaves room for 6 more.
    assert small.n_ctx_seq == 256
    tokens, finish = await collect(small, "full", [1] + [28] * 249,
                                   SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    assert finish.reason == "length" and len(tokens) == 256 - 250 + 1


async def test_unified_kv_lets_one_sequence_use_the_whole_context() -> None:
    engine = LlamaCppBackend(default_gguf_path(), EdgeConfig(kv_cache_mib=11.25, n_seq_max=2))
    try:
        assert engine.n_ctx_seq == 512 and engine.max_prompt_tokens == 511
        tokens, finish = await collect(engine, "long", [1] + [28] * 399,
                                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert len(tokens) == 4 and finish.reason == "length"
    finally:
        await engine.close()
    assert not engine.ready
    with pytest.raises(EngineUnavailableError):
        await anext(engine.generate("late", [1, 2], GREEDY))


def test_garbage_model_file_is_a_typed_error(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all, just text" * 4)
    with pytest.raises(ModelFileError):
        LlamaCppBackend(bad)
    with pytest.raises(ModelFileError):
        LlamaCppBackend(tmp_path / "missing.gguf")
