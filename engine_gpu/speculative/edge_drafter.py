"""The edge model as a drafter: the GGUF the edge tier serves, run by llama.cpp inside the torch
engine's own process (``llm_shared.llamacpp_runtime``; engines do not import each other).

Each request holds one llama.cpp sequence id (its slot) in a unified KV pool, and the drafter
remembers which tokens that slot's KV holds. A ``propose`` round:

1. cuts every slot back to its common prefix with the request's ``token_ids``: after a
   rejection the drafts past the accepted ones go, and the token the target added is simply
   one more missing token. This is how the drafter's KV follows what the target accepted;
2. feeds the missing tokens of every request in one ``llama_decode`` (a few past ``n_batch``),
   with logits at each request's last token only; they give every request's first draft;
3. drafts on: ``k - 1`` more ``llama_decode`` calls, each with one token for every sequence
   still drafting (never one call per sequence). Requests may ask for different ``k``.

The last draft is never fed: its KV is needed only if the target accepts it, and then the next
round's catch-up feeds it with the target's bonus token.

A drafter reads at most ``window`` tokens back (0: the whole context): a request new to it, or
one that fell further behind than that while it sat out, gets its slot started afresh at its
last ``window`` tokens. Catching up then costs a bounded forward, not the whole conversation
(llama.cpp reads prompts at ~430 tokens/s on these CPUs, slower than the bf16 target's prefill),
at the price of drafting from a shorter context; the controller measures what that does to
acceptance. A slot that would outgrow the positions it may hold restarts at the window too.

Room: a request drafts fewer tokens (possibly none) where its context plus ``k`` would pass the
pool or the model's trained context, rather than fail. Slots of requests not in the round are
idle and give their KV back, least recently used first, when the pool or the sequence ids run
out; a request that still finds none gets an empty draft.

Not thread-safe by design: the engine core calls it from its one thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine_gpu.sampler import sampling_probs
from engine_gpu.speculative.drafter import MAX_DRAFT_TOKENS, Draft, DraftRequest, draft_uniform
from engine_gpu.speculative.verify import draw
from llm_shared.errors import EngineError
from llm_shared.llamacpp_runtime import KV_PAD, ContextShape, LlamaContext, LlamaModel, TokenBatch
from llm_shared.load_cache import LoadCache
from llm_shared.modelfile import check_gguf
from llm_shared.tokenizer import Tokenizer, check_same_tokenizer

logger = logging.getLogger(__name__)

BATCH_TOKENS = 512  # most tokens per llama_decode (catch-up past this takes several calls)


@dataclass(eq=False)
class _Slot:
    seq_id: int  # llama.cpp sequence id
    tokens: list[int]  # tokens whose KV the sequence holds, positions 0..len-1
    last_used: int  # the propose call that last used it: least recently used gives way first
    start: int = 0  # where in the request's token ids its position 0 is (> 0: it reads a window)


@dataclass(eq=False)
class _Job:
    """One request's work in one propose call."""

    req: DraftRequest
    slot: _Slot
    n_draft: int  # drafts it will make (k cut to the room there is)
    drafts: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # q rows of sampled drafts
    failed: bool = False  # a decode of its tokens failed: it drafts no further


def _common_prefix(held: list[int], ids: list[int]) -> int:
    n = min(len(held), len(ids))
    if held[:n] == ids[:n]:
        return n
    return next(i for i in range(n) if held[i] != ids[i])


class EdgeDrafter:
    """``Drafter`` over a GGUF model in llama.cpp, all requests' sequences in one unified KV pool.

    Not thread-safe: one thread (the engine core's) calls every method, ``close`` included.
    """

    name = "edge"

    def __init__(
        self,
        model_path: Path,
        *,
        max_seqs: int,
        kv_cells: int = 0,
        kv_mib: float = 0.0,
        n_threads: int = 0,
        window: int = 0,
        target_tokenizer: Tokenizer | None = None,
        tokenizer_cache: LoadCache | None = None,
    ) -> None:
        """``max_seqs`` requests hold KV at once and share one pool of ``kv_cells`` cells, or of
        what ``kv_mib`` MiB hold at the model's cost per cell (one of the two; rounded up to a
        multiple of 256); ``n_threads`` 0 = all usable cores; ``window`` the most tokens of a
        context it reads (0: all). With ``target_tokenizer`` the GGUF's own tokenizer (read
        through ``tokenizer_cache`` when given) must match it id for id (``ConfigError``
        otherwise)."""
        if max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1, got {max_seqs}")
        if window < 0:
            raise ValueError(f"window must be >= 0 (0 = the whole context), got {window}")
        if (kv_cells >= 1) == (kv_mib > 0):
            raise ValueError(f"give one of kv_cells (>= 1) or kv_mib (> 0), got {kv_cells} and {kv_mib}")
        if n_threads < 0:
            raise ValueError(f"n_threads must be >= 0 (0 = all usable cores), got {n_threads}")
        path = check_gguf(Path(model_path))
        if target_tokenizer is not None:
            drafter_tokenizer = Tokenizer.from_gguf(path, cache=tokenizer_cache)
            check_same_tokenizer(target_tokenizer, drafter_tokenizer, f"{self.name} ({path.name})")
        self._model = LlamaModel(path)
        try:
            if kv_mib > 0:
                kv_cells = max(1, int(kv_mib * 2**20) // self._model.kv_bytes_per_cell)
            shape = ContextShape(n_ctx=-(-kv_cells // KV_PAD) * KV_PAD, n_seqs=max_seqs,
                                 n_batch=max(BATCH_TOKENS, max_seqs), n_threads=n_threads, kv_unified=True)
            self._ctx = LlamaContext(self._model, shape)
        except BaseException:
            self._model.free()
            raise
        self._batch = TokenBatch(self._ctx.n_batch)
        self.n_vocab: int = self._model.n_vocab
        self.max_seqs = max_seqs
        self.n_ctx: int = self._ctx.n_ctx  # cells in the pool
        self.n_ctx_seq: int = self._ctx.n_ctx_seq  # most positions one sequence may have (pool, trained context)
        self._slots: dict[str, _Slot] = {}
        self._free_ids = list(range(max_seqs - 1, -1, -1))  # pop() hands out the lowest id first
        self.window = window
        self._calls = 0
        self._closed = False
        self.last_forwards: list[tuple[int, float]] = []  # (tokens, seconds) of each llama_decode of the latest propose
        self._calibration: list[tuple[int, float]] | None = None
        self._counters = {"drafter_tokens_proposed": 0, "drafter_decode_calls": 0, "drafter_catchup_tokens": 0,
                          "drafter_propose_calls": 0, "drafter_evictions": 0, "drafter_decode_failures": 0}

    # ---- Drafter -------------------------------------------------------------------------------

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Draft]:
        """A draft for every request (empty where there was no room). Malformed input raises
        ``ValueError`` before any slot is touched."""
        if self._closed:
            raise EngineError("the edge drafter is closed")
        work = self._validated(requests)  # raises before any slot is touched
        self._calls += 1
        self._counters["drafter_propose_calls"] += 1
        self.last_forwards = []
        in_call = {req.request_id for req in requests}
        future = {slot.seq_id: len(slot.tokens) for slot in self._slots.values()}  # cells after this call
        jobs: list[_Job] = []
        catch_up: list[tuple[_Job, list[int]]] = []
        for req, ids, common in work:
            planned = self._plan(req, ids, common, in_call, future)
            if planned is not None:
                job, missing = planned
                jobs.append(job)
                catch_up.append((job, missing))
        self._counters["drafter_catchup_tokens"] += sum(len(missing) for _, missing in catch_up)
        # A sequence more than the usual bonus (and last draft) behind catches up first, in a
        # forward of its own: a one-off per request (its prompt, or what it missed while it sat
        # out), which the controller prices apart from drafting.
        behind = [(job, missing[:-1]) for job, missing in catch_up if len(missing) > 2]
        if behind:
            self._feed(behind)
            catch_up = [(job, missing[-1:] if len(missing) > 2 else missing) for job, missing in catch_up
                        if not job.failed]
        self._pick(self._feed(catch_up))
        while drafting := [job for job in jobs if job.drafts and len(job.drafts) < job.n_draft and not job.failed]:
            self._pick(self._feed([(job, [job.drafts[-1]]) for job in drafting]))
        out = {req.request_id: Draft([], None) for req in requests}
        for job in jobs:
            probs = torch.stack(job.probs) if job.probs else None
            out[job.req.request_id] = Draft(job.drafts, probs)
            self._counters["drafter_tokens_proposed"] += len(job.drafts)
        return out

    def behind(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Tokens the next ``propose`` for this context would feed before its first draft."""
        n = len(token_ids)
        slot = self._slots.get(request_id)
        if slot is None:
            return n - self._window_start(n)
        held = _common_prefix(slot.tokens, list(token_ids[slot.start:]))
        fed = n - slot.start - min(held, n - slot.start - 1)
        return min(fed, self.window) if self.window else fed

    def calibrate(self) -> list[tuple[int, float]]:
        """Forwards of 1 to 64 tokens in a scratch sequence, the faster of two each; timed once."""
        if self._calibration is not None:
            return self._calibration
        if self._closed or not self._free_ids:
            return []
        seq_id = self._free_ids[-1]  # the next slot's id: free now, and nothing else runs meanwhile
        out: list[tuple[int, float]] = []
        for n in (1, 2, 4, 8, 16, 64):
            if n > self._batch.capacity or n > self.n_ctx_seq:
                break
            times = []
            for _ in range(2):
                self._batch.clear()
                for pos in range(n):
                    self._batch.add(pos % self.n_vocab, pos, seq_id, pos == n - 1)
                started = time.perf_counter()
                rc = self._ctx.decode(self._batch)
                times.append(time.perf_counter() - started)
                self._ctx.seq_rm(seq_id)
                if rc != 0:
                    return out
            out.append((n, min(times)))
        self._batch.clear()
        self._calibration = out
        return out

    def release(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None and not self._closed:
            self._ctx.seq_rm(slot.seq_id)
            self._free_ids.append(slot.seq_id)

    def stats(self) -> dict[str, float]:
        cells = 0 if self._closed else sum(self._ctx.seq_pos_max(s) + 1 for s in range(self.max_seqs))
        return {**{k: float(v) for k, v in self._counters.items()},
                "drafter_slots_in_use": float(len(self._slots)),
                "drafter_kv_cells_used": float(cells),  # read from llama.cpp, not from our bookkeeping
                "drafter_kv_cells_total": float(self.n_ctx)}

    def set_threads(self, threads: int) -> None:
        self._ctx.set_threads(threads)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._slots.clear()
        self._batch.free()
        self._ctx.free()
        self._model.free()

    # ---- planning ------------------------------------------------------------------------------

    def _validated(self, requests: Sequence[DraftRequest]) -> list[tuple[DraftRequest, list[int], int]]:
        """Each request with its token ids as a list and the prefix its slot already holds."""
        out: list[tuple[DraftRequest, list[int], int]] = []
        seen: set[str] = set()
        for req in requests:
            rid = req.request_id
            if rid in seen:
                raise ValueError(f"request {rid!r} appears twice in one propose call")
            seen.add(rid)
            if isinstance(req.k, bool) or not isinstance(req.k, int) or not 1 <= req.k <= MAX_DRAFT_TOKENS:
                raise ValueError(f"request {rid!r}: k must be an integer in 1..{MAX_DRAFT_TOKENS}, got {req.k!r}")
            if req.output_index < 0:
                raise ValueError(f"request {rid!r}: output_index must be >= 0, got {req.output_index}")
            ids = list(req.token_ids)
            if not ids:
                raise ValueError(f"request {rid!r}: token_ids is empty; drafting continues at least one token")
            slot = self._slots.get(rid)
            start = slot.start if slot is not None else 0
            common = _common_prefix(slot.tokens, ids[start:]) if slot is not None else 0
            for pos in range(start + common, len(ids)):  # what the slot holds was checked when it was fed
                t = ids[pos]
                if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < self.n_vocab:
                    raise ValueError(f"request {rid!r}: token id {t!r} at position {pos} is outside the "
                                     f"drafter's vocabulary (0..{self.n_vocab - 1})")
                ids[pos] = int(t)
            out.append((req, ids, common))
        return out

    def _plan(
        self, req: DraftRequest, ids: list[int], common: int, in_call: set[str], future: dict[int, int]
    ) -> tuple[_Job, list[int]] | None:
        """The request's job and the tokens its slot is missing, with the slot cut back; None
        when it drafts nothing this call (no room, or its context is at the limit)."""
        slot = self._slots.get(req.request_id)
        start = slot.start if slot is not None else self._window_start(len(ids))
        if slot is not None and self.window and (
                len(ids) - start - min(common, len(ids) - start - 1) > self.window  # fell far behind
                or len(ids) - start + req.k > self.n_ctx_seq):  # would outgrow its positions
            start, common = self._window_start(len(ids)), 0  # read the last window afresh
        n_pos = len(ids) - start  # positions the slot holds once caught up
        n_draft = min(req.k, self.n_ctx_seq - n_pos)  # no draft at or past the last usable position
        if n_draft < 1:
            return None
        if slot is None:
            if not self._free_ids and not self._evict_lru(in_call, future):
                return None  # every sequence id belongs to a request in this call
            slot = self._slots[req.request_id] = _Slot(self._free_ids.pop(), [], self._calls, start)
            future[slot.seq_id] = 0
            common = 0
        slot.last_used = self._calls
        # Cells: the last draft is not fed, so the slot ends the call holding n_pos + n_draft - 1.
        pinned = sum(future[s.seq_id] for rid, s in self._slots.items() if rid in in_call and s is not slot)
        if pinned + n_pos <= self.n_ctx:  # idle slots can make room for at least one draft
            while sum(future.values()) - future[slot.seq_id] + n_pos + n_draft - 1 > self.n_ctx:
                if not self._evict_lru(in_call, future):
                    break
        n_draft = min(n_draft, self.n_ctx - (sum(future.values()) - future[slot.seq_id]) - n_pos + 1)
        if n_draft < 1:
            if not slot.tokens:  # a slot made for this call only: give its id back
                self.release(req.request_id)
                del future[slot.seq_id]
            return None
        keep = min(common, n_pos - 1)  # the last token is re-read even if held: its logits are draft 0's
        if not self._ctx.seq_rm(slot.seq_id, keep, -1):
            self._ctx.seq_rm(slot.seq_id)
            keep = 0
        del slot.tokens[keep:]
        slot.start = start
        future[slot.seq_id] = n_pos + n_draft - 1
        return _Job(req, slot, n_draft), ids[start + keep:]

    def _window_start(self, n_tokens: int) -> int:
        """Where a slot started afresh for a context of ``n_tokens`` begins."""
        return max(0, n_tokens - self.window) if self.window else 0

    def _evict_lru(self, in_call: set[str], future: dict[int, int]) -> bool:
        idle = [(slot.last_used, rid) for rid, slot in self._slots.items() if rid not in in_call]
        if not idle:
            return False
        _, rid = min(idle)
        future.pop(self._slots[rid].seq_id, None)
        self.release(rid)
        self._counters["drafter_evictions"] += 1
        return True

    # ---- execute -------------------------------------------------------------------------------

    def _feed(self, work: list[tuple[_Job, list[int]]]) -> dict[_Job, np.ndarray]:
        """Append each job's tokens to its sequence in as few ``llama_decode`` calls as the batch
        allows (one when they fit); the logits after each job's last token, copied out of
        llama.cpp's buffer. A job whose decode failed is marked failed and gets no logits."""
        rows: dict[_Job, np.ndarray] = {}
        pending: list[tuple[_Job, list[int], int]] = []  # (job, its tokens in this batch, logits index or -1)
        batch = self._batch
        batch.clear()
        for job, tokens in sorted(work, key=lambda item: item[0].slot.seq_id):
            i = 0
            while i < len(tokens):
                if batch.n_tokens == batch.capacity:
                    self._flush(pending, rows)
                if job.failed:
                    break
                take = min(len(tokens) - i, batch.capacity - batch.n_tokens)
                base = len(job.slot.tokens)  # its earlier chunks, if any, are decoded by now
                index = -1
                for n in range(take):
                    index = batch.add(tokens[i + n], base + n, job.slot.seq_id, i + n == len(tokens) - 1)
                i += take
                pending.append((job, tokens[i - take : i], index if i == len(tokens) else -1))
        if pending:
            self._flush(pending, rows)
        return rows

    def _flush(self, pending: list[tuple[_Job, list[int], int]], rows: dict[_Job, np.ndarray]) -> None:
        started = time.perf_counter()
        rc = self._ctx.decode(self._batch)
        self.last_forwards.append((self._batch.n_tokens, time.perf_counter() - started))
        self._counters["drafter_decode_calls"] += 1
        if rc != 0:
            # rc 1: no room in the pool (fragmentation); others: llama.cpp errors. Positions from
            # this batch on are cut so the sequences stay consecutive; earlier KV is intact.
            self._counters["drafter_decode_failures"] += 1
            logger.warning("edge drafter: llama_decode returned %d for %d tokens; those sequences draft no further",
                           rc, self._batch.n_tokens)
        for job, chunk, index in pending:
            if rc != 0:
                self._ctx.seq_rm(job.slot.seq_id, len(job.slot.tokens), -1)
                job.failed = True
                continue
            job.slot.tokens.extend(chunk)
            if index >= 0:
                rows[job] = self._ctx.logits(index).copy()
        pending.clear()
        self._batch.clear()

    def _pick(self, rows: dict[_Job, np.ndarray]) -> None:
        """The next draft of every job with logits: argmax for greedy requests, otherwise drawn
        from q = sampling_probs(logits) with the drafter's own uniforms (q kept for verification)."""
        sampled = [job for job in rows if not job.req.params.greedy]
        for job, row in rows.items():
            if job.req.params.greedy:
                job.drafts.append(int(np.argmax(row)))
        if not sampled:
            return
        params = [job.req.params for job in sampled]
        q = sampling_probs(  # [len(sampled), V] float32
            torch.from_numpy(np.stack([rows[job] for job in sampled])),
            torch.tensor([p.temperature for p in params], dtype=torch.float32),
            torch.tensor([p.top_k for p in params], dtype=torch.int64),
            torch.tensor([p.top_p for p in params], dtype=torch.float32),
        )
        for job, row in zip(sampled, q, strict=True):
            u = draft_uniform(job.req.seed, job.req.output_index, len(job.drafts))
            job.drafts.append(draw(row, u))
            job.probs.append(row)
