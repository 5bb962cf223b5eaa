"""Planning a step ahead (``Scheduler.schedule_ahead``): a steady decode's next plan is made
before the current plan's tokens are known, with pending tokens the runner takes from the
current plan's picks. Random operations (adds that must wait, aborts and caller finishes while
a plan ahead is in flight, stop tokens that end a sequence nobody could foresee) against a small
pool, checked after every operation; every request's tokens must be the reference's."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from sched_fakes import AheadDriver, reference_output

from engine_gpu.config import EngineConfig
from engine_gpu.sched_output import PENDING_TOKEN
from engine_gpu.scheduler import Scheduler
from llm_shared.contract import SamplingParams
from llm_shared.errors import OverloadedError, PromptTooLongError

BS = 8


def expected_output(prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    """What streams, and why it ends: the reference up to its first stop token (left out)."""
    ref = reference_output(prompt, params.max_tokens)
    for i, token in enumerate(ref):
        if token in params.stop_token_ids:
            return ref[:i], "stop"
    return ref, "length"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plans_made_ahead_stream_the_reference_and_leak_nothing(seed: int) -> None:
    rng = random.Random(seed)
    config = EngineConfig(block_size=BS, max_num_batched_tokens=64, max_num_seqs=6, max_waiting=12,
                          max_model_len=200, long_prefill_threshold=16, enable_prefix_caching=seed != 2)
    sched = Scheduler(config, 40, eos_token_id=None)
    driver = AheadDriver(sched)
    requests: dict[str, tuple[list[int], SamplingParams]] = {}
    ended_early: set[str] = set()
    for n in range(600):
        op = rng.choices(("add", "abort", "finish", "step"), weights=(2, 1, 1, 12))[0]
        if op == "add":
            prompt = [rng.randrange(3, 4000) for _ in range(rng.randrange(1, 40))]
            max_tokens = rng.randrange(1, 60)
            stop: tuple[int, ...] = ()
            if rng.random() < 0.3:  # a stop token the reference reaches: an end no plan foresees
                stop = (rng.choice(reference_output(prompt, max_tokens)),)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop)
            try:
                sched.add_request(f"r{n}", prompt, params, arrival=float(n))
            except (OverloadedError, PromptTooLongError):
                continue
            requests[f"r{n}"] = (prompt, params)
        elif op in ("abort", "finish") and requests:
            rid = rng.choice(list(requests))
            if op == "abort":
                sched.abort_request(rid)
            else:
                sched.finish_request(rid, "stop")
            ended_early.add(rid)
        elif op == "step":
            driver.step()
        sched.check_invariants()
    driver.run()

    stats = sched.stats()
    assert stats.kv_blocks_in_use == 0 and stats.running == 0 and stats.waiting == 0
    assert stats.kv_blocks_free + stats.kv_blocks_cached == stats.kv_blocks_total
    stopped = 0
    for rid, (prompt, params) in requests.items():
        want, reason = expected_output(prompt, params)
        got = driver.outputs.get(rid, [])
        if rid in ended_early:
            assert got == want[: len(got)], rid
        else:
            assert (got, driver.finished[rid]) == (want, reason), rid
            stopped += reason == "stop"
    # what the workload claims to exercise
    assert driver.num_ahead > 50 and stopped > 0 and len(ended_early) > 10


def test_only_a_steady_decode_is_planned_ahead() -> None:
    config = EngineConfig(block_size=BS, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    sched = Scheduler(config, 8, eos_token_id=None)
    driver = AheadDriver(sched)
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    sched.add_request("a", list(range(10, 17)), greedy)  # 7 tokens: the step ahead crosses into a second block
    prompt_plan = sched.schedule()
    assert sched.schedule_ahead(prompt_plan) is None  # a prompt chunk: not a steady decode
    with pytest.raises(ValueError, match="latest plan"):
        sched.schedule_ahead(replace(prompt_plan, step=prompt_plan.step - 1))
    sched.update_from_output(prompt_plan, driver.model.execute(prompt_plan))
    decode = sched.schedule()
    ahead = sched.schedule_ahead(decode)
    assert ahead is not None and ahead.source_rows == [0]
    (item,) = ahead.scheduled
    assert item.token_ids == [PENDING_TOKEN] and item.start_pos == 8 and len(item.block_table) == 2
    with pytest.raises(ValueError, match="only one not updated"):
        sched.schedule_ahead(ahead)  # two plans ahead of the updates: never
    with pytest.raises(ValueError, match="in the order"):
        sched.update_from_output(ahead, {"a": [5]})
    sched.update_from_output(decode, {"a": [5]})
    sched.add_request("b", [1, 2, 3], greedy)  # someone waits: the next plan admits it
    assert sched.schedule_ahead(ahead) is None
    sched.update_from_output(ahead, {"a": [6]})
    assert sched._requests["a"].token_ids[-2:] == [5, 6]


def test_a_token_that_ends_a_sequence_by_length_is_not_followed() -> None:
    config = EngineConfig(block_size=BS, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    sched = Scheduler(config, 8, eos_token_id=None)
    driver = AheadDriver(sched)
    sched.add_request("short", [5, 6], SamplingParams(temperature=0.0, max_tokens=2))
    sched.add_request("long", [7, 8], SamplingParams(temperature=0.0, max_tokens=9))
    first = sched.schedule()
    sched.update_from_output(first, driver.model.execute(first))  # one token each
    decode = sched.schedule()
    ahead = sched.schedule_ahead(decode)  # short's second token is its last
    assert ahead is not None and [item.request_id for item in ahead.scheduled] == ["long"]
    assert ahead.source_rows == [[item.request_id for item in decode.scheduled].index("long")]
