"""Server frames written straight to an accepted WebSocket's transport: the outbox's fast lane
(``gateway/ws/outbox.py``), which skips aiohttp's writer while the kernel takes every byte at once."""

from __future__ import annotations

import asyncio
import struct

from aiohttp import web


def frame_bytes(frame: str | bytes) -> bytes:
    """One unmasked, unfragmented server frame (RFC 6455 5.2): text for ``str``, binary for ``bytes``."""
    if isinstance(frame, str):
        # A text frame must be UTF-8: a lone surrogate (never expected: client strings are checked)
        # is sent as "?" rather than raising in the middle of a pump.
        payload, first = frame.encode("utf-8", "replace"), 0x81  # FIN + text
    else:
        payload, first = frame, 0x82  # FIN + binary
    n = len(payload)
    if n < 126:
        return bytes((first, n)) + payload
    if n < 65536:
        return struct.pack("!BBH", first, 126, n) + payload
    return struct.pack("!BBQ", first, 127, n) + payload


class TransportWriter:
    """The outbox's fast lane onto one accepted WebSocket: frames written straight to its transport
    while the kernel takes them at once. aiohttp writes its own control frames (pong, close) to
    the same transport; each write is a whole frame, so they never interleave inside one. Nothing
    is written once aiohttp began closing (no data frame may follow a close frame)."""

    def __init__(self, ws: web.WebSocketResponse, transport: asyncio.Transport) -> None:
        self._ws = ws
        self._transport = transport

    def writable(self) -> bool:
        transport = self._transport
        return not self._ws.closed and not transport.is_closing() and transport.get_write_buffer_size() == 0

    def write(self, frames: list[str | bytes]) -> None:
        if self._ws.closed or self._transport.is_closing():
            raise ConnectionResetError("the WebSocket is closing")
        self._transport.write(b"".join(map(frame_bytes, frames)))
