"""Client frames into client events, for one connection: the codec's decoding and the frame
gate's large frames (``gateway/ws/frame_gate.py``). What is not an event (a frame that does not
decode, a large one that is not an append, one the gate dropped) becomes an ``error`` event
through the session, in the order the frames came, and the session goes on."""

from __future__ import annotations

from typing import Any

from aiohttp import WSMsgType

from gateway.metrics import GatewayMetrics
from gateway.ws.codec import DecodeError, FrameCodec
from gateway.ws.frame_gate import FrameGate
from gateway.ws.session import RealtimeSession

LARGE_EVENT = "input_audio_buffer.append"  # the one event that may be larger than max_frame_bytes


class ClientFrames:
    def __init__(self, codec: FrameCodec, gate: FrameGate | None, session: RealtimeSession,
                 metrics: GatewayMetrics, max_frame_bytes: int) -> None:
        self._codec = codec
        self._gate = gate
        self._session = session
        self._metrics = metrics
        self._max_frame_bytes = max_frame_bytes

    def event(self, kind: WSMsgType, data: str | bytes) -> dict[str, Any] | None:
        """The frame's event, or None after telling the session why it is not one. Call
        ``handled`` once the session is done with it (a large frame's bytes go back then)."""
        gate = self._gate
        self.refusals()  # frames the gate dropped before this one
        large = gate.delivered() if gate is not None else 0
        try:
            event = self._codec.decode_text(str(data)) if kind == WSMsgType.TEXT else self._codec.decode_binary(
                bytes(data))
        except DecodeError as e:
            self._session.receive_invalid(e.code, e.message)
            return None
        if large and event.get("type") != LARGE_EVENT:
            self._session.receive_invalid("frame_too_large", f"only {LARGE_EVENT} may be larger than "
                                          f"{self._max_frame_bytes} bytes")
            return None
        return event

    def handled(self) -> None:
        if self._gate is not None:
            self._gate.handled()
            self.refusals()

    def refusals(self) -> bool:
        """Frames the gate dropped (over the budget or the cap) that are due now, each an ``error``
        event in the place it came; True when there were any (the caller pumps)."""
        if self._gate is None:
            return False
        refusals = self._gate.refusals()
        for refusal in refusals:
            self._metrics.large_frames_refused.labels(refusal.code).inc()
            self._session.receive_invalid(refusal.code, refusal.message)
        return bool(refusals)
