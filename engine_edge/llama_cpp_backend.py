"""The llama.cpp edge backend: concurrent requests batched in one llama.cpp context.

The asyncio side (``worker_front.WorkerFront``, shared with the ONNX backend) validates requests
and turns them into commands for one worker thread (``llama_cpp_worker``) that owns the context
and decodes every running sequence in one ``llama_batch`` per step; ``llama_decode`` releases
the GIL, so the event loop keeps serving.

KV layout: by default each sequence gets its own cache stream of ``n_ctx / (n_seq_max + 1)``
cells (rounded up to 256 by llama.cpp; the extra stream is the drafter's), and prompts are
validated against that. Measured on this model: with llama.cpp's unified cache, sequences
decoded together attend over each other's masked cells, and batched greedy outputs diverged
from solo ones (4 of 8 prompts within 24 tokens) at the same speed; with separate streams
they match exactly, so a seed gives the same text whatever else is batched.
``EdgeConfig.kv_unified`` trades that for letting one sequence use the whole ``n_ctx``.
"""

from __future__ import annotations

from pathlib import Path

from engine_edge.config import EdgeConfig
from engine_edge.llama_cpp_runtime import ContextShape, LlamaContext, LlamaModel, TokenBatch
from engine_edge.llama_cpp_worker import LlamaWorker
from engine_edge.worker_front import WorkerFront, open_gguf, require_same_vocab
from llm_shared.tokenizer import Tokenizer

BATCH_TOKENS = 512  # most tokens per llama_decode: prompt chunks plus one per decoding sequence


class LlamaCppBackend(WorkerFront):
    """``llm_shared.contract.Engine`` (and a drafter) over llama-cpp-python's low-level API (0.3.36)."""

    def __init__(self, model_path: Path, config: EdgeConfig | None = None, *,
                 tokenizer: Tokenizer | None = None) -> None:
        """``config.n_ctx`` is the KV cells of the whole context; ``n_threads`` 0 uses every usable core."""
        config = config if config is not None else EdgeConfig()
        n_seq_max = config.n_seq_max
        model_path, tokenizer = open_gguf(model_path, tokenizer)
        model = LlamaModel(model_path)
        try:
            require_same_vocab(tokenizer, model.n_vocab, "model")
            shape = ContextShape(config.n_ctx, n_seq_max + 1, BATCH_TOKENS, config.n_threads, config.kv_unified)
            ctx = LlamaContext(model, shape)
        except BaseException:
            model.free()
            raise
        self.model_path = model_path
        self.weight_bytes = model.size_bytes  # GGUF tensor data: what one decode step reads
        self.n_ctx = ctx.n_ctx
        self.n_threads = ctx.n_threads
        self._context = ctx
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
