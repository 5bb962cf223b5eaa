"""The llama.cpp edge backend: concurrent requests batched in one llama.cpp context.

The asyncio side (this class) validates requests and turns them into commands for one worker
thread (``llama_cpp_worker``) that owns the context and decodes every running sequence in one
``llama_batch`` per step; ``llama_decode`` releases the GIL, so the event loop keeps serving.

KV layout: by default each sequence gets its own cache stream of ``n_ctx / (n_seq_max + 1)``
cells (rounded up to 256 by llama.cpp; the extra stream is the drafter's). Measured on this
model: with llama.cpp's unified cache, sequences decoded together attend over each other's
masked cells, so batched greedy outputs diverged from solo ones (4 of 8 prompts within 24
tokens) and decoding slowed 3x; with separate streams they match exactly. ``kv_unified=True``
trades that for letting one sequence use the whole ``n_ctx``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TypeVar

from engine_edge.base import Draft, EdgeBackend, check_draft_request, check_prompt
from engine_edge.errors import (
    ConfigError,
    DuplicateRequestError,
    EngineUnavailableError,
    InvalidRequestError,
    InvalidSamplingError,
    OverloadedError,
)
from engine_edge.llama_cpp_runtime import ContextShape, LlamaContext, LlamaModel, TokenBatch
from engine_edge.llama_cpp_worker import LlamaWorker
from engine_edge.modelfile import check_gguf
from engine_edge.tokenizer import Tokenizer
from engine_edge.types import FinishEvent, Priority, SamplingParams, StreamEvent
from engine_edge.worker_channel import (
    AbortCmd,
    CallCmd,
    CloseCmd,
    Command,
    EventSink,
    GenerateCmd,
    ProposeCmd,
    reject,
)

T = TypeVar("T")
MAX_REQUEST_ID_CHARS = 256
BATCH_TOKENS = 512  # most tokens per llama_decode: prompt chunks plus one per decoding sequence


class LlamaCppBackend(EdgeBackend):
    """``engine_edge.types.Engine`` over llama-cpp-python's low-level API (0.3.36)."""

    def __init__(
        self,
        model_path: Path,
        *,
        n_ctx: int = 8192,
        n_seq_max: int = 8,
        n_threads: int = 0,
        max_queued: int = 64,
        tokenizer: Tokenizer | None = None,
        kv_unified: bool = False,
    ) -> None:
        if n_ctx < 64:
            raise ConfigError(f"n_ctx must be >= 64, got {n_ctx}")
        if not 1 <= n_seq_max <= 64:
            raise ConfigError(f"n_seq_max must be in 1..64, got {n_seq_max}")
        if n_threads < 0 or max_queued < 0:
            raise ConfigError("n_threads and max_queued must be >= 0")
        model_path = check_gguf(Path(model_path))
        self._tokenizer = tokenizer if tokenizer is not None else Tokenizer.from_gguf(model_path)
        model = LlamaModel(model_path)
        if model.n_vocab != self._tokenizer.vocab_size:
            model.free()
            raise ConfigError(
                f"tokenizer has {self._tokenizer.vocab_size} tokens but the model has {model.n_vocab}; "
                "they must come from the same model"
            )
        try:
            ctx = LlamaContext(model, ContextShape(n_ctx, n_seq_max + 1, BATCH_TOKENS, n_threads, kv_unified))
        except BaseException:
            model.free()
            raise
        self.model_path = model_path
        self.weight_bytes = model.size_bytes
        self.n_vocab = model.n_vocab
        self.n_ctx = ctx.n_ctx
        self.n_ctx_seq = ctx.n_ctx_seq
        self.n_threads = ctx.n_threads
        self.kv_unified = kv_unified
        self._n_seq_max = n_seq_max
        self._max_queued = max_queued
        self._open: set[str] = set()  # request ids whose stream has not ended (touched on event loops only)
        self._closed = False
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._worker = LlamaWorker(model, ctx, TokenBatch(ctx.n_batch), self._tokenizer, self._commands, n_seq_max)
        self._thread = threading.Thread(target=self._worker.run, name="llama-cpp-worker", daemon=True)
        self._thread.start()

    # ---- Engine protocol ---------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def ready(self) -> bool:
        return not self._closed and self._thread.is_alive()

    @property
    def max_prompt_tokens(self) -> int:
        return self.n_ctx_seq - 1

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        priority: Priority = Priority.INTERACTIVE,
    ) -> AsyncIterator[StreamEvent]:
        self._require_ready()
        if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError(f"request_id must be a string of 1..{MAX_REQUEST_ID_CHARS} characters",
                                      param="request_id")
        if not isinstance(params, SamplingParams):
            raise InvalidSamplingError("params must be a SamplingParams", param="params")
        if priority not in Priority.__members__.values():
            raise InvalidRequestError(f"priority must be one of {[int(p) for p in Priority]}", param="priority")
        prompt = check_prompt(prompt_ids, self.n_vocab, self.max_prompt_tokens)
        if request_id in self._open:
            raise DuplicateRequestError(f"request {request_id!r} is already running", param="request_id")
        if len(self._open) >= self._n_seq_max + self._max_queued:
            raise OverloadedError(
                f"the edge engine is busy ({len(self._open)} requests running or queued); retry shortly"
            )
        events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self._open.add(request_id)
        self._commands.put(GenerateCmd(request_id, prompt, params, Priority(priority),
                                       EventSink(asyncio.get_running_loop(), events)))
        finished = False
        try:
            while not finished:
                event = await events.get()
                finished = isinstance(event, FinishEvent)
                yield event
        finally:
            self._open.discard(request_id)
            if not finished and not self._closed:  # the consumer left early: free the slot
                self._commands.put(AbortCmd(request_id))

    async def abort(self, request_id: str) -> None:
        if request_id not in self._open or not self.ready:
            return
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._commands.put(AbortCmd(request_id, done))
        await asyncio.wrap_future(done)

    async def propose(self, context_ids: Sequence[int], k: int) -> Draft:
        self._require_ready()
        context = check_draft_request(context_ids, k, self.n_vocab, self.n_ctx_seq)
        cmd = ProposeCmd(context, k)
        self._commands.put(cmd)
        return await asyncio.wrap_future(cmd.done)

    def stats(self) -> dict[str, float]:
        return {**self._worker.snapshot, "open_streams": float(len(self._open))}

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._commands.put(CloseCmd())
        await asyncio.to_thread(self._thread.join)
        self._drain_after_close()

    # ---- helpers -------------------------------------------------------------------------------

    async def run_on_worker(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the worker thread between two steps (to inspect state it owns)."""
        self._require_ready()
        cmd = CallCmd(fn)
        self._commands.put(cmd)
        return await asyncio.wrap_future(cmd.done)

    async def kv_pos_max(self) -> list[int]:
        """Largest cached position of every sequence slot (the drafter's last); -1 = no KV."""
        ctx = self._worker.context
        return await self.run_on_worker(lambda: [ctx.seq_pos_max(s) for s in range(self._n_seq_max + 1)])

    def _require_ready(self) -> None:
        if not self.ready:
            raise EngineUnavailableError("the edge engine is closed")

    def _drain_after_close(self) -> None:
        """Commands that raced with close(): end their streams and waiters instead of leaving them hanging."""
        gone = EngineUnavailableError("the edge engine is closed")
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, GenerateCmd):
                cmd.sink.put(FinishEvent("error", prompt_tokens=len(cmd.prompt), completion_tokens=0,
                                         message=gone.message, tier="edge"))
            elif isinstance(cmd, AbortCmd) and cmd.done is not None:
                if cmd.done.set_running_or_notify_cancel():
                    cmd.done.set_result(None)
            elif isinstance(cmd, (ProposeCmd, CallCmd)):
                reject(cmd.done, gone)
