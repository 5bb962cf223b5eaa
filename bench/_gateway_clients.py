"""Clients for bench/gateway_overhead.py: one Realtime turn driven over a WebSocket (the openai SDK or
raw ``websockets``) or straight through the engine in-process, timed the same way.

Both sides record when each piece of text arrives: a ``response.output_text.delta`` on the
WebSocket, a ``TokenEvent`` with text in-process (tokens that end inside a UTF-8 character
carry no text and make no delta, so they are skipped on both sides). Token counts come from
usage (``response.done`` and ``FinishEvent``), since the gateway may coalesce deltas.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import websockets
from openai import AsyncOpenAI

from bench._common import BenchError  # re-exported: the benchmarks import it from here
from gateway.tiers.build import encode_chat
from llm_shared.contract import Engine, FinishEvent, Priority, SamplingParams, TokenEvent

BENCH_API_KEY = "bench"  # the gateway has no keys configured on loopback; any bearer is accepted
DELTA = "response.output_text.delta"
DONE = "response.done"
ClientKind = Literal["sdk", "websockets"]

TOPICS = (
    "a lighthouse keeper", "a lost robot", "a dragon who cannot fly", "a baker in Paris", "a space station cook",
    "a detective cat", "an old violin", "a river that talks", "a winter market", "a tiny island school",
    "a forgotten library", "a mountain rescue dog", "a clockmaker's apprentice", "a desert caravan",
    "a submarine crew", "a haunted train station", "a chess prodigy", "a city garden", "a time-travelling letter",
    "a storm at sea", "a circus acrobat", "a beekeeper", "a painter who sees music", "an arctic expedition",
    "a small-town radio host", "a runaway kite", "a jazz trumpeter", "a medieval scribe", "a family of foxes",
    "a broken satellite", "a night bus driver", "a glassblower",
)


def prompts(n: int) -> list[str]:
    """``n`` distinct prompts asking for long answers (bench/gateway_overhead.py's responses also ignore the
    end-of-sequence token, so they end by their token limit whatever the model would answer)."""
    return [f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}." + (f" Part {i // len(TOPICS) + 1}."
            if i >= len(TOPICS) else "") for i in range(n)]


def messages_for(prompt: str) -> list[dict[str, str]]:
    """The chat messages the gateway builds for an out-of-band response with one user input
    and no instructions (``gateway.ws.conversation.to_messages``)."""
    return [{"role": "user", "content": prompt}]


def response_create(prompt: str, max_tokens: int) -> dict[str, Any]:
    """Out-of-band (``conversation: "none"``) greedy response of exactly ``max_tokens`` tokens: the
    prompt never grows between turns, and the length does not depend on where the model would stop."""
    return {
        "type": "response.create",
        "response": {
            "conversation": "none",
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]}],
            "max_output_tokens": max_tokens,
            "temperature": 0,  # our GA extension; greedy, so both arms generate the same tokens
            "x_ignore_eos": True,  # our extension: runs to max_output_tokens (a cancel point is always reached)
        },
    }


@dataclass(frozen=True)
class Received:
    type: str
    at: float  # time.perf_counter() once the frame was read and parsed
    delta: str = ""
    status: str = ""
    output_tokens: int = 0
    input_tokens: int = 0
    error_code: str = ""
    error_message: str = ""


class RealtimeClient(Protocol):
    kind: ClientKind

    async def send(self, event: dict[str, Any]) -> None: ...

    async def recv(self) -> Received: ...

    async def close(self) -> None: ...


class SdkClient:
    """The official openai SDK (``AsyncOpenAI.realtime.connect``): every event is parsed into
    the SDK's pydantic model, as an application would see it."""

    kind: ClientKind = "sdk"

    def __init__(self, stack: AsyncExitStack, connection: Any) -> None:
        self._stack = stack
        self._conn = connection

    @classmethod
    async def open(cls, openai_client: AsyncOpenAI, model: str) -> SdkClient:
        stack = AsyncExitStack()
        connection = await stack.enter_async_context(openai_client.realtime.connect(model=model))
        return cls(stack, connection)

    async def send(self, event: dict[str, Any]) -> None:
        await self._conn.send(event)

    async def recv(self) -> Received:
        ev = await self._conn.recv()
        at = time.perf_counter()
        if ev.type == DELTA:
            return Received(ev.type, at, delta=ev.delta)
        if ev.type == DONE:
            usage = ev.response.usage
            return Received(ev.type, at, status=ev.response.status or "",
                            output_tokens=(usage.output_tokens or 0) if usage else 0,
                            input_tokens=(usage.input_tokens or 0) if usage else 0)
        if ev.type == "error":
            return Received(ev.type, at, error_code=ev.error.code or "", error_message=ev.error.message)
        return Received(ev.type, at)

    async def close(self) -> None:
        await self._stack.aclose()


class WsClient:
    """A raw ``websockets`` client decoding frames with ``json.loads``: the least a client can do."""

    kind: ClientKind = "websockets"

    def __init__(self, ws: Any) -> None:
        self.ws = ws

    @classmethod
    async def open(cls, ws_url: str, model: str, *, compression: str | None = None) -> WsClient:
        ws = await websockets.connect(f"{ws_url}?model={model}", compression=compression, max_size=None,
                                      additional_headers={"Authorization": f"Bearer {BENCH_API_KEY}"},
                                      open_timeout=60)
        return cls(ws)

    @property
    def negotiated_extensions(self) -> str:
        return self.ws.response.headers.get("Sec-WebSocket-Extensions", "") if self.ws.response else ""

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(event))

    async def recv(self) -> Received:
        raw = await self.ws.recv()
        at = time.perf_counter()
        ev = json.loads(raw)
        kind = ev.get("type", "")
        if kind == DELTA:
            return Received(kind, at, delta=ev["delta"])
        if kind == DONE:
            usage = ev["response"].get("usage") or {}
            return Received(kind, at, status=ev["response"]["status"], output_tokens=usage.get("output_tokens", 0),
                            input_tokens=usage.get("input_tokens", 0))
        if kind == "error":
            return Received(kind, at, error_code=ev["error"].get("code") or "", error_message=ev["error"]["message"])
        return Received(kind, at)

    async def close(self) -> None:
        await self.ws.close()


async def wait_for(client: RealtimeClient, event_type: str) -> Received:
    """Read until ``event_type``; an ``error`` event on the way is a BenchError."""
    while True:
        ev = await client.recv()
        if ev.type == event_type:
            return ev
        if ev.type == "error":
            raise BenchError(f"gateway error while waiting for {event_type}: {ev.error_code}: {ev.error_message}")


@dataclass
class Turn:
    """One response, seen by its consumer."""

    sent_at: float
    done_at: float = 0.0
    status: str = ""
    output_tokens: int = 0
    input_tokens: int = 0
    parts: list[str] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # when each piece of text arrived

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def intervals(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


async def ws_turn(client: RealtimeClient, prompt: str, max_tokens: int) -> Turn:
    turn = Turn(sent_at=time.perf_counter())
    await client.send(response_create(prompt, max_tokens))
    while True:
        ev = await client.recv()
        if ev.type == DELTA:
            turn.parts.append(ev.delta)
            turn.arrivals.append(ev.at)
        elif ev.type == DONE:
            turn.done_at, turn.status = ev.at, ev.status
            turn.output_tokens, turn.input_tokens = ev.output_tokens, ev.input_tokens
            if ev.status not in ("completed", "incomplete"):
                raise BenchError(f"response ended {ev.status!r} instead of completing")
            return turn
        elif ev.type == "error":
            raise BenchError(f"gateway error event: {ev.error_code}: {ev.error_message}")


async def inprocess_turn(engine: Engine, prompt: str, max_tokens: int, request_id: str) -> Turn:
    """What the gateway does for one turn, minus the gateway: encode the chat the same way,
    generate at the same priority, consume the stream."""
    turn = Turn(sent_at=time.perf_counter())
    prompt_ids = await encode_chat(engine, messages_for(prompt))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)  # as response_create asks
    finish: FinishEvent | None = None
    async for event in engine.generate(request_id, prompt_ids, params, Priority.REALTIME):
        if isinstance(event, TokenEvent):
            if event.text:
                turn.arrivals.append(time.perf_counter())
                turn.parts.append(event.text)
        else:
            finish = event
    if finish is None or finish.reason not in ("stop", "length"):
        raise BenchError(f"in-process request {request_id} ended {finish.reason if finish else 'without a finish'}")
    if finish.text:
        turn.arrivals.append(time.perf_counter())
        turn.parts.append(finish.text)
    turn.done_at = time.perf_counter()
    turn.status = "completed" if finish.reason == "stop" else "incomplete"
    turn.output_tokens, turn.input_tokens = finish.completion_tokens, finish.prompt_tokens
    return turn


@dataclass
class Round:
    arm: str  # "inprocess", "sdk" or "websockets"
    index: int
    seconds: float  # first request sent -> last response done
    turns: list[Turn]
    client_cpu_s: float  # this process (the clients, or the in-process engine and its consumer)
    server_cpu_s: float  # the gateway process (idle during in-process rounds)
    other_cpu_s: float  # every other process on the machine: how disturbed the round was

    @property
    def tokens(self) -> int:
        return sum(t.output_tokens for t in self.turns)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def intervals(self) -> list[float]:
        return [gap for t in self.turns for gap in t.intervals()]


class Clients:
    """Opens WebSocket clients of either kind against one gateway."""

    def __init__(self, http_url: str, model: str) -> None:
        self.ws_url = http_url.replace("http", "ws", 1) + "/v1/realtime"
        self.model = model
        self.openai = AsyncOpenAI(base_url=f"{http_url}/v1", api_key=BENCH_API_KEY, max_retries=0)

    async def open(self, kind: ClientKind) -> RealtimeClient:
        client: RealtimeClient
        if kind == "sdk":
            client = await SdkClient.open(self.openai, self.model)
        else:
            client = await WsClient.open(self.ws_url, self.model)
        await wait_for(client, "session.created")
        return client

    async def open_many(self, kind: ClientKind, n: int) -> list[RealtimeClient]:
        opened = await asyncio.gather(*(self.open(kind) for _ in range(n)), return_exceptions=True)
        clients = [c for c in opened if not isinstance(c, BaseException)]
        if len(clients) < n:
            await close_all(clients)
            error = next(c for c in opened if isinstance(c, BaseException))
            raise BenchError(f"opened only {len(clients)} of {n} {kind} sessions: {error!r}") from error
        return clients


async def close_all(clients: list[Any]) -> None:
    await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
