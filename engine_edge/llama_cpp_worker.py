"""The one thread that owns a llama.cpp context: it admits requests into sequence slots and
decodes a single batch per step for all of them, then samples and streams.

Which requests hold slots and KV cells (admission, reservations, preemption, the slot whose
cached KV serves a prompt best) is engine_edge.worker_slots, run between steps. Only requests with
the same cache salt reuse each other's KV.

A step is schedule (``plan_batch``: which tokens of which sequences), execute (one
``llama_decode``) and update (sample, emit, finish). Commands from the asyncio front are
read before every step, so an abort lands within one step and frees the sequence's KV at
once. Slots ``0..n_slots-1`` hold requests; slot ``n_slots`` belongs to the drafter, whose KV
stays cached between proposals so the next one re-reads only the context that changed.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import time
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from engine_edge.base import Draft
from engine_edge.batch_plan import Active, Span, plan_batch
from engine_edge.prefix_cache import PrefixCache
from engine_edge.sampling import greedy_with_prob, sample
from engine_edge.worker_channel import (
    AbortCmd,
    CallCmd,
    CloseCmd,
    Command,
    GenerateCmd,
    ProposeCmd,
    reject,
    resolve,
)
from engine_edge.worker_slots import DraftJob, GenSeq, SlotAdmission
from llm_shared.contract import FinishEvent, FinishReason, TokenEvent
from llm_shared.errors import EngineUnavailableError
from llm_shared.structured import allocate_bitmask, apply_bitmask

if TYPE_CHECKING:
    from llm_shared.llamacpp_runtime import LlamaContext, LlamaModel, TokenBatch
    from llm_shared.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# While other sequences are decoding, a prompt enters at most this many tokens per step, so a
# long prompt stretches one step to ~0.3 s on two cores instead of ~1 s (n_batch tokens).
PREFILL_CHUNK_WHILE_DECODING = 128
INTERNAL_ERROR = "internal error while generating; please retry"


class LlamaWorker(SlotAdmission):
    """Owns ``ctx`` (and frees it with the model on exit). Call ``run`` on a dedicated thread."""

    def __init__(
        self,
        model: LlamaModel,
        ctx: LlamaContext,
        batch: TokenBatch,
        tokenizer: Tokenizer,
        commands: queue.SimpleQueue[Command],
        n_slots: int,
        *,
        prefix_reuse: bool = True,
        snapshot_budget_bytes: int = 0,
    ) -> None:
        """``snapshot_budget_bytes`` bounds the host copies of evicted conversations (0: none;
        a runtime without ``state_get``/``state_set`` must pass 0)."""
        self._model = model
        self._ctx = ctx
        self._batch = batch
        self._tokenizer = tokenizer
        self._commands = commands
        self._free_slots = list(range(n_slots))
        self._n_slots = n_slots
        self._cache = PrefixCache(n_slots, snapshot_budget_bytes, enabled=prefix_reuse)
        self._separate_streams = ctx.separate_streams  # one KV stream per slot: no slot takes another's cells
        self._draft_slot = n_slots
        self._running: dict[str, GenSeq] = {}  # insertion order = admission order
        self._waiting: list[tuple[int, int, str]] = []  # heap of (priority, arrival, request id)
        self._waiting_cmds: dict[str, GenerateCmd] = {}
        self._preempted: deque[GenSeq] = deque()  # lost their cells to older sequences; resume first
        self._arrivals = itertools.count()
        self._draft_queue: deque[ProposeCmd] = deque()
        self._draft_job: DraftJob | None = None
        self._draft_cache: list[int] = []  # tokens whose KV the drafter slot holds
        self._closing = False
        self._bitmask: np.ndarray | None = None  # a grammar's mask row (_bitmask_row)
        self._counters = {"steps": 0, "tokens_generated": 0, "prompt_tokens": 0,
                          "draft_tokens_reused": 0, "draft_prefill_tokens": 0, "errors": 0, "restore_ms_total": 0,
                          "preemptions": 0, "thread_changes": 0}
        self.snapshot: dict[str, float] = {}  # replaced (never mutated) after every step and before a FinishEvent
        self._publish()

    @property
    def context(self) -> LlamaContext:
        return self._ctx

    def set_threads(self, threads: int) -> None:
        """Decode on ``threads`` threads from the next step (on this thread, between steps)."""
        if threads != self._ctx.n_threads:
            self._ctx.set_threads(threads)
            self._counters["thread_changes"] += 1
            self._publish()  # before the caller hears it is done

    # ---- main loop -------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while not self._closing:
                try:
                    self._receive(block=self._idle())
                    if self._closing:
                        break
                    self._admit()
                    if self._running or self._draft_job is not None:
                        self._step()
                except Exception:  # a bug here must not take the server down: fail what ran, go on
                    logger.exception("llama.cpp worker step failed")
                    self._fail_all(INTERNAL_ERROR)
                self._publish()
        finally:
            self._shutdown()

    def _idle(self) -> bool:
        return not (self._running or self._waiting_cmds or self._preempted or self._draft_job or self._draft_queue)

    def _step(self) -> None:
        self._grow_reservations()
        if not (self._running or self._draft_job):
            return
        active: list[Active] = [*([self._draft_job] if self._draft_job else []), *self._running.values()]
        spans = plan_batch(active, self._batch.capacity, PREFILL_CHUNK_WHILE_DECODING)
        started = time.perf_counter()
        fed = self._execute(spans)
        if fed is not None:
            prompt_tokens = sum(span.end - span.start for span in spans if span.end - span.start > 1)
            if prompt_tokens >= len(spans):  # mostly prompt: a fair sample of what a cached token saves
                self._cache.observe_prefill(self._batch.n_tokens, time.perf_counter() - started)
            self._update(fed)
        self._counters["steps"] += 1

    # ---- commands ----------------------------------------------------------------------------

    def _receive(self, *, block: bool) -> None:
        try:
            cmd = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: Command) -> None:
        if isinstance(cmd, GenerateCmd):
            heapq.heappush(self._waiting, (int(cmd.priority), next(self._arrivals), cmd.request_id))
            self._waiting_cmds[cmd.request_id] = cmd
        elif isinstance(cmd, AbortCmd):
            self._abort(cmd.request_id)
            resolve(cmd.done, None)
        elif isinstance(cmd, ProposeCmd):
            self._draft_queue.append(cmd)
        elif isinstance(cmd, CallCmd):
            try:
                resolve(cmd.done, cmd.fn())
            except Exception as e:  # handed to the caller, who asked for this call
                reject(cmd.done, e)
        elif isinstance(cmd, CloseCmd):
            self._closing = True

    def _abort(self, request_id: str) -> None:
        seq = self._running.get(request_id) or next(
            (s for s in self._preempted if s.cmd.request_id == request_id), None)
        if seq is not None:
            self._finish(seq, "abort", seq.stream.finish())
            return
        cmd = self._waiting_cmds.pop(request_id, None)
        if cmd is not None:  # its heap entry is skipped when it surfaces
            self._publish()  # no longer waiting, before its finish is read
            cmd.sink.put(FinishEvent("abort", prompt_tokens=len(cmd.prompt), completion_tokens=0, tier="edge"))

    # ---- execute and update ------------------------------------------------------------------

    def _execute(self, spans: list[Span]) -> list[tuple[Span, int]] | None:
        """Decode the spans; each comes back with the batch index of its logits (-1: none)."""
        batch = self._batch
        batch.clear()
        fed: list[tuple[Span, int]] = []
        try:
            # Tokens in increasing sequence id: with separate KV streams, a batch whose ids are
            # out of order made every step about twice as slow (measured at 8 sequences).
            for span in sorted(spans, key=lambda span: span.seq.slot):
                index = -1
                tokens, slot = span.seq.tokens, span.seq.slot
                for pos in range(span.start, span.end):
                    index = batch.add(tokens[pos], pos, slot, pos == span.end - 1 and span.wants_logits)
                fed.append((span, index if span.wants_logits else -1))
            rc = self._ctx.decode(batch)
        except Exception:
            logger.exception("llama_decode raised")
            rc = -100
        if rc == 0:
            return fed
        # rc 1 (no KV slot) restores the cache; other failures may leave partial KV behind.
        # Either way the sequences in this batch cannot trust their cache: fail them.
        logger.error("llama_decode returned %d for a batch of %d tokens", rc, batch.n_tokens)
        for span in spans:
            self._fail(span.seq, "the model context is full; retry later" if rc == 1 else INTERNAL_ERROR)
        return None

    def _update(self, fed: list[tuple[Span, int]]) -> None:
        for span, index in fed:
            seq = span.seq
            seq.n_cached = span.end
            if index < 0:
                continue
            try:
                logits = self._ctx.logits(index)
                if isinstance(seq, DraftJob):
                    self._advance_draft(seq, logits)
                elif isinstance(seq, GenSeq):
                    self._advance_generation(seq, logits)
            except Exception:
                logger.exception("sampling failed")
                self._fail(seq, INTERNAL_ERROR)

    def _advance_generation(self, seq: GenSeq, logits: np.ndarray) -> None:
        params = seq.params
        matcher = seq.cmd.matcher
        if matcher is not None:  # only the tokens the output grammar allows (logits: llama.cpp's buffer, read once)
            row = self._bitmask_row()
            matcher.fill_bitmask(row)
            apply_bitmask(logits, row)
        picked = sample(logits, params, seq.rng)
        token_id = picked.token_id
        if token_id in params.stop_token_ids or (not params.ignore_eos and self._model.is_eog(token_id)):
            self._finish(seq, "stop", seq.stream.finish())
            return
        if matcher is not None and (not matcher.accept(token_id) or matcher.error is not None):
            logger.warning("request %s: %s", seq.cmd.request_id, matcher.error or "a token left the output grammar")
            self._finish(seq, "error", "", "the output could not be kept to its grammar")
            return
        text, stopped = seq.stream.push(token_id)
        seq.n_generated += 1
        self._counters["tokens_generated"] += 1
        if not seq.cmd.sink.put(TokenEvent(token_id, text, picked.logprob, picked.top_logprobs)):
            self._finish(seq, "abort", "")  # the consumer's loop is gone
        elif stopped:
            self._finish(seq, "stop", "")
        elif seq.n_generated >= params.max_tokens:
            self._finish(seq, "length", seq.stream.finish())
        elif len(seq.tokens) >= self._ctx.n_ctx_seq:  # no cell left to store this token in
            self._finish(seq, "length", seq.stream.finish())
        else:
            seq.tokens.append(token_id)

    def _bitmask_row(self) -> np.ndarray:
        """This worker's one bitmask row, reused for every constrained token (one thread)."""
        if self._bitmask is None:
            self._bitmask = allocate_bitmask(1, self._tokenizer.vocab_size)[0]
        return self._bitmask

    def _advance_draft(self, job: DraftJob, logits: np.ndarray) -> None:
        token_id, prob = greedy_with_prob(logits)
        job.ids.append(token_id)
        job.probs.append(prob)
        if len(job.ids) < job.cmd.k:
            job.tokens.append(token_id)
            return
        self._draft_cache = job.tokens[: job.n_cached]
        self._draft_job = None
        resolve(job.cmd.done, Draft(tuple(job.ids), tuple(job.probs), reused_tokens=job.reused))

    # ---- finishing -------------------------------------------------------------------------------

    def _finish(self, seq: GenSeq, reason: FinishReason, tail: str, message: str = "") -> None:
        if seq.slot < 0:  # preempted: it holds no slot and no cells
            self._preempted.remove(seq)
        else:
            self._release_slot(seq, reason)
        # Stats first: whoever reads the FinishEvent must not still see the request's cells in use.
        self._publish()
        seq.cmd.sink.put(FinishEvent(reason, prompt_tokens=len(seq.cmd.prompt), completion_tokens=seq.n_generated,
                                     cached_tokens=seq.n_reused, text=tail, message=message, tier="edge"))

    def _release_slot(self, seq: GenSeq, reason: FinishReason) -> None:
        del self._running[seq.cmd.request_id]
        self._free_slots.append(seq.slot)
        if reason == "error":  # its KV may be partial: nothing of it is reused
            self._ctx.seq_rm(seq.slot)
            self._cache.dropped(seq.slot)
        else:  # the work stops now; its KV stays as cache for the conversation's next turn
            self._cache.finished(seq.slot, seq.tokens[: seq.n_cached], seq.cmd.session, len(seq.cmd.prompt),
                                 seq.cmd.salt)
            if not self._cache.enabled:
                self._ctx.seq_rm(seq.slot)

    def kv_state(self) -> dict[str, dict[int, int]]:
        """Cells per generation slot, read at once: every slot's (``held``), those of running
        requests, and those idle slots keep as cache; ``held`` is exactly the other two."""
        held = {slot: self._ctx.seq_pos_max(slot) + 1 for slot in range(self._draft_slot)}
        return {"held": {slot: n for slot, n in held.items() if n > 0},
                "running": {s.slot: held[s.slot] for s in self._running.values() if held[s.slot] > 0},
                "cached": {slot: len(r.tokens) for slot, r in self._cache.resident.items()}}

    def end_session(self, session: str) -> int:
        """Drop the KV and host copies a conversation left behind; the slots cleared."""
        slots = self._cache.end_session(session)
        for slot in slots:
            self._ctx.seq_rm(slot)
        self._publish()
        return len(slots)

    def _fail(self, seq: Active, message: str) -> None:
        self._counters["errors"] += 1
        if isinstance(seq, GenSeq):
            if seq.cmd.request_id in self._running or seq in self._preempted:
                self._finish(seq, "error", "", message)
        elif isinstance(seq, DraftJob):
            self._ctx.seq_rm(self._draft_slot)
            self._draft_cache = []
            if self._draft_job is seq:
                self._draft_job = None
            reject(seq.cmd.done, EngineUnavailableError(message))

    def _fail_all(self, message: str) -> None:
        for seq in [*self._running.values(), *self._preempted]:
            self._fail(seq, message)
        if self._draft_job is not None:
            self._fail(self._draft_job, message)

    def _shutdown(self) -> None:
        message = "the edge engine shut down"
        self._fail_all(message)
        for cmd in self._waiting_cmds.values():
            cmd.sink.put(FinishEvent("error", prompt_tokens=len(cmd.prompt), completion_tokens=0,
                                     message=message, tier="edge"))
        self._waiting_cmds.clear()
        for job in self._draft_queue:
            reject(job.done, EngineUnavailableError(message))
        self._draft_queue.clear()
        self._publish()
        self._batch.free()
        self._ctx.free()
        self._model.free()

    def _publish(self) -> None:
        cells = sum(s.n_cached for s in self._running.values())
        cells += self._draft_job.n_cached if self._draft_job else len(self._draft_cache)
        cache = self._cache
        self.snapshot = {
            "running": float(len(self._running)),
            "waiting": float(len(self._waiting_cmds) + len(self._preempted)),
            "max_running": float(self._n_slots),  # turns that can run at once (llm_shared.contract.engine_backlog)
            "kv_cells_used": float(cells),  # held by running work
            "kv_cells_cached": float(cache.resident_tokens),  # kept by idle slots for their conversations
            "kv_cells_total": float(self._ctx.n_ctx),
            "threads": float(getattr(self._ctx, "n_threads", 0)),
            "prefix_cache_queries": float(cache.stats.queried_tokens),
            "prefix_cache_hits": float(cache.stats.hit_tokens),
            "snapshots": float(len(cache.snapshots)),
            "snapshot_bytes": float(cache.snapshot_bytes),
            "snapshot_budget_bytes": float(cache.snapshot_budget_bytes),
            "snapshot_saves": float(cache.stats.saves),
            "snapshot_restores": float(cache.stats.restores),
            "snapshot_evictions": float(cache.stats.snapshot_evictions),
            **{k: float(v) for k, v in self._counters.items()},
        }
