"""The cheap side of bench/large_appends.py: Realtime sessions on raw sockets that each send one
prebuilt large frame, and an RSS sampler for the gateway's processes.

Sixty-four sessions each sending 15 MiB must not cost the benchmark's process 64 copies, nor the
two cores the masking of 960 MiB: every session writes the same bytes object, a masked text frame
whose mask key is zero (RFC 6455 lets the client pick any key; with zero the masked payload is the
payload), through ``loop.sock_sendall`` on a memoryview, which sends from it without copying
(asyncio's transports would copy what the socket does not take at once). The handshake is a real
HTTP/1.1 upgrade with its ``Sec-WebSocket-Accept`` checked; server frames are parsed as they come.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
import psutil

from bench._common import BenchError

WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
ZERO_MASK = b"\0\0\0\0"


def masked_text_frame(payload: bytes) -> bytes:
    """A client's text frame (FIN, masked) with the zero mask key: the payload as it is."""
    n = len(payload)
    if n < 126:
        header = struct.pack("!BB", 0x81, 0x80 | n)
    elif n < 65536:
        header = struct.pack("!BBH", 0x81, 0x80 | 126, n)
    else:
        header = struct.pack("!BBQ", 0x81, 0x80 | 127, n)
    return header + ZERO_MASK + payload


def append_frame(base64_chars: int) -> bytes:
    """One ``input_audio_buffer.append`` carrying ``base64_chars`` of base64 ("A": silence),
    framed: the one large bytes object every flooding session sends."""
    if base64_chars % 4:
        raise ValueError("base64 comes in groups of 4 characters")
    return masked_text_frame(b'{"type":"input_audio_buffer.append","audio":"' + b"A" * base64_chars + b'"}')


CLEAR_FRAME = masked_text_frame(b'{"type":"input_audio_buffer.clear"}')
CLOSE_FRAME = struct.pack("!BB", 0x88, 0x82) + ZERO_MASK + struct.pack("!H", 1000)  # a normal close, zero mask key


@dataclass
class Outcome:
    """What one large append got, up to the ``input_audio_buffer.cleared`` sent after it (events
    keep their order, so every answer to the append came before that)."""

    codes: list[str] = field(default_factory=list)  # the error events' codes, in order
    sent_s: float = 0.0  # from the flood's start until the frame had left
    answered_s: float | None = None  # ... until the clear's answer came (None: never)
    closed: bool = False  # the connection ended first

    @property
    def kind(self) -> str:
        if self.closed or self.answered_s is None:
            return "closed"
        return self.codes[0] if self.codes else "appended"


class RawSession:
    """One Realtime session on a non-blocking socket: ``await RawSession.open(...)`` returns it
    after ``session.created``."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray()

    @classmethod
    async def open(cls, host: str, port: int, path: str, api_key: str, timeout: float = 60.0) -> RawSession:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        session = cls(sock)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (host, port)), timeout)
            await asyncio.wait_for(session._upgrade(host, port, path, api_key), timeout)
            while (await asyncio.wait_for(session.event(), timeout))["type"] != "session.created":
                pass
        except BaseException:
            sock.close()
            raise
        return session

    async def _upgrade(self, host: str, port: int, path: str, api_key: str) -> None:
        loop = asyncio.get_running_loop()
        key = base64.b64encode(os.urandom(16))
        request = (f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                   f"Sec-WebSocket-Key: {key.decode()}\r\nSec-WebSocket-Version: 13\r\n"
                   f"Authorization: Bearer {api_key}\r\n\r\n").encode()
        await loop.sock_sendall(self._sock, request)
        while (end := self._buffer.find(b"\r\n\r\n")) < 0:
            await self._read()
        head = bytes(self._buffer[:end]).decode("latin-1").split("\r\n")
        del self._buffer[:end + 4]
        if not head[0].startswith("HTTP/1.1 101"):
            raise BenchError(f"upgrade refused: {head[0]}")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
        if headers.get("sec-websocket-accept", "").encode() != base64.b64encode(hashlib.sha1(key + WS_GUID).digest()):
            raise BenchError("wrong Sec-WebSocket-Accept")

    async def _read(self) -> None:
        data = await asyncio.get_running_loop().sock_recv(self._sock, 65536)
        if not data:
            raise ConnectionResetError("the server closed the connection")
        self._buffer += data

    async def event(self) -> dict[str, Any]:
        """The next server event (text frames; pings and pongs are skipped, a close ends it)."""
        while True:
            buffer = self._buffer
            flag = buffer[1] & 0x7F if len(buffer) >= 2 else 0
            header = 4 if flag == 126 else 10 if flag == 127 else 2
            if len(buffer) >= header:
                n = (struct.unpack_from("!H", buffer, 2)[0] if flag == 126 else
                     struct.unpack_from("!Q", buffer, 2)[0] if flag == 127 else flag)
                if len(buffer) >= header + n:
                    opcode, payload = buffer[0] & 0x0F, bytes(buffer[header:header + n])
                    del buffer[:header + n]
                    if opcode == 0x8:
                        raise ConnectionResetError("the server sent a close frame")
                    if opcode == 0x1:
                        return dict(orjson.loads(payload))
                    continue
            await self._read()

    async def send_large(self, frame: memoryview, started: float) -> Outcome:
        """Send ``frame`` (an append) and a clear after it; read until the clear is answered."""
        loop = asyncio.get_running_loop()
        outcome = Outcome()

        async def answers() -> None:
            while (event := await self.event())["type"] != "input_audio_buffer.cleared":
                if event["type"] == "error":
                    outcome.codes.append(str(event["error"].get("code")))
            outcome.answered_s = time.perf_counter() - started

        reader = asyncio.create_task(answers())
        try:
            await loop.sock_sendall(self._sock, frame)
            await loop.sock_sendall(self._sock, CLEAR_FRAME)
            outcome.sent_s = time.perf_counter() - started
            await reader
        except (ConnectionError, OSError):
            outcome.closed = True
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError):
                await reader
        return outcome

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.send(CLOSE_FRAME)
        self._sock.close()


class RssSampler:
    """The summed RSS of ``processes`` every ``interval_s``, on a thread of its own (the benchmark's
    event loop is busy sending while the flood runs)."""

    def __init__(self, processes: list[psutil.Process], interval_s: float = 0.01) -> None:
        self._processes = processes
        self._interval_s = interval_s
        self.samples: list[tuple[float, int]] = []  # (perf_counter, bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for process in self._processes:
                with contextlib.suppress(psutil.NoSuchProcess):
                    total += int(process.memory_info().rss)
            self.samples.append((time.perf_counter(), total))
            self._stop.wait(self._interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak(self) -> int:
        if not self.samples:
            raise BenchError("no RSS sample was taken")
        return max(rss for _, rss in self.samples)
