"""Realtime sessions over a real loopback server: the openai SDK (GA and beta) and raw clients."""

import json

import msgpack
import websockets
from fake_engine import FakeEngine, FakeTokenizer, default_reply
from gateway_harness import KEY, MODEL, recv_json, recv_until, running_gateway, send, user_item
from openai import AsyncOpenAI
from realtime_sdk_check import check_server_event

from gateway.ws.codec import MSGPACK_SUBPROTOCOL
from llm_shared.contract import Priority, SamplingParams


def expected_text(messages: list[dict[str, str]]) -> str:
    prompt = FakeTokenizer().encode_chat(messages)
    return "".join(default_reply(prompt, SamplingParams()))


async def test_openai_sdk_ga_turn() -> None:
    async with running_gateway() as gw:
        client = AsyncOpenAI(base_url=f"{gw.http}/v1", api_key="unused")
        async with client.realtime.connect(model=MODEL) as conn:
            await conn.conversation.item.create(
                item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]})
            await conn.response.create()
            raw = []
            while not raw or raw[-1]["type"] != "rate_limits.updated":
                raw.append(json.loads(await conn.recv_bytes()))
        for event in raw:
            check_server_event(event, beta=False)  # strict: every field as the SDK's models type it
        types = [e["type"] for e in raw]
        assert types[0] == "session.created"
        assert types.index("response.created") < types.index("response.output_text.delta") < types.index(
            "response.done") < types.index("rate_limits.updated")
        text = "".join(e["delta"] for e in raw if e["type"] == "response.output_text.delta")
        assert text == expected_text([{"role": "user", "content": "Hello"}])
        done = next(e for e in raw if e["type"] == "response.done")["response"]
        assert done["status"] == "completed"
        assert done["metadata"] == {"x_tier": "edge"}
        assert done["usage"]["output_tokens"] == 8
        assert gw.engine.started[0][1] == Priority.REALTIME
        assert gw.engine.blocks_in_use == 0
        await gw.wait_sessions_gone()


async def test_openai_sdk_beta_flavour() -> None:
    async with running_gateway() as gw:
        # The SDK's beta connect always picks wss:// unless told the WebSocket base URL.
        client = AsyncOpenAI(base_url=f"{gw.http}/v1", api_key="unused",
                             websocket_base_url=f"ws://127.0.0.1:{gw.port}/v1")
        async with client.beta.realtime.connect(model=MODEL) as conn:
            await conn.conversation.item.create(
                item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]})
            await conn.response.create()
            deltas = []
            async for event in conn:
                if event.type == "response.text.delta":  # the beta name
                    deltas.append(event.delta)
                if event.type == "response.done":
                    assert event.response.status == "completed"
                    assert event.response.metadata == {"x_tier": "edge"}
                    break
        assert "".join(deltas) == expected_text([{"role": "user", "content": "Hi"}])


async def test_msgpack_subprotocol_carries_the_same_events() -> None:
    async with running_gateway() as gw:
        async with websockets.connect(gw.ws_url, subprotocols=[MSGPACK_SUBPROTOCOL]) as ws:
            assert ws.subprotocol == MSGPACK_SUBPROTOCOL
            created = msgpack.unpackb(await ws.recv())
            assert created["type"] == "session.created"
            await ws.send(msgpack.packb(user_item("Hi")))
            await ws.send(msgpack.packb({"type": "response.create"}))
            events = []
            while not events or events[-1]["type"] != "rate_limits.updated":  # follows response.done
                frame = await ws.recv()
                assert isinstance(frame, bytes)
                events.append(msgpack.unpackb(frame))
            text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
            assert text == expected_text([{"role": "user", "content": "Hi"}])
            await ws.send('{"type": "response.create"}')  # text frames are refused on a msgpack connection
            error = msgpack.unpackb(await ws.recv())
            assert error["type"] == "error" and error["error"]["code"] == "invalid_event"


async def test_browser_subprotocols_authenticate_and_echo_realtime() -> None:
    async with running_gateway(api_keys=(KEY,)) as gw:
        protocols = ["realtime", f"openai-insecure-api-key.{KEY}"]
        async with websockets.connect(gw.ws_url, subprotocols=protocols) as ws:
            assert ws.subprotocol == "realtime"  # never the key-carrying one
            assert (await recv_json(ws))["type"] == "session.created"
        async with websockets.connect(gw.ws_url, subprotocols=[*protocols, "openai-beta.realtime-v1"]) as ws:
            assert (await recv_json(ws))["type"] == "session.created"
            assert (await recv_json(ws))["type"] == "conversation.created"  # beta flavour


async def test_binary_frame_on_a_json_connection_is_an_error_event() -> None:
    async with running_gateway() as gw:
        async with websockets.connect(gw.ws_url) as ws:
            await recv_json(ws)
            await ws.send(b"\x00\x01garbage")
            error = await recv_json(ws)
            assert error["type"] == "error" and "binary frames" in error["error"]["message"]
            await send(ws, user_item("still works"))
            await send(ws, {"type": "response.create"})
            done = (await recv_until(ws, "response.done"))[-1]
            assert done["response"]["status"] == "completed"


async def test_engine_refusal_fails_the_response_not_the_session() -> None:
    engine = FakeEngine(n_ctx=64)
    async with running_gateway(engine) as gw:
        async with websockets.connect(gw.ws_url) as ws:
            await recv_json(ws)
            await send(ws, {"type": "response.create"})  # an empty conversation is an empty prompt
            done = (await recv_until(ws, "response.done"))[-1]["response"]
            assert done["status"] == "failed"
            assert done["status_details"]["error"]["code"] == "empty_prompt"
            await send(ws, user_item("x" * 200))  # longer than the fake engine's context
            await send(ws, {"type": "response.create"})
            done = (await recv_until(ws, "response.done"))[-1]["response"]
            assert done["status"] == "failed"
            assert done["status_details"]["error"]["code"] == "context_length_exceeded"
            await send(ws, {"type": "conversation.item.delete", "item_id": "nonexistent"})
            assert (await recv_json(ws))["type"] == "error"  # the session goes on


async def test_unknown_model_is_refused_before_upgrade() -> None:
    async with running_gateway() as gw:
        try:
            async with websockets.connect(gw.ws_url.replace(MODEL, "gpt-9")):
                raise AssertionError("connected")
        except websockets.InvalidStatus as e:
            assert e.response.status_code == 404
            assert json.loads(e.response.body)["error"]["code"] == "model_not_found"
        assert gw.state.metrics.sessions_total._value.get() == 0


async def test_the_engine_hears_which_session_a_turn_continues_and_when_it_ends() -> None:
    """Turns name their session, so a tier can keep the conversation warm; closing the session
    tells every tier that served it, so nothing is kept for a conversation that is over."""
    async with running_gateway() as gw:
        async with websockets.connect(gw.ws_url) as ws:
            session_id = (await recv_json(ws))["session"]["id"]
            for text in ("Hi", "And again"):
                await send(ws, user_item(text))
                await send(ws, {"type": "response.create"})
                await recv_until(ws, "response.done")
        await gw.wait_sessions_gone()
        assert list(gw.engine.sessions.values()) == [session_id, session_id]
        assert gw.engine.ended_sessions == [session_id]


async def test_openai_sdk_out_of_band_response_with_item_references_and_retrieve() -> None:
    """An out-of-band response (``conversation: "none"``) over referenced items and a new one, with
    metadata, leaves the conversation as it was; ``conversation.item.retrieve`` reads an item back."""
    async with running_gateway() as gw:
        client = AsyncOpenAI(base_url=f"{gw.http}/v1", api_key="unused")
        async with client.realtime.connect(model=MODEL) as conn:
            await conn.conversation.item.create(item={"id": "note", "type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Buy milk."}]})
            await conn.response.create(response={
                "conversation": "none", "metadata": {"purpose": "classify"}, "output_modalities": ["text"],
                "input": [{"type": "item_reference", "id": "note"},
                          {"type": "message", "role": "user",
                           "content": [{"type": "input_text", "text": "Is that a task?"}]}]})
            await conn.conversation.item.retrieve(item_id="note")
            raw: list[dict] = []
            while {"response.done", "conversation.item.retrieved"} - {e["type"] for e in raw}:
                raw.append(json.loads(await conn.recv_bytes()))
        for event in raw:
            check_server_event(event, beta=False)
        done = next(e for e in raw if e["type"] == "response.done")["response"]
        assert done["status"] == "completed" and done["conversation_id"] is None
        assert done["metadata"]["purpose"] == "classify"
        prompt = "".join(chr(i) for i in gw.engine.prompts[done["id"]])
        assert "Buy milk." in prompt and "Is that a task?" in prompt
        assert not any(e["type"] == "conversation.item.added" and e["item"]["role"] == "assistant" for e in raw)
        retrieved = next(e for e in raw if e["type"] == "conversation.item.retrieved")["item"]
        assert retrieved["id"] == "note" and retrieved["content"][0]["text"] == "Buy milk."
