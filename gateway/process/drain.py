"""Draining a replica before it stops (SIGTERM, or ``RunningServer.drain`` in tests).

Gateways run as several replicas behind a load balancer, and a session lives on one of them.
When a replica is scaled down its users must not lose their conversation or see an error, so
before the normal shutdown the replica drains:

- it keeps its port open but takes no new work: ``/readyz`` answers 503 with ``"draining":
  true`` (the load balancer stops sending traffic), a new session or chat completion gets 503
  ``server_draining`` with ``Retry-After``;
- each idle session is closed at once, each busy one right after its response's
  ``response.done``; chat completions run to their end;
- after ``server.drain_timeout_s`` what is still running is cancelled (``server_shutdown``).

Every session is closed with 1001 and a reconnect hint as the close reason,
``{"reconnect":true,"after_ms":N}``, with N drawn for each session from
0..``server.drain_reconnect_spread_ms``, so that the clients of a drained replica come back
spread out rather than in the same millisecond. The SDKs reconnect to the same URL (the load
balancer picks a healthy replica) and restore the conversation there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
from typing import Any

from aiohttp import web

from gateway.http.api import authorize, json_error
from gateway.http.chat_schema import HttpError
from gateway.http.state import STATE, GatewayState
from gateway.ws.connection import WS_CLOSE_GOING_AWAY

log = logging.getLogger(__name__)

MAX_CLOSE_REASON_BYTES = 123  # RFC 6455: a close frame's payload is at most 125 bytes, 2 of them the code
RETRY_AFTER_S = 1  # another replica can take the request now; the load balancer needs a moment to notice
CHAT_PATH = "/v1/chat/completions"
READY_PATH = "/readyz"


def jittered_hint(spread_ms: int, rng: random.Random | None = None) -> str:
    """A reconnect hint with ``after_ms`` drawn uniformly from 0..``spread_ms``."""
    return reconnect_hint(rng.randint(0, spread_ms) if rng is not None else secrets.randbelow(spread_ms + 1))


def reconnect_hint(after_ms: int) -> str:
    """The close reason of a drained session: compact JSON, well under the close frame's limit."""
    reason = json.dumps({"reconnect": True, "after_ms": int(after_ms)}, separators=(",", ":"))
    assert len(reason.encode()) <= MAX_CLOSE_REASON_BYTES
    return reason


def draining_error() -> HttpError:
    return HttpError(503, "server_draining", "this gateway replica is shutting down and takes no new work; "
                     "retry: another replica will serve you", type_="server_error",
                     headers={"Retry-After": str(RETRY_AFTER_S)})


async def drain_replica(state: GatewayState, *, hurry: asyncio.Event | None = None,
                rng: random.Random | None = None) -> None:
    """Drain ``state``'s app (see the module's docstring). Returns once every session and chat
    completion has ended, or once those left after ``drain_timeout_s`` (or when ``hurry`` is
    set) have been cancelled and their sessions closed. Idempotent."""
    if state.draining:
        return
    state.draining = True
    server = state.config.server

    def hint() -> str:
        return jittered_hint(server.drain_reconnect_spread_ms, rng)

    connections = list(state.connections)
    for connection in connections:
        connection.drain(hint())
    log.info("draining: %d sessions (%d busy), %d chat completions; up to %g s", len(connections),
             sum(1 for c in connections if not c.closed), state.chats_in_flight, server.drain_timeout_s)
    idle = asyncio.create_task(state.wait_idle())
    waits: set[asyncio.Future[Any]] = {idle}
    hurried = asyncio.create_task(hurry.wait()) if hurry is not None else None
    if hurried is not None:
        waits.add(hurried)
    try:
        await asyncio.wait(waits, timeout=server.drain_timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
    if not state.busy:
        log.info("drained")
        return
    left = list(state.connections)
    log.warning("drain %s: cancelling %d sessions' responses; %d chat completions are left to shutdown",
                "cut short" if hurry is not None and hurry.is_set() else "timed out", len(left),
                state.chats_in_flight)
    closes = [c.close(WS_CLOSE_GOING_AWAY, hint(), cancel_reason="server_shutdown") for c in left]
    await asyncio.gather(*closes, return_exceptions=True)


@web.middleware
async def drain_gate(request: web.Request, handler: Any) -> web.StreamResponse:
    """While draining, ``/readyz`` says so and new chat completions are refused; chat completions
    are counted, so that the drain can wait for them. (The WebSocket handshake checks
    ``state.draining`` itself, in gateway/process/server.py.)"""
    state = request.app[STATE]
    if request.path == CHAT_PATH and request.method == "POST":
        if state.draining:
            return _refuse_chat(request, state)
        state.chats_in_flight += 1
        try:
            return await handler(request)
        finally:
            state.chats_in_flight -= 1
            state.work_ended.set()
    if request.path == READY_PATH and state.draining:
        return _draining_readyz(request, state)
    return await handler(request)


def _refuse_chat(request: web.Request, state: GatewayState) -> web.Response:
    try:
        authorize(request, state)  # a bad key is told so first, as in the handshake
        raise draining_error()
    except HttpError as e:
        state.metrics.errors.labels("chat", e.code).inc()
        return json_error(e)


def _draining_readyz(request: web.Request, state: GatewayState) -> web.Response:
    if state.config.server.operator_endpoints_need_key:
        try:
            authorize(request, state)
        except HttpError as e:
            return json_error(e)
    tiers = state.router.tiers_up() if state.router is not None else {}
    return web.json_response({"status": "draining", "draining": True, "tiers": tiers}, status=503,
                             headers={"Retry-After": str(RETRY_AFTER_S)})
