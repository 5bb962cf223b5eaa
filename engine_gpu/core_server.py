"""The engine core's loop: LLMEngine's steps served to clients over a socket, in one thread.

One thread, one selector. While requests are unfinished the loop polls the sockets without
waiting, handles every message that arrived since the last step (adds, aborts, stats), then
runs one step and sends each client its requests' new tokens with fresh stats. When idle it
blocks in ``select`` until a message arrives: no busy spin. An abort frees the request's blocks
before the next step; a client that disconnects has its requests aborted. A request with a
grammar is compiled on a thread of its own first (``COMPILE_THREADS``), so a new grammar never
pauses the batch of every client: the compiled request joins the loop through a wake-up pipe
(or is rejected with the compiler's error), and an abort or a disconnect meanwhile drops it.

Every connection proves it knows the shared secret (``protocol.Challenge``/``Authenticate``)
before anything else. The process around it (configs, listener, secret, signals) is
engine_gpu.core_process.
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import os
import queue
import secrets
import selectors
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from engine_gpu.outputs import RequestOutput
from engine_gpu.protocol import (
    AUTH_TIMEOUT_S,
    MAX_FRAME_BYTES,
    NONCE_BYTES,
    PRE_AUTH_MAX_FRAME_BYTES,
    AbortDone,
    AbortRequest,
    AddRequest,
    Authenticate,
    Challenge,
    CoreMessage,
    ErrorReply,
    FrameDecoder,
    Hello,
    ProtocolError,
    Rejected,
    SetThreads,
    Shutdown,
    StatsReply,
    StatsRequest,
    StepOutputs,
    check_mac,
    decode_client_message,
    encode_frame,
    encode_step_outputs,
)
from llm_shared.contract import FinishEvent, FinishReason, Priority, SamplingParams
from llm_shared.errors import DuplicateRequestError, EngineError

log = logging.getLogger("engine_gpu.core")

RECV_BYTES = 1 << 20
MAX_RECVS_PER_WAKEUP = 64
MAX_OUTBUF_BYTES = 64 * 1024 * 1024  # a client this far behind is dropped (its requests aborted)
if TYPE_CHECKING:
    from llm_shared.structured import SequenceMatcher

COMPILE_THREADS = 1  # grammar compiles at once (one thread: the engine builds its compiler lazily, once)
MAX_UNAUTHENTICATED = 32  # peers waiting to authenticate; more are refused at accept
GC_YOUNG_THRESHOLD = 10_000  # allocations between collections of the youngest generation (Python's default: 700)


class StepEngine(Protocol):
    """What the loop needs of LLMEngine (kept narrow so the loop reads on its own)."""

    def add_checked_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                            priority: Priority, draft_ids: list[int] | None = None,
                            cache_salt: str = "", matcher: SequenceMatcher | None = None) -> None: ...
    def compile_matcher(self, params: SamplingParams) -> SequenceMatcher | None: ...
    def abort_request(self, request_id: str, reason: FinishReason = "abort", message: str = "") -> RequestOutput | None: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished(self) -> bool: ...
    def stats(self) -> dict[str, float]: ...
    def info(self) -> dict[str, object]: ...
    def set_threads(self, threads: int) -> None: ...


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    cid: int
    nonce: bytes  # the challenge it must answer
    deadline: float  # monotonic time by which it must have authenticated
    decoder: FrameDecoder = field(default_factory=lambda: FrameDecoder(PRE_AUTH_MAX_FRAME_BYTES))
    outbuf: bytearray = field(default_factory=bytearray)
    requests: dict[str, str] = field(default_factory=dict)  # engine id -> client's request id
    authenticated: bool = False
    closed: bool = False


class CoreServer:
    def __init__(self, engine: StepEngine, listener: socket.socket, *, secret: bytes,
                 stop_fd: int | None = None, auth_timeout_s: float = AUTH_TIMEOUT_S) -> None:
        self.engine = engine
        self._secret = secret
        self._auth_timeout = auth_timeout_s
        self._listener = listener
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, self._accept)
        if stop_fd is not None:
            self._sel.register(stop_fd, selectors.EVENT_READ, lambda _mask: self._on_stop_fd(stop_fd))
        self._owners: dict[str, _Conn] = {}  # engine request id -> connection that added it
        self._conns: set[_Conn] = set()
        self._next_cid = 0
        self._stopping = False
        # Grammars compile off the step loop; compiled adds come back through a queue and a pipe
        # whose read end wakes the selector. Pending: engine id -> (connection, its add message).
        self._compile_pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="core-grammar")
        self._compiled: queue.SimpleQueue[tuple[str, concurrent.futures.Future[SequenceMatcher | None]]] = \
            queue.SimpleQueue()
        self._pending: dict[str, tuple[_Conn, AddRequest]] = {}
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._sel.register(self._wake_read, selectors.EVENT_READ, self._on_compiled)

    # --- loop ------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        # What is alive now (the model, the tokenizer's tables, every module) lives as long as the
        # process: kept out of the cycle collector's full passes, which otherwise scan it all every
        # few steps while hundreds of requests stream (at 256 that was ~40% of the host's step time).
        # A step at 256 builds ~5,000 short-lived containers: collecting the youngest generation
        # every 10,000 allocations instead of 700 saves another ~0.1 ms a step (bench/host_path.py).
        # Both are undone when the loop ends (tests run cores inside their own process).
        threshold = gc.get_threshold()
        gc.freeze()
        gc.set_threshold(GC_YOUNG_THRESHOLD, *threshold[1:])
        try:
            self._serve()
        finally:
            gc.set_threshold(*threshold)
            gc.unfreeze()

    def _serve(self) -> None:
        while not self._stopping:
            busy = self.engine.has_unfinished()
            for key, mask in self._sel.select(0 if busy else self._until_auth_deadline()):
                if isinstance(key.data, _Conn):
                    self._on_conn_event(key.data, mask)
                else:
                    key.data(mask)
            self._drop_unauthenticated_late()
            if self._stopping or not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # a failed step must not take every other client down with it
                log.exception("engine step failed; failing all in-flight requests")
                outputs = [o for rid in list(self._owners)
                           if (o := self.engine.abort_request(rid, "error", "the engine failed")) is not None]
            self._publish(outputs)
        log.info("engine core stopping")
        for conn in list(self._conns):
            self._flush(conn)
            self._close(conn)
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._sel.close()
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _until_auth_deadline(self) -> float | None:
        """How long an idle select may block: until the next unauthenticated peer's deadline."""
        deadlines = [c.deadline for c in self._conns if not c.authenticated]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _drop_unauthenticated_late(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self._conns if not c.authenticated and c.deadline <= now]:
            log.warning("client %d did not authenticate within %.0f s; closing it", conn.cid, self._auth_timeout)
            self._close(conn)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        per_conn: dict[_Conn, list[tuple[str, RequestOutput]]] = {}  # (the client's request id, output)
        owners = self._owners
        for out in outputs:
            conn = owners.get(out.request_id)
            if conn is None:
                continue
            batch = per_conn.get(conn)
            if batch is None:
                batch = per_conn[conn] = []
            batch.append((conn.requests[out.request_id], out))
            if out.finish is not None:
                del self._owners[out.request_id]
                del conn.requests[out.request_id]
        stats = self.engine.stats()
        for conn, outs in per_conn.items():
            self._send_frame(conn, encode_step_outputs(outs, stats))  # StepOutputs(outs renamed, stats)
        self._announce_if_idle(exclude=per_conn, stats=stats)

    def _announce_if_idle(self, *, exclude: Iterable[_Conn] = (), stats: dict[str, float] | None = None) -> None:
        """On going idle every client hears it, so no gateway's stats stay stuck at "busy"."""
        if self.engine.has_unfinished():
            return
        stats = stats if stats is not None else self.engine.stats()
        skip = set(exclude)
        for conn in list(self._conns):
            if conn not in skip and conn.authenticated:
                self._send(conn, StepOutputs([], stats))

    # --- sockets ---------------------------------------------------------------------------

    def _accept(self, _mask: int) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if sum(not c.authenticated for c in self._conns) >= MAX_UNAUTHENTICATED:
                log.warning("too many connections waiting to authenticate; refusing one")
                sock.close()
                continue
            self._next_cid += 1
            conn = _Conn(sock, self._next_cid, secrets.token_bytes(NONCE_BYTES),
                         time.monotonic() + self._auth_timeout)
            self._conns.add(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)
            log.info("client %d connected", conn.cid)
            self._send(conn, Challenge(conn.nonce))  # nothing else until it proves the secret

    def _on_conn_event(self, conn: _Conn, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
        if mask & selectors.EVENT_READ and not conn.closed:
            self._on_readable(conn)

    def _on_readable(self, conn: _Conn) -> None:
        # Drain what the client sent so all messages that arrived are handled before the next step,
        # up to a bound, so a client flooding the socket cannot hold the step loop forever.
        for _ in range(MAX_RECVS_PER_WAKEUP):
            if conn.closed:
                return
            try:
                data = conn.sock.recv(RECV_BYTES)
            except BlockingIOError:
                return
            except OSError as e:
                log.info("client %d: %s", conn.cid, e)
                self._close(conn)
                return
            if not data:
                self._close(conn)
                return
            try:
                frames = conn.decoder.feed(data)
            except ProtocolError as e:
                self._send(conn, ErrorReply(None, e.code, e.message))
                self._flush(conn)
                log.warning("client %d: %s; closing its connection", conn.cid, e.message)
                self._close(conn)
                return
            for payload in frames:
                if conn.closed:
                    return
                self._handle(conn, payload)

    def _send(self, conn: _Conn, message: CoreMessage) -> None:
        if not conn.closed:
            self._send_frame(conn, encode_frame(message))

    def _send_frame(self, conn: _Conn, frame: bytes) -> None:
        if conn.closed:
            return
        conn.outbuf += frame
        if len(conn.outbuf) > MAX_OUTBUF_BYTES:
            log.warning("client %d is not reading its outputs; dropping it", conn.cid)
            self._close(conn)
            return
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        if conn.closed:
            return
        try:
            while conn.outbuf:
                sent = conn.sock.send(conn.outbuf)
                del conn.outbuf[:sent]
        except BlockingIOError:
            pass
        except OSError as e:
            log.info("client %d: %s", conn.cid, e)
            self._close(conn)
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0)
        if self._sel.get_key(conn.sock).events != events:
            self._sel.modify(conn.sock, events, conn)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        for engine_id in [e for e, (owner, _) in self._pending.items() if owner is conn]:
            del self._pending[engine_id]  # still compiling: dropped when it comes back
        for engine_id in list(conn.requests):
            self.engine.abort_request(engine_id)  # frees its blocks; nobody is left to tell
            self._owners.pop(engine_id, None)
        had_requests = bool(conn.requests)
        conn.requests.clear()
        self._conns.discard(conn)
        self._sel.unregister(conn.sock)
        conn.sock.close()
        log.info("client %d disconnected", conn.cid)
        if had_requests:
            self._announce_if_idle()

    def _on_stop_fd(self, fd: int) -> None:
        if not os.read(fd, 4096):  # the parent closed our stdin: it exited or wants us gone
            self._stopping = True

    # --- messages --------------------------------------------------------------------------

    def _authenticate(self, conn: _Conn, payload: bytes) -> None:
        try:
            msg = decode_client_message(payload)
        except ProtocolError:
            msg = None
        if not isinstance(msg, Authenticate) or not check_mac(self._secret, conn.nonce, msg.mac):
            log.warning("client %d failed to authenticate; closing it", conn.cid)
            self._send(conn, ErrorReply(None, "unauthenticated", "authenticate with the shared secret first"))
            self._flush(conn)
            self._close(conn)
            return
        conn.authenticated = True
        conn.decoder.max_frame_bytes = MAX_FRAME_BYTES
        self._send(conn, Hello(self.engine.info(), self.engine.stats()))

    def _handle(self, conn: _Conn, payload: bytes) -> None:
        if not conn.authenticated:
            self._authenticate(conn, payload)
            return
        try:
            msg = decode_client_message(payload)
        except ProtocolError as e:
            if e.request_id is not None:
                self._send(conn, Rejected(e.request_id, e.code, e.message, e.param))
            else:
                self._send(conn, ErrorReply(e.seq, e.code, e.message))
            return
        match msg:
            case AddRequest():
                self._add(conn, msg)
            case AbortRequest():
                engine_id = f"{conn.cid}/{msg.request_id}"
                pending = self._pending.pop(engine_id, None)
                if pending is not None:  # still compiling: never added, and its stream ends here
                    end = FinishEvent("abort", len(pending[1].prompt_ids), 0, tier="gpu")
                    self._send(conn, StepOutputs([RequestOutput(msg.request_id, [], end)], self.engine.stats()))
                if engine_id in conn.requests:
                    out = self.engine.abort_request(engine_id)
                    del conn.requests[engine_id]
                    self._owners.pop(engine_id, None)
                    if out is not None:
                        self._send(conn, StepOutputs([replace(out, request_id=msg.request_id)], self.engine.stats()))
                self._send(conn, AbortDone(msg.seq, msg.request_id, self.engine.stats()))
                self._announce_if_idle(exclude=[conn])
            case StatsRequest():
                self._send(conn, StatsReply(msg.seq, self.engine.stats()))
            case SetThreads():  # between two steps: the next one computes with the new count
                self.engine.set_threads(msg.threads)
                self._send(conn, StatsReply(msg.seq, self.engine.stats()))
            case Shutdown():
                log.info("client %d asked the core to shut down", conn.cid)
                self._stopping = True
            case Authenticate():
                pass  # already authenticated: a repeat changes nothing

    def _add(self, conn: _Conn, msg: AddRequest) -> None:
        # Request ids are the client's own: namespacing them per connection keeps clients apart.
        engine_id = f"{conn.cid}/{msg.request_id}"
        if msg.params.grammar:  # compiled on the compile thread; added when it comes back
            if engine_id in self._pending or engine_id in conn.requests:
                e = DuplicateRequestError(f"request {msg.request_id!r} is already running", param="request_id")
                self._send(conn, Rejected(msg.request_id, e.code, e.message, e.param))
                return
            self._pending[engine_id] = (conn, msg)
            future = self._compile_pool.submit(self.engine.compile_matcher, msg.params)
            future.add_done_callback(lambda done: self._compiled_one(engine_id, done))
            return
        self._add_now(conn, msg, engine_id, None)

    def _add_now(self, conn: _Conn, msg: AddRequest, engine_id: str, matcher: SequenceMatcher | None) -> None:
        try:
            # decode_client_message checked the fields; the engine checks only its own limits
            self.engine.add_checked_request(engine_id, msg.prompt_ids, msg.params, msg.priority, msg.draft_ids,
                                            msg.cache_salt, matcher)
        except EngineError as e:
            self._send(conn, Rejected(msg.request_id, e.code, e.message, e.param))
            return
        conn.requests[engine_id] = msg.request_id
        self._owners[engine_id] = conn

    def _compiled_one(self, engine_id: str, done: concurrent.futures.Future[SequenceMatcher | None]) -> None:
        """On the compile thread: hand the result to the loop and wake it."""
        self._compiled.put((engine_id, done))
        try:
            os.write(self._wake_write, b"\0")
        except (BlockingIOError, OSError):  # the pipe is full (the loop will drain it) or closed (stopping)
            pass

    def _on_compiled(self, _mask: int) -> None:
        """On the loop: add each compiled request whose client still wants it, or reject it with
        the compiler's error."""
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                engine_id, done = self._compiled.get_nowait()
            except queue.Empty:
                return
            pending = self._pending.pop(engine_id, None)
            if pending is None:
                continue  # aborted, or its client left, while it compiled
            conn, msg = pending
            error = None if done.cancelled() else done.exception()
            if done.cancelled() or error is not None:
                e = error if isinstance(error, EngineError) else EngineError(f"the grammar failed to compile: {error}")
                self._send(conn, Rejected(msg.request_id, e.code, e.message, e.param))
                continue
            self._add_now(conn, msg, engine_id, done.result())
