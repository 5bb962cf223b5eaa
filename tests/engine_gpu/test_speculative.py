"""Speculative decoding in the torch engine: verification is exact (greedy output token for token,
sampled output in distribution), blocks of rejected drafts go back at once, and the engine drafts
where the step's price says it pays and nowhere else (the controller's own rules:
test_spec_controller.py).

Exactness runs in float32: bfloat16 rounds a 1-token and a k-token forward differently."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from sched_fakes import Driver, reference_output
from test_exactness import ALONE, BATCHED, greedy_params, make_prompts, run_batched
from tiny_engine import clear_greedy_reference, write_tiny_model

from engine_gpu.config import EngineConfig, SpeculativeConfig
from engine_gpu.engine import LLMEngine
from engine_gpu.runner import ModelRunner
from engine_gpu.scheduler import Scheduler
from engine_gpu.speculative.drafter import Draft, DraftRequest
from engine_gpu.speculative.ngram import NgramDrafter
from engine_gpu.speculative.speculator import Speculator
from engine_gpu.speculative.verify import accept
from llm_shared.contract import SamplingParams
from llm_shared.models import ModelConfig, tokenizer_for

NGRAM = SpeculativeConfig(method="ngram", num_draft_tokens=4, adaptive=False, max_batch=16, ngram_min=1, ngram_max=3)
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model_cfg(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-spec"), seed=3)


@pytest.fixture(scope="module")
def plain(model_cfg: ModelConfig) -> list[list[int]]:
    """Greedy without speculation, each prompt alone; every pick clear of float32 rounding, so that
    verifying several tokens in one forward must give the same tokens on every CPU."""
    prompts, max_tokens = make_prompts()
    return clear_greedy_reference(LLMEngine.from_config(model_cfg, ALONE), prompts, greedy_params(max_tokens))


# ---- greedy exactness through the whole engine -----------------------------------------------

def test_ngram_speculation_alone_equals_plain_greedy(model_cfg: ModelConfig, plain: list[list[int]]) -> None:
    engine = LLMEngine.from_config(model_cfg, replace(ALONE, speculative=NGRAM))
    prompts, max_tokens = make_prompts()
    got = [engine.generate([p], q, prefix=f"s{i}")[0]
           for i, (p, q) in enumerate(zip(prompts, greedy_params(max_tokens), strict=True))]
    assert got == plain
    stats = engine.stats()
    assert stats["spec_draft_tokens"] > 0 and 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert stats["kv_blocks_in_use"] == 0 and stats["drafter_requests"] == 0  # every request released


def test_ngram_speculation_batched_with_chunks_prefix_hits_and_preemption(model_cfg: ModelConfig,
                                                                         plain: list[list[int]]) -> None:
    engine = LLMEngine.from_config(model_cfg, replace(BATCHED, num_blocks=24, speculative=NGRAM))
    prompts, max_tokens = make_prompts()
    assert run_batched(engine, prompts, greedy_params(max_tokens)) == plain
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["spec_accepted_tokens"] > 0
    assert stats["kv_blocks_in_use"] == 0


def test_limits_and_stops_are_kept_with_speculation(model_cfg: ModelConfig) -> None:
    """No token past max_tokens or a stop token is ever emitted, drafts or not."""
    prompts, _ = make_prompts()
    plain_engine = LLMEngine.from_config(model_cfg, ALONE)
    spec_engine = LLMEngine.from_config(model_cfg, replace(ALONE, speculative=NGRAM))
    for i, prompt in enumerate(prompts[:6]):
        full = plain_engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                                     prefix=f"f{i}")[0]
        stop = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=(full[7],))
        cut = full[: full.index(full[7])]
        assert spec_engine.generate([prompt], stop, prefix=f"stop{i}")[0] == cut
        short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        assert spec_engine.generate([prompt], short, prefix=f"short{i}")[0] == full[:3]


def test_seeded_sampling_with_speculation_is_reproducible(model_cfg: ModelConfig) -> None:
    prompts, max_tokens = make_prompts()
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=7 + i, max_tokens=n, ignore_eos=True)
              for i, n in enumerate(max_tokens)]
    first = LLMEngine.from_config(model_cfg, replace(ALONE, speculative=NGRAM))
    again = LLMEngine.from_config(model_cfg, replace(BATCHED, speculative=NGRAM))
    alone = [first.generate([p], q, prefix=f"a{i}")[0] for i, (p, q) in enumerate(zip(prompts, params, strict=True))]
    assert run_batched(again, prompts, params) == alone


def test_abort_during_verification_frees_everything(model_cfg: ModelConfig) -> None:
    """An abort that lands while a step verifies a request's drafts (here: from inside the runner's
    forward) frees its blocks and its drafter state; the step's result for it is dropped."""
    engine = LLMEngine.from_config(model_cfg, replace(BATCHED, speculative=NGRAM))
    prompts, _ = make_prompts()
    for i, prompt in enumerate(prompts[:8]):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    launch = engine.runner.launch
    aborted: list[str] = []

    def launch_then_abort(batch, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = launch(batch, *args, **kwargs)
        verifying = [item.request_id for item in batch if item.num_draft_tokens]
        if verifying and len(aborted) < 3:
            engine.abort_request(verifying[0])
            aborted.append(verifying[0])
        return out

    engine.runner.launch = launch_then_abort  # type: ignore[method-assign]
    while engine.has_unfinished():
        outputs = engine.step()
        assert not {o.request_id for o in outputs} & set(aborted[:-1])  # nothing streams after an abort
        engine.scheduler.check_invariants()
    assert len(aborted) == 3
    stats = engine.stats()
    assert stats["kv_blocks_in_use"] == 0 and stats["running"] == 0 and stats["drafter_requests"] == 0


# ---- each step priced: the engine drafts where it pays, and only there --------------------------

class ScriptedDrafter:
    """Drafts the plain run's own next tokens (always accepted) and reports each forward at a set
    cost: what the controller sees of a perfect drafter that is cheap, or one that is ruinous."""

    name = "scripted"

    def __init__(self, prompts: list[list[int]], plain: list[list[int]], forward_s: float) -> None:
        self.truth = {tuple(p): out for p, out in zip(prompts, plain, strict=True)}
        self.forward_s = forward_s
        self.calls = 0
        self.last_forwards: list[tuple[int, float]] = []

    def propose(self, requests):  # type: ignore[no-untyped-def]
        self.calls += 1
        out = {}
        for req in requests:
            prompt, ahead = next((p, o) for p, o in self.truth.items() if tuple(req.token_ids[: len(p)]) == p)
            done = len(req.token_ids) - len(prompt)
            out[req.request_id] = Draft(ahead[done : done + req.k], None)
        self.last_forwards = [(len(requests), self.forward_s)] * max(r.k for r in requests)
        return out

    def behind(self, request_id: str, token_ids: list[int]) -> int:
        return 0

    def calibrate(self) -> list[tuple[int, float]]:
        return [(1, self.forward_s), (64, self.forward_s)]

    def release(self, request_id: str) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("forward_s", [1e-7, 10.0])
def test_the_engine_drafts_where_the_price_says_it_pays_and_nowhere_else(
        model_cfg: ModelConfig, plain: list[list[int]], forward_s: float) -> None:
    prompts, max_tokens = make_prompts()
    config = replace(BATCHED, speculative=SpeculativeConfig(method="ngram", max_batch=16))  # adaptive
    drafter = ScriptedDrafter(prompts, plain, forward_s)
    engine = LLMEngine(ModelRunner.from_config(model_cfg, config), tokenizer_for(model_cfg), config,
                       speculator=Speculator(config.speculative, drafter))
    assert run_batched(engine, prompts, greedy_params(max_tokens)) == plain
    stats = engine.stats()
    if forward_s < 1e-3:  # drafting is free and always right: every decoding step drafts
        assert drafter.calls > 0 and stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0
        assert stats["spec_predicted_gain"] > 1
    else:  # 10 s a draft forward: priced out before a single one is asked for
        assert drafter.calls == 0 and stats["spec_draft_tokens"] == 0 and stats["spec_off_by_gain"] > 0


# ---- block accounting under random drafts and aborts -----------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_random_drafts_and_aborts_keep_block_accounting_exact(seed: int) -> None:
    rng = random.Random(seed)
    config = EngineConfig(block_size=8, num_blocks=24, max_num_batched_tokens=24, max_num_seqs=6,
                          long_prefill_threshold=6, max_model_len=256)
    sched = Scheduler(config, config.num_blocks, eos_token_id=None)
    driver = Driver(sched)
    prompts = {f"r{i}": [rng.randrange(3, 90) for _ in range(rng.randrange(2, 30))] for i in range(14)}
    limits = {rid: rng.randrange(1, 30) for rid in prompts}
    for rid, prompt in prompts.items():
        sched.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=limits[rid]))
    aborted: set[str] = set()
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        for seq in sched.decoding():  # drafts: a correct prefix of random length, then noise
            truth = reference_output(prompts[seq.request_id], limits[seq.request_id] + 8)
            done = len(seq.output_ids)
            right = rng.randrange(0, 5)
            drafts = truth[done : done + right] + [rng.randrange(100, 1000) for _ in range(rng.randrange(0, 3))]
            sched.set_draft_tokens(seq.request_id, drafts)
        plan = sched.schedule()
        if plan.scheduled and rng.random() < 0.15:  # abort between scheduling and the result
            victim = rng.choice(plan.scheduled).request_id
            sched.abort_request(victim)
            aborted.add(victim)
        for update in sched.update_from_output(plan, driver.model.execute(plan)):
            driver.outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
        sched.check_invariants()
        for seq in sched._running.values():  # nothing held past the accepted tokens
            assert len(seq.block_table) <= max(sched.block_manager.blocks_for(seq.num_tokens), seq.num_published_blocks)
    assert not sched.has_unfinished()
    assert sched.block_manager.num_used_blocks == 0
    assert 0 < sched.stats().spec_accepted_tokens < sched.stats().spec_draft_tokens
    for rid, prompt in prompts.items():
        if rid not in aborted:
            assert driver.outputs[rid] == reference_output(prompt, limits[rid])


def test_blocks_only_rejected_drafts_reached_go_back_at_once() -> None:
    config = EngineConfig(block_size=8, num_blocks=8, max_num_batched_tokens=64, max_num_seqs=2)
    sched = Scheduler(config, config.num_blocks, eos_token_id=None)
    driver = Driver(sched)
    prompt = list(range(10, 16))  # 6 tokens, then the first output: 7 positions, one block
    sched.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=20))
    driver.step()  # prefill, first token
    free = sched.block_manager.num_free_blocks
    assert sched.set_draft_tokens("a", [999] * 12) == 12  # wrong drafts at positions 7..18: blocks 2 and 3
    plan = driver.step()
    assert plan.scheduled[0].num_draft_tokens == 12 and len(plan.scheduled[0].block_table) == 3
    assert sched.stats().spec_accepted_tokens == 0 and sched.stats().spec_freed_blocks == 2
    assert sched.block_manager.num_free_blocks == free  # both back: the new token's position 7 is in block 1
    assert driver.outputs["a"] == reference_output(prompt, 2)


# ---- the acceptance rule ---------------------------------------------------------------------

def test_greedy_acceptance_takes_drafts_while_they_are_the_argmax() -> None:
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([2, 4, 1, 5]):
        logits[row, best] = 3.0
    assert accept(logits, [2, 4, 0], None, GREEDY, 0, 0) == [2, 4, 1]  # third draft wrong: argmax instead
    assert accept(logits, [2, 4, 1], None, GREEDY, 0, 0) == [2, 4, 1, 5]  # all accepted, plus a bonus
    assert accept(logits[:1], [], None, GREEDY, 0, 0) == [2]


V = 4  # vocabulary of the Markov "models" below
LENGTH = 3  # tokens generated per sample
SAMPLES = 12_000


def markov(seed: int, sharpness: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g) * sharpness  # logits of the next token given the last


TARGET, DRAFTER = markov(1, 1.5), markov(2, 1.5)
TEMPERATURE = 0.8


def speculative_sample(seed: int, right_q: bool) -> tuple[int, ...]:
    """LENGTH tokens from token 0, in rounds of k = 2 drafts drawn from the drafter and verified
    by ``accept`` against the target. ``right_q`` False gives the rule the drafter's
    distribution at temperature 1 while the drafts were drawn at TEMPERATURE: a wrong rule."""
    params = SamplingParams(temperature=TEMPERATURE, seed=seed)
    rng = random.Random(seed)
    out = [0]
    while len(out) - 1 < LENGTH:
        drafts, q_rows = [], []
        last = out[-1]
        for _ in range(2):
            q = torch.softmax(DRAFTER[last] / TEMPERATURE, dim=-1)
            x = int(torch.multinomial(q, 1, generator=torch.Generator().manual_seed(rng.getrandbits(32))))
            drafts.append(x)
            q_rows.append(q if right_q else torch.softmax(DRAFTER[last], dim=-1))
            last = x
        context = [out[-1], *drafts]
        logits = torch.stack([TARGET[t] for t in context])  # the target after each context token
        out += accept(logits, drafts, torch.stack(q_rows), params, seed, len(out) - 1)
    return tuple(out[1 : 1 + LENGTH])


def target_probability(seq: tuple[int, ...]) -> float:
    p, last = 1.0, 0
    for t in seq:
        p *= float(torch.softmax(TARGET[last] / TEMPERATURE, dim=-1)[t])
        last = t
    return p


def chi_square_p_value(right_q: bool) -> float:
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(SAMPLES):
        seq = speculative_sample(seed, right_q)
        counts[seq] = counts.get(seq, 0) + 1
    cells = [(a, b, c) for a in range(V) for b in range(V) for c in range(V)]
    expected = torch.tensor([target_probability(c) * SAMPLES for c in cells], dtype=torch.float64)
    observed = torch.tensor([counts.get(c, 0) for c in cells], dtype=torch.float64)
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def test_sampled_speculation_matches_the_target_distribution() -> None:
    """Joint distribution of 3 tokens (64 cells) from 12,000 seeded samples against the target's
    own chain: the rejection rule passes, and the same test fails the rule when it is given the
    wrong q (the drafter's distribution before temperature, a plausible bug)."""
    assert chi_square_p_value(right_q=True) > 0.001
    assert chi_square_p_value(right_q=False) < 1e-6


# ---- drafters ---------------------------------------------------------------------------------

def test_ngram_drafter_proposes_what_followed_the_last_occurrence() -> None:
    drafter = NgramDrafter(min_n=1, max_n=3)
    context = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    draft = drafter.propose([DraftRequest("a", context, 3, GREEDY, 0, 0)])["a"]
    assert draft.token_ids == [8, 9, 1] and draft.probs is None
    # the index grows with the sequence; no match proposes nothing
    draft = drafter.propose([DraftRequest("a", [*context, 8, 9, 1, 5], 2, GREEDY, 0, 0)])["a"]
    assert draft.token_ids == [6, 7]
    assert drafter.propose([DraftRequest("b", [1, 2, 3], 2, GREEDY, 0, 0)])["b"].token_ids == []
    drafter.release("a")
    assert drafter.stats()["drafter_requests"] == 1
