"""The speculation controller on literal costs: each step is priced before it is taken, so a batch
where drafting loses never pays for a catch-up to find out, a catch-up is paid only where the
remaining tokens repay it, and a wrong price is corrected by the steps that paid it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine_gpu.config import SpeculativeConfig
from engine_gpu.speculative.controller import Candidate, SpecController, expected_tokens
from engine_gpu.speculative.costs import CostCurve

MS = 1e-3
EDGE = SpeculativeConfig(method="edge", draft_model="d", num_draft_tokens=4, max_batch=8)
# Measured on an AVX-512 EPYC (bench/spec.py's setup, bf16 target, llama.cpp Q4_1 drafter, 2 threads):
# the target's forward hardly grows with tokens, the drafter's grows with every one.
CPU_TARGET = {1: 20, 2: 23, 4: 25, 8: 27, 16: 35, 40: 50}
CPU_DRAFTER = {1: 6, 2: 13, 4: 20, 8: 30, 64: 150}
GPU_TARGET = {1: 10, 8: 10.2, 40: 11, 136: 13}
GPU_DRAFTER = {1: 1, 8: 1.1, 64: 3}


def controller(target: dict[int, float], drafter: dict[int, float], config: SpeculativeConfig = EDGE,
               acceptance: float = 0.9) -> SpecController:
    ctl = SpecController(replace(config, initial_acceptance=acceptance))
    for n, ms in target.items():
        ctl.observe_target(n, ms * MS)
    ctl.observe_drafter([(n, ms * MS) for n, ms in drafter.items()])
    return ctl


def caught_up(n: int, remaining: int = 200) -> list[Candidate]:
    return [Candidate(f"r{i}", room=16, behind=1, remaining=remaining) for i in range(n)]


def test_a_cost_curve_interpolates_between_what_it_measured_and_follows_it() -> None:
    curve = CostCurve()
    assert not curve.known
    curve.observe(1, 0.010)
    assert curve(4) == pytest.approx(0.040)  # one point: proportional, the cautious guess
    curve.observe(9, 0.018)
    assert curve(5) == pytest.approx(0.014) and curve(1) == pytest.approx(0.010)
    assert curve(17) == pytest.approx(0.026)  # above: the last segment's slope
    for _ in range(30):
        curve.observe(9, 0.036)  # slower now: the bucket follows
    assert curve(9) == pytest.approx(0.036, rel=0.01)
    curve.observe(3, float("nan"))
    curve.observe(0, 1.0)
    assert len(curve.points()) == 2  # nonsense is ignored


def test_nothing_is_priced_above_max_batch_or_with_nothing_decoding() -> None:
    ctl = controller(GPU_TARGET, GPU_DRAFTER)
    assert ctl.plan([]) == {} and ctl.plan(caught_up(9)) == {}
    assert ctl.stats()["spec_off_by_batch"] == 1 and ctl.stats()["spec_enabled"] == 0.0
    assert controller(GPU_TARGET, GPU_DRAFTER, replace(EDGE, method="off")).plan(caught_up(1)) == {}


def test_where_wide_forwards_cost_what_narrow_ones_do_everyone_drafts_the_most() -> None:
    ctl = controller(GPU_TARGET, GPU_DRAFTER)
    assert ctl.plan(caught_up(8)) == {f"r{i}": 4 for i in range(8)}
    assert ctl.stats()["spec_predicted_gain"] > 2


def test_on_these_cpus_one_request_drafts_and_eight_take_plain_steps() -> None:
    ctl = controller(CPU_TARGET, CPU_DRAFTER)
    alone = ctl.plan(caught_up(1))
    assert alone and alone["r0"] >= 2  # 4.1 tokens for ~50 ms against 1 for 20
    assert ctl.plan(caught_up(8)) == {}  # the drafter's 8-token forwards cost more than plain steps gain
    assert ctl.stats()["spec_off_by_gain"] == 1 and ctl.stats()["spec_predicted_gain"] < 1.05


def test_a_catch_up_is_paid_only_where_the_remaining_tokens_repay_it() -> None:
    ctl = controller(CPU_TARGET, CPU_DRAFTER)
    # a new request whose 64-token prompt the drafter must read first (~150 ms)
    assert ctl.plan([Candidate("new", room=16, behind=64, remaining=300)])  # 300 tokens repay it
    assert ctl.plan([Candidate("new", room=3, behind=64, remaining=4)]) == {}  # 4 do not: plain


def test_sequences_the_drafter_guesses_badly_sit_out_while_the_others_draft() -> None:
    ctl = controller(GPU_TARGET, GPU_DRAFTER)
    for _ in range(20):
        ctl.observe_round("copying", proposed=4, accepted=4)
        ctl.observe_round("guessing", proposed=4, accepted=0)
    plan = ctl.plan([Candidate("guessing", 16, 1, 200), Candidate("copying", 16, 1, 200)])
    assert plan == {"copying": 4}
    assert 0.35 < ctl.stats()["spec_prior_acceptance"] < 0.7  # new sequences start from the mean of all


def test_a_bad_first_round_does_not_shut_a_sequence_out_for_the_rest_of_its_answer() -> None:
    ctl = controller(CPU_TARGET, CPU_DRAFTER, acceptance=0.95)
    ctl.observe_round("r0", proposed=4, accepted=0)  # the answer's first drafts all missed
    plans = [ctl.plan(caught_up(1)) for _ in range(30)]
    assert plans[0] or any(plans[1:10])  # sits out a few steps at most, then drafts again
    for _ in range(5):
        ctl.observe_round("r0", proposed=4, accepted=0)  # a sequence the drafter keeps missing...
    assert ctl.plan(caught_up(1)) == {}  # ...sits out


def test_a_wrong_price_is_corrected_by_the_steps_that_paid_it() -> None:
    ctl = controller(GPU_TARGET, GPU_DRAFTER)
    assert ctl.plan(caught_up(4)) == {f"r{i}": 4 for i in range(4)}
    for _ in range(20):  # verification turns out to cost 6 plain steps, and drafting 3 a position
        ctl.observe_target(4, 0.010)  # plain steps of the four cost what they did
        for rows in range(5, 21):
            ctl.observe_target(rows, 0.060)
        ctl.observe_drafter([(n, 0.030) for n in range(1, 5)])
    assert ctl.plan(caught_up(4)) == {}


def test_drafts_never_exceed_what_a_sequence_may_still_generate() -> None:
    ctl = controller(GPU_TARGET, GPU_DRAFTER)
    plan = ctl.plan([Candidate("a", room=2, behind=1, remaining=3), Candidate("b", room=0, behind=1, remaining=1)])
    assert plan == {"a": 2}


def test_without_adaptation_every_sequence_drafts_the_most_it_may() -> None:
    ctl = SpecController(replace(EDGE, adaptive=False))
    assert ctl.plan([Candidate("a", 16, 50, 10), Candidate("b", 1, 1, 2)]) == {"a": 4, "b": 1}


def test_expected_tokens_per_round() -> None:
    assert expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 4) == pytest.approx(expected_tokens(0.99, 4))  # capped: finite


def test_finished_requests_teach_how_long_requests_run() -> None:
    ctl = controller(CPU_TARGET, CPU_DRAFTER)
    for i in range(60):
        ctl.observe_finished(f"done{i}", 6)  # answers here end after ~6 tokens
    # so a new request's catch-up is spread over ~6 tokens, not its max_tokens of 4,000: plain
    assert ctl.plan([Candidate("new", room=16, behind=64, remaining=4000)]) == {}
