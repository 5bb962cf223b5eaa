"""The ONNX Runtime edge backend: the GGUF's weights as an exported float32 decoder.

Same behaviour as the llama.cpp backend (it shares the asyncio front, ``worker_front``, and the
worker thread, ``llama_cpp_worker.LlamaWorker``); only the runtime differs (``onnx_runtime``).
Decoding sequences of different lengths are batched in one onnxruntime run with left-padded
caches and an attention mask; a prompt chunk runs on its own between decode steps. An abort
lands before the next step. Onnxruntime releases the GIL while it runs, so the event loop keeps
serving, and its workers never spin (see ``onnx_decoder``), so torch in the same process is not
starved.

Without ``onnx_path`` the backend finds the export in the cache, or exports it first (about a
minute for the 135M model; progress goes to the log), with ``engine_edge.export_onnx``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from engine_edge.config import EdgeConfig
from engine_edge.llama_cpp_worker import LlamaWorker
from engine_edge.onnx_decoder import CONTEXT_LENGTH_KEY, OnnxDecoder
from engine_edge.onnx_runtime import OnnxBatch, OnnxContext, OnnxModel, end_of_generation_ids
from engine_edge.worker_front import WorkerFront, open_gguf, require_same_vocab
from llm_shared.errors import ModelFileError
from llm_shared.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Most tokens per step: a prompt chunk this long takes ~0.2 s on two cores, which bounds how
# long an abort or the other sequences' next token can wait (the worker caps chunks at 128
# while others are decoding).
BATCH_TOKENS = 256


class OnnxBackend(WorkerFront):
    """``llm_shared.contract.Engine`` (and a drafter) over an onnxruntime session."""

    def __init__(
        self,
        model_path: Path,
        config: EdgeConfig | None = None,
        *,
        onnx_path: Path | None = None,
        tokenizer: Tokenizer | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        """``model_path`` is the GGUF (tokenizer, and the weights if it must export); all sequences
        share one pool of the cells ``config.kv_cache_mib`` holds (``kv_layout`` has no other
        choice here); ``n_threads`` 0 lets onnxruntime use every core."""
        config = config if config is not None else EdgeConfig(backend="onnx")
        n_seq_max = config.n_seq_max
        model_path, tokenizer = open_gguf(model_path, tokenizer)
        if onnx_path is None:
            from engine_edge.export_onnx import ensure_onnx

            onnx_path = ensure_onnx(model_path, progress=progress or (lambda message: logger.info("%s", message))).onnx_path
        elif not Path(onnx_path).is_file():
            raise ModelFileError(f"ONNX model {str(onnx_path)!r} does not exist; export it with "
                                 "`python -m engine_edge.export_onnx`")
        decoder = OnnxDecoder(Path(onnx_path), n_threads=config.n_threads)
        require_same_vocab(tokenizer, decoder.shape.vocab_size, "ONNX model")
        shape = decoder.shape
        # float32 K and V of every layer, as the graph takes and returns its past_key_values
        bytes_per_cell = shape.n_layers * 2 * shape.n_kv_heads * shape.head_dim * 4
        n_ctx = config.kv_cells(bytes_per_cell)
        trained = decoder.metadata.get(CONTEXT_LENGTH_KEY, "")
        n_ctx_seq = min(n_ctx, int(trained)) if trained.isdigit() else n_ctx
        self.model_path = model_path
        self.onnx_path = Path(onnx_path)
        self.n_ctx = n_ctx
        self.kv_cache_bytes = n_ctx * bytes_per_cell
        self.n_threads = config.n_threads
        eog = end_of_generation_ids(tokenizer.eos_id, ((i, tokenizer.token_bytes(i)) for i in tokenizer.special_ids))
        context = OnnxContext(decoder, n_ctx=n_ctx, n_ctx_seq=n_ctx_seq)
        self._start_worker(
            lambda commands: LlamaWorker(OnnxModel(eog), context, OnnxBatch(BATCH_TOKENS),  # type: ignore[arg-type]
                                         tokenizer, commands, n_seq_max, prefix_reuse=config.prefix_reuse),
            config,
            tokenizer=tokenizer, n_vocab=decoder.shape.vocab_size, n_ctx_seq=context.n_ctx_seq, thread_name="onnx-worker",
        )
        self._context = context
        logger.info("edge KV (ONNX): %d float32 cells of %d bytes (%.0f MiB) in one pool; a turn may use up to %d "
                    "tokens", n_ctx, bytes_per_cell, self.kv_cache_bytes / 2**20, context.n_ctx_seq)
        logger.info("ONNX edge backend: a conversation's next turn reuses the KV its last turn left in its slot%s; "
                    "idle conversations are not copied to host memory (only the llama.cpp backend has snapshots)",
                    "" if config.prefix_reuse else " (switched off: edge.prefix_reuse = false)")

    async def kv_lengths(self) -> dict[int, int]:
        """Cached positions per sequence slot (the drafter's slot is ``n_seq_max``); for tests and stats."""
        context = self._context
        return await self.run_on_worker(
            lambda: {slot: context.seq_pos_max(slot) + 1 for slot in range(self._n_seq_max + 1)
                     if context.seq_pos_max(slot) >= 0}
        )
