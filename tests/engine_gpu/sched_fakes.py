"""A model stand-in for scheduler tests: a KV store of token ids in physical blocks.

Each step writes the scheduled tokens into the blocks the plan names and samples a token that
is a hash of the whole context read back *through the block tables*. So a wrong block table,
a stale prefix-cache hit, a bad position or a lost token after preemption changes the output,
and the correct output of any request is simply ``reference_output(prompt, n)``.
"""

from __future__ import annotations

import zlib
from array import array
from dataclasses import replace

from engine_gpu.sched_output import PENDING_TOKEN, SchedulerOutput
from engine_gpu.scheduler import Scheduler

EOS = 2


def next_token(context: list[int]) -> int:
    """Deterministic function of the whole context; never EOS."""
    return 100 + zlib.crc32(array("q", context).tobytes()) % 900


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    context = list(prompt)
    for _ in range(max_tokens):
        context.append(next_token(context))
    return context[len(prompt) :]


class FakeModel:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]

    def execute(self, plan: SchedulerOutput) -> dict[str, list[int]]:
        """Verify drafts like a real runner: accept while they equal what it would sample."""
        bs = self.block_size
        contexts = {}
        for item in plan.scheduled:  # read the cache as it was before this step's writes
            past = [self.kv[item.block_table[p // bs]][p % bs] for p in range(item.start_pos)]
            assert None not in past, f"{item.request_id} reads KV that was never written"
            contexts[item.request_id] = [*past, *item.token_ids]
        for item in plan.scheduled:
            assert len(item.block_table) == -(-(item.start_pos + len(item.token_ids)) // bs)
            for i, token in enumerate(item.token_ids):
                pos = item.start_pos + i
                self.kv[item.block_table[pos // bs]][pos % bs] = token
        sampled = {}
        for item in plan.scheduled:
            if not item.sample:
                continue
            context = contexts[item.request_id]
            last_real = len(context) - item.num_draft_tokens  # context[:last_real] are verified tokens
            accepted: list[int] = []
            for j in range(item.num_draft_tokens + 1):
                predicted = next_token(context[: last_real + j])
                accepted.append(predicted)
                if j == item.num_draft_tokens or context[last_real + j] != predicted:
                    break
            sampled[item.request_id] = accepted
        return sampled


def check_plan(sched: Scheduler, plan: SchedulerOutput) -> None:
    """What must hold for every plan, whatever the workload."""
    cfg = sched.config
    assert plan.num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(plan.scheduled) <= cfg.max_num_seqs
    ids = [item.request_id for item in plan.scheduled]
    assert len(set(ids)) == len(ids)
    assert not set(ids) & set(plan.preempted)
    for item in plan.scheduled:
        assert item.token_ids, "an item with nothing to compute"
        assert item.start_pos + len(item.token_ids) <= cfg.max_model_len
        assert all(sched.block_manager.ref_count(b) > 0 for b in item.block_table)
    assert sched.stats().num_scheduled_tokens == plan.num_scheduled_tokens


class Driver:
    """Schedule, execute on the fake model, update; collects streamed tokens per request."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.model = FakeModel(sched.block_manager.num_blocks, sched.config.block_size)
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}

    def step(self) -> SchedulerOutput:
        plan = self.sched.schedule()
        check_plan(self.sched, plan)
        for item in plan.scheduled:  # the runner's RNG key: tokens streamed so far
            assert item.output_index == len(self.outputs.get(item.request_id, []))
        self._update(plan, self.model.execute(plan))
        return plan

    def _update(self, plan: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """Apply a plan's results and collect what streams; the invariants must hold after."""
        for update in self.sched.update_from_output(plan, sampled):
            self.outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.finish_reason is not None:
                self.finished[update.request_id] = update.finish_reason
        self.sched.check_invariants()

    def busy(self) -> bool:
        return self.sched.has_unfinished()

    def run(self, max_steps: int = 10_000) -> list[SchedulerOutput]:
        plans = []
        while self.busy():
            assert len(plans) < max_steps, "no progress"
            plans.append(self.step())
        return plans


class AheadDriver(Driver):
    """The overlapped engine's loop: after a plan is executed, the next one is planned ahead
    (``schedule_ahead``) and executed before the first one's update, its pending tokens taken
    from what the first one sampled, as a runner reads them on the device. The fake model writes
    whatever token it is given into the KV, so a placeholder that leaked, or a wrong source row,
    changes every later token."""

    def __init__(self, sched: Scheduler) -> None:
        super().__init__(sched)
        self.ahead: tuple[SchedulerOutput, dict[str, list[int]]] | None = None
        self.num_ahead = 0

    def step(self) -> SchedulerOutput:
        if self.ahead is not None:
            (plan, sampled), self.ahead = self.ahead, None
        else:
            plan = self.sched.schedule()
            check_plan(self.sched, plan)
            for item in plan.scheduled:
                assert item.output_index == len(self.outputs.get(item.request_id, []))
            sampled = self.model.execute(plan)
        nxt = self.sched.schedule_ahead(plan)
        if nxt is not None:
            check_plan(self.sched, nxt)
            assert nxt.source_rows is not None and len(nxt.source_rows) == len(nxt.scheduled)
            resolved = []
            for item, row in zip(nxt.scheduled, nxt.source_rows, strict=True):
                assert item.token_ids == [PENDING_TOKEN] and item.sample and not item.num_draft_tokens
                source = plan.scheduled[row]
                assert source.request_id == item.request_id and item.start_pos == source.start_pos + 1
                assert item.output_index == source.output_index + 1
                resolved.append(replace(item, token_ids=sampled[source.request_id][-1:]))
            self.ahead = (nxt, self.model.execute(replace(nxt, scheduled=resolved)))
            self.num_ahead += 1
        self._update(plan, sampled)
        return plan

    def busy(self) -> bool:
        return self.sched.has_unfinished() or self.ahead is not None  # a plan ahead still needs its update
