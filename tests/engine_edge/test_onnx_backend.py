"""The ONNX Runtime edge backend: greedy output equal to the torch model's, batching of
sequences of different lengths, cancellation, drafting with prefix reuse, and bad inputs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from onnx_tiny import VOCAB, tiny_export, tiny_tokenizer, torch_greedy

from engine_edge.config import EdgeConfig
from engine_edge.onnx_backend import BATCH_TOKENS, OnnxBackend
from engine_edge.sampling import log_softmax
from llm_shared.contract import FinishEvent, SamplingParams, TokenEvent
from llm_shared.errors import (
    ConfigError,
    DuplicateRequestError,
    EmptyPromptError,
    EngineUnavailableError,
    InvalidRequestError,
    InvalidSamplingError,
    ModelFileError,
    OverloadedError,
    PromptTooLongError,
)
from llm_shared.llama.loader import load_gguf
from llm_shared.llama.model import LlamaModel

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, LlamaModel]:
    gguf, result = tiny_export(tmp_path_factory.getbasetemp() / "onnx-tiny")
    return gguf, result.onnx_path, load_gguf(gguf, dtype=torch.float32)


def make_backend(tiny: tuple[Path, Path, LlamaModel], **kwargs: Any) -> OnnxBackend:
    gguf, onnx_path, _ = tiny
    tokenizer = kwargs.pop("tokenizer", None) or tiny_tokenizer()
    limits: dict[str, Any] = {"kv_cache_mib": 1, "n_seq_max": 4, "n_threads": 1, "max_queued": 2, **kwargs}
    return OnnxBackend(gguf, EdgeConfig(backend="onnx", **limits), onnx_path=onnx_path, tokenizer=tokenizer)


@pytest.fixture
async def backend(tiny: tuple[Path, Path, LlamaModel]) -> AsyncIterator[OnnxBackend]:
    b = make_backend(tiny)
    yield b
    await b.close()


async def collect(
    backend: OnnxBackend, request_id: str, prompt: Sequence[int], params: SamplingParams = GREEDY
) -> tuple[list[TokenEvent], FinishEvent]:
    tokens: list[TokenEvent] = []
    async for event in backend.generate(request_id, prompt, params):
        if isinstance(event, FinishEvent):
            return tokens, event
        tokens.append(event)
    raise AssertionError("stream ended without a FinishEvent")


def prompt_of(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, VOCAB - 1, n)]


async def test_concurrent_greedy_equals_torch_token_for_token(backend: OnnxBackend, tiny: tuple) -> None:
    model = tiny[2]
    prompts = [prompt_of(5, 1), prompt_of(17, 2), prompt_of(2, 3), prompt_of(40, 4)]
    results = await asyncio.gather(*(collect(backend, f"r{i}", p) for i, p in enumerate(prompts)))
    for prompt, (tokens, finish) in zip(prompts, results, strict=True):
        assert [t.token_id for t in tokens] == torch_greedy(model, prompt, GREEDY.max_tokens)
        assert (finish.reason, finish.prompt_tokens, finish.completion_tokens) == ("length", len(prompt), 24)
        assert finish.tier == "edge"
    stats = backend.stats()
    assert stats["tokens_generated"] == 4 * 24
    assert stats["steps"] < 2 * 24  # sequences decoded together, not one after another


async def test_logprobs_are_the_models_own(backend: OnnxBackend, tiny: tuple) -> None:
    model, prompt = tiny[2], prompt_of(9, 5)
    tokens, _ = await collect(backend, "lp", prompt, SamplingParams(temperature=0.0, max_tokens=3, logprobs=2,
                                                                   ignore_eos=True))
    with torch.inference_mode():
        logits = model.forward_contiguous(torch.tensor([prompt]))[0][0, -1].numpy()
    want = log_softmax(logits)
    first = tokens[0]
    assert first.logprob == pytest.approx(float(want.max()), abs=1e-4)
    assert [t for t, _ in first.top_logprobs] == list(np.argsort(-want)[:2])


async def test_prompt_longer_than_one_batch_is_prefilled_in_chunks(backend: OnnxBackend, tiny: tuple) -> None:
    prompt = prompt_of(BATCH_TOKENS + 70, 6)
    other = prompt_of(12, 7)
    (long_tokens, _), (short_tokens, _) = await asyncio.gather(
        collect(backend, "long", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)),
        collect(backend, "short", other),
    )
    assert [t.token_id for t in long_tokens] == torch_greedy(tiny[2], prompt, 6)
    assert [t.token_id for t in short_tokens] == torch_greedy(tiny[2], other, GREEDY.max_tokens)


async def test_stop_token_and_eos_end_the_stream(backend: OnnxBackend, tiny: tuple) -> None:
    prompt = prompt_of(8, 8)
    expected = torch_greedy(tiny[2], prompt, 10)
    stop = expected[3]
    tokens, finish = await collect(backend, "s", prompt, SamplingParams(temperature=0.0, max_tokens=10,
                                                                        stop_token_ids=(stop,), ignore_eos=True))
    cut = expected.index(stop)
    assert [t.token_id for t in tokens] == expected[:cut]
    assert (finish.reason, finish.completion_tokens) == ("stop", cut)

    eos_backend = make_backend(tiny, tokenizer=tiny_tokenizer(eos=stop))
    try:
        tokens, finish = await collect(eos_backend, "eos", prompt, SamplingParams(temperature=0.0, max_tokens=10))
        assert [t.token_id for t in tokens] == expected[:cut] and finish.reason == "stop"
        tokens, finish = await collect(eos_backend, "no-eos", prompt, SamplingParams(
            temperature=0.0, max_tokens=10, ignore_eos=True))
        assert [t.token_id for t in tokens] == expected and finish.reason == "length"
    finally:
        await eos_backend.close()


async def test_seeded_sampling_does_not_depend_on_the_batch(backend: OnnxBackend) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=16, ignore_eos=True)
    alone, _ = await collect(backend, "alone", prompt_of(6, 9), params)
    together, _ = (await asyncio.gather(collect(backend, "t1", prompt_of(6, 9), params),
                                        collect(backend, "t2", prompt_of(30, 10), params)))[0]
    assert [t.token_id for t in alone] == [t.token_id for t in together]


async def test_abort_ends_the_stream_within_a_step_and_frees_kv(backend: OnnxBackend) -> None:
    stream = backend.generate("a", prompt_of(10, 11), SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    first = await anext(stream)
    assert isinstance(first, TokenEvent)
    await backend.abort("a")
    state = await backend.kv_state()
    assert state["running"] == {} and state["held"] == state["cached"]  # kept only as cache
    rest = [event async for event in stream]
    finish = rest[-1]
    assert isinstance(finish, FinishEvent) and finish.reason == "abort"
    assert all(isinstance(e, TokenEvent) for e in rest[:-1])
    assert finish.completion_tokens == 1 + len(rest) - 1 < 400  # nothing generated after the abort
    await backend.abort("a")  # idempotent
    await backend.abort("never-existed")


async def test_consumer_leaving_frees_the_sequence(backend: OnnxBackend) -> None:
    stream = backend.generate("gone", prompt_of(10, 12), SamplingParams(temperature=0.0, max_tokens=300))
    async for _ in stream:
        break
    await stream.aclose()
    state = await backend.kv_state()
    assert state["running"] == {} and state["held"] == state["cached"]
    tokens, _ = await collect(backend, "gone", prompt_of(4, 13))  # the id is free again
    assert len(tokens) == GREEDY.max_tokens


async def test_propose_drafts_greedy_tokens_and_reuses_the_prefix(backend: OnnxBackend, tiny: tuple) -> None:
    model = tiny[2]
    context = prompt_of(20, 14)
    first = await backend.propose(context, 4)
    assert list(first.token_ids) == torch_greedy(model, context, 4)
    assert first.reused_tokens == 0 and all(0.0 < p <= 1.0 for p in first.probs)
    extended = [*context, *first.token_ids[:2], 5]
    second = await backend.propose(extended, 3)
    assert second.reused_tokens == len(context) + 2
    assert list(second.token_ids) == torch_greedy(model, extended, 3)
    shorter = context[:12]
    third = await backend.propose(shorter, 2)
    assert third.reused_tokens == 11 and list(third.token_ids) == torch_greedy(model, shorter, 2)


async def test_propose_while_generating(backend: OnnxBackend, tiny: tuple) -> None:
    model, prompt, context = tiny[2], prompt_of(7, 15), prompt_of(25, 16)
    (tokens, _), draft = await asyncio.gather(collect(backend, "g", prompt), backend.propose(context, 5))
    assert [t.token_id for t in tokens] == torch_greedy(model, prompt, GREEDY.max_tokens)
    assert list(draft.token_ids) == torch_greedy(model, context, 5)


async def test_bad_requests_raise_typed_errors(backend: OnnxBackend) -> None:
    async def first_event(request_id: str, prompt: object, params: object = GREEDY) -> None:
        await anext(backend.generate(request_id, prompt, params))  # type: ignore[arg-type]

    with pytest.raises(EmptyPromptError):
        await first_event("e", [])
    with pytest.raises(PromptTooLongError):
        await first_event("l", [1] * backend.n_ctx_seq)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary") as bad_id:
        await first_event("v", [1, VOCAB])
    assert bad_id.value.param == "prompt"
    with pytest.raises(InvalidRequestError):
        await first_event("n", [1, -1])
    with pytest.raises(InvalidRequestError, match="request_id"):
        await first_event("", [1])
    with pytest.raises(InvalidSamplingError):
        await first_event("p", [1], {"temperature": 0})
    with pytest.raises(InvalidRequestError, match="k must be"):
        await backend.propose([1, 2], 0)
    with pytest.raises(EmptyPromptError):
        await backend.propose([], 2)
    running = backend.generate("dup", [1, 2], SamplingParams(max_tokens=200, ignore_eos=True))
    await anext(running)
    with pytest.raises(DuplicateRequestError):
        await first_event("dup", [3])
    await running.aclose()


async def test_overload_is_refused(tiny: tuple) -> None:
    backend = make_backend(tiny, n_seq_max=1, max_queued=0)
    try:
        running = backend.generate("one", [1, 2], SamplingParams(max_tokens=200, ignore_eos=True))
        await anext(running)
        with pytest.raises(OverloadedError):
            await anext(backend.generate("two", [3], GREEDY))
        await running.aclose()
    finally:
        await backend.close()


async def test_closed_backend_refuses_work(tiny: tuple) -> None:
    backend = make_backend(tiny)
    assert backend.ready
    await backend.close()
    assert not backend.ready
    with pytest.raises(EngineUnavailableError):
        await anext(backend.generate("x", [1], GREEDY))
    with pytest.raises(EngineUnavailableError):
        await backend.propose([1], 1)
    await backend.close()  # idempotent


def test_construction_checks_its_inputs(tiny: tuple, tmp_path: Path) -> None:
    gguf, onnx_path, _ = tiny
    with pytest.raises(ConfigError, match="same model"):
        OnnxBackend(gguf, onnx_path=onnx_path, tokenizer=tiny_tokenizer(VOCAB + 4))
    with pytest.raises(ModelFileError, match="does not exist"):
        OnnxBackend(gguf, onnx_path=tmp_path / "missing.onnx", tokenizer=tiny_tokenizer())
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x08\x07 definitely not a protobuf graph")
    with pytest.raises(ModelFileError, match="cannot load"):
        OnnxBackend(gguf, onnx_path=garbage, tokenizer=tiny_tokenizer())
    with pytest.raises(ConfigError, match=r"kv_cache_mib = 0\.01 holds 20 KV cells"):
        make_backend(tiny, kv_cache_mib=0.01)  # 512 bytes a cell of the tiny model
    with pytest.raises(ConfigError, match="n_seq_max"):
        make_backend(tiny, n_seq_max=0)


async def test_context_is_capped_by_the_trained_length(tiny: tuple) -> None:
    backend = make_backend(tiny, kv_cache_mib=2)
    try:
        assert backend.n_ctx_seq == 512 and backend.max_prompt_tokens == 511  # tiny_config's context
    finally:
        await backend.close()


@pytest.mark.slow
@pytest.mark.model
async def test_real_model_greedy_equals_torch() -> None:
    """SmolLM2-135M: the export is cached (a second lookup is quick) and greedy matches torch."""
    from engine_edge.export_onnx import ensure_onnx
    from llm_shared.modelfile import default_gguf_path
    from llm_shared.tokenizer import Tokenizer

    gguf = default_gguf_path()
    ensure_onnx(gguf)  # exports once (~1 min), then cached
    started = time.perf_counter()
    assert ensure_onnx(gguf).cached
    assert time.perf_counter() - started < 10
    model = load_gguf(gguf, dtype=torch.float32)
    tokenizer = Tokenizer.from_gguf(gguf)
    backend = OnnxBackend(gguf, EdgeConfig(backend="onnx", kv_cache_mib=192, n_seq_max=4))
    try:
        prompts = [
            tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}]),
            tokenizer.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}]),
            tokenizer.encode("def fibonacci(n):"),
        ]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        results = await asyncio.gather(*(collect(backend, f"m{i}", p, params) for i, p in enumerate(prompts)))
        for prompt, (tokens, _) in zip(prompts, results, strict=True):
            assert [t.token_id for t in tokens] == torch_greedy(model, prompt, 24)
    finally:
        await backend.close()
