"""Iteration-level scheduler of the torch engine. Pure Python, no torch.

There are no prefill and decode phases. Each request has ``num_computed_tokens`` and a target
(its tokens plus any draft tokens to verify); every step hands out a token budget:

1. running requests that are decoding, highest priority first;
2. running requests still in their prompt, as chunks of what budget is left (capped at
   ``long_prefill_threshold`` while others decode, so a long prompt never stalls them);
3. waiting requests by priority class, FCFS inside a class, reusing prefix-cache hits.

When blocks run out, the lowest-priority, latest-arrived running request is preempted: its
blocks are freed, it keeps its generated tokens and goes back to the front of its class's
queue, to be recomputed later (mostly from the prefix cache its own blocks left behind).
A waiting request may likewise preempt running requests of a strictly lower class.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC

from engine_gpu.block_manager import BlockManager
from engine_gpu.config import EngineConfig
from engine_gpu.request_limits import check_fits, check_token_ids
from engine_gpu.sched_output import PENDING_TOKEN, RequestUpdate, ScheduledSeq, SchedulerOutput, SchedulerStats
from engine_gpu.sequence import MAX_TOKEN_ID, SeqStatus, Sequence, as_token_ids, new_sequence
from engine_gpu.step_plan import StepPlan
from engine_gpu.step_results import append_tokens, checked_tokens
from llm_shared.contract import FINISH_REASONS, FinishReason, Priority, SamplingParams
from llm_shared.errors import DuplicateRequestError, InvalidRequestError, OverloadedError


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, *, eos_token_id: int | None,
                 vocab_size: int | None = None) -> None:
        self.config = config
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size  # None: prompts are not checked against a vocabulary (no model)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self._requests: dict[str, Sequence] = {}  # every live request, waiting or running
        self._waiting: dict[Priority, deque[Sequence]] = {p: deque() for p in sorted(Priority)}
        self._running: dict[str, Sequence] = {}
        # _running in order_key order, sorted again only after it changed (None): a steady decode
        # batch is the same set step after step, and sorting it each step was most of schedule().
        self._running_order: list[Sequence] | None = None
        # Plans scheduled and not yet updated, oldest first, with their sequences: one, or two while
        # a plan made by ``schedule_ahead`` runs behind the one it follows.
        self._in_flight: deque[tuple[int, dict[str, Sequence]]] = deque()
        self._finished_ids: list[str] = []  # since the last schedule(); tells the runner what to forget
        self._seq_numbers = itertools.count()
        self._step = 0
        self._num_preemptions = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._last_num_scheduled = 0
        self._draft_tokens = 0  # verified draft tokens, and of those the accepted ones
        self._accepted_tokens = 0
        self._freed_draft_blocks = 0

    # ---- requests in and out ----

    def add_request(
        self,
        request_id: str,
        prompt_ids: SequenceABC[int],
        params: SamplingParams,
        priority: Priority = Priority.INTERACTIVE,
        arrival: float | None = None,
        draft_ids: SequenceABC[int] = (),
        cache_salt: str = "",
    ) -> None:
        """Queue a request from an in-process caller, or raise: a malformed field (checked here),
        a token outside the vocabulary, a request that can never fit, or overload.

        ``draft_ids`` guess the output's first tokens (the cascade's held edge tokens): they
        ride with the prompt's last chunk and are verified in that same pass. ``cache_salt``:
        prefix-cache hits come only from requests with the same salt (``Engine.generate``)."""
        try:
            drafts = as_token_ids(draft_ids)
        except ValueError as e:
            raise InvalidRequestError(f"draft_ids: {e}", param="draft_ids") from None
        seq = new_sequence(request_id, prompt_ids, params, priority, arrival, next(self._seq_numbers), cache_salt)
        self._admit(seq, drafts)

    def add_checked_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: Priority, arrival: float,
        draft_ids: list[int] | None = None, cache_salt: str = "",
    ) -> None:
        """Queue a request whose fields a trust boundary already checked (the core's socket decoder:
        a non-empty list of non-negative ints, a valid priority and cache salt); only this engine's
        limits are checked."""
        self._admit(Sequence(
            request_id=request_id,
            token_ids=list(prompt_ids),  # a copy: the sequence appends its output to it
            num_prompt_tokens=len(prompt_ids),
            params=params,
            priority=priority,
            arrival=arrival,
            seq_no=next(self._seq_numbers),
            cache_salt=cache_salt,
        ), draft_ids or [])

    def _admit(self, seq: Sequence, drafts: list[int]) -> None:
        """Queue a well-formed sequence if this engine can serve it: vocabulary, duplicates, length,
        load; it takes as many of ``drafts`` as it may verify."""
        request_id = seq.request_id
        check_token_ids(seq, drafts, self.vocab_size)
        if request_id in self._requests:
            raise DuplicateRequestError(f"request id {request_id!r} is already in use", param="request_id")
        check_fits(seq, self.config.max_model_len, self.block_manager)
        if self.num_waiting >= self.config.max_waiting:
            raise OverloadedError(f"the server is overloaded ({self.num_waiting} requests waiting); retry later")
        seq.draft_token_ids = drafts[: seq.draft_room]
        self._requests[request_id] = seq
        self._waiting[seq.priority].append(seq)

    def abort_request(self, request_id: str) -> bool:
        """Free the request's blocks now. False if it is unknown or already over (idempotent)."""
        seq = self._requests.get(request_id)
        if seq is None:
            return False
        self._finish(seq, "abort")
        return True

    def finish_request(self, request_id: str, reason: FinishReason) -> None:
        """End a request the caller decided is done (a stop string matched). Unknown or already
        finished ids are ignored: the request may have ended on its own in the same step."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason must be one of {FINISH_REASONS}, got {reason!r}")
        seq = self._requests.get(request_id)
        if seq is not None:
            self._finish(seq, reason)

    def set_draft_tokens(self, request_id: str, draft_ids: SequenceABC[int]) -> int:
        """Offer speculative tokens to verify in the request's next step, replacing earlier ones.

        Only a decoding request takes drafts, and no more than it may still generate minus the
        token that verification always adds. Returns how many were kept.
        """
        seq = self._running.get(request_id)
        if seq is None or not seq.is_caught_up:
            return 0
        drafts = as_token_ids(draft_ids)
        seq.draft_token_ids = drafts[: seq.draft_room]
        return len(seq.draft_token_ids)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.block_manager.deallocate(seq)
            del self._running[seq.request_id]
            self._running_order = None
        elif seq.status is SeqStatus.WAITING:
            self._waiting[seq.priority].remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        del self._requests[seq.request_id]
        self._finished_ids.append(seq.request_id)

    # ---- the step ----

    def schedule(self) -> SchedulerOutput:
        """Plan the next step from the scheduler's state (the latest plan's update applied: a plan
        left without one is dropped, as a runner that failed it leaves it)."""
        plan = StepPlan(budget=self.config.max_num_batched_tokens)
        if self._running_order is None:
            self._running_order = sorted(self._running.values(), key=Sequence.order_key)
        running = self._running_order
        block_size = self.block_manager.block_size
        if not self._plan_steady_decode(running, plan):
            for seq in [s for s in running if s.is_caught_up] + [s for s in running if not s.is_caught_up]:
                if plan.budget == 0:
                    break
                if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                    continue
                n = self._chunk_size(seq.num_pending_tokens, plan)
                # Inside its last block (most decode steps) a seq needs no block: nothing to grow or preempt.
                if (seq.num_computed_tokens + n <= len(seq.block_table) * block_size
                        or self._grow_or_preempt(seq, seq.num_computed_tokens + n, plan)):
                    plan.add(seq, n)
        if not plan.preempted:  # blocks are short: admitting now would only preempt again next step
            self._admit_waiting(plan)
        return self._emit(plan)

    def schedule_ahead(self, previous: SchedulerOutput) -> SchedulerOutput | None:
        """Plan the step after ``previous`` (the latest plan, not yet updated) before its tokens
        are known, so that a runner can launch it while ``previous`` still runs on the device.

        Only a steady decode is planned ahead: ``previous`` decoded one token per sequence with no
        drafts, nothing waits for admission, and the free blocks cover every sequence's next
        position (nobody is preempted). Each sequence that ``previous``'s token cannot end by
        length decodes that token (``PENDING_TOKEN``; ``source_rows`` says whose); one that an EOS
        or stop token ends meanwhile has its row computed and dropped by its update, and its
        blocks go back as for any finish (a device runs steps in order, so the row's write lands
        before any later step reuses them). Returns None where the step must be planned by
        ``schedule()`` once ``previous`` is updated."""
        if len(self._in_flight) != 1 or self._in_flight[0][0] != previous.step:
            raise ValueError("schedule_ahead takes the latest plan, while it is the only one not updated")
        if not previous.scheduled or self.num_waiting:
            return None
        in_flight = self._in_flight[0][1]
        max_model_len = self.config.max_model_len
        rows: list[int] = []
        seqs: list[Sequence] = []
        for row, item in enumerate(previous.scheduled):
            if not item.sample or item.num_draft_tokens or len(item.token_ids) != 1:
                return None
            seq = in_flight[item.request_id]
            if seq.status is not SeqStatus.RUNNING:  # aborted or stopped since it was planned
                continue
            if seq.ends_by_length(len(seq.token_ids) + 1, max_model_len):  # once previous's token is appended
                continue  # that token ends it by length
            rows.append(row)
            seqs.append(seq)
        if not seqs:
            return None
        bm = self.block_manager
        # The step computes position num_computed + 1 (previous computes num_computed).
        short = [seq for seq in seqs if seq.num_computed_tokens + 2 > len(seq.block_table) * bm.block_size]
        if sum(bm.blocks_for(seq.num_computed_tokens + 2) - len(seq.block_table) for seq in short) \
                > bm.num_available_blocks:
            return None
        for seq in short:
            bm.may_append(seq, seq.num_computed_tokens + 2)
        scheduled = [ScheduledSeq(
            seq.request_id,  # request_id
            [PENDING_TOKEN],  # token_ids
            seq.num_computed_tokens + 1,  # start_pos
            seq.block_table_prefix(bm.blocks_for(seq.num_computed_tokens + 2)),  # block_table
            True,  # sample
            0,  # num_draft_tokens
            seq.params,  # params
            len(seq.token_ids) + 1 - seq.num_prompt_tokens,  # output_index
        ) for seq in seqs]
        self._step += 1
        self._in_flight.append((self._step, {seq.request_id: seq for seq in seqs}))
        self._last_num_scheduled = len(seqs)
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(scheduled=scheduled, cached_tokens={}, preempted=[], finished=finished,
                               step=self._step, source_rows=rows)

    def _plan_steady_decode(self, running: list[Sequence], plan: StepPlan) -> bool:
        """The steady state, planned in one pass: when every running seq decodes one token (caught
        up, no drafts), the budget covers them all and the free blocks cover those that cross into
        a new block, the loop in ``schedule`` would add each with one token in this order, growing
        the crossing ones in this order and preempting nobody. Otherwise plan nothing, return False."""
        if len(running) > plan.budget:
            return False
        bm = self.block_manager
        crossing: list[Sequence] = []  # need a block for their next position
        for seq in running:
            if seq.draft_token_ids or seq.num_computed_tokens < len(seq.token_ids) - 1:
                return False
            if seq.num_computed_tokens >= len(seq.block_table) * bm.block_size:
                crossing.append(seq)
        if sum(bm.blocks_for(seq.num_computed_tokens + 1) - len(seq.block_table) for seq in crossing) \
                > bm.num_available_blocks:
            return False
        for seq in crossing:
            bm.may_append(seq, seq.num_computed_tokens + 1)
        plan.tokens = dict.fromkeys(running, 1)
        plan.budget -= len(running)
        plan.num_decodes = len(running)
        return True

    def _chunk_size(self, num_pending: int, plan: StepPlan) -> int:
        n = min(num_pending, plan.budget)
        if num_pending > 1 and plan.num_decodes > 0:
            n = min(n, self.config.long_prefill_threshold)
        return n

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int, plan: StepPlan) -> bool:
        """Cover ``num_tokens`` positions for a running seq, preempting the lowest running
        requests as needed. False if the seq itself was the one preempted."""
        bm = self.block_manager
        while not bm.can_append(seq, num_tokens):
            victim = max(self._running.values(), key=Sequence.order_key)
            self._preempt(victim, plan)
            if victim is seq:
                return False
        bm.may_append(seq, num_tokens)
        return True

    def _admit_waiting(self, plan: StepPlan) -> None:
        bm = self.block_manager
        for queue in self._waiting.values():  # highest class first
            while queue and plan.budget > 0:
                seq = queue[0]
                hits = bm.match_prefix(seq)
                num_cached = len(hits) * bm.block_size
                num_preempted = len(plan.preempted)
                while True:  # a preemption may refund budget, so the chunk is sized again
                    n = self._chunk_size(seq.num_pending_tokens - num_cached, plan)  # drafts ride with the last chunk
                    if len(self._running) < self.config.max_num_seqs and bm.can_allocate(hits, num_cached + n):
                        break
                    victim = max(self._running.values(), key=Sequence.order_key, default=None)
                    if victim is None or victim.priority <= seq.priority:
                        return  # the head waits; lower classes must not overtake it
                    self._preempt(victim, plan)
                queue.popleft()
                self._start_running(seq, hits, n, plan)
                if len(plan.preempted) > num_preempted:
                    return  # the victims queue again; don't let a later candidate readmit them

    def _start_running(self, seq: Sequence, hits: list[int], num_new: int, plan: StepPlan) -> None:
        num_cached = len(hits) * self.block_manager.block_size
        self.block_manager.allocate(seq, hits, num_cached + num_new)
        seq.num_computed_tokens = num_cached
        seq.status = SeqStatus.RUNNING
        self._running[seq.request_id] = seq
        self._running_order = None
        if seq.num_cached_tokens < 0:  # first admission, not a resumption
            seq.num_cached_tokens = num_cached
            plan.cached_tokens[seq.request_id] = num_cached
        self._prefix_queries += seq.num_tokens
        self._prefix_hits += num_cached
        plan.add(seq, num_new)

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        plan.drop(seq)
        self.block_manager.deallocate(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.status = SeqStatus.WAITING
        del self._running[seq.request_id]
        self._running_order = None
        self._waiting[seq.priority].appendleft(seq)
        plan.preempted.append(seq.request_id)
        self._num_preemptions += 1

    def _emit(self, plan: StepPlan) -> SchedulerOutput:
        bm = self.block_manager
        scheduled: list[ScheduledSeq] = []
        for seq, n in plan.tokens.items():
            start = seq.num_computed_tokens
            token_ids = seq.token_ids[start : start + n]
            num_drafts = n - len(token_ids)
            if num_drafts:
                token_ids.extend(seq.draft_token_ids[:num_drafts])
            num_tokens = len(seq.token_ids)
            scheduled.append(ScheduledSeq(  # positional: a quarter cheaper than by keyword, 256 times a step
                seq.request_id,  # request_id
                token_ids,  # token_ids
                start,  # start_pos
                seq.block_table_prefix(bm.blocks_for(start + n)),  # block_table
                start + n >= num_tokens,  # sample
                num_drafts,  # num_draft_tokens
                seq.params,  # params
                num_tokens - seq.num_prompt_tokens,  # output_index
            ))
        self._step += 1
        self._in_flight.clear()
        self._in_flight.append((self._step, {seq.request_id: seq for seq in plan.tokens}))
        self._last_num_scheduled = sum(plan.tokens.values())
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            scheduled=scheduled,
            cached_tokens=plan.cached_tokens,
            preempted=plan.preempted,
            finished=finished,
            step=self._step,
        )

    def update_from_output(self, output: SchedulerOutput, sampled: Mapping[str, list[int]]) -> list[RequestUpdate]:
        """Apply a step's results. ``sampled`` maps each request that sampled to its accepted
        tokens: the draft tokens that verification accepted, then one new token.

        Requests aborted or finished since ``schedule()`` are skipped. Everything is validated
        before anything changes, so a malformed result leaves the scheduler as it was.
        """
        if not self._in_flight or output.step != self._in_flight[0][0]:
            raise ValueError("update_from_output takes each plan's output once, in the order they were made")
        work: list[tuple[Sequence, ScheduledSeq, list[int] | None]] = []
        in_flight = self._in_flight[0][1]
        num_sampling_with_tokens = 0  # batch ids are distinct, so this equals len(sampled) unless some are unexpected
        for item in output.scheduled:
            seq = in_flight[item.request_id]
            tokens = sampled.get(item.request_id) if item.sample else None
            if tokens is not None:
                num_sampling_with_tokens += 1
            if seq.status is not SeqStatus.RUNNING:
                continue
            if item.sample and not (  # a plain step's one valid token passes as it is (the common case)
                    tokens is not None and len(tokens) == 1 and not item.num_draft_tokens
                    and type(t := tokens[0]) is int and 0 <= t <= MAX_TOKEN_ID):
                tokens = checked_tokens(item, tokens)
            work.append((seq, item, tokens))
        if len(sampled) > num_sampling_with_tokens:
            unexpected = set(sampled) - {item.request_id for item in output.scheduled if item.sample}
            raise ValueError(f"tokens for requests that did not sample this step: {sorted(unexpected)[:5]}")
        self._in_flight.popleft()

        updates: list[RequestUpdate] = []
        bm = self.block_manager
        block_size = bm.block_size
        for seq, item, tokens in work:
            if tokens is None:
                seq.num_computed_tokens += len(item.token_ids)
                bm.publish_full_blocks(seq)
                continue
            rejected = item.num_draft_tokens - (len(tokens) - 1)
            seq.num_computed_tokens += len(item.token_ids) - rejected
            if seq.draft_token_ids:
                seq.draft_token_ids = []  # drafted from an older last token; the drafter offers new ones
            new_ids, reason, stop_id = append_tokens(seq, tokens, self.eos_token_id, self.config.max_model_len)
            if seq.num_computed_tokens // block_size > seq.num_published_blocks:  # else publishing is a no-op
                bm.publish_full_blocks(seq)  # accepted tokens only: rejected ones were never computed
            if item.num_draft_tokens:
                self._draft_tokens += item.num_draft_tokens
                self._accepted_tokens += len(tokens) - 1
                if rejected:  # blocks that only rejected drafts reached go back now
                    self._freed_draft_blocks += self.block_manager.trim(seq, seq.num_tokens)
            updates.append(RequestUpdate(seq.request_id, new_ids, reason, stop_id))
            if reason is not None:
                self._finish(seq, reason)
        return updates

    # ---- introspection ----

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def decoding(self) -> list[Sequence]:
        """Running requests whose next step is a decode (all their tokens but the last computed):
        the ones a drafter can propose for."""
        return [seq for seq in self._running.values() if seq.is_caught_up]

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            running=len(self._running),
            waiting=self.num_waiting,
            kv_blocks_in_use=bm.num_used_blocks,
            kv_blocks_cached=bm.num_cached_blocks,
            kv_blocks_free=bm.num_free_blocks,
            kv_blocks_total=bm.num_blocks,
            prefix_cache_queries=self._prefix_queries,
            prefix_cache_hits=self._prefix_hits,
            preemptions=self._num_preemptions,
            num_scheduled_tokens=self._last_num_scheduled,
            spec_draft_tokens=self._draft_tokens,
            spec_accepted_tokens=self._accepted_tokens,
            spec_freed_blocks=self._freed_draft_blocks,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError on any inconsistency. O(pool + requests): for tests."""
        bm = self.block_manager
        bm.check_invariants(seq.block_table for seq in self._running.values())
        if len(self._running) > self.config.max_num_seqs:
            raise AssertionError(f"{len(self._running)} running > max_num_seqs")
        waiting = [seq for q in self._waiting.values() for seq in q]
        if {s.request_id for s in waiting} | set(self._running) != set(self._requests):
            raise AssertionError("waiting + running differ from the live requests")
        if len(waiting) + len(self._running) != len(self._requests):
            raise AssertionError("a request is queued twice or both waiting and running")
        for seq in waiting:
            if seq.status is not SeqStatus.WAITING or seq.block_table or seq.num_computed_tokens:
                raise AssertionError(f"waiting {seq.request_id} holds state")
        for seq in self._running.values():
            if seq.status is not SeqStatus.RUNNING or not 0 <= seq.num_computed_tokens < seq.num_tokens:
                raise AssertionError(f"running {seq.request_id}: {seq.num_computed_tokens}/{seq.num_tokens} computed")
            if len(seq.block_table) < bm.blocks_for(seq.num_computed_tokens):
                raise AssertionError(f"running {seq.request_id} computed past its blocks")
            if seq.num_output_tokens >= seq.params.max_tokens:
                raise AssertionError(f"running {seq.request_id} should have finished")
