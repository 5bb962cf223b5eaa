"""A caller's draft of the output's first tokens (the cascade's held edge tokens) is verified in
the prompt's own last pass: the prefix the target agrees with streams with the first token, and
the output stays exactly what the target would generate alone (greedy, float32)."""

from __future__ import annotations

from dataclasses import replace

import msgpack
import pytest
from test_exactness import ALONE, BATCHED, make_prompts, run_batched
from tiny_engine import clear_greedy_reference, write_tiny_model

from engine_gpu.engine import LLMEngine
from engine_gpu.protocol import AddRequest, ProtocolError, decode_client_message, encode_frame
from llm_shared.contract import MAX_PREFIX_DRAFT_TOKENS, Priority, SamplingParams
from llm_shared.errors import InvalidRequestError
from llm_shared.models import ModelConfig

MAX_TOKENS = 24


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def model_cfg(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-prefix-drafts"), seed=7)


@pytest.fixture(scope="module")
def plain(model_cfg: ModelConfig) -> list[list[int]]:
    prompts, _ = make_prompts()
    return clear_greedy_reference(LLMEngine.from_config(model_cfg, ALONE), prompts[:6], [greedy()] * 6)


def first_step_tokens(engine: LLMEngine, rid: str) -> list[int]:
    """Token ids the request emitted in the first step that emitted any."""
    while True:
        for out in engine.step():
            if out.request_id == rid and out.tokens:
                return [t.token_id for t in out.tokens]


def finish(engine: LLMEngine, rid: str, first: list[int]) -> list[int]:
    tokens = list(first)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens += [t.token_id for t in out.tokens]
    return tokens


@pytest.mark.parametrize("wrong_at", [0, 3, None])
def test_the_agreed_prefix_streams_with_the_first_token(model_cfg: ModelConfig, plain: list[list[int]],
                                                        wrong_at: int | None) -> None:
    prompts, _ = make_prompts()
    engine = LLMEngine.from_config(model_cfg, ALONE)  # no speculator: the drafts come from the caller
    for i, prompt in enumerate(prompts[:6]):
        drafts = list(plain[i][:8])
        if wrong_at is not None:
            drafts[wrong_at] = 4 if drafts[wrong_at] != 4 else 5
        engine.add_request(f"r{i}", prompt, greedy(), draft_ids=drafts)
        first = first_step_tokens(engine, f"r{i}")
        agreed = 8 if wrong_at is None else wrong_at
        assert first == plain[i][: agreed + 1]  # the agreed drafts, then the target's own next token
        assert finish(engine, f"r{i}", first) == plain[i]
    stats = engine.stats()
    assert stats["spec_draft_tokens"] == 6 * 8
    assert stats["spec_accepted_tokens"] == 6 * (8 if wrong_at is None else wrong_at)
    assert stats["kv_blocks_in_use"] == 0


def test_drafts_ride_with_the_last_chunk_of_a_chunked_batched_prefill(model_cfg: ModelConfig,
                                                                       plain: list[list[int]]) -> None:
    """A 32-token budget splits the long prompts; other requests decode meanwhile; prefix hits.
    Drafts that a capped chunk leaves out are dropped (the output is the same either way)."""
    prompts, _ = make_prompts()
    engine = LLMEngine.from_config(model_cfg, BATCHED)
    add = engine.add_request

    def add_with_drafts(rid, prompt, params, *args):  # type: ignore[no-untyped-def]
        n = int(rid.rsplit("-", 1)[-1])
        add(rid, prompt, params, *args, draft_ids=plain[n][:6] if n % 2 == 0 else [])

    engine.add_request = add_with_drafts  # type: ignore[method-assign]
    assert run_batched(engine, prompts[:6], [greedy()] * 6) == plain
    stats = engine.stats()
    assert 0 < stats["spec_accepted_tokens"] <= 3 * 6 and stats["kv_blocks_in_use"] == 0


def test_drafts_never_push_the_output_past_max_tokens(model_cfg: ModelConfig, plain: list[list[int]]) -> None:
    prompts, _ = make_prompts()
    engine = LLMEngine.from_config(model_cfg, ALONE)
    engine.add_request("short", prompts[0], greedy(3), draft_ids=plain[0][:8])
    assert finish(engine, "short", []) == plain[0][:3]


def test_bad_drafts_are_refused_naming_the_field(model_cfg: ModelConfig) -> None:
    prompts, _ = make_prompts()
    engine = LLMEngine.from_config(model_cfg, ALONE)
    for drafts in ([engine.vocab_size], [-1], ["a"], [5] * (MAX_PREFIX_DRAFT_TOKENS + 1)):
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("bad", prompts[0], greedy(), draft_ids=drafts)
        assert e.value.param == "draft_ids"
    assert not engine.has_unfinished()


def test_drafts_cross_the_core_socket_bounded() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8)
    frame = encode_frame(AddRequest("r1", [5, 6], params, Priority.REALTIME, [7, 8, 9]))
    msg = decode_client_message(frame[4:])
    assert isinstance(msg, AddRequest) and msg.draft_ids == [7, 8, 9]
    plain_msg = decode_client_message(encode_frame(AddRequest("r2", [5], params, Priority.REALTIME))[4:])
    assert isinstance(plain_msg, AddRequest) and plain_msg.draft_ids == []
    raw = msgpack.unpackb(frame[4:])
    for bad in ([1] * (MAX_PREFIX_DRAFT_TOKENS + 1), "abc", [True], [-3]):
        with pytest.raises(ProtocolError) as e:
            decode_client_message(msgpack.packb({**raw, "draft": bad}))
        assert e.value.param == "draft" and e.value.request_id == "r1"


def test_a_preempted_request_drops_its_drafts_and_still_matches(model_cfg: ModelConfig,
                                                                plain: list[list[int]]) -> None:
    prompts, _ = make_prompts()
    engine = LLMEngine.from_config(model_cfg, replace(BATCHED, num_blocks=12, enable_prefix_caching=False))
    for i in range(6):
        engine.add_request(f"q{i}", prompts[i], greedy(), draft_ids=plain[i][:5])
    got: dict[str, list[int]] = {f"q{i}": [] for i in range(6)}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += [t.token_id for t in out.tokens]
        engine.scheduler.check_invariants()
    assert [got[f"q{i}"] for i in range(6)] == plain
    assert engine.stats()["preemptions"] > 0 and engine.stats()["kv_blocks_in_use"] == 0
