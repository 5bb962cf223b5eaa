"""A scripted Realtime server for the Python SDK tests: it answers as the gateway does, with no
model, and can drain a session or hold a handshake where a test needs the client caught there."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request

HINT = '{"reconnect":true,"after_ms":%d}'


class ScriptedGateway:
    """Serve ``handler`` (and ``process_request`` where a handshake is held). ``drain_on_create``
    closes the first session with 1001 and that reason when its first ``response.create``
    arrives, untaken; ``hold_handshake`` (1 for the first connection, ...) keeps that
    connection's opening handshake waiting, ``held`` set, until ``release`` is set."""

    def __init__(self, drain_on_create: str | None = None, hold_handshake: int | None = None) -> None:
        self.drain_on_create = drain_on_create
        self.hold_handshake = hold_handshake
        self.held = asyncio.Event()
        self.release = asyncio.Event()
        self.connections: list[ServerConnection] = []  # each handshake seen by process_request
        self.received: list[list[dict[str, Any]]] = []  # the client events, per session

    async def process_request(self, ws: ServerConnection, request: Request) -> None:
        self.connections.append(ws)
        if len(self.connections) == self.hold_handshake:
            self.held.set()
            await self.release.wait()

    async def handler(self, ws: ServerConnection) -> None:
        events: list[dict[str, Any]] = []
        self.received.append(events)
        n = len(self.received)
        try:
            await ws.send(json.dumps({"type": "session.created", "session": {"id": f"sess_{n}", "model": "m"}}))
            async for frame in ws:
                event = json.loads(frame)
                events.append(event)
                if event["type"] == "conversation.item.create":
                    await ws.send(json.dumps({"type": "conversation.item.added", "item": event["item"]}))
                elif event["type"] == "response.create":
                    if self.drain_on_create is not None:
                        reason, self.drain_on_create = self.drain_on_create, None
                        await ws.close(1001, reason)
                        return
                    await self.answer(ws, f"resp_{n}", "Hello!")
        except ConnectionClosed:
            pass

    @staticmethod
    async def answer(ws: ServerConnection, response_id: str, text: str) -> None:
        item = {"id": f"item_{response_id}", "type": "message", "role": "assistant", "content": []}
        for event in (
            {"type": "response.created", "response": {"id": response_id}},
            {"type": "conversation.item.added", "item": item},
            {"type": "response.output_text.delta", "response_id": response_id, "item_id": item["id"], "delta": text},
            {"type": "response.done", "response": {"id": response_id, "status": "completed", "metadata": {"x_tier": "edge"},
                                                   "output": [{**item, "content": [{"type": "output_text", "text": text}]}]}},
        ):
            await ws.send(json.dumps(event))
