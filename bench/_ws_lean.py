"""A lean Realtime client for load benchmarks: thousands of sessions in one process.

``bench/load.py`` measures what one gateway process carries, with its clients on the same two
cores. A ``websockets`` client costs ~60 µs of Python per received event (its frame reader, a
queue hop, the caller's ``recv``), so past a few hundred streams the clients, not the gateway,
set the ceiling. This client is an ``asyncio.Protocol`` that parses RFC 6455 frames as they
arrive and handles each event in the same callback (no task wake per event), so a stream costs
the client little more than the kernel's receive.

It is still a real client: an HTTP/1.1 upgrade with ``Sec-WebSocket-Key`` checked against the
server's ``Sec-WebSocket-Accept``, masked client frames with a random key per frame, every
server frame's JSON parsed (by orjson: ~0.7 µs a delta's frame where the standard library's
decoder took ~4), pings answered, a close frame when done. It speaks only what the
benchmark needs (text frames, no extensions, no fragmented frames from the server).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import struct
import time
from dataclasses import dataclass, field
from typing import Any, cast

import orjson

WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class ProtocolViolation(Exception):
    """The server sent something RFC 6455 or the Realtime protocol does not allow here."""


@dataclass
class Stream:
    """One response as a client saw it (times from ``time.perf_counter``)."""

    sent: float = 0.0
    first: float | None = None
    deltas: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    status: str = ""
    code: str | None = None
    done: float | None = None
    tier: str = ""  # the tier that served it and how it was routed (metadata x_tier, x_route)
    route: str = ""
    output_tokens: int = 0  # as response.done's usage reports them

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.deltas, self.deltas[1:], strict=False)]


def _mask(payload: bytes) -> bytes:
    key = os.urandom(4)
    n = len(payload)
    repeated = (key * (n // 4 + 1))[:n]
    masked = (int.from_bytes(payload, "big") ^ int.from_bytes(repeated, "big")).to_bytes(n, "big")
    return key + masked


def client_frame(opcode: int, payload: bytes) -> bytes:
    n = len(payload)
    if n < 126:
        header = bytes((0x80 | opcode, 0x80 | n))
    elif n < 65536:
        header = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
    else:
        header = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
    return header + _mask(payload)


class LeanSession(asyncio.Protocol):
    """One WebSocket session. ``await LeanSession.open(...)`` returns it after ``session.created``."""

    def __init__(self, host: str, port: int, path: str) -> None:
        self._request_key = base64.b64encode(os.urandom(16))
        self._accept = base64.b64encode(hashlib.sha1(self._request_key + WS_GUID).digest())
        self._request = (f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                         f"Connection: Upgrade\r\nSec-WebSocket-Key: {self._request_key.decode()}\r\n"
                         "Sec-WebSocket-Version: 13\r\n\r\n").encode()
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._upgraded = False
        loop = asyncio.get_running_loop()
        self.created: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self._stream: Stream | None = None
        self._done: asyncio.Future[Stream] | None = None
        self.events = 0

    @classmethod
    async def open(cls, host: str, port: int, path: str = "/v1/realtime", timeout: float = 60.0) -> LeanSession:
        loop = asyncio.get_running_loop()
        _, session = await asyncio.wait_for(loop.create_connection(lambda: cls(host, port, path), host, port), timeout)
        await asyncio.wait_for(asyncio.shield(session.created), timeout)
        return session

    # ----- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        self._transport.write(self._request)

    def connection_lost(self, exc: Exception | None) -> None:
        self._settle(ProtocolViolation(f"connection lost: {exc}"))
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()  # the arrival time of every event in this read
        buffer = self._buffer
        buffer += data
        try:
            if not self._upgraded and not self._upgrade(buffer):
                return
            self._frames(buffer, now)
        except ProtocolViolation as e:
            self._fail(e)

    # ----- sending --------------------------------------------------------------------------

    def send(self, event: dict[str, Any]) -> None:
        assert self._transport is not None
        self._transport.write(client_frame(0x1, json.dumps(event).encode()))

    def start_response(self, max_tokens: int, text: str = "Go on.") -> asyncio.Future[Stream]:
        """Send an out-of-band ``response.create``; the future resolves at its ``response.done``."""
        assert self._done is None or self._done.done(), "one response at a time"
        self._stream = Stream()
        self._done = asyncio.get_running_loop().create_future()
        self.send({"type": "response.create", "response": {
            "conversation": "none", "max_output_tokens": max_tokens,
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}]}})
        self._stream.sent = time.perf_counter()
        return self._done

    def close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(client_frame(0x8, struct.pack("!H", 1000)))
            self._transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    # ----- receiving ------------------------------------------------------------------------

    def _upgrade(self, buffer: bytearray) -> bool:
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > 16384:
                raise ProtocolViolation("no end to the upgrade response's headers")
            return False
        head = bytes(buffer[:end]).decode("latin-1").split("\r\n")
        if not head[0].startswith("HTTP/1.1 101"):
            raise ProtocolViolation(f"upgrade refused: {head[0]}")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
        if headers.get("sec-websocket-accept", "").encode() != self._accept:
            raise ProtocolViolation("wrong Sec-WebSocket-Accept")
        del buffer[:end + 4]
        self._upgraded = True
        return True

    def _frames(self, buffer: bytearray, now: float) -> None:
        offset, size = 0, len(buffer)
        while size - offset >= 2:
            first, second = buffer[offset], buffer[offset + 1]
            if second & 0x80:
                raise ProtocolViolation("a masked frame from the server")
            n, header = second & 0x7F, 2
            if n == 126:
                if size - offset < 4:
                    break
                n, header = struct.unpack_from("!H", buffer, offset + 2)[0], 4
            elif n == 127:
                if size - offset < 10:
                    break
                n, header = struct.unpack_from("!Q", buffer, offset + 2)[0], 10
            if size - offset < header + n:
                break
            payload = bytes(buffer[offset + header:offset + header + n])
            offset += header + n
            if not first & 0x80 or first & 0x70:
                raise ProtocolViolation("a fragmented frame or reserved bits from the server")
            self._frame(first & 0x0F, payload, now)
        del buffer[:offset]

    def _frame(self, opcode: int, payload: bytes, now: float) -> None:
        if opcode == 0x1:
            self.events += 1
            self._event(orjson.loads(payload), now)
        elif opcode == 0x9:
            assert self._transport is not None
            self._transport.write(client_frame(0xA, payload))
        elif opcode == 0x8:
            if self._transport is not None:
                self._transport.close()
        elif opcode != 0xA:
            raise ProtocolViolation(f"unexpected opcode {opcode}")

    def _event(self, event: dict[str, Any], now: float) -> None:
        kind = event["type"]
        stream = self._stream
        if kind == "response.output_text.delta":
            if stream is None:
                raise ProtocolViolation("a delta outside any response")
            if stream.first is None:
                stream.first = now
            stream.deltas.append(now)
            stream.text.append(event["delta"])
        elif kind == "response.done":
            if stream is None or self._done is None:
                raise ProtocolViolation("response.done outside any response")
            stream.done = now
            response = event["response"]
            stream.status = response["status"]
            stream.code = ((response.get("status_details") or {}).get("error") or {}).get("code")
            stream.output_tokens = int((response.get("usage") or {}).get("output_tokens") or 0)
            metadata = response.get("metadata") or {}
            stream.tier, stream.route = metadata.get("x_tier", ""), metadata.get("x_route", "")
            if not self._done.done():
                self._done.set_result(stream)
        elif kind == "session.created":
            if not self.created.done():
                self.created.set_result(None)
        elif kind == "error":
            self._fail(ProtocolViolation(f"error event: {event['error']}"))

    def _fail(self, error: Exception) -> None:
        self._settle(error)
        self.abort()

    def _settle(self, error: Exception) -> None:
        """Whoever waits for the session or its response learns ``error``."""
        for future in (self.created, self._done):
            if future is not None and not future.done():
                future.set_exception(error)
