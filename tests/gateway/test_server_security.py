"""Safe defaults and access control: bind refusal, API keys, Origin, session counts, rate limits."""

import json
import logging

import aiohttp
import openai
import pytest
import websockets
from gateway_harness import KEY, MODEL, make_config, recv_json, recv_until, running_gateway, send, user_item
from openai import AsyncOpenAI

from gateway.config import DEFAULT_CONFIG
from gateway.process.main import main
from gateway.process.server import create_app, start_server
from llm_shared.errors import ConfigError


async def handshake_status(url: str, **kwargs) -> tuple[int, dict]:
    try:
        async with websockets.connect(url, **kwargs):
            pass
    except websockets.InvalidStatus as e:
        return e.response.status_code, json.loads(e.response.body)
    raise AssertionError("the handshake was accepted")


async def test_refuses_a_public_bind_without_keys() -> None:
    with pytest.raises(ConfigError, match="no API keys"):
        await start_server(create_app(make_config(host="0.0.0.0")))


def test_cli_refuses_a_public_bind_with_a_clear_message(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GATEWAY_API_KEYS", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "refusing to listen on 0.0.0.0" in err and "GATEWAY_API_KEYS" in err


def test_cli_rejects_a_bad_config_file(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(DEFAULT_CONFIG.read_text().replace("port = 8000", "port = 'eighty'"))
    assert main(["serve", "--config", str(bad)]) == 2
    assert "server.port" in capsys.readouterr().err


async def test_public_bind_is_allowed_with_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_GATEWAY_KEYS", f"{KEY}, other")
    app = create_app(make_config(host="0.0.0.0", api_keys_env="TEST_GATEWAY_KEYS"))
    server = await start_server(app)
    await server.stop()


async def test_missing_or_wrong_key_gets_401_and_no_session(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gateway")
    caplog.set_level(logging.DEBUG, logger="aiohttp")
    async with running_gateway(api_keys=(KEY,)) as gw:
        assert (await handshake_status(gw.ws_url))[0] == 401
        status, body = await handshake_status(gw.ws_url, additional_headers={"Authorization": "Bearer sk-wrong"})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, _ = await handshake_status(gw.ws_url, subprotocols=["realtime", "openai-insecure-api-key.sk-no"])
        assert status == 401
        client = AsyncOpenAI(base_url=f"{gw.http}/v1", api_key="sk-wrong")
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        with pytest.raises(websockets.InvalidStatus) as rejected:  # the SDK surfaces the handshake's status
            async with client.realtime.connect(model=MODEL):
                pass
        assert rejected.value.response.status_code == 401
        assert gw.state.metrics.sessions_total._value.get() == 0  # no session was ever created
        assert gw.engine.started == []
        good = AsyncOpenAI(base_url=f"{gw.http}/v1", api_key=KEY)
        async with good.realtime.connect(model=MODEL) as conn:
            assert (await conn.recv()).type == "session.created"
        await good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    server_logs = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith(("gateway", "aiohttp")))
    assert server_logs  # the server did log at DEBUG...
    assert KEY not in server_logs and "sk-wrong" not in server_logs  # ...but never a key


async def test_origin_allow_list() -> None:
    async with running_gateway(allowed_origins=("https://app.example",)) as gw:
        status, body = await handshake_status(gw.ws_url, origin="https://evil.example")
        assert status == 403 and body["error"]["code"] == "origin_not_allowed"
        async with websockets.connect(gw.ws_url, origin="https://app.example") as ws:
            assert (await recv_json(ws))["type"] == "session.created"
        async with websockets.connect(gw.ws_url, origin=f"http://127.0.0.1:{gw.port}") as ws:  # same host
            assert (await recv_json(ws))["type"] == "session.created"
        async with aiohttp.ClientSession(gw.http) as http:
            resp = await http.post("/v1/chat/completions", headers={"Origin": "https://evil.example"},
                                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
            assert resp.status == 403
        assert gw.engine.started == []


async def test_sessions_per_key_limit_rejects_with_429() -> None:
    async with running_gateway(api_keys=(KEY, "sk-other"), max_sessions_per_key=2) as gw:
        auth = {"Authorization": f"Bearer {KEY}"}
        async with websockets.connect(gw.ws_url, additional_headers=auth) as a, \
                websockets.connect(gw.ws_url, additional_headers=auth) as b:
            await recv_json(a)
            await recv_json(b)
            status, body = await handshake_status(gw.ws_url, additional_headers=auth)
            assert status == 429 and body["error"]["code"] == "too_many_sessions"
            # Another key is counted separately.
            async with websockets.connect(gw.ws_url, additional_headers={"Authorization": "Bearer sk-other"}) as c:
                assert (await recv_json(c))["type"] == "session.created"
        await gw.wait_sessions_gone()
        async with websockets.connect(gw.ws_url, additional_headers=auth) as d:  # slots are given back
            assert (await recv_json(d))["type"] == "session.created"


async def test_realtime_request_rate_limit() -> None:
    async with running_gateway(requests_per_minute=2) as gw, websockets.connect(gw.ws_url) as ws:
        await recv_json(ws)
        await send(ws, user_item("hi"))
        for _ in range(2):
            await send(ws, {"type": "response.create"})
            updated = (await recv_until(ws, "rate_limits.updated"))[-1]
        requests = next(r for r in updated["rate_limits"] if r["name"] == "requests")
        assert requests["limit"] == 2 and requests["remaining"] == 0
        await send(ws, {"type": "response.create"})
        error = await recv_json(ws)
        assert error["type"] == "error" and error["error"]["code"] == "rate_limit_exceeded"
        assert "requests per minute" in error["error"]["message"]
        assert (await recv_json(ws))["type"] == "rate_limits.updated"
        assert len(gw.engine.started) == 2


async def test_token_rate_limit_applies_to_realtime_and_http() -> None:
    async with running_gateway(tokens_per_minute=5) as gw:
        async with websockets.connect(gw.ws_url) as ws:
            await recv_json(ws)
            await send(ws, user_item("hi"))
            await send(ws, {"type": "response.create"})  # makes 8 tokens: the bucket is in debt afterwards
            updated = (await recv_until(ws, "rate_limits.updated"))[-1]
            assert next(r for r in updated["rate_limits"] if r["name"] == "tokens")["remaining"] == 0
            await send(ws, {"type": "response.create"})
            error = await recv_json(ws)
            assert error["error"]["code"] == "rate_limit_exceeded" and "tokens per minute" in error["error"]["message"]
        client = AsyncOpenAI(base_url=f"{gw.http}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError) as e:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        assert e.value.code == "rate_limit_exceeded"
        assert e.value.response.headers["x-ratelimit-remaining-tokens"] == "0"
        assert "retry-after" in e.value.response.headers


async def test_http_request_rate_limit_counts_chat_completions() -> None:
    async with running_gateway(requests_per_minute=1) as gw:
        client = AsyncOpenAI(base_url=f"{gw.http}/v1", api_key="unused", max_retries=0)
        ok = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}])
        assert ok.headers["x-ratelimit-limit-requests"] == "1"
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])


async def test_a_dns_rebinding_request_is_refused_on_every_endpoint() -> None:
    """A page on evil.example whose name re-resolves to 127.0.0.1 reaches a keyless loopback
    server with ``Host: evil.example``: refused (421), HTTP and the WebSocket handshake alike,
    with the Origin check no longer fooled by a Host the attacker chose."""
    async with running_gateway(allowed_hosts=("gw.example",)) as gw, aiohttp.ClientSession(gw.http) as http:
        evil = {"Host": f"evil.example:{gw.port}", "Origin": f"http://evil.example:{gw.port}"}
        for path in ("/v1/models", "/healthz", "/readyz", "/metrics"):
            response = await http.get(path, headers={"Host": f"evil.example:{gw.port}"})
            assert response.status == 421, path
            assert (await response.json())["error"]["code"] == "host_not_allowed"
        chat = await http.post("/v1/chat/completions", headers=evil, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status == 421
        upgrade = {**evil, "Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
                   "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
        handshake = await http.get(f"/v1/realtime?model={MODEL}", headers=upgrade)
        assert handshake.status == 421 and (await handshake.json())["error"]["code"] == "host_not_allowed"
        assert gw.engine.started == []  # nothing reached the engine
        for host in (f"localhost:{gw.port}", f"127.0.0.1:{gw.port}", f"[::1]:{gw.port}", "gw.example"):
            assert (await http.get("/v1/models", headers={"Host": host})).status == 200, host
