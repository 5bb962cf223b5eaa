"""Speculative decoding in the torch engine: verification is exact (greedy output token for token,
sampled output in distribution), blocks of rejected drafts go back at once, and the switch turns
speculation off where it does not pay.

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
from engine_gpu.scheduler import Scheduler
from engine_gpu.speculative.controller import MIN_SAMPLES, SpecController
from engine_gpu.speculative.drafter import DraftRequest
from engine_gpu.speculative.ngram import NgramDrafter
from engine_gpu.speculative.verify import accept
from llm_shared.contract import SamplingParams
from llm_shared.models import ModelConfig

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
    execute = engine.runner.execute
    aborted: list[str] = []

    def execute_then_abort(batch, *args):  # type: ignore[no-untyped-def]
        out = execute(batch, *args)
        verifying = [item.request_id for item in batch if item.num_draft_tokens]
        if verifying and len(aborted) < 3:
            engine.abort_request(verifying[0])
            aborted.append(verifying[0])
        return out

    engine.runner.execute = execute_then_abort  # type: ignore[method-assign]
    while engine.has_unfinished():
        outputs = engine.step()
        assert not {o.request_id for o in outputs} & set(aborted[:-1])  # nothing streams after an abort
        engine.scheduler.check_invariants()
    assert len(aborted) == 3
    stats = engine.stats()
    assert stats["kv_blocks_in_use"] == 0 and stats["running"] == 0 and stats["drafter_requests"] == 0


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


# ---- the switch and draft lengths ------------------------------------------------------------

def test_the_switch_turns_speculation_off_where_it_loses_and_back_on_where_it_pays() -> None:
    ctl = SpecController(SpeculativeConfig(method="ngram", max_batch=8, probe_every=10))
    assert not ctl.speculate(9) and not ctl.speculate(0)  # above max_batch, or nothing decoding

    def run(steps: int, on_rate: float, off_rate: float) -> list[bool]:
        choices = []
        for _ in range(steps):
            on = ctl.speculate(2)
            ctl.observe_step(2, on, 100, 100 / (on_rate if on else off_rate))
            choices.append(on)
        return choices

    run(2 * MIN_SAMPLES, on_rate=50, off_rate=100)  # explores both arms
    losing = run(40, on_rate=50, off_rate=100)
    assert sum(losing) <= 5 and ctl.gain(2) < 1  # off, apart from probes
    winning = run(60, on_rate=300, off_rate=100)
    assert sum(winning[-20:]) >= 17 and ctl.gain(2) > 1  # probes saw it pay: back on (off only to probe)
    assert ctl.stats()["spec_enabled"] == 1.0


def test_draft_length_follows_each_sequences_acceptance() -> None:
    ctl = SpecController(SpeculativeConfig(method="ngram", num_draft_tokens=8, initial_cost_ratio=0.05))
    for _ in range(20):
        ctl.observe_round("copying", proposed=8, accepted=8)
        ctl.observe_round("guessing", proposed=4, accepted=0)
    assert ctl.draft_len("copying") == 8
    assert ctl.draft_len("guessing") == 1  # the least: the switch, not k, turns drafting off


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


def test_draft_length_counts_what_verification_costs() -> None:
    """Where verification costs grow with every query token, fewer drafts pay; where a wide
    verification costs about what a narrow one does (these CPUs past 2 tokens, a GPU at small
    batch), the most do. Measured per bucket; a sequence drafts at least one token."""
    def controller(verify_s: dict[int, float], acceptance: float = 0.7) -> SpecController:
        ctl = SpecController(SpeculativeConfig(method="edge", draft_model="d", num_draft_tokens=4,
                                               initial_acceptance=acceptance))
        ctl.observe_step(1, False, 1, 0.1)  # a plain step: 100 ms
        for k, seconds in verify_s.items():  # drafting took 5 ms a position (c = 0.05)
            ctl.observe_step(1, True, 2, 0.005 * k + seconds, draft_seconds=0.005 * k, draft_positions=k,
                             verify_width=k)
        return ctl

    flat = controller({1: 0.185, 4: 0.197})  # like fp32 on these CPUs: v(1) = 1.85, v(4) = 1.97
    assert flat.draft_len("new", 1) == 4
    assert flat.stats()["spec_verify_cost_batch1"] == pytest.approx(1.97)
    steep = controller({1: 0.13, 2: 0.16, 3: 0.19, 4: 0.22})  # 30% more per token
    assert steep.draft_len("new", 1) == 2
    assert controller({4: 0.4}, acceptance=0.1).draft_len("new", 1) == 1  # never 0: acceptance stays measured


def test_probes_of_a_losing_arm_back_off() -> None:
    """Each probe costs the drafter a catch-up: while speculation keeps losing, probes thin out."""
    ctl = SpecController(SpeculativeConfig(method="ngram", probe_every=8))
    choices = []
    for _ in range(2000):
        on = ctl.speculate(2)
        ctl.observe_step(2, on, 100, 100 / (50 if on else 100))
        choices.append(on)
    probes = sum(choices[2 * MIN_SAMPLES:])
    assert 3 <= probes <= 12  # 8, 16, 32, ... capped at 32 x 8 steps: ~10 in 2,000 steps, not 250
