"""Scheduler behaviour with a fake model (no torch): budgets, chunking, priorities, preemption,
admission control, aborts and prefix sharing. Every step goes through ``check_plan`` and the
scheduler's own invariant check (see sched_fakes.Driver)."""

from __future__ import annotations

import pytest
from sched_fakes import EOS, Driver, reference_output

from engine_gpu.config import EngineConfig
from engine_gpu.scheduler import Scheduler
from llm_shared.contract import Priority, SamplingParams
from llm_shared.errors import (
    DuplicateRequestError,
    EmptyPromptError,
    InvalidRequestError,
    OverloadedError,
    PromptTooLongError,
)

BS = 16


def make_sched(num_blocks: int = 64, **overrides: object) -> Scheduler:
    fields: dict[str, object] = dict(
        block_size=BS, max_num_batched_tokens=64, max_num_seqs=8, max_waiting=64,
        max_model_len=1024, long_prefill_threshold=32,
    )
    fields.update(overrides)
    return Scheduler(EngineConfig(**fields), num_blocks, eos_token_id=EOS)  # type: ignore[arg-type]


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 + 3 for i in range(n)]


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def test_budget_and_seq_limit_hold_every_step_and_all_outputs_are_right() -> None:
    sched = make_sched(max_num_seqs=4)
    driver = Driver(sched)
    prompts = {f"r{i}": prompt(i, 5 + 17 * i % 90) for i in range(12)}
    for rid, p in prompts.items():
        sched.add_request(rid, p, greedy(6 + len(p) % 9))
    plans = driver.run()
    assert max(plan.num_scheduled_tokens for plan in plans) == 64  # chunked prefill fills the budget
    assert all(len(plan.scheduled) <= 4 for plan in plans)
    for rid, p in prompts.items():
        assert driver.outputs[rid] == reference_output(p, 6 + len(p) % 9)
        assert driver.finished[rid] == "length"
    stats = sched.stats()
    assert (stats.running, stats.waiting, stats.kv_blocks_in_use) == (0, 0, 0)


def test_long_prompt_is_chunked_while_decodes_continue() -> None:
    sched = make_sched(max_num_batched_tokens=64, long_prefill_threshold=16)
    driver = Driver(sched)
    for rid in ("d1", "d2"):
        sched.add_request(rid, prompt(len(rid), 5), greedy(40))
    driver.step()  # both prompts in one step; both decode from now on
    long_prompt = prompt(99, 200)
    sched.add_request("long", long_prompt, greedy(3), Priority.REALTIME)  # outranks them, yet they go first
    expected_start = 0
    while True:
        plan = driver.step()
        ids = [item.request_id for item in plan.scheduled]
        assert ids[:2] == ["d1", "d2"]  # decodes first, one token each
        assert all(len(item.token_ids) == 1 for item in plan.scheduled[:2])
        chunk = plan.scheduled[2]
        assert chunk.request_id == "long" and chunk.start_pos == expected_start
        assert chunk.token_ids == long_prompt[expected_start : expected_start + len(chunk.token_ids)]
        assert len(chunk.token_ids) <= 16  # capped while others decode, though budget is left
        expected_start += len(chunk.token_ids)
        assert chunk.sample == (expected_start == 200)
        if chunk.sample:
            break
    assert expected_start == 200
    driver.run()
    assert driver.outputs["long"] == reference_output(long_prompt, 3)
    assert driver.outputs["d1"] == reference_output(prompt(2, 5), 40)


def test_a_prompt_alone_takes_the_whole_budget() -> None:
    sched = make_sched(max_num_batched_tokens=64, long_prefill_threshold=16)
    sched.add_request("long", prompt(1, 150), greedy(2))
    plan = sched.schedule()
    assert [len(item.token_ids) for item in plan.scheduled] == [64]
    assert plan.scheduled[0].sample is False


def test_realtime_overtakes_queued_requests_and_fcfs_holds_within_a_class() -> None:
    sched = make_sched(max_num_seqs=1)
    driver = Driver(sched)
    order = [("b1", Priority.BATCH), ("i1", Priority.INTERACTIVE), ("b2", Priority.BATCH),
             ("i2", Priority.INTERACTIVE), ("r1", Priority.REALTIME)]
    for n, (rid, prio) in enumerate(order):
        sched.add_request(rid, prompt(n, 10), greedy(3), prio)
    admitted = [rid for plan in driver.run() for rid in plan.cached_tokens]
    assert admitted == ["r1", "i1", "i2", "b1", "b2"]


def test_realtime_request_preempts_a_running_batch_one_for_its_slot() -> None:
    sched = make_sched(max_num_seqs=1, max_num_batched_tokens=16)
    driver = Driver(sched)
    sched.add_request("batch", prompt(1, 20), greedy(12), Priority.BATCH)
    for _ in range(5):
        driver.step()
    sched.add_request("rt", prompt(2, 16), greedy(3), Priority.REALTIME)
    plan = driver.step()
    assert plan.preempted == ["batch"]
    # The victim's decode token went back to the budget: the whole prompt fits in one step.
    assert [(item.request_id, len(item.token_ids)) for item in plan.scheduled] == [("rt", 16)]
    plans = driver.run()
    assert "batch" not in [rid for p in plans for rid in p.cached_tokens]  # reported once, at first admission
    resumed = next(item for p in plans for item in p.scheduled if item.request_id == "batch")
    assert resumed.start_pos == 16  # its own freed blocks served the recompute from cache
    assert driver.outputs["batch"] == reference_output(prompt(1, 20), 12)
    assert driver.outputs["rt"] == reference_output(prompt(2, 16), 3)
    assert sched.stats().preemptions == 1


def test_preemption_when_blocks_run_out_picks_lowest_priority_then_latest_and_resumes_exactly() -> None:
    # 8 blocks of 16 tokens; each request grows to 79 positions (5 blocks): they cannot all fit.
    sched = make_sched(num_blocks=8, enable_prefix_caching=False)
    driver = Driver(sched)
    requests = [("early", Priority.INTERACTIVE), ("late", Priority.INTERACTIVE), ("bulk", Priority.BATCH)]
    for n, (rid, prio) in enumerate(requests):
        sched.add_request(rid, prompt(n, 20), greedy(60), prio, arrival=float(n))
    plans = driver.run()
    preempted = [rid for plan in plans for rid in plan.preempted]
    assert preempted[0] == "bulk"
    assert "early" not in preempted  # the oldest of the highest class is never the victim
    assert "late" in preempted
    for n, (rid, _) in enumerate(requests):
        assert driver.outputs[rid] == reference_output(prompt(n, 20), 60)
    stats = sched.stats()
    assert stats.preemptions == len(preempted) and stats.kv_blocks_in_use == 0


def test_preempted_request_goes_back_to_the_front_of_its_class() -> None:
    # a and b grow until the pool is short; b (later) is preempted while c still waits.
    sched = make_sched(num_blocks=6, max_num_seqs=2, enable_prefix_caching=False)
    driver = Driver(sched)
    sched.add_request("a", prompt(1, 30), greedy(60), Priority.BATCH, arrival=0.0)
    sched.add_request("b", prompt(2, 30), greedy(60), Priority.BATCH, arrival=1.0)
    sched.add_request("c", prompt(3, 30), greedy(5), Priority.BATCH, arrival=2.0)
    plans = driver.run()
    first = next(i for i, plan in enumerate(plans) if plan.preempted)
    assert plans[first].preempted == ["b"]
    later = [item.request_id for plan in plans[first + 1 :] for item in plan.scheduled]
    assert later.index("b") < later.index("c")  # c would have fitted first, yet must not overtake
    assert driver.outputs["b"] == reference_output(prompt(2, 30), 60)
    assert driver.outputs["c"] == reference_output(prompt(3, 30), 5)


def test_admission_is_bounded_by_max_waiting() -> None:
    sched = make_sched(max_waiting=3, max_num_seqs=1)
    for i in range(3):
        sched.add_request(f"r{i}", prompt(i, 5), greedy(4))
    with pytest.raises(OverloadedError, match="overloaded"):
        sched.add_request("r3", prompt(3, 5), greedy(4))
    assert sched.stats().waiting == 3
    Driver(sched).step()  # r0 leaves the queue
    sched.add_request("r3", prompt(3, 5), greedy(4))  # the rejected id was not kept
    assert sched.stats().waiting == 3


def test_requests_that_can_never_fit_or_are_malformed_are_rejected_at_add() -> None:
    sched = make_sched(num_blocks=4, max_model_len=80)
    with pytest.raises(PromptTooLongError):
        sched.add_request("ctx", prompt(1, 60), greedy(21))  # 81 > max_model_len
    with pytest.raises(PromptTooLongError):
        sched.add_request("pool", prompt(1, 50), greedy(16))  # needs 65 positions, pool holds 64
    with pytest.raises(EmptyPromptError):
        sched.add_request("empty", [], greedy(1))
    with pytest.raises(InvalidRequestError):
        sched.add_request("neg", [1, -5], greedy(1))
    for bad in (dict(request_id=""), dict(prompt_ids=[1, True]), dict(prompt_ids=[1, 2**31]),
                dict(prompt_ids="abc"), dict(params={"max_tokens": 1}), dict(priority=7), dict(arrival=float("nan")),
                dict(cache_salt=7), dict(cache_salt="s" * 65), dict(cache_salt="\x00")):
        args: dict[str, object] = dict(request_id="bad", prompt_ids=[1, 2], params=greedy(1))
        args.update(bad)
        with pytest.raises(InvalidRequestError):
            sched.add_request(**args)  # type: ignore[arg-type]
    assert not sched.has_unfinished()
    sched.add_request("fits", prompt(1, 50), greedy(15))  # exactly the whole pool
    with pytest.raises(DuplicateRequestError):
        sched.add_request("fits", prompt(2, 5), greedy(1))
    driver = Driver(sched)
    driver.run()
    assert driver.outputs["fits"] == reference_output(prompt(1, 50), 15)
    sched.add_request("fits", prompt(2, 5), greedy(1))  # finished ids may be reused


def test_abort_frees_blocks_at_once_and_is_idempotent() -> None:
    sched = make_sched(max_num_seqs=2)
    driver = Driver(sched)
    sched.add_request("keep", prompt(1, 40), greedy(20))
    sched.add_request("drop", prompt(2, 40), greedy(20))
    sched.add_request("queued", prompt(3, 40), greedy(20), Priority.BATCH)
    driver.step()
    driver.step()
    used = sched.block_manager.num_used_blocks
    assert sched.abort_request("drop")
    assert sched.block_manager.num_used_blocks == used - 3  # before any further schedule()
    assert sched.stats().kv_blocks_in_use == used - 3
    assert not sched.abort_request("drop") and not sched.abort_request("never-seen")
    assert sched.abort_request("queued") and sched.stats().waiting == 0
    plan = driver.step()
    assert set(plan.finished) == {"drop", "queued"}
    assert "drop" not in driver.finished

    plan = sched.schedule()  # abort between schedule and update: the update skips it
    sched.abort_request("keep")
    assert sched.update_from_output(plan, driver.model.execute(plan)) == []
    assert sched.stats().kv_blocks_in_use == 0 and not sched.has_unfinished()


def test_shared_prefix_blocks_are_shared_reported_cached_reused_and_evicted_lru() -> None:
    sched = make_sched(num_blocks=12)
    driver = Driver(sched)
    bm = sched.block_manager
    shared = prompt(5, 3 * BS)
    sched.add_request("a", [*shared, 1001, 1002], greedy(4))
    plan = driver.step()
    assert plan.cached_tokens == {"a": 0}
    sched.add_request("b", [*shared, 2001], greedy(4))
    plan = driver.step()
    assert plan.cached_tokens == {"b": 48}
    tables = {item.request_id: item.block_table for item in plan.scheduled}
    assert tables["a"][:3] == tables["b"][:3]
    assert all(bm.ref_count(block) == 2 for block in tables["a"][:3])
    driver.run()
    assert driver.outputs["b"] == reference_output([*shared, 2001], 4)
    stats = sched.stats()
    assert stats.kv_blocks_in_use == 0 and stats.kv_blocks_cached >= 3
    assert stats.kv_blocks_cached + stats.kv_blocks_free == stats.kv_blocks_total
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (50 + 49, 48)
    assert stats.as_dict()["prefix_cache_hits"] == 48.0

    sched.add_request("c", [*shared, 3001], greedy(2))  # a freed-but-cached prefix is reused
    plan = driver.step()
    assert plan.cached_tokens == {"c": 48} and plan.scheduled[0].block_table[:3] == tables["a"][:3]
    driver.run()

    sched.add_request("big", prompt(9, 10 * BS), greedy(2))  # needs 10 of 12 blocks: evicts LRU
    driver.run()
    sched.add_request("d", [*shared, 4001], greedy(2))
    plan = driver.step()
    assert plan.cached_tokens["d"] == BS  # the shared prefix's tail blocks were evicted first
    driver.run()
    assert driver.outputs["d"] == reference_output([*shared, 4001], 2)


def test_prefix_hits_stay_within_a_cache_salt() -> None:
    sched = make_sched()
    driver = Driver(sched)
    shared = prompt(6, 3 * BS)
    sched.add_request("a1", [*shared, 1], greedy(2), cache_salt="tenant-a")
    driver.run()
    sched.add_request("b1", [*shared, 2], greedy(2), cache_salt="tenant-b")
    assert driver.step().cached_tokens == {"b1": 0}  # another tenant's prefix is not served
    driver.run()
    sched.add_request("plain", [*shared, 3], greedy(2))
    assert driver.step().cached_tokens == {"plain": 0}  # nor is it served to requests with no salt
    driver.run()
    sched.add_request("a2", [*shared, 4], greedy(2), cache_salt="tenant-a")
    assert driver.step().cached_tokens == {"a2": 48}  # the tenant's own prefix is
    driver.run()
    assert driver.outputs["a2"] == reference_output([*shared, 4], 2)


def test_a_prompt_fully_in_cache_still_computes_its_last_token() -> None:
    sched = make_sched()
    driver = Driver(sched)
    p = prompt(3, 2 * BS)
    sched.add_request("first", p, greedy(1))
    driver.run()
    sched.add_request("again", p, greedy(1))
    plan = driver.step()
    assert plan.cached_tokens == {"again": BS}
    assert plan.scheduled[0].start_pos == BS and plan.scheduled[0].sample
    assert driver.outputs["again"] == driver.outputs["first"]


def test_finish_on_eos_stop_ids_length_and_caller_stop() -> None:
    sched = make_sched()
    driver = Driver(sched)
    sched.add_request("eos", prompt(1, 5), greedy(10))
    sched.add_request("ignore", prompt(2, 5), greedy(3, ignore_eos=True))
    sched.add_request("stopid", prompt(3, 5), greedy(10, stop_token_ids=(77,)))
    sched.add_request("caller", prompt(4, 5), greedy(10))
    plan = sched.schedule()
    driver.model.execute(plan)  # write the prompts' KV, but sample these tokens instead:
    fixed = {"eos": [EOS], "ignore": [EOS], "stopid": [77], "caller": [500]}
    updates = {u.request_id: u for u in sched.update_from_output(plan, fixed)}
    driver.outputs.update({rid: list(u.new_token_ids) for rid, u in updates.items()})
    assert (updates["eos"].finish_reason, updates["eos"].new_token_ids, updates["eos"].stop_token_id) == ("stop", [], EOS)
    assert (updates["stopid"].finish_reason, updates["stopid"].stop_token_id) == ("stop", 77)
    assert updates["ignore"].finish_reason is None and updates["ignore"].new_token_ids == [EOS]
    assert updates["caller"].finish_reason is None
    sched.finish_request("caller", "stop")  # a stop string matched in the caller's detokenizer
    sched.finish_request("caller", "stop")  # already over: ignored
    with pytest.raises(ValueError):
        sched.finish_request("ignore", "bogus")
    assert sched.stats().running == 1
    driver.run()
    assert driver.finished["ignore"] == "length" and len(driver.outputs["ignore"]) == 3
    assert sched.stats().kv_blocks_in_use == 0


def test_draft_tokens_are_scheduled_verified_and_rolled_back() -> None:
    sched = make_sched()
    driver = Driver(sched)
    p = prompt(1, 10)
    ref = reference_output(p, 12)
    sched.add_request("s", p, greedy(12))
    assert sched.set_draft_tokens("s", [1, 2]) == 0  # still in its prompt: no drafts
    driver.step()
    assert sched.set_draft_tokens("s", [ref[1], ref[2], 9]) == 3  # two right, one wrong
    plan = driver.step()
    item = plan.scheduled[0]
    assert (item.start_pos, item.token_ids, item.num_draft_tokens) == (10, [ref[0], ref[1], ref[2], 9], 3)
    assert driver.outputs["s"] == ref[:4]  # 2 accepted drafts + the corrected token
    plan = sched.schedule()
    assert (plan.scheduled[0].start_pos, plan.scheduled[0].token_ids) == (13, [ref[3]])
    with pytest.raises(ValueError):  # no drafts were scheduled, so only one token may come back
        sched.update_from_output(plan, {"s": [1, 2]})
    for update in sched.update_from_output(plan, driver.model.execute(plan)):
        driver.outputs["s"].extend(update.new_token_ids)
    assert sched.set_draft_tokens("s", list(range(100, 120))) == 12 - 5 - 1  # room before max_tokens
    driver.run()
    assert driver.outputs["s"] == ref


def test_update_rejects_stale_or_inconsistent_results() -> None:
    sched = make_sched()
    sched.add_request("a", prompt(1, 100), greedy(2))
    sched.add_request("b", prompt(2, 5), greedy(2))
    plan = sched.schedule()  # a: a 64-token chunk that does not sample; b: waiting for budget
    with pytest.raises(ValueError):
        sched.update_from_output(plan, {"a": [5]})
    sched.update_from_output(plan, {})
    with pytest.raises(ValueError):
        sched.update_from_output(plan, {})  # the same plan twice
    plan = sched.schedule()
    with pytest.raises(ValueError):
        sched.update_from_output(plan, {})  # a sampled this step


def test_the_scheduler_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, engine_gpu.scheduler; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
