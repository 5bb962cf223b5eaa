"""Tenants do not share prefix caches: with several API keys, one key's turns never reuse KV that
another key's turns left, on either tier, over either API, so ``cached_tokens`` and the time to
first token say nothing about what another tenant sent. With one key, or
``server.isolate_prefix_cache = false``, the cache is shared as before.

The torch tier runs a real engine core on a tiny random checkpoint; the edge tier the embedded
SmolLM2 through llama.cpp."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

import pytest
import websockets
from gateway_harness import (
    KEY,
    make_config,
    recv_json,
    recv_until,
    running_gateway,
    send,
    serving,
    tiny_chat_model,
    tiny_gpu_gateway,
    user_item,
)
from openai import AsyncOpenAI

from gateway.auth import cache_salt, cache_salts, key_fingerprint
from gateway.config import DEFAULT_CONFIG, Config, ServerConfig, parse_config
from llm_shared.configtools import read_toml
from llm_shared.contract import MAX_CACHE_SALT_CHARS
from llm_shared.errors import ConfigError
from llm_shared.models import ModelConfig

KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-9876543210"
# Long enough for several full KV blocks on either tier; the same for both tenants.
PROMPT = ("Please summarise the following notes about the quarterly planning meeting: budget review, "
          "hiring plan for the platform team, and the migration timeline for the storage cluster.")


# ---- the salt and the setting ----------------------------------------------------------------

def test_a_salt_is_deterministic_per_key_and_reveals_nothing_of_it() -> None:
    salt = cache_salt(KEY_A)
    assert salt == cache_salt(KEY_A)  # every gateway process computes the same one
    assert re.fullmatch(r"[0-9a-f]{32}", salt) and len(salt) <= MAX_CACHE_SALT_CHARS
    assert salt != cache_salt(KEY_B)
    assert KEY_A not in salt and key_fingerprint(KEY_A)[len("key-"):] not in salt  # not the logged fingerprint


@pytest.mark.parametrize(
    ("setting", "keys", "isolated"),
    [("auto", (), False), ("auto", (KEY_A,), False), ("auto", (KEY_A, KEY_B), True),
     (True, (KEY_A,), True), (False, (KEY_A, KEY_B), False)],
)
def test_isolation_is_on_with_more_than_one_key_unless_set(setting: object, keys: tuple[str, ...],
                                                            isolated: bool) -> None:
    server = ServerConfig(api_keys=keys, api_keys_env="", isolate_prefix_cache=setting)  # type: ignore[arg-type]
    assert server.prefix_cache_isolated() is isolated
    assert cache_salts(server) == ({key_fingerprint(k): cache_salt(k) for k in keys} if isolated else {})


def test_keys_from_the_environment_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENANCY_TEST_KEYS", f"{KEY_B}")
    server = ServerConfig(api_keys=(KEY_A,), api_keys_env="TENANCY_TEST_KEYS")
    assert server.prefix_cache_isolated() and set(cache_salts(server).values()) == {cache_salt(KEY_A), cache_salt(KEY_B)}


@pytest.mark.parametrize("value", ["yes", 1, "AUTO", ["auto"]])
def test_a_bad_setting_is_a_config_error_naming_the_key(value: object) -> None:
    raw = read_toml(DEFAULT_CONFIG)
    raw["server"]["isolate_prefix_cache"] = value
    with pytest.raises(ConfigError, match=r"server\.isolate_prefix_cache"):
        parse_config(raw)
    with pytest.raises(ConfigError, match=r"server\.isolate_prefix_cache"):
        ServerConfig(isolate_prefix_cache=value)  # type: ignore[arg-type]


async def realtime_turn(url: str, key: str, text: str = PROMPT, max_output_tokens: int = 4) -> dict[str, Any]:
    """One Realtime turn with ``key``; its ``response.done`` response."""
    async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
        await recv_json(ws)  # session.created
        await send(ws, user_item(text))
        await send(ws, {"type": "response.create", "response": {"max_output_tokens": max_output_tokens}})
        done = (await recv_until(ws, "response.done", timeout=60))[-1]["response"]
    assert done["status"] in ("completed", "incomplete"), json.dumps(done)
    return done


async def chat_cached(url: str, key: str, model: str, text: str = PROMPT) -> int:
    """One chat completion with ``key``; the prompt tokens it got from the prefix cache."""
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    chat = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                                max_tokens=4, temperature=0)
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    return chat.usage.prompt_tokens_details.cached_tokens or 0


async def test_both_apis_send_the_salt_of_the_authenticated_key() -> None:
    async with running_gateway(api_keys=(KEY_A, KEY_B)) as gw:
        await realtime_turn(gw.ws_url, KEY_A, "hello")
        await chat_cached(gw.http, KEY_B, "smollm2-135m-edge", "hello")
    assert sorted(gw.engine.salts.values()) == sorted([cache_salt(KEY_A), cache_salt(KEY_B)])
    async with running_gateway(api_keys=(KEY_A, KEY_B), isolate_prefix_cache=False) as gw:
        await realtime_turn(gw.ws_url, KEY_A, "hello")
        await chat_cached(gw.http, KEY_B, "smollm2-135m-edge", "hello")
    assert list(gw.engine.salts.values()) == ["", ""]


# ---- the torch tier: a real engine core --------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    return tiny_chat_model(tmp_path_factory.mktemp("tiny-tenancy"))


async def test_the_torch_tier_keeps_each_keys_prefix_cache_to_itself(tiny_model: ModelConfig) -> None:
    async with tiny_gpu_gateway(tiny_model, api_keys=(KEY_A, KEY_B)) as (server, config):
        model = config.routing.gpu_model
        assert await chat_cached(server.url, KEY_A, model) == 0
        assert await chat_cached(server.url, KEY_B, model) == 0  # the same prompt, another key: computed again
        assert await chat_cached(server.url, KEY_A, model) >= 128  # A's own blocks serve A's repeat
        assert await chat_cached(server.url, KEY_B, model) >= 128  # and B's serve B's
        ws_url = f"ws://127.0.0.1:{server.port}/v1/realtime?model={model}"
        other = "A different request about the release notes of the storage service and its new snapshots."
        turns = [await realtime_turn(ws_url, key, other) for key in (KEY_A, KEY_B, KEY_A)]
        cached = [t["usage"]["input_token_details"]["cached_tokens"] for t in turns]
        assert cached[0] == 0 and cached[1] == 0 and cached[2] >= 64


async def test_the_torch_tier_shares_its_cache_when_isolation_is_off(tiny_model: ModelConfig) -> None:
    async with tiny_gpu_gateway(tiny_model, api_keys=(KEY_A, KEY_B), isolate_prefix_cache=False) as (server, config):
        model = config.routing.gpu_model
        assert await chat_cached(server.url, KEY_A, model) == 0
        assert await chat_cached(server.url, KEY_B, model) >= 128  # what A left serves B: shared, as before


async def test_with_one_key_the_cache_is_shared_as_before(tiny_model: ModelConfig) -> None:
    async with tiny_gpu_gateway(tiny_model, api_keys=(KEY,)) as (server, config):
        assert not config.server.prefix_cache_isolated()
        model = config.routing.gpu_model
        assert await chat_cached(server.url, KEY, model) == 0
        assert await chat_cached(server.url, KEY, model) >= 128


# ---- the edge tier: llama.cpp with the embedded model ------------------------------------------

def edge_config(**server: Any) -> Config:
    config = make_config(**server)
    return replace(config, edge=replace(config.edge, kv_cache_mib=48, n_seq_max=2, n_threads=1))


@pytest.mark.model
@pytest.mark.parametrize("isolate", ["auto", False])
async def test_the_edge_tier_keeps_each_keys_slots_to_itself(isolate: object) -> None:
    config = edge_config(api_keys=(KEY_A, KEY_B), isolate_prefix_cache=isolate)
    async with serving(config) as (server, _state):
        model = config.routing.edge_model
        assert await chat_cached(server.url, KEY_A, model) == 0
        b = await chat_cached(server.url, KEY_B, model)
        a = await chat_cached(server.url, KEY_A, model)
        if isolate == "auto":  # two keys: isolated
            assert b == 0 and a > 20  # B computes it all; A's slot still holds A's prompt
        else:
            assert b > 20 and a > 20  # shared, as before
