"""The llama.cpp edge backend: concurrent requests batched in one llama.cpp context.

The asyncio side (``worker_front.WorkerFront``, shared with the ONNX backend) validates requests
and turns them into commands for one worker thread (``llama_cpp_worker``) that owns the context
and decodes every running sequence in one ``llama_batch`` per step; ``llama_decode`` releases
the GIL, so the event loop keeps serving.

KV layout (``EdgeConfig.kv_layout``), sized from ``EdgeConfig.kv_cache_mib`` and what one cell
of the model costs (``LlamaModel.kv_bytes_per_cell``):
- ``shared`` (the default): one pool of cells for every sequence and the drafter; a turn may
  use up to the model's trained context (8,192 tokens for the embedded model) while cells are
  free. The worker admits a request only when its prompt plus ``max_tokens`` fit beside what
  running sequences may grow to; idle conversations' KV gives way first (to host memory).
  Batched greedy outputs equal solo ones up to near-ties: llama.cpp's attention over a unified
  pool rounds by where a sequence's cells landed (measured on this model: 6 of 8 prompts
  batched by 8 parted from solo within 64 tokens, each time where the solo run's top two were
  within 0.1 nats; ``tests/engine_edge/test_long_context.py`` checks exactly that).
- ``per_sequence``: each slot (and the drafter) its own stream of an equal share, attention over
  its own cells only: batched outputs equal solo ones bit for bit, but no turn outgrows its
  share.
"""

from __future__ import annotations

import logging
from pathlib import Path

from engine_edge.config import EdgeConfig
from engine_edge.llama_cpp_worker import LlamaWorker
from engine_edge.worker_front import WorkerFront, open_gguf, require_same_vocab
from llm_shared.llamacpp_runtime import KV_PAD, ContextShape, LlamaContext, LlamaModel, TokenBatch
from llm_shared.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

BATCH_TOKENS = 512  # most tokens per llama_decode: prompt chunks plus one per decoding sequence


def context_shape(config: EdgeConfig, model: LlamaModel) -> ContextShape:
    """The llama.cpp context that ``config``'s KV budget buys for ``model``."""
    n_seqs = config.n_seq_max + 1  # the generation slots and the drafter's
    if config.kv_layout == "shared":
        cells = config.kv_cells(model.kv_bytes_per_cell, granularity=KV_PAD, at_least=KV_PAD)
        return ContextShape(cells, n_seqs, BATCH_TOKENS, config.n_threads, kv_unified=True)
    per_stream = config.kv_cells(model.kv_bytes_per_cell, n_streams=n_seqs, granularity=KV_PAD, at_least=KV_PAD)
    if model.n_ctx_train:  # a stream past the trained context would be memory no position can use
        per_stream = min(per_stream, -(-model.n_ctx_train // KV_PAD) * KV_PAD)
    return ContextShape(per_stream * n_seqs, n_seqs, BATCH_TOKENS, config.n_threads, kv_unified=False)


class LlamaCppBackend(WorkerFront):
    """``llm_shared.contract.Engine`` (and a drafter) over llama-cpp-python's low-level API (0.3.36)."""

    def __init__(self, model_path: Path, config: EdgeConfig | None = None, *,
                 tokenizer: Tokenizer | None = None) -> None:
        """``n_threads`` 0 in ``config`` uses every usable core."""
        config = config if config is not None else EdgeConfig()
        n_seq_max = config.n_seq_max
        model_path, tokenizer = open_gguf(model_path, tokenizer)
        model = LlamaModel(model_path)
        try:
            require_same_vocab(tokenizer, model.n_vocab, "model")
            ctx = LlamaContext(model, context_shape(config, model))
        except BaseException:
            model.free()
            raise
        self.model_path = model_path
        self.weight_bytes = model.size_bytes  # GGUF tensor data: what one decode step reads
        self.n_ctx = ctx.n_ctx
        self.kv_cache_bytes = ctx.n_ctx * model.kv_bytes_per_cell
        self.n_threads = ctx.n_threads
        self._context = ctx
        logger.info("edge KV: %d cells of %d bytes (%.0f MiB), %s; a turn may use up to %d tokens",
                    ctx.n_ctx, model.kv_bytes_per_cell, self.kv_cache_bytes / 2**20,
                    f"one pool for {n_seq_max} sequences and the drafter" if not ctx.separate_streams
                    else f"{ctx.n_ctx // (n_seq_max + 1)} each for {n_seq_max} sequences and the drafter",
                    ctx.n_ctx_seq)
        self._start_worker(
            lambda commands: LlamaWorker(model, ctx, TokenBatch(ctx.n_batch), tokenizer, commands, n_seq_max,
                                         prefix_reuse=config.prefix_reuse,
                                         snapshot_budget_bytes=config.snapshot_mib * 2**20), config,
            tokenizer=tokenizer, n_vocab=model.n_vocab, n_ctx_seq=ctx.n_ctx_seq, thread_name="llama-cpp-worker",
        )

    async def kv_pos_max(self) -> list[int]:
        """Largest cached position of every sequence slot (the drafter's last); -1 = no KV."""
        ctx = self._context
        return await self.run_on_worker(lambda: [ctx.seq_pos_max(s) for s in range(self._n_seq_max + 1)])
