"""The asyncio half of an edge backend whose model is owned by one worker thread.

It validates requests, enforces admission limits and turns calls into ``worker_channel``
commands; the worker (``engine_edge.llama_cpp_worker.LlamaWorker`` over any runtime with its
model/context/batch surface) answers through futures and per-request event channels. A backend
builds its runtime, then calls ``_start_worker``; everything the ``Engine`` protocol asks for
is here. The same behaviour as ``LlamaCppBackend``, written once for backends to share.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from engine_edge.base import Draft, EdgeBackend, check_draft_ids, check_draft_request, check_prompt
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
from llm_shared.channel import EventChannel
from llm_shared.contract import (
    FinishEvent,
    Priority,
    SamplingParams,
    check_cache_salt,
)
from llm_shared.cores import ClaimOnWork, CoreShare
from llm_shared.errors import (
    ConfigError,
    DuplicateRequestError,
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
    InvalidSamplingError,
    OverloadedError,
)
from llm_shared.load_cache import LoadCache
from llm_shared.modelfile import check_gguf
from llm_shared.structured import GrammarCompiler, RequestMatchers, SequenceMatcher
from llm_shared.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine_edge.config import EdgeConfig
    from engine_edge.llama_cpp_worker import LlamaWorker

T = TypeVar("T")
MAX_REQUEST_ID_CHARS = 256


def open_gguf(model_path: Path, tokenizer: Tokenizer | None) -> tuple[Path, Tokenizer]:
    """The checked GGUF path and the tokenizer to serve it with (its own, through the load cache
    the environment names, unless one is given)."""
    model_path = check_gguf(Path(model_path))
    if tokenizer is None:
        tokenizer = Tokenizer.from_gguf(model_path, cache=LoadCache.from_env())
    return model_path, tokenizer


def require_same_vocab(tokenizer: Tokenizer, n_vocab: int, runtime: str) -> None:
    """Refuse a tokenizer and weights from different models before any request can mix them up."""
    if n_vocab != tokenizer.vocab_size:
        raise ConfigError(f"tokenizer has {tokenizer.vocab_size} tokens but the {runtime} has {n_vocab}; "
                          "they must come from the same model")


class WorkerFront(EdgeBackend):
    """``Engine`` + ``propose`` over a worker thread. Subclasses build the runtime, then ``_start_worker``."""

    _tokenizer: Tokenizer
    _worker: LlamaWorker
    _thread: threading.Thread
    n_vocab: int
    n_ctx_seq: int

    def _start_worker(
        self, worker_factory: Callable[[queue.SimpleQueue[Command]], LlamaWorker], config: EdgeConfig, *,
        tokenizer: Tokenizer, n_vocab: int, n_ctx_seq: int, thread_name: str,
    ) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self._grammars = RequestMatchers(tokenizer)
        # Grammars compile on a thread of their own: never on the event loop (every stream of the
        # process waits on it) nor in the worker's decode loop (every sequence of the batch would).
        self._compile_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="edge-grammar")
        self.n_vocab = n_vocab
        self.n_ctx_seq = n_ctx_seq
        self._n_seq_max = config.n_seq_max
        self._max_queued = config.max_queued
        self._open: set[str] = set()  # request ids whose stream has not ended (touched on event loops only)
        self._closed = False
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._cores: ClaimOnWork | None = None  # share_cores: a claim on the host's cores while requests run
        self._held: list[GenerateCmd] = []  # requests waiting for that claim before they reach the worker
        self._proposing = 0  # drafts asked for and not yet answered (work, like an open request)
        self._worker = worker_factory(self._commands)
        self._thread = threading.Thread(target=self._worker.run, name=thread_name, daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def ready(self) -> bool:
        return not self._closed and self._thread.is_alive()

    @property
    def max_prompt_tokens(self) -> int:
        return self.n_ctx_seq - 1

    def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        priority: Priority = Priority.INTERACTIVE,
        session_id: str = "",
        draft_ids: Sequence[int] = (),
        cache_salt: str = "",
    ) -> EventChannel:
        """``draft_ids`` are checked and ignored: this tier is the drafter, not a verifier. A slot's
        or snapshot's KV is reused only by a request with the ``cache_salt`` of the one that left it."""
        try:
            command = self._generate_cmd(request_id, prompt_ids, params, priority, session_id, draft_ids, cache_salt)
        except EngineError as e:
            return EventChannel.refused(e)
        self._open.add(request_id)
        if params.grammar:
            self._compile(command)  # to the worker once its matcher exists
        else:
            self._submit(command)
        return command.sink.channel

    def _submit(self, command: GenerateCmd) -> None:
        """To the worker; while the tier claims its cores (it was idle), once it holds them."""
        cores = self._cores
        if cores is None or cores.claimed:
            self._commands.put(command)
            return
        self._held.append(command)
        if len(self._held) == 1:
            asyncio.get_running_loop().create_task(self._submit_when_claimed(cores), name="edge-claim")

    async def _submit_when_claimed(self, cores: ClaimOnWork) -> None:
        await cores.ready()
        held, self._held = self._held, []
        for command in held:
            self._commands.put(command)

    def share_cores(self, share: CoreShare) -> bool:
        """Claim ``share`` before requests reach the idle worker and release it when the last one
        ended (``llm_shared.cores``); False where the runtime's threads are fixed at load (ONNX
        Runtime's session), which then computes on its static share."""
        if not callable(getattr(self._worker.context, "set_threads", None)):
            return False
        self._cores = ClaimOnWork(share, self._apply_threads, lambda: bool(self._open) or self._proposing > 0)
        return True

    async def set_threads(self, threads: int) -> None:
        """Returns once the worker decodes on ``threads`` threads (from its next step)."""
        if self.ready:
            await self.run_on_worker(lambda: self._worker.set_threads(threads))

    def _apply_threads(self, threads: int) -> None:
        """Ahead of the requests that claimed them: the worker reads commands in order, between steps."""
        self._commands.put(CallCmd(lambda: self._worker.set_threads(threads)))

    def _compile(self, command: GenerateCmd) -> None:
        loop = asyncio.get_running_loop()
        params = command.params
        future = self._compile_pool.submit(self._grammars.matcher, params.grammar, params.max_tokens)

        def compiled(done: concurrent.futures.Future[SequenceMatcher | None]) -> None:
            try:
                loop.call_soon_threadsafe(self._compiled, command, done)
            except RuntimeError:  # the consumer's loop is closed: nobody waits for it
                pass

        future.add_done_callback(compiled)

    def _compiled(self, command: GenerateCmd, done: concurrent.futures.Future[SequenceMatcher | None]) -> None:
        """On the loop: the compiled request goes to the worker, or its stream ends with the
        compiler's SchemaError (naming ``grammar``). A request whose consumer left meanwhile is dropped."""
        channel = command.sink.channel
        if channel.closed or command.request_id not in self._open:
            return
        if self._closed:
            channel.fail(EngineUnavailableError("the edge engine is closed"))
            return
        error = None if done.cancelled() else done.exception()
        if done.cancelled() or error is not None:
            channel.fail(error if isinstance(error, EngineError) else EngineUnavailableError(
                f"the output grammar could not be compiled: {error or 'the edge engine closed'}"))
            return
        self._submit(replace(command, matcher=done.result()))

    def _left(self, request_id: str, finished: bool) -> None:
        self._open.discard(request_id)
        if self._unhold(request_id) is None and not finished and not self._closed:
            self._commands.put(AbortCmd(request_id))  # the consumer left early: free the sequence
        if self._cores is not None:
            self._cores.settle()

    def _unhold(self, request_id: str) -> GenerateCmd | None:
        """Take back a request still waiting for the tier's claim (it never reached the worker)."""
        for command in self._held:
            if command.request_id == request_id:
                self._held.remove(command)
                return command
        return None

    def _generate_cmd(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, priority: Priority,
                      session_id: str, draft_ids: Sequence[int], cache_salt: str) -> GenerateCmd:
        """The validated request, or the EngineError that refuses it."""
        self._require_ready()
        if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError(f"request_id must be a string of 1..{MAX_REQUEST_ID_CHARS} characters",
                                      param="request_id")
        if not isinstance(session_id, str) or len(session_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError(f"session_id must be a string of at most {MAX_REQUEST_ID_CHARS} characters",
                                      param="session_id")
        if not isinstance(params, SamplingParams):
            raise InvalidSamplingError("params must be a SamplingParams", param="params")
        if priority not in Priority.__members__.values():
            raise InvalidRequestError(f"priority must be one of {[int(p) for p in Priority]}", param="priority")
        prompt = check_prompt(prompt_ids, self.n_vocab, self.max_prompt_tokens)
        check_draft_ids(draft_ids, self.n_vocab)
        salt = check_cache_salt(cache_salt)
        if request_id in self._open:
            raise DuplicateRequestError(f"request {request_id!r} is already running", param="request_id")
        if len(self._open) >= self._n_seq_max + self._max_queued:
            raise OverloadedError(
                f"the edge engine is busy ({len(self._open)} requests running or queued); retry shortly"
            )
        channel = EventChannel(on_close=lambda finished: self._left(request_id, finished))
        return GenerateCmd(request_id, prompt, params, Priority(priority),
                           EventSink(asyncio.get_running_loop(), channel), session_id, salt)

    def grammar_compiler(self) -> GrammarCompiler:
        """This tier's compiler and its cache (built once, ~0.1 s; blocking): the gateway in the
        same process compiles with it too, so a grammar it checked is a cache hit here."""
        return self._grammars.compiler()

    async def abort(self, request_id: str) -> None:
        if request_id not in self._open or not self.ready:
            return
        held = self._unhold(request_id)
        if held is not None:
            held.sink.channel.put(FinishEvent("abort", prompt_tokens=len(held.prompt), completion_tokens=0, tier="edge"))
            return
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._commands.put(AbortCmd(request_id, done))
        await asyncio.wrap_future(done)

    async def probe(self) -> None:
        """Returns once the worker thread ran a no-op between two of its steps."""
        await self.run_on_worker(lambda: None)

    async def kv_state(self) -> dict[str, dict[int, int]]:
        """KV cells per slot now: ``running`` (requests in flight) and ``cached`` (idle slots
        keeping a finished turn for its conversation); for tests and debugging."""
        return await self.run_on_worker(self._worker.kv_state)

    async def end_session(self, session_id: str) -> None:
        """The conversation is over: the KV its turns left in idle slots and host memory goes now."""
        if self.ready and session_id:
            await self.run_on_worker(lambda: self._worker.end_session(session_id))

    async def propose(self, context_ids: Sequence[int], k: int) -> Draft:
        self._require_ready()
        context = check_draft_request(context_ids, k, self.n_vocab, self.n_ctx_seq)
        cmd = ProposeCmd(context, k)
        self._proposing += 1
        try:
            if self._cores is not None:
                await self._cores.ready()  # a draft computes too: on the tier's claim
            self._commands.put(cmd)
            return await asyncio.wrap_future(cmd.done)
        finally:
            self._proposing -= 1
            if self._cores is not None:
                self._cores.settle()

    def stats(self) -> dict[str, float]:
        return {**self._worker.snapshot, "open_streams": float(len(self._open))}

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._compile_pool.shutdown(wait=False, cancel_futures=True)  # each one's stream ends (closed)
        if self._cores is not None:
            self._cores.cancel()
        held, self._held = self._held, []
        for command in held:  # the worker ends them as it shuts down
            self._commands.put(command)
        self._commands.put(CloseCmd())
        await asyncio.to_thread(self._thread.join)
        self._drain_after_close()

    async def run_on_worker(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the worker thread between two steps (to inspect state it owns)."""
        self._require_ready()
        cmd = CallCmd(fn)
        self._commands.put(cmd)
        return await asyncio.wrap_future(cmd.done)

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
