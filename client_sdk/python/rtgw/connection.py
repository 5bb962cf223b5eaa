"""The client's link to the gateway: one Realtime session over a WebSocket at a time, opened with
the reconnect policy and opened again after a drop or a drain.

``Connection`` owns the socket, its reader task, the acknowledgements awaited on it (futures
keyed by what answers them) and the reconnect state. The client gives it its hooks: each server
event (``on_event``), a session just opened (``on_open``: the client's settings and conversation
go out first), a session the gateway drained (``on_drain``) and the reconnect after it ended,
opened or not (``on_drain_over``), a connection lost (``on_lost``: what ran on it fails).
``busy`` says whether a turn runs: then a silent server drops the connection.

A gateway replica that is going away (drained) closes with 1001 and a reconnect hint once no
response is in progress: the connection comes back by itself after the time it names, to the
same URL (the load balancer routes to a replica that stays), with the whole backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import websockets
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from rtgw.errors import ClientClosed, FrameError, GatewayError, GatewayRefused, GatewayUnreachable
from rtgw.framing import MSGPACK_SUBPROTOCOL, Framing, decode, encode
from rtgw.protocol import reconnect_hint

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 16 * 1024 * 1024

Key = tuple[str, str]  # what answers a request: ("truncated", item_id), ("event", event_id)...


@dataclass(frozen=True)
class Backoff:
    """Reconnect delays: ``initial`` doubling up to ``max_delay``, each drawn uniformly from
    [(1 - jitter) * d, d] so that many clients dropped at once do not return at once."""

    initial: float = 0.25
    factor: float = 2.0
    max_delay: float = 8.0
    jitter: float = 0.5
    attempts: int = 5  # connection attempts per operation, the first one immediate

    def delays(self, rng: random.Random) -> Iterator[float]:
        delay = self.initial
        for _ in range(self.attempts - 1):
            yield delay * (1.0 - self.jitter * rng.random())
            delay = min(self.max_delay, delay * self.factor)


DEFAULT_BACKOFF = Backoff()


def realtime_url(url: str, model: str | None) -> str:
    """``http://host:port`` (or ws://, or a full /v1/realtime URL) -> the session's ws(s) URL."""
    parts = urllib.parse.urlsplit(url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise ValueError(f"not a gateway URL: {url!r}")
    path = parts.path.rstrip("/")
    if not path.endswith("/realtime"):
        path = (path if path.endswith("/v1") else path + "/v1") + "/realtime"
    query = urllib.parse.parse_qs(parts.query)
    if model:
        query["model"] = [model]
    return urllib.parse.urlunsplit((scheme, parts.netloc, path, urllib.parse.urlencode(query, doseq=True), ""))


class Connection:
    def __init__(
        self,
        ws_url: str,
        *,
        api_key: str | None,
        framing: Framing,
        connect_timeout: float,
        silence_timeout: float,
        request_timeout: float,
        backoff: Backoff,
        retry_online_s: float,
        seed: int | None,
        on_event: Callable[[dict[str, Any]], None],
        on_open: Callable[[], Awaitable[None]],
        on_drain: Callable[[], None],
        on_drain_over: Callable[[], None],
        on_lost: Callable[[], None],
        busy: Callable[[], bool],
    ) -> None:
        self.ws_url = ws_url
        self.api_key = api_key
        self.framing = framing
        self.connect_timeout = connect_timeout
        self.silence_timeout = silence_timeout
        self.request_timeout = request_timeout
        self.backoff = backoff
        self.retry_online_s = retry_online_s
        self._on_event = on_event
        self._on_open = on_open
        self._on_drain = on_drain
        self._on_drain_over = on_drain_over
        self._on_lost = on_lost
        self._busy = busy
        self._rng = random.Random(seed)
        self.ws: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._waiters: dict[Key, asyncio.Future[Any]] = {}
        self._last_online_try = -float("inf")
        self.lock = asyncio.Lock()  # one connect / send at a time
        self.reconnects = 0  # sessions opened after the first
        self._sessions = 0
        self.closed = False  # close() was called: no session opens until connect() or send() again
        # A drained session (1001 with a reconnect hint): when to come back, and the task that does.
        self._reconnect_at: float | None = None
        self._reconnect_task: asyncio.Task[None] | None = None

    @property
    def online(self) -> bool:
        return self.ws is not None

    async def wait_reconnected(self) -> bool:
        """Wait for a reconnect the gateway asked for to end; whether the link is up then."""
        task = self._reconnect_task
        if task is not None:
            # Not shield(): close() cancels the task, and that is an answer (False), not our cancel.
            # wait() neither raises when the task is cancelled nor cancels it when we are.
            await asyncio.wait({task})
            if task.cancelled():
                return False
            task.result()  # a failure the reconnect did not expect surfaces here, as it did
        return self.online

    async def stop_reconnect(self) -> None:
        """End a reconnect under way; a later connect need not wait for the drained gateway's time."""
        task, self._reconnect_task = self._reconnect_task, None
        self._reconnect_at = None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # --- opening --------------------------------------------------------------------------------

    async def ensure(self, *, required: bool) -> bool:
        """True once a session is open; False when it cannot be and ``required`` is False. The
        caller holds ``lock``."""
        self._raise_if_closed()  # close() was called while this call waited for the lock
        if self.ws is not None:
            return True
        if self._reconnect_at is not None:
            return await self._reconnect_as_asked(required=required)
        now = time.monotonic()
        if not required and now - self._last_online_try < self.retry_online_s:
            return False  # offline, and the gateway was tried a moment ago
        self._last_online_try = now
        try:
            await self._open_with_backoff(attempts=self.backoff.attempts if required else 1)
        except GatewayUnreachable:
            if required:
                raise
            log.info("the gateway is unreachable: serving turns on the device")
            return False
        return True

    async def _reconnect_as_asked(self, *, required: bool) -> bool:
        """A drained session: wait until the time the gateway named, then reconnect with the
        whole backoff (another replica is there to take us, so the fallback is not tried first)."""
        assert self._reconnect_at is not None
        await asyncio.sleep(max(0.0, self._reconnect_at - time.monotonic()))
        self._reconnect_at = None
        self._last_online_try = time.monotonic()
        try:
            await self._open_with_backoff(attempts=self.backoff.attempts)
        except GatewayUnreachable:
            if required:
                raise
            log.info("the gateway is unreachable after a drain: serving turns on the device")
            return False
        return True

    async def _reconnect_after_drain(self) -> None:
        async with self.lock:
            try:
                await self.ensure(required=True)
            except ClientClosed:
                pass  # close() ended the reconnect: nothing to report
            except GatewayError as e:
                log.warning("could not reconnect after the gateway closed this session for a drain: %s", e)
        self._on_drain_over()

    async def _open_with_backoff(self, attempts: int) -> None:
        delays = self.backoff.delays(self._rng)
        for attempt in range(attempts):
            self._raise_if_closed()  # close() during the wait before this attempt
            try:
                await self._open()
                return
            except GatewayUnreachable:
                self._raise_if_closed()  # close() dropped the session this attempt was setting up
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(next(delays, self.backoff.max_delay))

    def _raise_if_closed(self) -> None:
        if self.closed:
            raise ClientClosed()

    async def _open(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        subprotocols = [MSGPACK_SUBPROTOCOL] if self.framing == "msgpack" else None
        try:
            ws = await websockets.connect(self.ws_url, additional_headers=headers, subprotocols=subprotocols,
                                          open_timeout=self.connect_timeout, max_size=MAX_FRAME_BYTES,
                                          close_timeout=self.request_timeout)
        except InvalidStatus as e:
            status = e.response.status_code
            body = e.response.body.decode("utf-8", "replace")[:500] if e.response.body else ""
            if status >= 500:
                raise GatewayUnreachable(f"the gateway is not serving (HTTP {status}): {body}") from e
            raise GatewayRefused(status, body) from e
        except (OSError, TimeoutError, ssl.SSLError, InvalidHandshake, InvalidURI) as e:
            raise GatewayUnreachable(f"cannot reach the gateway at {self.ws_url}: {e}") from e
        if self.closed:  # close() returned while we connected: it could not close this one
            await _close_quietly(ws, self.request_timeout)
            raise ClientClosed()
        if self.framing == "msgpack" and ws.subprotocol != MSGPACK_SUBPROTOCOL:
            await ws.close()
            raise GatewayRefused(400, "the gateway does not speak msgpack framing")
        self.ws = ws
        created = self.expect(("session", "created"))
        self._reader = asyncio.create_task(self._read_loop(ws), name="rtgw-reader")
        try:
            await asyncio.wait_for(created, self.request_timeout)
        except (TimeoutError, GatewayUnreachable) as e:
            await self.drop()
            raise GatewayUnreachable("the gateway accepted the connection but sent no session") from e
        if self._sessions:
            self.reconnects += 1
        self._sessions += 1
        await self._on_open()
        if self.closed:  # close() began while the session was set up (it waits on an offline turn)
            await self.drop()
            raise ClientClosed()

    async def drop(self) -> None:
        """Close the session (if any) and stop its reader."""
        ws, self.ws = self.ws, None
        reader, self._reader = self._reader, None
        if ws is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(), self.request_timeout)
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    # --- events out, acknowledgements in -----------------------------------------------------

    async def send(self, event: dict[str, Any]) -> None:
        ws = self.ws
        if ws is None:
            raise GatewayUnreachable("not connected to the gateway")
        try:
            await asyncio.wait_for(ws.send(encode(event, self.framing)), self.request_timeout)
        except (ConnectionClosed, OSError, TimeoutError) as e:
            await self._lost(ws)
            raise GatewayUnreachable(f"the connection to the gateway was lost: {e}") from e

    def expect(self, key: Key) -> asyncio.Future[Any]:
        """A future for the server's answer ``key`` (``resolve``); it fails with
        ``GatewayUnreachable`` when the connection is lost first."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiters[key] = future
        return future

    def resolve(self, key: Key, value: Any) -> bool:
        future = self._waiters.pop(key, None)
        if future is None or future.done():
            return False
        future.set_result(value)
        return True

    def forget(self, key: Key, future: asyncio.Future[Any] | None = None) -> None:
        """Stop waiting for ``key`` (only if its waiter is still ``future``, when given)."""
        if future is None:
            self._waiters.pop(key, None)
        elif self._waiters.get(key) is future:
            del self._waiters[key]

    # --- the reader --------------------------------------------------------------------------

    async def _read_loop(self, ws: Any) -> None:
        try:
            while True:
                timeout = self.silence_timeout if self._busy() else None
                try:
                    frame = await asyncio.wait_for(ws.recv(), timeout)
                except TimeoutError:
                    log.warning("no server event for %.0f s during a turn: dropping the connection",
                                self.silence_timeout)
                    break
                try:
                    event = decode(frame)
                except FrameError as e:
                    log.warning("%s", e)
                    continue
                self._on_event(event)
        except ConnectionClosed:
            pass
        finally:
            if self.ws is ws:
                self.ws = None
                self._after_close(ws)
                asyncio.get_running_loop().create_task(_close_quietly(ws, self.request_timeout))
            self._fail_pending()

    async def _lost(self, ws: Any) -> None:
        if self.ws is ws:
            self.ws = None
            self._after_close(ws)
            await _close_quietly(ws, self.request_timeout)
        self._fail_pending()

    def _after_close(self, ws: Any) -> None:
        """The session on ``ws`` is over. A gateway replica going away says so with 1001 and a
        reconnect hint, sent only once no response is in progress: come back after the time it
        names, and let the client keep a turn whose request the old session never took."""
        rcvd = getattr(getattr(ws, "protocol", None), "close_rcvd", None)  # the server's close frame
        after_ms = reconnect_hint(rcvd.code, rcvd.reason) if rcvd is not None else None
        if after_ms is None or self.closed:
            return
        log.info("the gateway is draining this session: reconnecting in %d ms", after_ms)
        self._reconnect_at = time.monotonic() + after_ms / 1000
        self._on_drain()
        if self._reconnect_task is None or self._reconnect_task.done():
            self._reconnect_task = asyncio.get_running_loop().create_task(self._reconnect_after_drain(),
                                                                          name="rtgw-reconnect")

    def _fail_pending(self) -> None:
        self._on_lost()
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(GatewayUnreachable("the connection to the gateway was lost"))
        self._waiters.clear()


async def _close_quietly(ws: Any, timeout: float) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ws.close(), timeout)
