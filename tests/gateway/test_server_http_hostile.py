"""Every malformed chat-completions body gets a 400 with a reason, never a 500: nesting depth,
charset, invalid Unicode, wrong types of every field."""

from __future__ import annotations

import json

import aiohttp
import pytest
from gateway_harness import MODEL, running_gateway

BASE = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
WRONG_TYPES = {
    "temperature": ["hot", [], {}], "top_p": ["x", [], 2], "max_tokens": ["5", 1e30, 2**70, -1, True],
    "max_completion_tokens": [2**70, "x"], "stop": [[1], 5, [""], {"a": 1}], "seed": [1.5, "1", 2**70],
    "n": ["1", 2, 1.0], "logprobs": ["yes", 1], "top_logprobs": [1.5, "3", 99, -1], "stream": ["yes", 1],
    "stream_options": [5, {"include_usage": "x"}, []], "priority": [5, "urgent"], "service_tier": [5, "x"],
    "user": [5], "metadata": [5, [1]], "model": [5, None, ""], "frequency_penalty": ["x", 1],
    "presence_penalty": [1.5], "response_format": [5, {"type": "json"}], "store": ["x"],
    "messages": [5, [], [5], [{"role": 5}], [{"role": "user"}], [{"role": "user", "content": 5}],
                 [{"role": "user", "content": [5]}], [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                 [{"role": "user", "content": [{"type": "image_url"}]}], [{"role": "user", "content": "x", "name": 5}]],
}
CASES = [json.dumps({**BASE, field: value}).encode() for field, values in WRONG_TYPES.items() for value in values]
CASES += [
    b"[" * 100_000 + b"]" * 100_000,  # the JSON decoder's recursion
    b'{"a":' * 5_000 + b"1" + b"}" * 5_000,
    json.dumps({**BASE, "metadata": {"x": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}}).encode(),
    b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "\\ud800"}]}',
    b"5", b'"x"', b"null", b"", b"\xff\xfe\xfa", b"{'single': 'quotes'}", b'{"a": NaN}',
]


@pytest.mark.parametrize("charset", [None, "utf-8"])
async def test_hostile_bodies_get_a_400_with_a_reason(charset: str | None) -> None:
    content_type = "application/json" + (f"; charset={charset}" if charset else "")
    async with running_gateway() as gw, aiohttp.ClientSession(gw.http) as http:
        for body in CASES:
            response = await http.post("/v1/chat/completions", data=body, headers={"Content-Type": content_type})
            assert response.status == 400, (body[:80], await response.text())
            error = (await response.json())["error"]
            assert error["message"] and error["type"] == "invalid_request_error"
        assert gw.engine.started == []


async def test_an_unknown_charset_is_a_400_and_a_known_one_is_decoded() -> None:
    async with running_gateway() as gw, aiohttp.ClientSession(gw.http) as http:
        body = json.dumps(BASE).encode()
        response = await http.post("/v1/chat/completions", data=body,
                                   headers={"Content-Type": "application/json; charset=klingon"})
        assert response.status == 400 and (await response.json())["error"]["code"] == "invalid_charset"
        response = await http.post("/v1/chat/completions", data=json.dumps(BASE).encode("utf-16"),
                                   headers={"Content-Type": "application/json; charset=utf-16"})
        assert response.status == 200
