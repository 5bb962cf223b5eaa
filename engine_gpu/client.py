"""The gateway's side of the torch engine: an asyncio client of the engine core process.

``EngineClient`` implements the ``Engine`` protocol (llm_shared/contract.py) with tier "gpu".
It spawns a core (``start``) or connects to one already running (``connect``, e.g. over TCP),
sends requests as msgpack frames and routes each step's outputs to per-request queues. It
imports no torch: the model lives in the core process only.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import socket
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from engine_gpu.config import EngineConfig
from engine_gpu.core_spawn import ready_address, remove_private_socket_dir, stop_process
from engine_gpu.protocol import (
    MAX_REQUEST_ID_CHARS,
    AbortDone,
    AbortRequest,
    AddRequest,
    Authenticate,
    Challenge,
    ClientMessage,
    ErrorReply,
    Hello,
    ProtocolError,
    Rejected,
    SetThreads,
    Shutdown,
    StatsReply,
    StatsRequest,
    StepOutputs,
    auth_mac,
    decode_core_message,
    encode_frame,
    error_from_code,
    parse_listen,
    read_frame,
    secret_bytes,
)
from llm_shared import errors
from llm_shared.channel import EventChannel, Subscriber
from llm_shared.contract import (
    MAX_PREFIX_DRAFT_TOKENS,
    FinishEvent,
    Priority,
    SamplingParams,
    StreamEvent,
    check_cache_salt,
)
from llm_shared.cores import ClaimOnWork, CoreShare
from llm_shared.models import REPO_ROOT, ModelConfig, tokenizer_for
from llm_shared.tokenizer import Tokenizer

log = logging.getLogger("engine_gpu.client")

CONNECT_TIMEOUT_S = 30.0


@dataclass
class _Live:
    """A request the core accepted or is about to answer for."""

    prompt_tokens: int
    events: EventChannel = field(default_factory=EventChannel)
    completion_tokens: int = 0


class EngineClient:
    tier = "gpu"

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hello: Hello, *,
                 address: str, tokenizer: Tokenizer | None = None,
                 process: asyncio.subprocess.Process | None = None) -> None:
        self.address = address
        self.info = hello.info
        self._reader = reader
        self._writer = writer
        self._tokenizer = tokenizer
        self._process = process
        self._stats: dict[str, float] = dict(hello.stats)
        self._live: dict[str, _Live] = {}
        self._unstarted: weakref.WeakValueDictionary[str, _Stream] = weakref.WeakValueDictionary()
        self._waiters: dict[int, asyncio.Future[dict[str, float]]] = {}
        self._seq = itertools.count(1)
        self._ready = True
        self._closed = False
        self._max_model_len = int(hello.info.get("max_model_len", 0))
        self._vocab_size = int(hello.info.get("vocab_size", 0))
        self._cores: ClaimOnWork | None = None  # share_cores: a claim on the host's cores while requests run
        self._read_task = asyncio.create_task(self._read_loop(), name="engine-client-reader")

    # --- construction -------------------------------------------------------------------------

    @classmethod
    async def start(cls, model_cfg: ModelConfig, engine_cfg: EngineConfig, *,
                    draft_model_cfg: ModelConfig | None = None, startup_timeout: float = 600.0,
                    environment: Mapping[str, str] | None = None) -> EngineClient:
        """Spawn a core process for these configs, wait until its model (and drafter) is loaded,
        connect. ``environment``: variables the core gets on top of this process's (those set
        here already win)."""
        from engine_gpu.core_process import config_args  # the module is torch-free until main() runs

        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        # The configured secret (other clients may need it, e.g. over TCP), else a fresh one per core;
        # in its environment, never on its command line, which other users can read.
        secret = env[engine_cfg.secret_env] = env.get(engine_cfg.secret_env) or secrets.token_urlsafe(32)
        for key, value in (environment or {}).items():
            env.setdefault(key, value)
        # stdin is a pipe the core watches: if this process dies, the core sees EOF and exits.
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "engine_gpu.core_process", *config_args(model_cfg, engine_cfg, draft_model_cfg),
            "--exit-on-stdin-eof", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
        )
        tokenizer_task = asyncio.create_task(asyncio.to_thread(tokenizer_for, model_cfg))
        try:
            address = await asyncio.wait_for(ready_address(process), startup_timeout)
            tokenizer = await tokenizer_task
            return await cls.connect(address, secret=secret, tokenizer=tokenizer, process=process)
        except BaseException:
            tokenizer_task.cancel()
            await stop_process(process)
            raise

    @classmethod
    async def connect(cls, address: str, *, secret: str | bytes | None = None, tokenizer: Tokenizer | None = None,
                      process: asyncio.subprocess.Process | None = None,
                      timeout: float = CONNECT_TIMEOUT_S, secret_env: str = "ENGINE_CORE_SECRET") -> EngineClient:
        """Connect to a running core ('unix:/path' or 'tcp:host:port') and authenticate with the
        shared ``secret`` (default: the environment variable ``secret_env``). Without a
        tokenizer, the one the core's model config names is loaded here if its file is reachable
        from this machine."""
        key = secret_bytes(secret if secret is not None else os.environ.get(secret_env),
                           f"the secret argument or ${secret_env}")
        family, addr = parse_listen(address)
        writer = None
        try:
            if family == socket.AF_UNIX:
                assert isinstance(addr, str)
                reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(addr), timeout)
            else:
                host, port = addr
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
            payload = await asyncio.wait_for(read_frame(reader), timeout)
            challenge = decode_core_message(payload) if payload is not None else None
            if not isinstance(challenge, Challenge):
                raise ProtocolError("the engine core did not open with a challenge")
            writer.write(encode_frame(Authenticate(auth_mac(key, challenge.nonce))))
            await asyncio.wait_for(writer.drain(), timeout)
            payload = await asyncio.wait_for(read_frame(reader), timeout)
            hello = decode_core_message(payload) if payload is not None else None
        except (OSError, TimeoutError, ProtocolError) as e:
            if writer is not None:
                writer.close()
            raise errors.EngineUnavailableError(f"cannot reach the engine core at {address}: {e}") from e
        if isinstance(hello, ErrorReply) and hello.code == "unauthenticated":
            writer.close()
            raise errors.EngineUnavailableError(f"the engine core at {address} refused our secret")
        if not isinstance(hello, Hello):
            writer.close()
            raise errors.EngineUnavailableError(f"the engine core at {address} did not greet us")
        if tokenizer is None and hello.info.get("model_config"):
            try:
                tokenizer = await asyncio.to_thread(tokenizer_for, ModelConfig(**hello.info["model_config"]))
            except (errors.ModelFileError, errors.ConfigError, OSError, TypeError) as e:
                log.warning("engine at %s: its tokenizer is not loadable here (%s); pass one explicitly", address, e)
        return cls(reader, writer, hello, address=address, tokenizer=tokenizer, process=process)

    # --- Engine protocol ----------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise errors.ModelFileError("this engine client has no tokenizer; pass one to EngineClient.connect")
        return self._tokenizer

    @property
    def ready(self) -> bool:
        return self._ready

    def generate(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                 priority: Priority = Priority.INTERACTIVE, session_id: str = "",
                 draft_ids: Sequence[int] = (), cache_salt: str = "") -> _Stream:
        # session_id is not sent: the core's prefix cache finds a conversation by its token
        # blocks (among those of requests with the same cache_salt) and evicts them by LRU, so
        # there is nothing to end per session.
        stream = _Stream(self, request_id, prompt_ids, params, priority, draft_ids, cache_salt)
        if isinstance(request_id, str):
            self._unstarted[request_id] = stream
        return stream

    async def end_session(self, session_id: str) -> None:
        """Nothing is kept per session here (see ``generate``)."""

    async def abort(self, request_id: str) -> None:
        """Returns once the core confirmed the request's blocks are free (idempotent)."""
        unstarted = self._unstarted.pop(request_id, None)
        if unstarted is not None:
            unstarted.aborted = True
        if request_id not in self._live or not self._ready:
            return
        try:
            await self._call(lambda seq: AbortRequest(request_id, seq))
        except errors.EngineUnavailableError:
            return  # the core is gone, and its blocks with it

    async def probe(self) -> None:
        """A stats round trip through the core's loop (it answers between two steps)."""
        if not self._ready:
            raise errors.EngineUnavailableError("the torch engine is not connected")
        await self.refresh_stats()

    def stats(self) -> dict[str, float]:
        """The latest stats the core pushed (with every step's outputs, on abort and on request)."""
        return dict(self._stats)

    def kv_use(self) -> float:
        """Share of the core's KV blocks in use, from its latest stats."""
        return kv_use(self._stats)

    def share_cores(self, share: CoreShare) -> bool:
        """From now on, claim ``share`` before a request reaches an idle core and release it when
        the core's last request ended (``llm_shared.cores``)."""
        self._cores = ClaimOnWork(share, self._send_threads, lambda: bool(self._live))
        return True

    async def set_threads(self, threads: int, timeout: float = 10.0) -> None:
        """Returns once the core computes on ``threads`` threads (from its next step)."""
        if not self._ready:
            return  # no core, nothing computing
        await asyncio.wait_for(self._call(lambda seq: SetThreads(seq, threads)), timeout)

    def _send_threads(self, threads: int) -> None:
        """Ahead of the request that claimed them; the core applies messages in order, between steps."""
        if self._ready:
            self._writer.write(encode_frame(SetThreads(next(self._seq), threads)))

    async def wait_lost(self) -> None:
        """Return once the connection to the core is over (the core died, or ``close``)."""
        await asyncio.shield(self._read_task)

    async def refresh_stats(self) -> dict[str, float]:
        self._stats = await self._call(StatsRequest)
        return self.stats()

    async def close(self) -> None:
        """Disconnect; a core this client spawned is stopped (its requests end with reason "error")."""
        if self._closed:
            return
        self._closed = True
        if self._process is not None and self._ready:
            try:
                await self._send(Shutdown())
            except errors.EngineUnavailableError:
                pass  # already gone: nothing left to ask
        self._ready = False  # from here on the connection ends on purpose: no warning
        self._writer.close()
        if self._process is not None:
            await stop_process(self._process)
            remove_private_socket_dir(self.address)  # left behind if the core was killed
        self._read_task.cancel()
        await asyncio.gather(self._read_task, return_exceptions=True)
        self._fail_all("the engine client was closed")

    async def shutdown_core(self) -> None:
        """Stop a core this client connected to but did not spawn (e.g. a remote worker)."""
        if self._ready:
            await self._send(Shutdown())
        await self.close()

    # --- internals ----------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        """Prompt plus output tokens one request may have (the core's, 0 if it did not say)."""
        return self._max_model_len

    def _validate(self, request_id: object, prompt_ids: Sequence[int], params: object, priority: object,
                  draft_ids: Sequence[int] = (), cache_salt: object = "") -> None:
        """Cheap checks that save a round trip; the core validates again."""
        if not self._ready:
            raise errors.EngineUnavailableError("the torch engine is not available")
        if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
            raise errors.InvalidRequestError(
                f"request_id must be a non-empty string of at most {MAX_REQUEST_ID_CHARS} characters", param="request_id")
        if request_id in self._live:
            raise errors.DuplicateRequestError(f"request {request_id!r} is already running", param="request_id")
        if not isinstance(params, SamplingParams):
            raise errors.InvalidSamplingError("params must be SamplingParams", param="params")
        if not isinstance(priority, int) or priority not in {int(p) for p in Priority}:
            raise errors.InvalidRequestError(f"unknown priority {priority!r}", param="priority")
        if len(prompt_ids) == 0:
            raise errors.EmptyPromptError("the prompt has no tokens", param="prompt")
        if self._max_model_len and len(prompt_ids) + params.max_tokens > self._max_model_len:
            raise errors.PromptTooLongError(
                f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"the context length of {self._max_model_len} tokens", param="max_tokens")
        if len(draft_ids) > MAX_PREFIX_DRAFT_TOKENS:
            raise errors.InvalidRequestError(f"draft_ids holds at most {MAX_PREFIX_DRAFT_TOKENS} tokens",
                                             param="draft_ids")
        check_cache_salt(cache_salt)
        for ids, param in ((prompt_ids, "prompt"), (draft_ids, "draft_ids")):
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < (self._vocab_size or 2**31):
                    raise errors.InvalidRequestError(f"token id {t!r} is outside the vocabulary", param=param)

    async def _open(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                    priority: Priority, draft_ids: Sequence[int], cache_salt: str) -> _Live:
        self._validate(request_id, prompt_ids, params, priority, draft_ids, cache_salt)
        live = self._live[request_id] = _Live(prompt_tokens=len(prompt_ids))
        try:
            if self._cores is not None:
                await self._cores.ready()
            await self._send(AddRequest(request_id, list(prompt_ids), params, Priority(priority), list(draft_ids),
                                        cache_salt))
        except BaseException:
            self._live.pop(request_id, None)
            self._settle()
            raise
        return live

    def _settle(self) -> None:
        if self._cores is not None:
            self._cores.settle()

    async def _send(self, message: ClientMessage) -> None:
        try:
            self._writer.write(encode_frame(message))
            await self._writer.drain()
        except (ConnectionError, OSError) as e:
            raise errors.EngineUnavailableError("lost the connection to the torch engine") from e

    async def _call(self, make: Callable[[int], ClientMessage]) -> dict[str, float]:
        """Send a message carrying a fresh seq and wait for the reply with that seq."""
        seq = next(self._seq)
        future: asyncio.Future[dict[str, float]] = asyncio.get_running_loop().create_future()
        self._waiters[seq] = future
        try:
            await self._send(make(seq))
            return await future
        finally:
            self._waiters.pop(seq, None)

    async def _read_loop(self) -> None:
        reason = "the torch engine closed the connection"
        try:
            while (payload := await read_frame(self._reader)) is not None:
                self._dispatch(decode_core_message(payload))
        except ProtocolError as e:
            reason = f"bad message from the torch engine: {e.message}"
            log.error("%s", reason)
        except (ConnectionError, OSError) as e:
            reason = f"lost the torch engine: {e}"
        finally:
            self._fail_all(reason)

    def _dispatch(self, msg: object) -> None:
        match msg:
            case StepOutputs():
                self._stats = msg.stats
                for out in msg.outputs:
                    live = self._live.get(out.request_id)
                    if live is None:
                        continue
                    for token in out.tokens:
                        live.events.put(token)
                    live.completion_tokens += len(out.tokens)
                    if out.finish is not None:
                        live.events.put(out.finish)
                        del self._live[out.request_id]
                if not self._live:  # the last request ended (a step's frame with some left costs no call)
                    self._settle()
            case Rejected():
                live = self._live.pop(msg.request_id, None)
                if live is not None:
                    live.events.fail(error_from_code(msg.code, msg.message, msg.param))
                self._settle()
            case AbortDone() | StatsReply():
                self._stats = msg.stats
                future = self._waiters.get(msg.seq)
                if future is not None and not future.done():
                    future.set_result(msg.stats)
            case ErrorReply():
                future = self._waiters.get(msg.seq) if msg.seq is not None else None
                if future is not None and not future.done():
                    future.set_exception(errors.EngineError(msg.message))
                else:
                    log.warning("torch engine reported %s: %s", msg.code, msg.message)
            case _:
                log.warning("unexpected message from the torch engine: %r", msg)

    def _fail_all(self, reason: str) -> None:
        if self._ready:
            log.warning("torch engine unavailable: %s", reason)
        self._ready = False
        for live in list(self._live.values()):  # a subscriber runs inside put
            live.events.put(FinishEvent("error", live.prompt_tokens, live.completion_tokens, 0,
                                              message="the torch engine stopped", tier=self.tier))
        self._live.clear()
        self._settle()
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(errors.EngineUnavailableError("the torch engine stopped"))


class _Stream:
    """The async iterator ``generate`` returns. Nothing is sent before the first ``__anext__``,
    which raises the request's typed error if the client or the core rejects it. After that a
    consumer may ``subscribe`` instead (``Turn.run``): the reader task's dispatch of each step's
    outputs then calls it directly (its ``EventChannel``)."""

    def __init__(self, client: EngineClient, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                 priority: Priority, draft_ids: Sequence[int], cache_salt: str) -> None:
        self._client = client
        self._args = (request_id, prompt_ids, params, priority, draft_ids, cache_salt)
        self._events: EventChannel | None = None  # once the request is sent (or ended before it was)
        self.aborted = False  # aborted before it started: it ends at once without reaching the core

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._events is None:
            if self.aborted:
                self._events = EventChannel()
                self._events.put(FinishEvent("abort", len(self._args[1]), 0, tier=self._client.tier))
            else:
                if self._client._unstarted.get(self._args[0]) is self:
                    del self._client._unstarted[self._args[0]]
                self._events = (await self._client._open(*self._args)).events
        return await anext(self._events)

    def can_subscribe(self) -> bool:
        return self._events is not None and not self._events.ended and self._events.can_subscribe()

    def subscribe(self, callback: Subscriber) -> None:
        """After the first event: the rest by call from the dispatch (see ``EventChannel.subscribe``)."""
        if self._events is None:
            raise RuntimeError("the stream has not started: read its first event first")
        self._events.subscribe(callback)

    def unsubscribe(self) -> None:
        if self._events is not None:
            self._events.unsubscribe()

    async def aclose(self) -> None:
        """Stopping early aborts the request, so its blocks do not run on for nobody."""
        events = self._events
        if events is None or events.ended or events.closed:
            return
        await events.aclose()
        await self._client.abort(self._args[0])


def kv_use(stats: Mapping[str, float]) -> float:
    """Share of a torch engine's KV blocks in use (0 before it reported any), from ``stats()``."""
    total = stats.get("kv_blocks_total", 0.0)
    return stats.get("kv_blocks_in_use", 0.0) / total if total > 0 else 0.0
