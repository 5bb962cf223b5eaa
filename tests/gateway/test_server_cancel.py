"""Cancels at random points: response.cancel, truncation of the item being written, disconnects.

After each cancel the client must see ``response.done`` with ``cancelled`` and no later delta
of that response, and by then the engine must hold no KV for it. After the whole run nothing
may be left behind: no KV blocks, no engine request, no task, no session object.
"""

import asyncio
import gc
import random
import weakref

import aiohttp
import websockets
from fake_engine import FakeEngine, FakeTokenizer
from gateway_harness import MODEL, Gateway, recv_json, recv_until, running_gateway, send, user_item

TOKENS = 40


def reply(prompt, params) -> list[str]:
    # Chat requests here ask for something long: their clients always leave before the end.
    n = 10 * TOKENS if "<user>long\n" in FakeTokenizer().decode(prompt) else TOKENS
    return [f"t{i} " for i in range(n)]


class TrackingSet(set):
    """Stands in for the app's set of live connections, keeping weak references to every
    connection and session it ever held."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []

    def add(self, connection) -> None:
        self.refs.append(weakref.ref(connection))
        self.refs.append(weakref.ref(connection.session))
        super().add(connection)


async def until(condition, timeout: float = 5.0) -> None:
    """Server-side clean-up after a client leaves has no event the client could await: poll."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def assert_nothing_left(gw: Gateway, tracked: TrackingSet, tasks_before: set[asyncio.Task]) -> None:
    await gw.wait_sessions_gone()

    def leftover() -> set[asyncio.Task]:
        return {t for t in asyncio.all_tasks() if not t.done()} - tasks_before - {asyncio.current_task()}

    await until(lambda: not leftover() and gw.engine.running == 0)
    assert gw.engine.blocks_in_use == 0
    assert not gw.state.http_requests
    gc.collect()
    alive = [r() for r in tracked.refs if r() is not None]
    assert not alive, f"objects left behind: {alive[:3]}"


async def cancel_many(gw: Gateway, rng: random.Random, count: int, stats: dict[str, int]) -> None:
    engine = gw.engine
    async with websockets.connect(gw.ws_url) as ws:
        await recv_json(ws)
        await send(ws, user_item("hello"))
        done_ids: set[str] = set()
        for _ in range(count):
            point = rng.randint(-1, TOKENS + 2)  # -1: cancel before response.created arrives
            truncate = rng.random() < 0.3
            await send(ws, {"type": "response.create"})
            if point == -1:
                await send(ws, {"type": "response.cancel"})
            seen, text, item_id = 0, "", None
            while True:
                event = await recv_json(ws)
                kind = event["type"]
                if kind == "response.output_text.delta":
                    assert event["response_id"] not in done_ids, "a delta after response.done"
                    seen, text, item_id = seen + 1, text + event["delta"], event["item_id"]
                    if seen == point:
                        if truncate:
                            await send(ws, {"type": "conversation.item.truncate", "item_id": item_id,
                                            "content_index": 0, "x_text_end": len(text) // 2})
                        else:
                            await send(ws, {"type": "response.cancel"})
                elif kind == "response.done":
                    response = event["response"]
                    done_ids.add(response["id"])
                    stats[response["status"]] += 1
                    if response["status"] == "cancelled":
                        assert response["status_details"]["reason"] == "client_cancelled"
                        assert engine.blocks_of(response["id"]) == 0  # KV freed before the client hears
                    else:
                        assert response["status"] == "completed"
                    break
                elif kind == "error":
                    # A cancel that crossed response.done (or came before any response) on the wire.
                    assert event["error"]["code"] in ("response_cancel_not_active", "item_not_found"), event


async def test_random_cancels_of_200_responses() -> None:
    rng = random.Random(20261122)
    async with running_gateway(FakeEngine(tokens_per_second=4000, reply=reply)) as gw:
        tracked = gw.state.connections = TrackingSet()
        tasks_before = set(asyncio.all_tasks())
        stats = {"cancelled": 0, "completed": 0}
        await asyncio.gather(*(cancel_many(gw, random.Random(rng.random()), 50, stats) for _ in range(4)))
        assert stats["cancelled"] + stats["completed"] == 200
        assert stats["cancelled"] > 120 and stats["completed"] > 0  # both outcomes exercised
        assert len(gw.engine.aborts) > 100
        await assert_nothing_left(gw, tracked, tasks_before)


async def disconnect_once(gw: Gateway, rng: random.Random) -> None:
    ws = await websockets.connect(gw.ws_url)
    await recv_json(ws)
    await send(ws, user_item("hello"))
    await send(ws, {"type": "response.create"})
    for _ in range(rng.randint(0, TOKENS + 8)):
        event = await recv_json(ws)
        if event["type"] == "rate_limits.updated":
            break  # the response finished before this client left
    if rng.random() < 0.5:
        ws.transport.abort()  # the network drops: no close frame
    else:
        await ws.close()


async def sse_disconnect_once(http: aiohttp.ClientSession, gw: Gateway, rng: random.Random) -> None:
    resp = await http.post("/v1/chat/completions", json={"model": MODEL, "stream": True,
                                                          "messages": [{"role": "user", "content": "long"}]})
    for _ in range(rng.randint(0, 10)):
        await resp.content.readline()
    resp.close()


async def test_200_random_disconnects_leave_nothing_behind() -> None:
    rng = random.Random(7)
    # 500 tokens/s: a 40-token answer takes 80 ms, longer than any client here stays.
    async with running_gateway(FakeEngine(tokens_per_second=500, reply=reply)) as gw:
        tracked = gw.state.connections = TrackingSet()
        tasks_before = set(asyncio.all_tasks())
        for _ in range(8):
            await asyncio.gather(*(disconnect_once(gw, random.Random(rng.random())) for _ in range(25)))
        async with aiohttp.ClientSession(gw.http, connector=aiohttp.TCPConnector(force_close=True)) as http:
            await asyncio.gather(*(sse_disconnect_once(http, gw, random.Random(rng.random())) for _ in range(40)))
        assert len(tracked.refs) == 2 * 200
        assert len(gw.engine.started) == 240 and len(gw.engine.aborts) > 100
        chat_ids = {rid for rid, _ in gw.engine.started if rid.startswith("chatcmpl-")}
        assert len(chat_ids) == 40
        await until(lambda: chat_ids <= set(gw.engine.finished))  # aborted, or (wrongly) ran to the end
        assert {gw.engine.finished[rid] for rid in chat_ids} == {"abort"}  # every SSE client left early
        await assert_nothing_left(gw, tracked, tasks_before)


async def test_cancel_while_a_long_prompt_is_being_tokenized() -> None:
    """Long prompts are tokenized in a thread; a cancel in that window must stop the request
    from ever running (the engine cannot abort what it has not seen yet)."""
    engine = FakeEngine(reply=reply, tokenizer=FakeTokenizer(chat_delay_s=0.3))
    async with running_gateway(engine) as gw:
        tracked = gw.state.connections = TrackingSet()
        tasks_before = set(asyncio.all_tasks())
        async with websockets.connect(gw.ws_url) as ws:
            await recv_json(ws)
            await send(ws, user_item("x" * 20_000))  # above gateway.tiers.build.INLINE_TOKENIZE_CHARS
            await send(ws, {"type": "response.create"})
            await recv_until(ws, "response.created")  # the generation task is tokenizing now
            await send(ws, {"type": "response.cancel"})
            done = (await recv_until(ws, "response.done"))[-1]["response"]
            assert done["status"] == "cancelled"
            await send(ws, {"type": "response.create"})  # the next turn runs normally
            done = (await recv_until(ws, "response.done"))[-1]["response"]
            assert done["status"] == "completed"
        await assert_nothing_left(gw, tracked, tasks_before)
        assert list(gw.engine.finished.values()) == ["stop"]  # only the second turn reached the engine
