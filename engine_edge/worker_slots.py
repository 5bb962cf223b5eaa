"""Which requests hold the edge worker's sequence slots and KV cells: admission, reservations,
preemption, and placing a prompt in the slot whose cached KV serves it best.

A request goes to the slot ``prefix_cache.PrefixCache`` picks: a finished request leaves its KV
in its slot, so the next turn of a conversation computes only its new tokens; a slot's KV moves to
host memory when another conversation needs the slot, and back when restoring beats recomputing.
In a pool shared by all slots a sequence reserves cells as it grows (``GROW_CELLS`` at a time);
when the pool cannot give them, idle caches give way first, then the most recently admitted
sequence is preempted and later resumes by recomputing its tokens. ``LlamaWorker``
(engine_edge.llama_cpp_worker) owns the state and runs these between its steps.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from engine_edge.batch_plan import common_prefix
from engine_edge.prefix_cache import Placement, PrefixCache
from engine_edge.sampling import make_rng
from engine_edge.worker_channel import GenerateCmd, ProposeCmd
from llm_shared.contract import SamplingParams
from llm_shared.textstream import TextStream

if TYPE_CHECKING:
    from llm_shared.llamacpp_runtime import LlamaContext
    from llm_shared.tokenizer import Tokenizer

logger = logging.getLogger("engine_edge.llama_cpp_worker")  # the worker's records, under one name

# In a shared pool a sequence reserves its prompt plus this many cells, and this many more each
# time it reaches its reservation: reserving all of max_tokens up front would let a few default
# Realtime turns (4,096 tokens allowed each) keep every other request waiting.
GROW_CELLS = 256


@dataclass(eq=False)
class GenSeq:
    """A generating request in a slot (slot -1 while preempted)."""

    cmd: GenerateCmd
    slot: int
    tokens: list[int]  # prompt, then sampled tokens; the last one is not in the KV yet
    stream: TextStream
    rng: np.random.Generator
    reservation: int  # KV cells this sequence may grow to before it asks for more (counts against a shared pool)
    n_cached: int = 0
    n_reused: int = 0  # prompt tokens whose KV was already there (reported as cached_tokens)
    n_generated: int = 0

    @property
    def params(self) -> SamplingParams:
        return self.cmd.params


@dataclass(eq=False)
class DraftJob:
    """A proposal being drafted in the drafter's slot."""

    cmd: ProposeCmd
    slot: int
    tokens: list[int]  # context, then drafts; the last one is not in the KV yet
    n_cached: int
    reused: int
    ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)


class SlotAdmission:
    """The admission half of ``LlamaWorker``: the worker builds the state declared here."""

    _ctx: LlamaContext
    _tokenizer: Tokenizer
    _cache: PrefixCache
    _separate_streams: bool  # one KV stream per slot: no slot takes another's cells
    _free_slots: list[int]
    _running: dict[str, GenSeq]  # insertion order = admission order
    _waiting: list[tuple[int, int, str]]  # heap of (priority, arrival, request id)
    _waiting_cmds: dict[str, GenerateCmd]
    _preempted: deque[GenSeq]  # lost their cells to older sequences; resume first
    _arrivals: itertools.count[int]
    _draft_slot: int
    _draft_queue: deque[ProposeCmd]
    _draft_job: DraftJob | None
    _draft_cache: list[int]  # tokens whose KV the drafter slot holds
    _counters: dict[str, float]

    def _reserved_cells(self) -> int:
        job = self._draft_job
        draft = len(job.tokens) + job.cmd.k if job is not None else len(self._draft_cache)
        return draft + sum(s.reservation for s in self._running.values()) + self._cache.resident_tokens

    def _fits(self, cells: int) -> bool:
        """With separate per-sequence caches this always holds; with a unified pool it keeps
        the sum of what admitted sequences may grow to, and the KV idle slots keep, within the
        pool: idle caches give way first (the drafter's, then conversations', to host memory)."""
        if self._separate_streams or self._reserved_cells() + cells <= self._ctx.n_ctx:
            return True
        if self._draft_job is None and self._draft_cache:  # an idle drafter's cache is only an optimization
            self._ctx.seq_rm(self._draft_slot)
            self._draft_cache = []
        while self._reserved_cells() + cells > self._ctx.n_ctx and self._cache.resident:
            self._evict(self._cache.least_recent(self._cache.resident))
        return self._reserved_cells() + cells <= self._ctx.n_ctx

    def _evict(self, slot: int) -> None:
        """Move an idle slot's KV to host memory (within the budget) and clear the slot."""
        resident = self._cache.resident[slot]
        if self._cache.snapshot_budget_bytes > 0:
            self._cache.saved(resident, self._ctx.state_get(slot))
        self._cache.dropped(slot)
        self._ctx.seq_rm(slot)

    def _cap(self, seq: GenSeq) -> int:
        """The most cells ``seq`` can ever hold: its prompt plus max_tokens, within one sequence's limit."""
        return min(len(seq.cmd.prompt) + seq.params.max_tokens - 1, self._ctx.n_ctx_seq)

    def _grow_reservations(self) -> None:
        """Before a step: every running sequence gets the cells it may fill this step. One that
        has reached its reservation asks for ``GROW_CELLS`` more; if the pool cannot give them
        (idle caches already gave way), the most recently admitted other sequence is preempted:
        its cells are freed and it resumes, by recomputing its tokens, when cells are free again."""
        for seq in list(self._running.values()):  # oldest first: the oldest keep their cells
            if seq.cmd.request_id not in self._running:
                continue  # preempted for an older one in this loop
            while seq.reservation < min(len(seq.tokens) + 1, self._cap(seq)):
                more = min(GROW_CELLS, self._cap(seq) - seq.reservation)
                if self._fits(more):
                    seq.reservation += more
                    break
                victim = next(reversed(self._running.values()))
                self._preempt(victim)
                if victim is seq:
                    break

    def _preempt(self, seq: GenSeq) -> None:
        del self._running[seq.cmd.request_id]
        self._ctx.seq_rm(seq.slot)
        self._cache.dropped(seq.slot)
        self._free_slots.append(seq.slot)
        seq.slot, seq.n_cached, seq.reservation = -1, 0, 0
        self._preempted.append(seq)
        self._counters["preemptions"] += 1

    def _resume_preempted(self) -> bool:
        """Put preempted sequences back, oldest first; False while one still cannot fit."""
        while self._preempted and self._free_slots:
            seq = self._preempted[0]
            reservation = min(len(seq.tokens) + GROW_CELLS, self._cap(seq))
            if not self._fits(reservation):
                return False
            self._preempted.popleft()
            placement = self._cache.place(tuple(seq.tokens), self._free_slots, seq.cmd.salt)
            self._free_slots.remove(placement.slot)
            seq.slot, seq.reservation = placement.slot, reservation
            seq.n_cached = self._prepare_slot(placement)
            self._running[seq.cmd.request_id] = seq
        return not self._preempted

    def _admit(self) -> None:
        if self._draft_job is None and self._draft_queue:
            if self._fits(len(self._draft_queue[0].context) + self._draft_queue[0].k):
                self._start_draft(self._draft_queue.popleft())
        if not self._resume_preempted():
            return  # preempted sequences go before new ones
        while self._free_slots and self._waiting:
            request_id = self._waiting[0][2]
            cmd = self._waiting_cmds.get(request_id)
            if cmd is None:  # aborted while waiting
                heapq.heappop(self._waiting)
                continue
            reservation = min(len(cmd.prompt) + min(cmd.params.max_tokens, GROW_CELLS) - 1, self._ctx.n_ctx_seq)
            if not self._fits(reservation):
                return  # first come first served: later requests do not jump a big one
            heapq.heappop(self._waiting)
            del self._waiting_cmds[request_id]
            placement = self._cache.place(cmd.prompt, self._free_slots, cmd.salt)
            self._free_slots.remove(placement.slot)
            keep = self._prepare_slot(placement)
            seq = GenSeq(cmd, placement.slot, list(cmd.prompt), TextStream(self._tokenizer, cmd.params.stop),
                         make_rng(cmd.params.seed), reservation, n_cached=keep, n_reused=keep)
            self._running[request_id] = seq
            self._counters["prompt_tokens"] += len(cmd.prompt)

    def _prepare_slot(self, placement: Placement) -> int:
        """Carry out a placement; the prompt tokens whose KV the slot now holds (from position 0)."""
        slot, keep = placement.slot, placement.keep
        if placement.save is not None:
            self._cache.saved(placement.save, self._ctx.state_get(slot))
        if placement.restore is not None:
            self._ctx.seq_rm(slot)
            started = time.perf_counter()
            restored = self._ctx.state_set(slot, placement.restore.data)
            seconds = time.perf_counter() - started
            self._counters["restore_ms_total"] += seconds * 1e3
            self._cache.observe_restore(len(placement.restore.tokens), seconds)
            if not restored:
                logger.warning("llama.cpp refused a KV snapshot of %d tokens; recomputing", len(placement.restore.tokens))
                self._ctx.seq_rm(slot)
                return 0
        if keep == 0 or not self._ctx.seq_rm(slot, keep, -1):
            self._ctx.seq_rm(slot)
            return 0
        return keep

    def _start_draft(self, cmd: ProposeCmd) -> None:
        context = list(cmd.context)
        # Keep the KV of the longest common prefix, but re-read at least the last context
        # token: its logits are the first draft's distribution.
        keep = min(common_prefix(self._draft_cache, context), len(context) - 1)
        if not self._ctx.seq_rm(self._draft_slot, keep, -1):
            self._ctx.seq_rm(self._draft_slot)
            keep = 0
        self._draft_cache = context[:keep]
        self._draft_job = DraftJob(cmd, self._draft_slot, context, n_cached=keep, reused=keep)
        self._counters["draft_tokens_reused"] += keep
        self._counters["draft_prefill_tokens"] += len(context) - keep
