"""Typed wrappers over llama-cpp-python's low-level ctypes API (0.3.36): model, context, batch.

Both engines use it: the edge tier's llama.cpp backend (``engine_edge.llama_cpp_backend``) and
the torch engine's speculative drafter (``engine_gpu.speculative.edge_drafter``), which runs
the edge model inside the engine's own process. It lives here because engines import only
``llm_shared``. Imported only where llama.cpp is chosen, so llama-cpp-python stays optional;
it imports no torch. A ``LlamaContext`` and its batches are not thread-safe: exactly one
thread (the owner's worker) may call them. Logit views returned by ``LlamaContext.logits``
point into llama.cpp's buffer and are valid only until the next decode.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np

from llm_shared.errors import EngineError, ModelFileError
from llm_shared.modelfile import check_gguf

_log = logging.getLogger("llm_shared.llamacpp")
# ggml.h: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (llama-cpp-python's own
# _logger.py still assumes the older numbering, which is why it prints model loads as warnings).
_GGML_LOG_WARN = 3
_GGML_LOG_ERROR = 4


# Warnings that describe a choice made on purpose: a shared pool larger than the trained context
# (LlamaContext caps every sequence at the trained context itself).
_EXPECTED_WARNINGS = ("> n_ctx_train",)


def _forward_llama_log(level: int, text: bytes | None, _user_data: ctypes.c_void_p) -> None:
    # llama.cpp narrates every load and context creation (hundreds of lines on stderr);
    # keep only its warnings and errors, through Python logging.
    if text and level in (_GGML_LOG_WARN, _GGML_LOG_ERROR):
        message = text.decode("utf-8", errors="replace").rstrip()
        if level == _GGML_LOG_WARN and any(marker in message for marker in _EXPECTED_WARNINGS):
            _log.debug("%s", message)
            return
        _log.log(logging.WARNING if level == _GGML_LOG_WARN else logging.ERROR, "%s", message)


# llama.cpp keeps this pointer for the life of the process, so the ctypes object must too.
_LOG_CALLBACK = llama_cpp.llama_log_callback(_forward_llama_log)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class LlamaModel:
    """A GGUF model loaded (memory-mapped) by llama.cpp."""

    def __init__(self, path: Path) -> None:
        # llama.cpp aborts the whole process on some malformed files, so check first.
        check_gguf(path)
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            raise ModelFileError(f"llama.cpp could not load model file {str(path)!r}")
        self._model: ctypes.c_void_p | None = model
        self.path = path
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab: int = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.n_ctx_train: int = llama_cpp.llama_model_n_ctx_train(model)
        self.size_bytes: int = llama_cpp.llama_model_size(model)  # tensor data, what one decode step reads
        head_dim = llama_cpp.llama_model_n_embd(model) // max(1, llama_cpp.llama_model_n_head(model))
        # One KV cell: K and V of every layer in f16 (llama.cpp's default cache type).
        self.kv_bytes_per_cell: int = (llama_cpp.llama_model_n_layer(model) * 2
                                       * llama_cpp.llama_model_n_head_kv(model) * head_dim * 2)

    @property
    def handle(self) -> ctypes.c_void_p:
        if self._model is None:
            raise EngineError("the model has been freed")
        return self._model

    def is_eog(self, token_id: int) -> bool:
        """End-of-generation tokens (EOS, EOT...) as the model's metadata defines them."""
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token_id))

    def free(self) -> None:
        if self._model is not None:
            llama_cpp.llama_model_free(self._model)
            self._model = None


KV_PAD = 256  # llama.cpp's KV cache size granularity


@dataclass(frozen=True)
class ContextShape:
    n_ctx: int  # KV cells requested for the whole context
    n_seqs: int  # sequence ids the context accepts (generation slots plus the drafter slot)
    n_batch: int  # most tokens in one llama_decode call
    n_threads: int  # 0 = all usable cores
    kv_unified: bool = False  # one cell pool for all sequences instead of one stream each


def per_stream_cells(n_ctx: int, n_seqs: int) -> int:
    """Cells of each stream when ``n_ctx`` is split over ``n_seqs`` separate streams.

    llama.cpp rounds a stream up to a multiple of 256 cells (and warns); doing it here keeps
    the log quiet and the arithmetic visible: 8192 over 9 streams gives 1024 each, 9216 in all.
    """
    return -(-n_ctx // (n_seqs * KV_PAD)) * KV_PAD


class LlamaContext:
    """One llama.cpp context serving ``n_seqs`` sequence ids.

    Separate streams give each sequence ``n_ctx_seq = n_ctx / n_seqs`` cells (llama.cpp rounds
    up to a multiple of 256) and attention over its own cells only, so a sequence computes the
    same logits whatever else is in the batch. A unified pool lets one sequence use any free
    cell, up to the model's trained context, but attention then runs over the pool's cell
    layout, and the rounding of a sequence's logits depends on where its cells landed.
    """

    def __init__(self, model: LlamaModel, shape: ContextShape) -> None:
        threads = shape.n_threads or usable_cores()
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = shape.n_ctx if shape.kv_unified else per_stream_cells(shape.n_ctx, shape.n_seqs) * shape.n_seqs
        params.n_batch = shape.n_batch
        params.n_ubatch = shape.n_batch
        params.n_seq_max = shape.n_seqs
        params.n_threads = threads
        params.n_threads_batch = threads
        params.kv_unified = shape.kv_unified
        params.no_perf = True
        ctx = llama_cpp.llama_init_from_model(model.handle, params)
        if not ctx:
            raise EngineError(f"llama.cpp could not create a context with n_ctx={shape.n_ctx}, n_seq_max={shape.n_seqs}")
        self._ctx: ctypes.c_void_p | None = ctx
        self._mem = llama_cpp.llama_get_memory(ctx)
        self.n_vocab = model.n_vocab
        self.n_ctx: int = llama_cpp.llama_n_ctx(ctx)
        # cells one sequence may use: no position past what the model was trained on
        self.n_ctx_seq: int = min(llama_cpp.llama_n_ctx_seq(ctx), model.n_ctx_train or llama_cpp.llama_n_ctx_seq(ctx))
        self.separate_streams = not shape.kv_unified  # no sequence can take another's cells
        self.n_batch: int = llama_cpp.llama_n_batch(ctx)
        self.n_threads = threads

    @property
    def handle(self) -> ctypes.c_void_p:
        if self._ctx is None:
            raise EngineError("the llama.cpp context has been freed")
        return self._ctx

    def set_threads(self, threads: int) -> None:
        """Compute the next ``decode`` calls (generation and prompt batches) on ``threads`` threads."""
        llama_cpp.llama_set_n_threads(self.handle, threads, threads)
        self.n_threads = threads

    def decode(self, batch: TokenBatch) -> int:
        """0 on success; 1 = no KV slot; other values are errors (see llama.h)."""
        return int(llama_cpp.llama_decode(self.handle, batch.raw))

    def logits(self, batch_index: int) -> np.ndarray:
        """Raw logits [n_vocab] of the token at ``batch_index`` of the last decoded batch (a view)."""
        ptr = llama_cpp.llama_get_logits_ith(self.handle, batch_index)
        if not ptr:
            raise EngineError(f"no logits for batch index {batch_index}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Drop the sequence's cells with positions in [p0, p1) (-1: open end)."""
        return bool(llama_cpp.llama_memory_seq_rm(self._mem, seq_id, p0, p1))

    def state_get(self, seq_id: int) -> bytes:
        """A copy of the sequence's KV state (host memory), for ``state_set`` into any slot later."""
        size = int(llama_cpp.llama_state_seq_get_size(self.handle, seq_id))
        buffer = (ctypes.c_uint8 * size)()
        written = int(llama_cpp.llama_state_seq_get_data(self.handle, buffer, size, seq_id))
        if written != size:
            raise EngineError(f"llama.cpp copied {written} of {size} state bytes of sequence {seq_id}")
        return bytes(buffer)

    def state_set(self, seq_id: int, data: bytes) -> bool:
        """Load a ``state_get`` copy into ``seq_id`` (whose cells must be empty); False if llama.cpp refused it."""
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return int(llama_cpp.llama_state_seq_set_data(self.handle, buffer, len(data), seq_id)) > 0

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest cached position of the sequence, -1 when it holds no cells."""
        return int(llama_cpp.llama_memory_seq_pos_max(self._mem, seq_id))

    def free(self) -> None:
        if self._ctx is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None


class TokenBatch:
    """A reusable ``llama_batch`` with one sequence id per token, filled with ``add``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.raw = llama_cpp.llama_batch_init(capacity, 0, 1)
        self._freed = False
        self.raw.n_tokens = 0

    @property
    def n_tokens(self) -> int:
        return int(self.raw.n_tokens)

    def clear(self) -> None:
        self.raw.n_tokens = 0

    def add(self, token_id: int, pos: int, seq_id: int, want_logits: bool) -> int:
        """Append one token; returns its batch index (what ``LlamaContext.logits`` takes)."""
        i = self.raw.n_tokens
        if i >= self.capacity:
            raise EngineError(f"batch is full ({self.capacity} tokens)")
        raw = self.raw
        raw.token[i] = token_id
        raw.pos[i] = pos
        raw.n_seq_id[i] = 1
        raw.seq_id[i][0] = seq_id
        raw.logits[i] = 1 if want_logits else 0
        raw.n_tokens = i + 1
        return i

    def free(self) -> None:
        if not self._freed:
            llama_cpp.llama_batch_free(self.raw)
            self._freed = True
