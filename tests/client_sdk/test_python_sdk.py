"""The Python SDK against a real gateway process (the embedded model on the edge tier): streaming,
cancel, barge-in with truncate, msgpack, reconnect after a restart, the on-device fallback and
its return, and a refused key."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_process import GatewayProcess, free_port, serving, write_config
from rtgw import Backoff, GatewayRefused, GatewayUnreachable, OfflineConfig, RealtimeClient

pytestmark = pytest.mark.model

KEY = "sk-sdk-test-key"
LONG = "Write a long story about a lighthouse keeper and a storm, with many details."


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    with serving(tmp_path_factory.mktemp("sdk-gateway"), api_keys=(KEY,)) as process:
        yield process


def client(gateway: GatewayProcess, **options: object) -> RealtimeClient:
    return RealtimeClient(gateway.url, api_key=KEY, connect_timeout=30, silence_timeout=120, request_timeout=30,
                          **options)  # type: ignore[arg-type]


async def test_a_turn_streams_and_its_result_says_how_it_was_served(gateway: GatewayProcess) -> None:
    async with client(gateway) as c:
        turn = await c.send("Say hello in five words.", max_output_tokens=24, temperature=0)
        deltas = [d.text async for d in turn]
        result = await turn.result()
        assert len(deltas) >= 2 and "".join(deltas) == result.text and result.text.strip()
        assert result.status in ("completed", "incomplete") and result.tier == "edge" and not result.offline
        assert [i.role for i in c.conversation] == ["user", "assistant"]
        assert c.conversation[1].text == result.text


async def first_chars(turn: object, at_least: int) -> str:
    seen = ""
    async for delta in turn:  # type: ignore[attr-defined]
        seen += delta.text
        if len(seen) >= at_least:
            return seen
    raise AssertionError(f"the turn ended after {len(seen)} characters")


async def test_cancel_ends_the_turn_and_keeps_what_was_streamed(gateway: GatewayProcess) -> None:
    async with client(gateway) as c:
        turn = await c.send(LONG, max_output_tokens=400)
        await first_chars(turn, 10)
        result = await c.cancel()
        assert result is not None and result.status == "cancelled" and result.reason == "client_cancelled"
        assert 0 < len(result.text) and c.conversation[-1].text == result.text
        assert await c.cancel() is None  # nothing left to cancel
        follow = await c.send("Thanks.", max_output_tokens=8)
        assert (await follow.result()).status in ("completed", "incomplete")


@pytest.mark.parametrize("framing", ["json", "msgpack"])
async def test_interrupt_keeps_only_what_the_user_heard(gateway: GatewayProcess, framing: str) -> None:
    async with client(gateway, framing=framing) as c:
        turn = await c.send(LONG, max_output_tokens=400)
        streamed = await first_chars(turn, 20)
        result = await c.interrupt(heard_chars=12)
        assert result is not None and result.status == "cancelled"
        heard = streamed[:12]
        assert c.conversation[-1].text == heard
        on_server = await c.retrieve_item(result.item_id)
        assert on_server.text == heard  # the next turn's context holds only the heard part
        nxt = await c.send("Go on.", max_output_tokens=8)
        assert (await nxt.result()).status in ("completed", "incomplete")


async def test_the_conversation_survives_a_server_restart(gateway: GatewayProcess) -> None:
    async with client(gateway, backoff=Backoff(initial=0.5, max_delay=4, attempts=40)) as c:
        first = await c.send("My name is Ada. Please remember it.", max_output_tokens=16, temperature=0)
        await first.result()
        before = [(i.id, i.role, i.text) for i in c.conversation]
        await asyncio.to_thread(gateway.restart)  # the session is gone with the old process
        second = await c.send("What is my name?", max_output_tokens=16, temperature=0)
        result = await second.result()
        assert result.status in ("completed", "incomplete"), result.error
        assert c.reconnects == 1
        for item_id, role, text in before:  # the new session holds the earlier turns, same ids and text
            restored = await c.retrieve_item(item_id)
            assert (restored.role, restored.text) == (role, text)
        assert result.usage["input_tokens"] > 40  # the prompt carried the history, not just the question


async def test_offline_turns_on_the_device_then_back_to_the_gateway(tmp_path: Path) -> None:
    port = free_port()
    process = GatewayProcess(write_config(tmp_path, api_keys=(KEY,)), tmp_path / "gateway.log", port=port)
    c = RealtimeClient(process.url, api_key=KEY, connect_timeout=5, request_timeout=30, silence_timeout=120,
                       offline=OfflineConfig(max_output_tokens=16, temperature=0.0), retry_online_s=0.0,
                       backoff=Backoff(attempts=1))
    try:
        await c.connect()  # nothing listens: the client starts offline instead of failing
        assert not c.online
        turn = await c.send("Hello! Who are you?", max_output_tokens=16)
        offline = await turn.result()
        assert offline.offline and offline.tier == "device" and offline.text.strip()
        assert offline.status in ("completed", "incomplete")
        offline_items = [(i.id, i.role, i.text) for i in c.conversation]
        assert [r for _, r, _ in offline_items] == ["user", "assistant"]

        await asyncio.to_thread(process.start)
        back = await c.send("Thanks!", max_output_tokens=8)
        online = await back.result()
        assert c.online and not online.offline and online.tier == "edge"
        for item_id, role, text in offline_items:  # the offline turn was carried over
            carried = await c.retrieve_item(item_id)
            assert (carried.role, carried.text) == (role, text)
    finally:
        await c.close()
        await asyncio.to_thread(process.stop)


async def test_a_refused_key_is_an_error_not_a_fallback(gateway: GatewayProcess) -> None:
    c = RealtimeClient(gateway.url, api_key="sk-wrong", offline=OfflineConfig(), connect_timeout=30)
    with pytest.raises(GatewayRefused) as e:
        await c.connect()
    assert e.value.status == 401
    nobody = RealtimeClient(f"http://127.0.0.1:{free_port()}", api_key=KEY, connect_timeout=5,
                            backoff=Backoff(initial=0.05, attempts=2))
    with pytest.raises(GatewayUnreachable):
        await nobody.connect()


async def test_the_voice_example_cuts_in_and_reuses_the_cached_prefix(gateway: GatewayProcess,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "examples" / "voice_bargein.py"
    spec = importlib.util.spec_from_file_location("voice_bargein", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    # 40 characters a second: the user still cuts in (after 1..4 s; seed 7: 2.0 and 1.5 s, so after
    # 79 and 58 characters) long before 120 tokens are spoken. Greedy: an answer sampled at the
    # default temperature can end in fewer characters than that (seen once in a full run), and then
    # the user has nothing to cut into.
    code = await example.main(["--url", gateway.url, "--api-key", KEY, "--turns", "3", "--rate", "40",
                               "--seed", "7", "--temperature", "0"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("[user cut in after") == 2, out
    last = [line for line in out.splitlines() if line.strip().startswith("turn 3:")]
    assert last, out
    cached = int(last[0].rsplit("cached ", 1)[1])
    assert cached > 0, out  # the truncated conversation was served from the edge tier's cache
