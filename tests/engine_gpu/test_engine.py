"""LLMEngine in process on a tiny random checkpoint (float32): streaming, text, stop conditions,
usage, abort, admission errors, prefix-cache accounting and stats."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tiny_engine import write_tiny_model

from engine_gpu.config import EngineConfig
from engine_gpu.engine import LLMEngine
from engine_gpu.outputs import RequestOutput
from llm_shared import errors
from llm_shared.contract import FinishEvent, Priority, SamplingParams, TokenEvent
from llm_shared.models import ModelConfig

CONFIG = EngineConfig(dtype="float32", block_size=16, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=8,
                      threads=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def model_cfg(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def engine(model_cfg: ModelConfig) -> LLMEngine:
    return LLMEngine.from_config(model_cfg, CONFIG)


def prompt(n: int, offset: int = 0) -> list[int]:
    return [3 + (7 * i + offset) % 90 for i in range(n)]


def run(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def events(outs: list[RequestOutput]) -> tuple[list[TokenEvent], FinishEvent]:
    tokens = [t for o in outs for t in o.tokens]
    finishes = [o.finish for o in outs if o.finish is not None]
    assert len(finishes) == 1 and outs[-1].finish is finishes[0], "exactly one finish, on the last output"
    return tokens, finishes[0]


def test_streams_tokens_text_and_usage(engine: LLMEngine) -> None:
    engine.add_request("a", prompt(40), replace(GREEDY, logprobs=3))
    tokens, finish = events(run(engine)["a"])
    ids = [t.token_id for t in tokens]
    assert len(ids) == 12
    assert "".join(t.text for t in tokens) + finish.text == engine.tokenizer.decode(ids, skip_special=True)
    assert (finish.reason, finish.prompt_tokens, finish.completion_tokens, finish.tier) == ("length", 40, 12, "gpu")
    for t in tokens:  # greedy: the chosen token is the best alternative
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0] == (t.token_id, t.logprob) and t.logprob <= 0
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == stats["kv_blocks_in_use"] == 0
    assert stats["steps"] >= 12 and stats["step_time_ms"] > 0 and stats["generated_tokens"] == 12


def test_stop_string_ends_the_stream_before_it(engine: LLMEngine) -> None:
    engine.add_request("ref", prompt(30), replace(GREEDY, max_tokens=20))
    ref_tokens, _ = events(run(engine)["ref"])
    text = "".join(t.text for t in ref_tokens)
    stop = text[6:8]
    engine.add_request("s", prompt(30), replace(GREEDY, max_tokens=20, stop=(stop,)))
    tokens, finish = events(run(engine)["s"])
    assert finish.reason == "stop"
    assert "".join(t.text for t in tokens) + finish.text == text[: text.index(stop)]
    assert finish.completion_tokens == len(tokens) < 20
    assert engine.stats()["kv_blocks_in_use"] == 0


def test_stop_token_is_counted_but_not_streamed(engine: LLMEngine) -> None:
    ref = engine.generate([prompt(30, 5)], replace(GREEDY, max_tokens=20))[0]
    stop_id = ref[4]
    engine.add_request("t", prompt(30, 5), replace(GREEDY, max_tokens=20, stop_token_ids=(stop_id,)))
    tokens, finish = events(run(engine)["t"])
    first = ref.index(stop_id)
    assert [t.token_id for t in tokens] == ref[:first]
    assert (finish.reason, finish.completion_tokens) == ("stop", first + 1)


def test_abort_frees_blocks_at_once(engine: LLMEngine) -> None:
    engine.add_request("x", prompt(100), replace(GREEDY, max_tokens=200))
    engine.add_request("y", prompt(20, 1), replace(GREEDY, max_tokens=200))
    for _ in range(4):
        engine.step()
    assert engine.stats()["kv_blocks_in_use"] > 0
    out = engine.abort_request("x")
    assert out is not None and out.finish is not None
    assert (out.finish.reason, out.finish.prompt_tokens) == ("abort", 100)
    assert engine.abort_request("x") is None  # idempotent
    engine.abort_request("y")
    stats = engine.stats()
    assert stats["kv_blocks_in_use"] == 0 and stats["running"] == 0 and not engine.has_unfinished()


def test_prefix_hits_are_reported_in_usage_and_stats(engine: LLMEngine) -> None:
    shared = prompt(48)
    engine.add_request("first", [*shared, 5, 6, 7], GREEDY)
    run(engine)
    engine.add_request("second", [*shared, 9, 9], GREEDY)
    _, finish = events(run(engine)["second"])
    assert finish.cached_tokens == 48
    stats = engine.stats()
    assert stats["prefix_cache_hits"] == 48 and stats["prefix_cache_queries"] == 51 + 50
    assert stats["kv_blocks_cached"] > 0 and stats["kv_blocks_in_use"] == 0


@pytest.mark.parametrize(
    ("prompt_ids", "params", "error"),
    [
        ([], GREEDY, errors.EmptyPromptError),
        ([3, 96], GREEDY, errors.InvalidRequestError),  # vocab is 96
        (prompt(500), replace(GREEDY, max_tokens=20), errors.PromptTooLongError),  # the model has 512 positions
    ],
)
def test_bad_requests_raise_typed_errors(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams,
                                         error: type[Exception]) -> None:
    with pytest.raises(error):
        engine.add_request("bad", prompt_ids, params)
    assert not engine.has_unfinished()


def test_checked_requests_still_meet_the_engines_limits(engine: LLMEngine) -> None:
    """The core's path skips the field checks its socket decoder made, not the engine's limits."""
    with pytest.raises(errors.InvalidRequestError, match="vocabulary"):
        engine.add_checked_request("bad", [3, 96], GREEDY, Priority.INTERACTIVE)
    with pytest.raises(errors.PromptTooLongError):
        engine.add_checked_request("long", prompt(500), replace(GREEDY, max_tokens=20), Priority.INTERACTIVE)
    assert not engine.has_unfinished()
    engine.add_checked_request("ok", prompt(10), GREEDY, Priority.INTERACTIVE)
    with pytest.raises(errors.DuplicateRequestError):
        engine.add_checked_request("ok", prompt(10), GREEDY, Priority.INTERACTIVE)
    _, finish = events(run(engine)["ok"])
    assert finish.reason == "length" and finish.prompt_tokens == 10


def test_duplicate_and_overload(model_cfg: ModelConfig) -> None:
    engine = LLMEngine.from_config(model_cfg, replace(CONFIG, max_waiting=1))
    engine.add_request("a", prompt(10), GREEDY)
    with pytest.raises(errors.DuplicateRequestError):
        engine.add_request("a", prompt(10), GREEDY)
    with pytest.raises(errors.OverloadedError):
        engine.add_request("b", prompt(10), GREEDY)


def test_max_model_len_is_capped_by_the_model(engine: LLMEngine) -> None:
    assert engine.max_model_len == 512 and engine.info()["max_model_len"] == 512
    assert engine.info()["vocab_size"] == 96 and engine.info()["eos_id"] == 2


def test_batch_outputs_match_single_runs(engine: LLMEngine) -> None:
    prompts = [prompt(10 + 13 * i, i) for i in range(6)]
    alone = [engine.generate([p], GREEDY, prefix=f"alone{i}")[0] for i, p in enumerate(prompts)]
    assert engine.generate(prompts, GREEDY) == alone
