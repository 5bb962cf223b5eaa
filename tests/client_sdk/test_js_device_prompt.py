"""The JS SDK's on-device prompt is the edge tier's prompt.

``rtgw-device.js`` renders the local conversation itself (``conversationMessages`` and
``renderPrompt``), since the browser has no Jinja. Here the same conversations go through the
gateway's own rendering, ``llm_shared.structured.render_messages`` (through the Python SDK's
``render_conversation``, which the gateway's Realtime session shares) and the GGUF's chat template
(``Tokenizer.apply_chat_template``), and the two texts must be equal, byte for byte.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

import pytest
from gateway_process import REPO_ROOT

NODE = shutil.which("node")
pytestmark = [pytest.mark.model, pytest.mark.skipif(NODE is None, reason="node is not installed (make system-deps)")]

RENDER = """
import { conversationMessages, renderPrompt } from "./client_sdk/js/rtgw-device.js";
let input = "";
for await (const chunk of process.stdin) input += chunk;
const out = JSON.parse(input).map(({ items, instructions }) =>
  renderPrompt("smollm2", conversationMessages(items, instructions)));
process.stdout.write(JSON.stringify(out));
"""

CALL = {"type": "function_call", "id": "i3", "callId": "call_1", "name": "get_weather",
        "arguments": '{"city":"Paris","units":["c","f"],"days":3,"ok":true,"note":"é \\"q\\""}', "status": "completed"}
CASES: list[dict[str, Any]] = [
    {"instructions": "", "items": [{"type": "message", "id": "i1", "role": "user", "text": "Hi!"}]},
    {"instructions": "Be brief.", "items": [
        {"type": "message", "id": "i1", "role": "user", "text": "My name is Ada."},
        {"type": "message", "id": "i2", "role": "assistant", "text": "Hello Ada!\n\n```py\nprint(1)\n```"},
        {"type": "message", "id": "i3", "role": "user", "text": ""},
        {"type": "message", "id": "i4", "role": "user", "text": "What is my name? <b>bold</b> 日本語 🙂"}]},
    {"instructions": "", "items": [
        {"type": "message", "id": "i1", "role": "user", "text": "Weather in Paris?"},
        {"type": "message", "id": "i2", "role": "assistant", "text": "Let me check."},
        CALL,
        {**CALL, "id": "i4", "callId": "call_2", "arguments": "not json"},
        {"type": "function_call_output", "id": "i5", "callId": "call_1", "output": '{"temp": 21}'},
        {"type": "function_call", "id": "i6", "callId": "call_3", "name": "get_time", "arguments": "{}"},
        {"type": "message", "id": "i7", "role": "user", "text": "Thanks"}]},
]


def python_items(items: list[dict[str, Any]]) -> list[Any]:
    from rtgw.protocol import FunctionCallItem, FunctionCallOutputItem, Item

    out: list[Any] = []
    for item in items:
        if item["type"] == "function_call":
            out.append(FunctionCallItem(item["id"], item["callId"], item["name"], item["arguments"]))
        elif item["type"] == "function_call_output":
            out.append(FunctionCallOutputItem(item["id"], item["callId"], item["output"]))
        else:
            out.append(Item(item["id"], item["role"], item["text"]))
    return out


def test_the_device_prompt_is_the_edge_tiers_prompt() -> None:
    from rtgw.offline import render_conversation

    from llm_shared.modelfile import default_gguf_path
    from llm_shared.structured import get_family
    from llm_shared.tokenizer import Tokenizer

    assert NODE is not None
    done = subprocess.run([NODE, "--input-type=module", "-e", RENDER], cwd=REPO_ROOT, input=json.dumps(CASES),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    js = json.loads(done.stdout)
    tokenizer = Tokenizer.from_gguf(default_gguf_path())
    family = get_family("smollm2")
    for case, rendered in zip(CASES, js, strict=True):
        messages = render_conversation(case["instructions"], python_items(case["items"]), None, family)
        assert rendered == tokenizer.apply_chat_template(messages), case
