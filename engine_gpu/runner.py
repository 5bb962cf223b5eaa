"""The model runner: one forward over a flattened varlen batch, plain Python in and out.

Each step takes the scheduler's ``ScheduledSeq``s (any mix of prompt chunks, decodes and draft
tokens), writes the K/V of all new tokens into their paged slots, attends causally through each
sequence's block table, and samples where asked. It makes no scheduling decisions: block ids and
positions come from the caller, so tests run it from hand-built ``ScheduledSeq``s.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_gpu.attention import get_attention_backend
from engine_gpu.attention.base import AttentionBackend, PagedLayout
from engine_gpu.config import resolve_dtype
from engine_gpu.graph_runner import GraphRunner, graphs_wanted
from engine_gpu.kv_cache import PagedKVCache
from engine_gpu.sampler import SampledToken, Sampler, masked_logits
from engine_gpu.sched_output import PENDING_TOKEN, ScheduledSeq
from engine_gpu.speculative.verify_batch import verify_drafts
from llm_shared.contract import SamplingParams
from llm_shared.errors import ConfigError
from llm_shared.llama import matmul
from llm_shared.llama.loader import load_model
from llm_shared.llama.model import LlamaModel
from llm_shared.load_cache import LoadCache
from llm_shared.modelfile import resolve_source

if TYPE_CHECKING:
    from engine_gpu.config import EngineConfig
    from llm_shared.models import ModelConfig

__all__ = ["ModelRunner", "SampledToken", "StepResult", "build_layout"]

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def build_layout(
    starts: list[int], lengths: list[int], block_tables: list[list[int]], block_size: int, device: torch.device
) -> PagedLayout:
    """Positions and cache slots of every new token, with one tensor construction per field."""
    # only the blocks this step can touch: a longer table (blocks reserved ahead) is not gathered
    num_blocks = [-(-(s + n) // block_size) for s, n in zip(starts, lengths, strict=True)]
    width = max(num_blocks)
    rows = [t[:k] + [0] * (width - k) for t, k in zip(block_tables, num_blocks, strict=True)]
    table = torch.tensor(rows, dtype=torch.int64, device=device)
    starts_t = torch.tensor(starts, dtype=torch.int64, device=device)
    if all(n == 1 for n in lengths):  # pure decode: one token per sequence
        seq_of_token = torch.arange(len(starts), device=device)
        positions = starts_t
    else:
        lens = torch.tensor(lengths, dtype=torch.int64, device=device)
        seq_of_token = torch.repeat_interleave(torch.arange(len(starts), device=device), lens)
        firsts = torch.cumsum(lens, 0) - lens
        offsets = torch.arange(int(sum(lengths)), device=device) - firsts[seq_of_token]
        positions = starts_t[seq_of_token] + offsets
    blocks = table[seq_of_token, positions // block_size]
    slots = blocks * block_size + positions % block_size
    return PagedLayout(list(starts), list(lengths), positions, slots, table, num_blocks)


class StepResult:
    """A launched step: call it for the tokens ``execute`` returns (on a GPU, the one transfer
    that waits for the device). ``ids``: for a pure decode step, row n's chosen token [n] on the
    device, which a step planned ahead reads as its input (None for other steps)."""

    __slots__ = ("_collect", "ids")

    def __init__(self, collect: Callable[[], dict[str, list[SampledToken]]], ids: torch.Tensor | None = None) -> None:
        self._collect = collect
        self.ids = ids

    def __call__(self) -> dict[str, list[SampledToken]]:
        return self._collect()


_NOTHING = StepResult(dict)


def _check_rows(mask: np.ndarray, width: int) -> np.ndarray:
    if mask.ndim != 2 or mask.shape[0] != width:
        raise ValueError(f"an item verifying {width - 1} drafts takes a mask of {width} rows")
    return mask


def _rows_of(items: Sequence[ScheduledSeq], masks: Mapping[str, np.ndarray] | None) -> dict[int, np.ndarray] | None:
    """Masks by request id -> by row of ``items``."""
    if not masks:
        return None
    return {n: masks[item.request_id] for n, item in enumerate(items) if item.request_id in masks}


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: PagedKVCache,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        attention_backend: AttentionBackend | str = "auto",
        sampler: Sampler | None = None,
    ) -> None:
        self.model = model.eval()
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.dtype = dtype
        args = model.args
        if isinstance(attention_backend, str):
            attention_backend = get_attention_backend(
                attention_backend, device=self.device, block_size=kv_cache.block_size,
                num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, dtype=dtype,
            )
        if kv_cache.layout != attention_backend.kv_layout:
            raise ValueError(
                f"the {attention_backend.name} attention backend reads a {attention_backend.kv_layout!r} KV pool, "
                f"got {kv_cache.layout!r}"
            )
        self.attention_backend = attention_backend
        self.sampler = sampler or Sampler()
        self.num_blocks = kv_cache.num_blocks
        self.block_size = kv_cache.block_size
        self.vocab_size = args.vocab_size
        self.max_position = args.max_position_embeddings
        self.graphs: GraphRunner | None = None  # fixed-shape decode steps (enable_decode_graphs)

    @property
    def threads(self) -> int:
        """torch's intra-op threads (the process's pool, which this runner's forwards use)."""
        return torch.get_num_threads()

    def set_threads(self, threads: int) -> None:
        """Run the next forwards on ``threads`` intra-op threads; on CUDA the one thread that
        launches kernels stays."""
        if self.device.type == "cpu":
            torch.set_num_threads(threads)

    @classmethod
    def from_config(cls, model_cfg: ModelConfig, engine_cfg: EngineConfig, *,
                    cache: LoadCache | None = None) -> ModelRunner:
        """Load the weights of ``model_cfg`` (through ``cache``, default ``LoadCache.from_env()``:
        a GGUF's weights and the matmul tuning) and size the KV pool from ``engine_cfg``."""
        cache = cache if cache is not None else LoadCache.from_env()
        if engine_cfg.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("engine.device = 'cuda' but torch sees no CUDA device")
        if engine_cfg.threads > 0:
            torch.set_num_threads(engine_cfg.threads)
        dtype_name, why = resolve_dtype(engine_cfg.dtype, engine_cfg.device)
        log.info("dtype %s (%s)", dtype_name, why)
        dtype = DTYPES[dtype_name]
        device = torch.device(engine_cfg.device)
        path = resolve_source(model_cfg.source)
        # on a CPU a GGUF's 4-bit blocks are kept too: few-row products read a quarter of the bytes
        model = load_model(path, model_cfg.format, dtype=dtype, device=device, cache=cache,
                           packed4=device.type == "cpu")
        if device.type == "cpu":  # which of the matmul forms this CPU computes fastest, per shape and rows
            matmul.tune(model.projection_weights(), packed=model.packed_projections(), cache=cache)
        return cls.for_model(model, engine_cfg)

    @classmethod
    def for_model(cls, model: LlamaModel, engine_cfg: EngineConfig) -> ModelRunner:
        """A runner of a loaded model (on ``engine_cfg``'s device, in its dtype): the attention
        backend, a KV pool and the decode graphs ``engine_cfg`` asks for, warmed up. Several
        runners may share one model (bench/gpu.py sizes a pool per batch)."""
        device = torch.device(engine_cfg.device)
        dtype = model.embed.weight.dtype
        args = model.args
        backend = get_attention_backend(
            engine_cfg.attention, device=device, block_size=engine_cfg.block_size,
            num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, dtype=dtype,
        )
        graphs = graphs_wanted(engine_cfg.cuda_graphs, device, backend)
        kv_cache = PagedKVCache.for_model(
            args, block_size=engine_cfg.block_size, dtype=dtype, device=device,
            kv_cache_mib=engine_cfg.kv_cache_mib, num_blocks=engine_cfg.num_blocks, layout=backend.kv_layout,
            scratch=graphs or device.type == "cuda",  # padded and warm-up rows write there
        )
        log.info("KV pool: %d blocks of %d tokens (%.0f MiB), %s attention", kv_cache.num_blocks,
                 kv_cache.block_size, kv_cache.num_bytes / 2**20, backend.name)
        runner = cls(model, kv_cache, device=device, dtype=dtype, attention_backend=backend)
        if graphs:
            runner.enable_decode_graphs(engine_cfg.max_num_seqs, min(engine_cfg.max_model_len, runner.max_position))
        runner.warm_up()
        return runner

    def enable_decode_graphs(self, max_batch: int, max_model_len: int) -> GraphRunner:
        """Run pure decode steps of up to ``max_batch`` sequences at padded sizes over persistent
        buffers (``engine_gpu.graph_runner``); the pool needs a scratch block."""
        self.graphs = GraphRunner(self.model, self.kv_cache, self.attention_backend,
                                  max_batch=max_batch, max_model_len=max_model_len)
        return self.graphs

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Before the first request (and before the engine reports ready): one eager forward of
        each kind a step can take (a decode, a few verified drafts, a prompt chunk), written to
        the scratch block, then the decode graphs' capture. On CUDA this pays for kernel
        compilation and graph capture; a pool without a scratch block (CPU) skips it."""
        scratch = self.kv_cache.scratch_block
        if scratch is None:
            return
        started = time.perf_counter()
        for n in sorted({1, min(5, self.block_size), self.block_size}):
            item = ScheduledSeq("warm-up", [0] * n, 0, [scratch], True, 0, SamplingParams(max_tokens=1), 0)
            self.model.compute_logits(self._run([item], None))
        captured = self.graphs.capture() if self.graphs is not None else 0.0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("warm-up in %.1f s (graph capture %.1f s)", time.perf_counter() - started, captured)

    def execute(
        self,
        batch: Sequence[ScheduledSeq],
        draft_probs: Mapping[str, torch.Tensor | None] | None = None,
        seeds: Mapping[str, int] | None = None,
    ) -> dict[str, list[SampledToken]]:
        """One forward over the batch; for each item with ``sample=True``, by request id, the
        tokens it emits: one sampled token, or for an item with draft tokens, the drafts that
        verification accepted and one more (``speculative.verify``). ``draft_probs`` holds the
        distributions drafts were drawn from (absent or None: point masses) and ``seeds`` the
        seed of each sampled request with drafts (absent: drawn here)."""
        return self.launch(batch, draft_probs, seeds)()

    @torch.inference_mode()
    def launch(
        self,
        batch: Sequence[ScheduledSeq],
        draft_probs: Mapping[str, torch.Tensor | None] | None = None,
        seeds: Mapping[str, int] | None = None,
        *,
        pending: tuple[StepResult, Sequence[int]] | None = None,
        masks: Callable[[], Mapping[str, np.ndarray]] | None = None,
    ) -> StepResult:
        """``execute`` in two halves: the forward and the sampling's tensor work now (on a GPU,
        queued), and a call that transfers the chosen tokens back and returns what ``execute``
        returns. A step with drafts verifies them before returning (its transfer is made here).

        ``pending`` = (a launched pure decode step, rows): a decode step planned before that
        step's tokens were read (``Scheduler.schedule_ahead``), whose item n decodes the token
        that step's row ``rows[n]`` picks, read on the device (its ``token_ids`` hold
        ``PENDING_TOKEN``).

        ``masks``: called once the forward is queued (on a GPU the host computes them while the
        device runs it): request id -> the grammar bitmask its sampled token must obey
        (``SamplingParams.grammar``; int32 words, ``llm_shared.structured``): one row, or for an
        item verifying k drafts k + 1 rows (the target's distribution at each position is masked
        before the acceptance test)."""
        if not batch:
            return _NOTHING
        input_ids = None
        if pending is not None:
            input_ids = self._pending_ids(batch, *pending)
        if all(item.sample and len(item.token_ids) == 1 and not item.num_draft_tokens for item in batch):
            # a pure decode step: logit row n is item n's
            logits = self.model.compute_logits(self._forward(batch, None, input_ids)).float()
            return self._sample_plain(batch, logits, masks() if masks is not None else None)
        if input_ids is not None:
            raise ValueError("a step planned ahead decodes one token per sequence")
        rows = [i for i, item in enumerate(batch) if item.sample]
        widths = [batch[i].num_draft_tokens + 1 for i in rows]  # logit rows each sampled item needs
        hidden = self._forward(batch, self._last_rows(batch, rows, widths))
        if not rows:
            return _NOTHING
        logits = self.model.compute_logits(hidden).float()
        masked = masks() if masks is not None else None
        drafted = [n for n, width in enumerate(widths) if width > 1]
        if not drafted:  # logit row n is sampled item n's
            return self._sample_plain([batch[i] for i in rows], logits, masked)
        firsts = list(itertools.accumulate(widths, initial=0))  # each sampled item's first logit row
        if masked:  # a drafted item's mask has a row per verified position: its drafts', then the bonus
            by_row = {firsts[n] + j: row for n in drafted if (mask := masked.get(batch[rows[n]].request_id)) is not None
                      for j, row in enumerate(_check_rows(mask, widths[n]))}
            if by_row:
                logits = masked_logits(logits, by_row)
        plain = [n for n, width in enumerate(widths) if width == 1]
        out: dict[str, list[SampledToken]] = {}
        if plain:
            items = [batch[rows[n]] for n in plain]
            tokens = self.sampler.sample_later(logits[[firsts[n] for n in plain]], [item.params for item in items],
                                               [item.output_index for item in items], _rows_of(items, masked))()
            out.update((item.request_id, [token]) for item, token in zip(items, tokens, strict=True))
        items = [batch[rows[n]] for n in drafted]
        item_seeds = [(seeds or {}).get(item.request_id) for item in items]
        item_seeds = [self.sampler.seed_for(item.params) if seed is None else seed  # in item order, as ever
                      for item, seed in zip(items, item_seeds, strict=True)]
        verified = verify_drafts(  # all drafted items at once, one transfer (speculative.verify_batch)
            logits[[r for n in drafted for r in range(firsts[n], firsts[n] + widths[n])]],
            [item.token_ids[len(item.token_ids) - item.num_draft_tokens:] for item in items],
            [(draft_probs or {}).get(item.request_id) for item in items],
            [item.params for item in items], item_seeds, [item.output_index for item in items])
        out.update((item.request_id, tokens) for item, tokens in zip(items, verified, strict=True))
        return StepResult(lambda: out)

    def _pending_ids(self, batch: Sequence[ScheduledSeq], previous: StepResult, rows: Sequence[int]) -> torch.Tensor:
        """[len(batch)] int64 on the device: the tokens a step planned ahead decodes."""
        ids = previous.ids
        if ids is None:
            raise ValueError("a step planned ahead follows a pure decode step")
        if len(rows) != len(batch) or any(item.token_ids != [PENDING_TOKEN] for item in batch):
            raise ValueError("a step planned ahead has one pending token per item and a source row for each")
        if not all(0 <= row < ids.shape[0] for row in rows):
            raise ValueError(f"source rows outside the previous step's {ids.shape[0]} rows")
        if len(rows) == ids.shape[0] and all(row == n for n, row in enumerate(rows)):
            return ids  # the same sequences in the same order: the steady state
        return ids[torch.tensor(rows, dtype=torch.int64, device=ids.device)]

    def _sample_plain(self, items: Sequence[ScheduledSeq], logits: torch.Tensor,
                      masks: Mapping[str, np.ndarray] | None = None) -> StepResult:
        """One token for each item from its row of ``logits`` [len(items), vocab], once called."""
        later = self.sampler.sample_later(logits, [item.params for item in items],
                                          [item.output_index for item in items], _rows_of(items, masks))
        return StepResult(lambda: {item.request_id: [token] for item, token in zip(items, later(), strict=True)},
                          later.ids)

    @torch.inference_mode()
    def execute_logits(self, batch: Sequence[ScheduledSeq]) -> list[torch.Tensor]:
        """The same step, returning float32 logits [len(token_ids), vocab] for every item's every token,
        in batch order (for verifying drafts and for tests)."""
        if not batch:
            return []
        logits = self.model.compute_logits(self._forward(batch, None)).float()
        return list(logits.split([len(item.token_ids) for item in batch]))

    @staticmethod
    def _last_rows(batch: Sequence[ScheduledSeq], rows: list[int], widths: list[int]) -> list[int]:
        """Flat token rows of the last ``widths[n]`` tokens of item ``rows[n]``, in order."""
        ends, total = [], 0
        for item in batch:
            total += len(item.token_ids)
            ends.append(total)
        return [r for i, width in zip(rows, widths, strict=True) for r in range(ends[i] - width, ends[i])]

    def _forward(self, batch: Sequence[ScheduledSeq], keep_rows: list[int] | None,
                 input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run the model over all new tokens; hidden states [rows, hidden] of ``keep_rows`` (None: all).
        ``input_ids`` [tokens] on the device, when given, replace the items' ``token_ids``."""
        self._validate(batch, tokens_known=input_ids is None)
        return self._run(batch, keep_rows, input_ids)

    def _run(self, batch: Sequence[ScheduledSeq], keep_rows: list[int] | None,
             input_ids: torch.Tensor | None = None) -> torch.Tensor:
        graphs = self.graphs
        if graphs is not None and graphs.covers([len(item.token_ids) for item in batch],
                                                [item.start_pos + len(item.token_ids) for item in batch]):
            hidden = graphs.run([0 if input_ids is not None else item.token_ids[0] for item in batch],
                                [item.start_pos for item in batch], [item.block_table for item in batch],
                                input_ids)  # [n, hidden]: one row per item
            if keep_rows is None or len(keep_rows) == len(batch):  # every item samples: rows in order
                return hidden
            return hidden[torch.tensor(keep_rows, dtype=torch.int64, device=self.device)]
        layout = build_layout(
            [item.start_pos for item in batch], [len(item.token_ids) for item in batch],
            [item.block_table for item in batch], self.block_size, self.device,
        )
        if input_ids is None:
            input_ids = torch.tensor([t for item in batch for t in item.token_ids], dtype=torch.int64,
                                     device=self.device)
        attention = self.attention_backend.prepare(self.kv_cache, layout, self.dtype)
        hidden = self.model(input_ids.unsqueeze(0), layout.positions.unsqueeze(0), attention)[0]  # [N, hidden]
        if keep_rows is None:
            return hidden
        return hidden[torch.tensor(keep_rows, dtype=torch.int64, device=self.device)]  # int64 even when empty

    def _validate(self, batch: Sequence[ScheduledSeq], *, tokens_known: bool = True) -> None:
        # Cheap O(items) checks: a bad block table would silently corrupt another sequence's KV.
        seen: set[str] = set()
        for item in batch:
            n = len(item.token_ids)
            if n == 0:
                raise ValueError(f"request {item.request_id!r}: empty token_ids")
            if item.request_id in seen:
                raise ValueError(f"request {item.request_id!r} appears twice in one batch")
            seen.add(item.request_id)
            if item.start_pos < 0:
                raise ValueError(f"request {item.request_id!r}: negative start_pos {item.start_pos}")
            end = item.start_pos + n
            need = -(-end // self.block_size)
            if len(item.block_table) < need:
                raise ValueError(
                    f"request {item.request_id!r}: {len(item.block_table)} blocks cannot hold positions [0, {end})"
                )
            if tokens_known and (min(item.token_ids) < 0 or max(item.token_ids) >= self.vocab_size):
                raise ValueError(f"request {item.request_id!r}: token id outside the vocabulary [0, {self.vocab_size})")
            if min(item.block_table) < 0 or max(item.block_table) >= self.num_blocks:
                raise ValueError(f"request {item.request_id!r}: block id outside the pool [0, {self.num_blocks})")
