"""Large frames without unbounded memory: a gate in front of aiohttp's WebSocket parser.

The Realtime API lets one ``input_audio_buffer.append`` carry up to 15 MiB of base64 audio (a
push-to-talk app, a file upload), while every other event is small. aiohttp's parser holds a
whole message before anyone sees it, so its one size limit would either close such sessions
(1009) or let every session make the server hold 15 MiB at once. The gate reads each frame's
header (RFC 6455 section 5.2: the payload length comes before the payload) and decides before a
byte of the payload is held:

- a message up to ``small`` bytes passes, as before;
- a larger one, up to ``cap``, passes only if the server-wide ``LargeFrameBudget`` has room for
  it: those bytes are the message's until the session has handled it (``FrameGate.handled``);
- otherwise its payload is read and dropped as it arrives, and the session is told with an
  ``error`` event (``large_frames_busy``, ``frame_too_large``) in the order the frame came: the
  connection and its conversation go on.

A message sent in fragments is held by the gate until it is over ``small`` (at most ``small``
bytes), then takes ``cap`` of the budget, since its total is not known yet. Control frames
(ping, pong, close) always pass. Malformed framing is passed on for aiohttp to refuse, with the
close code it always used. The gate only counts and routes bytes; it never unmasks or copies
a payload it passes whole.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from aiohttp import web

OP_CONTINUATION, OP_TEXT, OP_BINARY = 0x0, 0x1, 0x2
NO_DATA = (False, b"")


class Parser(Protocol):
    """What aiohttp's protocol feeds: its ``WebSocketReader``, and the gate in front of it."""

    def feed_data(self, data: bytes) -> tuple[bool, bytes]: ...

    def feed_eof(self) -> None: ...


class LargeFrameBudget:
    """Bytes of large frames the server holds at once, over all sessions of this process."""

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.in_flight = 0
        self.refused = 0  # large frames dropped for want of room (the metrics read it)

    def take(self, n: int) -> bool:
        if self.in_flight + n > self.total_bytes:
            self.refused += 1
            return False
        self.in_flight += n
        return True

    def give_back(self, n: int) -> None:
        self.in_flight -= n
        assert self.in_flight >= 0, "gave back more large-frame bytes than were taken"


@dataclass(frozen=True)
class Passed:
    """A message that reached aiohttp's parser, holding ``reserved`` bytes of the budget (0: small)."""

    reserved: int


@dataclass(frozen=True)
class Refused:
    """A message the gate dropped: the ``error`` event's code and message."""

    code: str
    message: str


Mode = Literal["pass", "hold", "skip"]


@dataclass
class _Message:
    size: int  # payload bytes declared so far (all frames of the message)
    mode: Mode
    reserved: int = 0
    refusal: Refused | None = None


class FrameGate:
    """Reads frame headers from the byte stream and routes each frame to aiohttp's parser
    (``inner``) or drops it. ``messages`` says, in order, what became of each data message;
    ``on_refused`` is called (from the protocol's ``data_received``) when a refusal is queued."""

    def __init__(self, inner: Parser, budget: LargeFrameBudget, *, small: int, cap: int,
                 on_refused: Callable[[], None] = lambda: None) -> None:
        self._inner = inner
        self._budget = budget
        self._small = small
        self._cap = cap
        self.on_refused = on_refused
        self.messages: deque[Passed | Refused] = deque()
        self._head = bytearray()  # the header of the frame being read, until it is whole
        self._left = 0  # payload bytes of the current frame still to come
        self._in_payload = False
        self._frame_mode: Mode = "pass"
        self._frame_fin = True
        self._frame_control = False
        self._message: _Message | None = None  # a data message under way (its frames not all read)
        self._held = bytearray()  # frames of a fragmented message not decided yet (at most ``small``)
        self._out: list[bytes | memoryview] = []  # what this read passes to aiohttp, in order
        self._refused = False  # this read completed a dropped message: the connection is told
        self._failed = False

    # ----- the protocol's side --------------------------------------------------------------

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        if self._failed:
            return self._inner.feed_data(data)  # aiohttp failed the stream: let it answer as it does
        out = self._out
        view = memoryview(data)
        pos, end = 0, len(data)
        while pos < end:
            if not self._in_payload:
                pos = self._read_header(view, pos)
                continue
            take = min(self._left, end - pos)
            self._route(view[pos:pos + take])
            self._left -= take
            pos += take
            if self._left == 0:
                self._frame_done()
        if self._refused:
            self._refused = False
            self.on_refused()
        if not out:
            return NO_DATA
        if len(out) == 1 and len(out[0]) == end:
            piece: bytes = data  # the whole read passes: no copy
        else:
            piece = b"".join(out)
        out.clear()
        result = self._inner.feed_data(piece)
        if result[0]:
            self._failed = True  # aiohttp refused the stream (a protocol error, a message too big): it closes
        return result

    def feed_eof(self) -> None:
        self._inner.feed_eof()

    # ----- the session's side ---------------------------------------------------------------

    def refusals(self) -> list[Refused]:
        """The refusals due now (those before any message still to be handled), taken."""
        due: list[Refused] = []
        while self.messages and isinstance(self.messages[0], Refused):
            refusal = self.messages.popleft()
            assert isinstance(refusal, Refused)
            due.append(refusal)
        return due

    def delivered(self) -> int:
        """Bytes of the budget the oldest message aiohttp delivered holds (0: a small one). Take
        the refusals due before it first."""
        head = self.messages[0] if self.messages else None
        return head.reserved if isinstance(head, Passed) else 0

    def handled(self) -> None:
        """The session is done with the oldest message aiohttp delivered: its bytes go back."""
        if self.messages and isinstance(self.messages[0], Passed):
            self._budget.give_back(self.messages.popleft().reserved)  # type: ignore[union-attr]

    def close(self) -> None:
        """The connection is over: every byte it held goes back, and nothing more is held."""
        for entry in self.messages:
            if isinstance(entry, Passed):
                self._budget.give_back(entry.reserved)
        self.messages.clear()
        if self._message is not None and self._message.reserved:
            self._budget.give_back(self._message.reserved)
            self._message.reserved = 0
        self._held.clear()
        self._failed = True

    # ----- frames ---------------------------------------------------------------------------

    def _read_header(self, view: memoryview, pos: int) -> int:
        """Takes header bytes from ``pos``; once the header is whole, routes the frame."""
        head = self._head
        need = 2
        while True:
            if len(head) >= 2:
                flag = head[1] & 0x7F
                need = 2 + (2 if flag == 126 else 8 if flag == 127 else 0) + (4 if head[1] & 0x80 else 0)
            if len(head) >= need or pos >= len(view):
                break
            grab = min(need - len(head), len(view) - pos)
            head += view[pos:pos + grab]
            pos += grab
        if len(head) < need:
            return pos  # the rest of the header comes with the next read
        fin, opcode, length = bool(head[0] & 0x80), head[0] & 0x0F, self._length(head)
        self._frame_fin, self._frame_control = fin, opcode >= 0x8
        self._frame_mode = self._decide(fin, opcode, length)
        self._route(bytes(head))
        head.clear()
        self._left = length
        self._in_payload = True
        if length == 0:
            self._frame_done()
        return pos

    @staticmethod
    def _length(head: bytearray) -> int:
        flag = head[1] & 0x7F
        if flag == 126:
            return int(struct.unpack_from("!H", head, 2)[0])
        if flag == 127:
            return int(struct.unpack_from("!Q", head, 2)[0])
        return flag

    def _decide(self, fin: bool, opcode: int, length: int) -> Mode:
        if opcode not in (OP_CONTINUATION, OP_TEXT, OP_BINARY):
            return "pass"  # control frames, and unknown opcodes for aiohttp to refuse
        message = self._message
        if opcode == OP_CONTINUATION:
            return "pass" if message is None else self._grow(message, length)  # of nothing: aiohttp refuses
        if message is not None:
            # A new message before the last one ended: a protocol error aiohttp can only see if it
            # has the earlier frames, so they go to it (a dropped message's are gone: no error).
            self._end_message(message, complete=False)
        message = self._message = _Message(size=0, mode="pass" if fin else "hold")
        return self._grow(message, length)

    def _grow(self, message: _Message, length: int) -> Mode:
        """A frame of ``length`` more bytes of ``message``: where it goes."""
        message.size += length
        if message.mode == "skip" or message.size <= self._small or message.reserved:
            # (Reserved and over ``cap`` in fragments: aiohttp's own limit closes the connection, 1009.)
            return message.mode
        if message.size > self._cap:
            return self._skip(message, Refused("frame_too_large", f"this frame is over {self._cap} bytes, the most "
                                               "one event may carry (an input_audio_buffer.append of up to 15 MiB "
                                               "of base64 audio); it was dropped"))
        # A whole message in one frame takes what it declares; one in fragments the most it may grow to.
        want = message.size if self._frame_fin and message.mode == "pass" else self._cap
        if not self._budget.take(want):
            return self._skip(message, Refused("large_frames_busy", "the server holds as many large frames as its "
                                               "memory budget allows; this event was dropped: send it again in a "
                                               f"moment, or in events of at most {self._small} bytes"))
        message.reserved = want
        if message.mode == "hold":
            self._out.append(bytes(self._held))
            self._held.clear()
            message.mode = "pass"
        return "pass"

    def _skip(self, message: _Message, refusal: Refused) -> Mode:
        message.mode = "skip"
        message.refusal = refusal
        self._held.clear()
        return "skip"

    def _route(self, piece: bytes | memoryview) -> None:
        if self._frame_control or self._frame_mode == "pass":
            self._out.append(piece)
        elif self._frame_mode == "hold":
            self._held += piece

    def _frame_done(self) -> None:
        self._in_payload = False
        if not self._frame_control and self._frame_fin and self._message is not None:
            self._end_message(self._message, complete=True)

    def _end_message(self, message: _Message, *, complete: bool) -> None:
        self._message = None
        if message.mode == "skip":
            assert message.refusal is not None
            self.messages.append(message.refusal)
            self._refused = True
            return
        if message.mode == "hold":
            self._out.append(bytes(self._held))
            self._held.clear()
        if complete:
            self.messages.append(Passed(message.reserved))
        elif message.reserved:
            self._budget.give_back(message.reserved)


class GatedWebSocketResponse(web.WebSocketResponse):
    """aiohttp's WebSocket response with a ``FrameGate`` in front of its parser (``gate``), put
    there before the first byte after the handshake is parsed. aiohttp has no public hook for
    this: the gate takes the parser's place in the request's protocol (``_payload_parser``), and
    any frames a client sent together with its handshake (``_message_tail``) go through the gate
    too. ``tests/gateway/test_frame_gate.py`` fails if a new aiohttp moves either."""

    def __init__(self, *, gate: Callable[[Parser], FrameGate], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._make_gate = gate
        self.gate: FrameGate | None = None

    def _post_start(self, request: Any, protocol: str | None, writer: Any) -> None:
        handler = request.protocol
        early, handler._message_tail = handler._message_tail, b""
        super()._post_start(request, protocol, writer)
        self.gate = self._make_gate(handler._payload_parser)
        handler._payload_parser = self.gate
        if early:
            handler.data_received(early)
