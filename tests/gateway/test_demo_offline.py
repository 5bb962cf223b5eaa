"""The demo page's on-device fallback in Debian's Chromium, against a real gateway process that is
killed and started again: the JS SDK's DeviceFallback with llama.cpp in WebAssembly (wllama,
served by the gateway) and the embedded model's own GGUF, downloaded once from the gateway.

One conversation: two turns online, the model prefetched with a progress bar, the gateway
killed (SIGKILL), the next turn answered on the device without a reload (from the whole
conversation: its prompt holds what was said two turns before), a device answer cancelled
mid-stream, the gateway started again and the next turn served online with every item restored,
the device's answers included. Then the page is reloaded from a gateway without COOP/COEP: no
cross-origin isolation, one thread, and the model loads from Cache Storage with no download.
No request may leave the gateway's origin. The model runs on a busy CPU: waits are long and
observed, never slept.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client_sdk"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gateway_process import GatewayProcess, write_config

from bench._browser import (
    CHROMIUM,
    WAIT_MS,
    WATCH,
    RequestLog,
    ask,
    chromium,
    enable_device,
    last_answer,
    wait_device_ready,
    wait_done,
    wait_text,
)

pytestmark = [
    pytest.mark.model,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium is not installed (make system-deps)"),
]
playwright_sync = pytest.importorskip("playwright.sync_api")
FILE = "/v1/models/smollm2-135m/file"
STORY = "Tell me a long story about a dragon who learns to bake bread, with many details."


def device_prompt(page: Any) -> str:
    return str(page.evaluate("() => window.rtgwDemo.device().lastPrompt ?? ''"))


def stored_form(page: Any) -> dict[str, int]:
    """The length of the model file as stored, and as the engine's latest load handed it to llama.cpp."""
    return dict(page.evaluate("""async () => {
      const d = window.rtgwDemo.device();
      return { stored: (await d.store.stored()).storedBytes, given: d.engine.lastLoad.bytes };
    }"""))


def online_then_device(page: Any, gateway: GatewayProcess, log: RequestLog) -> None:
    page.goto(f"{gateway.url}/")
    page.wait_for_selector('#status[data-state="connected"]', timeout=WAIT_MS)
    page.evaluate(WATCH)
    enable_device(page)
    page.wait_for_selector('#status[data-state="connected"]', timeout=WAIT_MS)
    wait_device_ready(page)
    assert page.evaluate("() => crossOriginIsolated") is True
    threads = page.evaluate("() => window.rtgwDemo.device().engine.threads")
    cores = page.evaluate("() => navigator.hardwareConcurrency")
    assert threads == min(cores, 8) and threads >= 1, (threads, cores)
    progress = page.evaluate("() => window.__offline.progress")
    total = progress[-1][1]
    assert progress[-1][0] == total > 90_000_000 and len(progress) > 10, progress[-3:]
    states = [s for s, _ in page.evaluate("() => window.__offline.states")]
    assert states[:3] == ["downloading", "loading", "ready"], states
    assert "downloading" in [m for m, _ in page.evaluate("() => window.__offline.modes")]
    assert log.count(FILE) == 1
    # kept in the engine's form: Q4_1 tensors as Q5_1 (gguf.js), which llama.cpp is given
    assert stored_form(page)["stored"] == stored_form(page)["given"] > total, stored_form(page)

    assert wait_done(page, ask(page, "My name is Zorblat. Please remember my name.", 32)) in ("completed", "incomplete")
    assert wait_done(page, ask(page, "What is the capital of France?", 32)) in ("completed", "incomplete")
    assert last_answer(page).get_attribute("data-tier") == "edge"
    assert page.locator("#device").get_attribute("data-mode") == "online"

    gateway.kill()  # no drain, no close frame: the host is gone
    answer = ask(page, "What is my name?", 48)
    assert wait_done(page, answer) in ("completed", "incomplete")
    assert answer.get_attribute("data-tier") == "device"
    assert answer.locator(".text").inner_text().strip(), "the device's answer is empty"
    assert "tier device" in answer.locator(".meta").inner_text()
    assert page.locator("#device").get_attribute("data-mode") == "device"
    prompt = device_prompt(page)
    assert "My name is Zorblat. Please remember my name." in prompt  # said two turns before
    assert prompt.endswith("What is my name?<|im_end|>\n<|im_start|>assistant\n")

    answer = ask(page, STORY, 400)
    wait_text(page, 1)
    page.click("#stop")
    assert wait_done(page, answer, timeout_ms=30_000) == "cancelled"
    assert answer.get_attribute("data-tier") == "device"
    kept = page.evaluate("() => window.rtgwDemo.client().conversation.at(-1)")
    assert kept["role"] == "assistant" and kept["text"], kept

    items = len(page.evaluate("() => window.rtgwDemo.client().conversation"))
    gateway.start()
    answer = ask(page, "Thank you!", 24)
    assert wait_done(page, answer) in ("completed", "incomplete")
    assert answer.get_attribute("data-tier") == "edge"
    assert page.locator("#status").inner_text() == f"reconnected, {items} messages restored"
    assert page.locator("#device").get_attribute("data-mode") == "online"


def reload_without_isolation(page: Any, gateway: GatewayProcess, config: Path, log: RequestLog) -> None:
    gateway.stop()
    gateway.config = config
    gateway.start()
    downloads = log.count(FILE)
    page.reload()
    page.wait_for_selector('#status[data-state="connected"]', timeout=WAIT_MS)
    wait_device_ready(page)
    assert page.evaluate("() => crossOriginIsolated") is False
    assert page.evaluate("() => window.rtgwDemo.device().engine.threads") == 1
    assert log.count(FILE) == downloads, "the stored model was downloaded again"
    assert stored_form(page)["stored"] == stored_form(page)["given"], stored_form(page)  # loaded as stored
    text = page.evaluate("""async () => {
      let text = '';
      for await (const part of window.rtgwDemo.device().engine.generate({
          prompt: '<|im_start|>user\\nSay hello.<|im_end|>\\n<|im_start|>assistant\\n', maxTokens: 8, temperature: 0 }))
        text += part.text ?? '';
      return text;
    }""")
    assert text.strip()


def context_overflow_is_an_error(page: Any) -> None:
    """A prompt past the device's context is refused with the gateway's code, never a hang."""
    outcome = page.evaluate("""async () => {
      const mod = await import('/sdk/rtgw-device.js');
      const d = window.rtgwDemo.device();
      const engine = new mod.WllamaEngine({ assetsUrl: '/vendor/', threads: 1, nCtx: 256 });
      await engine.load(await d.store.load(d.card));
      const run = async (prompt, maxTokens) => {
        let end = null;
        try {
          for await (const part of engine.generate({ prompt, maxTokens, temperature: 0 })) if (part.done) end = part;
          return { finishReason: end?.finishReason, output: end?.usage?.output_tokens };
        } catch (e) { return { code: e.code, message: e.message }; }
      };
      const long = '<|im_start|>user\\n' + 'Tell me about the sea. '.repeat(80) + '<|im_end|>\\n<|im_start|>assistant\\n';
      const tooLong = await run(long, 16);
      await engine.unload();
      return { tooLong };
    }""")
    assert outcome["tooLong"].get("code") == "context_length_exceeded", outcome


def markdown_is_rendered_and_html_is_text(page: Any) -> None:
    html = page.evaluate("""() => {
      const box = document.createElement('div');
      box.innerHTML = window.rtgwDemo.renderMarkdown(
        "Code:\\n\\n```py\\nprint(1)\\n```\\n\\n- one\\n- two\\n\\n<img src=x onerror=alert(1)><script>alert(2)</script>" +
        "\\n\\n![pic](https://example.com/a.png) [link](javascript:alert(3))");
      return { pre: box.querySelectorAll('pre code').length, li: box.querySelectorAll('ul li').length,
               bad: box.querySelectorAll('img, script, [onerror]').length,
               js: [...box.querySelectorAll('a')].filter((a) => a.href.startsWith('javascript')).length,
               text: box.textContent };
    }""")
    assert html["pre"] == 1 and html["li"] == 2, html
    assert html["bad"] == 0 and html["js"] == 0, html
    assert "<img src=x onerror=alert(1)>" in html["text"], html  # shown as text, not run


def test_demo_page_answers_on_the_device_when_the_gateway_dies(tmp_path: Path) -> None:
    gateway = GatewayProcess(write_config(tmp_path), tmp_path / "gateway.log")
    plain = write_config(tmp_path, server={"cross_origin_isolation": False}, name="plain.toml")
    gateway.start()
    try:
        with playwright_sync.sync_playwright() as p, chromium(p) as browser:
            context = browser.new_context(viewport={"width": 1280, "height": 800})
            log = RequestLog(context)
            page = context.new_page()
            page.set_default_timeout(WAIT_MS)
            online_then_device(page, gateway, log)
            markdown_is_rendered_and_html_is_text(page)
            reload_without_isolation(page, gateway, plain, log)
            context_overflow_is_an_error(page)
            assert log.offsite(gateway.url) == []
            assert log.count("/vendor/wllama.wasm") >= 1
    except Exception:
        print(gateway.log_tail())
        raise
    finally:
        gateway.stop()
