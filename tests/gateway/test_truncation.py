"""A conversation longer than the model's context (the session's ``truncation``, issue 41): the
oldest turns leave the prompt in chunks, the instructions and the newest turn stay, the prefix
cache grows again between cuts; ``"disabled"`` fails the turn as the API does.

The fake engine counts a token per character and caches prompt prefixes per 16-token block, so
the prompts and ``cached_tokens`` here are exact; tests/gateway/test_server_model.py runs the
same conversation on the real edge tier."""

from __future__ import annotations

from typing import Any

import pytest
import websockets
from fake_engine import FakeEngine
from gateway_harness import recv_json, recv_until, running_gateway, send, user_item

from gateway.context_fit import PromptCuts, fit
from llm_shared.errors import PromptTooLongError

CONTEXT = 700  # the fake edge's prompt limit is CONTEXT - 1 tokens (characters)
INSTRUCTIONS = "You are terse."


async def turn(ws: Any, text: str, **response: Any) -> dict[str, Any]:
    await send(ws, user_item(text))
    await send(ws, {"type": "response.create", "response": {"max_output_tokens": 8, **response}})
    return (await recv_until(ws, "response.done"))[-1]["response"]


async def session(ws: Any, **fields: Any) -> None:
    await recv_json(ws)
    await send(ws, {"type": "session.update", "session": {"instructions": INSTRUCTIONS, **fields}})
    updated = await recv_until(ws, "session.updated")
    assert updated[-1]["type"] == "session.updated", updated


async def test_auto_truncation_keeps_answering_past_twice_the_context_with_the_cache_growing_between_cuts() -> None:
    engine = FakeEngine(n_ctx=CONTEXT)
    async with running_gateway(engine) as gw, websockets.connect(gw.ws_url) as ws:
        await session(ws)
        usages, said = [], 0
        n = 0
        while said < 2 * CONTEXT:
            n += 1
            text = f"turn {n:02d}: " + "tell me more about the sea. " * 2
            done = await turn(ws, text)
            assert done["status"] in ("completed", "incomplete"), done
            usages.append((done["usage"]["input_tokens"], done["usage"]["input_token_details"]["cached_tokens"]))
            said += len(text) + len(done["output"][0]["content"][0]["text"])
        prompts = [p for p in engine.prompts.values()]
        assert all(len(p) <= CONTEXT - 1 - 8 for p in prompts)  # room left for the answer
        last = "".join(chr(i) for i in prompts[-1])
        assert last.startswith(f"<system>{INSTRUCTIONS}\n<user>turn ")  # instructions, then a whole user turn
        assert f"turn {n:02d}" in last and "turn 01" not in last
        cuts = [i for i in range(1, len(usages)) if usages[i][0] < usages[i - 1][0]]
        assert len(cuts) >= 2, usages
        # Between cuts each prompt extends the one before: the cache holds all but its last block or so.
        for i in range(1, len(usages)):
            if i not in cuts:
                assert usages[i][1] > usages[i - 1][1] and usages[i][1] >= usages[i - 1][0] - 16, (i, usages)
        # Each cut keeps at most the retained share of the room after the instructions.
        instructions = len(f"<system>{INSTRUCTIONS}\n")
        for i in cuts:
            assert usages[i][0] <= instructions + 0.8 * (CONTEXT - 1 - 8 - instructions) + 20, usages[i]

        # A truncated item is out of the prompt, not out of the conversation.
        first = prompts[0]
        assert "turn 01" in "".join(chr(i) for i in first)


async def test_disabled_truncation_fails_the_turn_with_the_apis_error() -> None:
    engine = FakeEngine(n_ctx=CONTEXT)
    async with running_gateway(engine) as gw, websockets.connect(gw.ws_url) as ws:
        await session(ws, truncation="disabled")
        statuses = []
        for n in range(12):
            done = await turn(ws, f"turn {n:02d}: " + "tell me more about the sea. " * 2)
            statuses.append(done["status"])
            if done["status"] == "failed":
                assert done["status_details"]["error"]["code"] == "context_length_exceeded"
                break
        assert statuses[-1] == "failed" and set(statuses[:-1]) <= {"completed", "incomplete"}


async def test_retention_ratio_is_echoed_and_cuts_deeper() -> None:
    engine = FakeEngine(n_ctx=CONTEXT)
    truncation = {"type": "retention_ratio", "retention_ratio": 0.3}
    async with running_gateway(engine) as gw, websockets.connect(gw.ws_url) as ws:
        await recv_json(ws)
        await send(ws, {"type": "session.update", "session": {"instructions": INSTRUCTIONS,
                                                               "truncation": truncation}})
        updated = (await recv_until(ws, "session.updated"))[-1]
        assert updated["session"]["truncation"] == truncation
        inputs = []
        for n in range(16):
            done = await turn(ws, f"turn {n:02d}: " + "tell me more about the sea. " * 2)
            inputs.append(done["usage"]["input_tokens"])
        cut = next(i for i in range(1, len(inputs)) if inputs[i] < inputs[i - 1])
        instructions = len(f"<system>{INSTRUCTIONS}\n")
        assert inputs[cut] <= instructions + 0.3 * (CONTEXT - 1 - 8 - instructions) + 20


@pytest.mark.parametrize(("value", "code", "param"), [
    ("sometimes", "invalid_value", "session.truncation"),
    ({"type": "retention_ratio"}, "missing_required_parameter", "session.truncation.retention_ratio"),
    ({"type": "retention_ratio", "retention_ratio": 1.5}, "invalid_value", "session.truncation.retention_ratio"),
    ({"type": "tokens", "retention_ratio": 0.5}, "invalid_value", "session.truncation.type"),
])
async def test_bad_truncation_is_refused_naming_the_field(value: Any, code: str, param: str) -> None:
    async with running_gateway() as gw, websockets.connect(gw.ws_url) as ws:
        await recv_json(ws)
        await send(ws, {"type": "session.update", "session": {"truncation": value}})
        error = (await recv_until(ws, "error"))[-1]["error"]
        assert (error["code"], error["param"]) == (code, param)


class CountingEngine:
    """Just a tokenizer: a token per character."""

    def __init__(self) -> None:
        self.tokenizer = FakeEngine().tokenizer


def cuts_over(turns: list[str], ratio: float) -> tuple[list[dict[str, str]], PromptCuts]:
    system = [{"role": "system", "content": "sys"}]

    def render(k: int) -> list[dict[str, str]]:
        return system + [{"role": "user", "content": t} for t in turns[k:]]

    return render(0), PromptCuts(count=len(turns) - 1, render=render, dropped=lambda k: tuple(map(str, range(k))),
                                 instructions=system, retention_ratio=ratio, post_instructions=None, sticky=True)


async def test_fit_takes_the_least_cut_within_the_retained_share() -> None:
    messages, cuts = cuts_over(["a" * 50] * 10, 0.5)
    engine: Any = CountingEngine()
    fitted = await fit(engine, messages, cuts, 10_000)
    assert fitted.dropped == ()  # it fits: nothing cut
    fitted = await fit(engine, messages, cuts, 400)
    # 400 tokens of room, 5 + 11 of them the instructions: at most half the rest for the turns, 8 each
    assert len(fitted.prompt_ids) <= 16 + 0.5 * (400 - 16) and fitted.dropped == tuple(map(str, range(7)))
    with pytest.raises(PromptTooLongError):
        await fit(engine, messages, cuts, 40)  # not even the newest turn fits


async def test_items_left_out_make_room_when_the_conversation_hits_the_servers_bounds() -> None:
    """Past ``max_conversation_items`` the items truncation left out are deleted, oldest first (a
    ``conversation.item.deleted`` each), so a long conversation goes on instead of being refused."""
    engine = FakeEngine(n_ctx=CONTEXT)
    async with running_gateway(engine, max_conversation_items=12) as gw, websockets.connect(gw.ws_url) as ws:
        await session(ws)
        deleted: list[str] = []
        for n in range(20):  # a turn is about a third of the context: cuts come long before 12 items
            await send(ws, user_item(f"turn {n:02d}: " + "tell me more about the sea. " * 7))
            await send(ws, {"type": "response.create", "response": {"max_output_tokens": 8}})
            events = await recv_until(ws, "response.done")
            assert not [e for e in events if e["type"] == "error"], events
            assert events[-1]["response"]["status"] in ("completed", "incomplete")
            deleted += [e["item_id"] for e in events if e["type"] == "conversation.item.deleted"]
        assert len(deleted) >= 20 * 2 - 12  # two items a turn, at most 12 kept
        await send(ws, {"type": "conversation.item.retrieve", "item_id": deleted[0]})
        error = (await recv_until(ws, "error"))[-1]["error"]
        assert error["code"] == "item_not_found"
