"""1,000 random operations against a small pool: adds (often sharing prefixes), aborts, caller
finishes, drafts and steps. Invariants are checked after every operation; every request that
ran to its length must have produced exactly the reference tokens; nothing may leak."""

from __future__ import annotations

import random

import pytest
from sched_fakes import Driver, reference_output

from engine_gpu.config import EngineConfig
from engine_gpu.scheduler import Scheduler
from llm_shared.contract import Priority, SamplingParams
from llm_shared.errors import OverloadedError, PromptTooLongError

BS = 8
NUM_OPS = 1000


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_invariants_and_leak_nothing(seed: int) -> None:
    rng = random.Random(seed)
    config = EngineConfig(
        block_size=BS, max_num_batched_tokens=40, max_num_seqs=5, max_waiting=12,
        max_model_len=160, long_prefill_threshold=12, enable_prefix_caching=seed != 2,
    )
    sched = Scheduler(config, 24, eos_token_id=None)  # 192 token slots
    driver = Driver(sched)
    prefixes = [[rng.randrange(3, 4000) for _ in range(rng.choice((8, 16, 20)))] for _ in range(4)]
    prompts: dict[str, tuple[list[int], int]] = {}
    ended_early: set[str] = set()
    counts = dict.fromkeys(("add", "rejected", "abort", "finish", "draft", "step"), 0)

    for n in range(NUM_OPS):
        op = rng.choices(("add", "abort", "finish", "draft", "step"), weights=(4, 1, 1, 2, 8))[0]
        if op == "add":
            head = rng.choice(prefixes) if rng.random() < 0.6 else []
            tail = [rng.randrange(3, 4000) for _ in range(rng.randrange(1, 60))]
            max_tokens = rng.randrange(1, 50)
            rid = f"r{n}"
            try:
                sched.add_request(rid, head + tail, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                  rng.choice(list(Priority)), arrival=float(n))
            except (OverloadedError, PromptTooLongError):
                counts["rejected"] += 1
            else:
                prompts[rid] = (head + tail, max_tokens)
        elif op in ("abort", "finish", "draft") and prompts:
            rid = rng.choice(list(prompts))
            if op == "abort":
                sched.abort_request(rid)
                ended_early.add(rid)
            elif op == "finish":
                sched.finish_request(rid, "stop")
                ended_early.add(rid)
            else:  # drafts from a "drafter" that is right about half the time
                p, max_tokens = prompts[rid]
                ref = reference_output(p, max_tokens)
                done = len(driver.outputs.get(rid, []))
                drafts = [t if rng.random() < 0.7 else 7 for t in ref[done + 1 : done + 1 + rng.randrange(1, 5)]]
                sched.set_draft_tokens(rid, drafts)
        else:
            op = "step"
            driver.step()
        counts[op] += 1
        sched.check_invariants()

    driver.run()
    stats = sched.stats()
    assert stats.kv_blocks_in_use == 0 and stats.running == 0 and stats.waiting == 0
    assert stats.kv_blocks_free + stats.kv_blocks_cached == stats.kv_blocks_total
    if config.enable_prefix_caching:
        assert stats.prefix_cache_hits > 0
    else:
        assert stats.kv_blocks_cached == 0
    completed = 0
    for rid, (p, max_tokens) in prompts.items():
        expected = reference_output(p, max_tokens)
        got = driver.outputs.get(rid, [])
        if rid in ended_early:
            assert got == expected[: len(got)]
        else:
            assert driver.finished[rid] == "length" and got == expected
            completed += 1
    # The workload must actually have exercised what it claims to.
    assert completed > 20 and counts["rejected"] > 0 and stats.preemptions > 0
