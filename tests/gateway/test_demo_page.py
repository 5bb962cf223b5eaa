"""The demo page in Debian's Chromium (through Playwright) against a real gateway process.

Desktop: tokens stream into the answer, Stop cancels a long answer, the next answer completes
with its tier and TTFT; with the demo tools required, the answer shows the model's call (the
function and its arguments, pretty-printed), the page answers it and the model goes on. Phone-sized: no horizontal scrolling, the input and buttons on screen,
and speaking mode's Stop is barge-in (the conversation keeps what was shown). Last, the
gateway is stopped and the page says it cannot reach it. Screenshots go to docs/img/ only when
asked (``RTGW_UPDATE_SCREENSHOTS=1``) and everything passed: a test run leaves the tree as it was. The model runs on a busy CPU: waits are long, and observed, never slept.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client_sdk"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gateway_process import REPO_ROOT, GatewayProcess, write_config

from bench._browser import CHROMIUM, WAIT_MS, ask, chromium, last_answer, wait_done, wait_text

IMG = REPO_ROOT / "docs" / "img"
STORY = "Tell me a long story about a dragon who learns to bake bread, with many details."

pytestmark = [
    pytest.mark.model,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium is not installed (make system-deps)"),
]
playwright_sync = pytest.importorskip("playwright.sync_api")

# Records the last answer's text length at every change, with its status then: the proof that
# text arrived in pieces while the turn was still streaming.
WATCH = """() => {
  window.__lengths = [];
  const box = () => [...document.querySelectorAll('.msg.assistant')].at(-1);
  new MutationObserver(() => {
    const b = box();
    if (b) window.__lengths.push([b.querySelector('.text').textContent.length, b.dataset.status]);
  }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
}"""


def open_settings(page: Any) -> None:
    page.evaluate("() => { document.getElementById('settings').open = true; }")


def desktop_flow(page: Any, url: str, shots: Path) -> None:
    page.goto(url)
    page.wait_for_selector('#status[data-state="connected"]', timeout=WAIT_MS)
    open_settings(page)
    assert "smollm2-135m-edge" in page.locator("#model option").all_inner_texts()

    page.evaluate(WATCH)
    answer = ask(page, "What is the capital of France?", 24)
    assert wait_done(page, answer) in ("completed", "incomplete")
    lengths = page.evaluate("() => window.__lengths")
    growing = sorted({n for n, status in lengths if status == "streaming" and n > 0})
    assert len(growing) >= 2, f"the text did not stream: {lengths}"

    answer = ask(page, STORY, 400)
    wait_text(page, 1)
    page.click("#stop")
    assert wait_done(page, answer) == "cancelled"
    assert "cancelled" in answer.locator(".meta").inner_text()

    answer = ask(page, "Say hello in French.", 16)
    assert wait_done(page, answer) in ("completed", "incomplete")
    meta = answer.locator(".meta")
    assert meta.locator(".tier").inner_text().startswith("tier edge")
    assert meta.locator(".ttft").inner_text().startswith("TTFT ")
    assert meta.locator(".cached").inner_text().startswith("cached ")
    page.screenshot(path=str(shots / "demo_desktop.png"))


def tool_flow(page: Any) -> None:
    open_settings(page)
    page.select_option("#tools", "required")
    before = page.locator(".msg.assistant").count()
    ask(page, "What is the weather in Paris, in Celsius?", 80)
    answer = page.locator(".msg.assistant").nth(before)  # the call's bubble; the answer after it comes next
    status = wait_done(page, answer)  # waits for the whole exchange: call, output, answer
    assert status == "completed", answer.inner_text()
    call = answer.locator(".call")
    assert call.count() == 1 and call.get_attribute("data-status") == "completed"
    name = call.locator(".fn").inner_text()
    assert name in ("get_weather", "get_time")
    shown = call.locator(".args").inner_text()
    arguments = json.loads(shown)
    assert isinstance(arguments, dict) and shown == json.dumps(arguments, indent=2, ensure_ascii=False)
    assert "answered by this page" in call.locator(".call-output").inner_text()
    follow = last_answer(page)
    assert page.locator(".msg.assistant").count() == before + 2
    assert follow.get_attribute("data-status") in ("completed", "incomplete")
    assert follow.locator(".call").count() == 0 and follow.locator(".text").inner_text().strip()
    kinds = page.evaluate("() => window.rtgwDemo.client().conversation.map((i) => i.type)")
    assert kinds[-4:] == ["message", "function_call", "function_call_output", "message"], kinds
    page.select_option("#tools", "off")


def phone_flow(page: Any, url: str, shots: Path) -> None:
    page.goto(url)
    page.wait_for_selector('#status[data-state="connected"]', timeout=WAIT_MS)
    open_settings(page)
    page.check("#speaking")
    page.evaluate("() => { document.getElementById('settings').open = false; }")

    answer = ask(page, STORY, 200)
    wait_text(page, 8)  # revealed at 15 characters per second
    page.click("#stop")
    answer.locator("xpath=self::*[@data-interrupted='true']").wait_for(timeout=WAIT_MS)
    wait_done(page, answer)
    shown = answer.locator(".text").inner_text()
    kept = page.evaluate("() => window.rtgwDemo.client().conversation.at(-1)")
    assert kept["role"] == "assistant" and kept["text"] == shown and len(shown) >= 8
    assert f"keeps {len(shown)} characters" in answer.locator(".meta").inner_text()

    answer = ask(page, "Say hi.", 12)  # still speaking: Send comes back once it is all shown
    assert wait_done(page, answer) in ("completed", "incomplete", "cancelled")

    width = page.evaluate("() => [document.documentElement.scrollWidth, document.body.scrollWidth, innerWidth]")
    assert max(width[:2]) <= width[2], f"horizontal scrolling on a phone: {width}"
    for selector in ("#prompt", "#send", "#stop"):
        box = page.locator(selector).bounding_box()
        assert box is not None and page.locator(selector).is_visible(), selector
        assert box["x"] >= 0 and box["x"] + box["width"] <= 390 and box["y"] + box["height"] <= 844, (selector, box)
    page.screenshot(path=str(shots / "demo_phone.png"))


def unreachable_flow(page: Any, gateway: GatewayProcess) -> None:
    gateway.stop()
    page.wait_for_selector('#status[data-state="idle"]', timeout=WAIT_MS)  # the socket closed
    page.fill("#prompt", "Are you there?")
    page.click("#send")
    page.wait_for_selector("#banner:not([hidden])", timeout=WAIT_MS)
    assert "Cannot reach the server" in page.locator("#banner").inner_text()
    assert last_answer(page).get_attribute("data-status") == "failed"


def test_demo_page_in_chromium(tmp_path: Path) -> None:
    gateway = GatewayProcess(write_config(tmp_path), tmp_path / "gateway.log")
    gateway.start()
    shots = tmp_path / "shots"
    shots.mkdir()
    try:
        with playwright_sync.sync_playwright() as p, chromium(p) as browser:
            desktop = browser.new_page(viewport={"width": 1280, "height": 800})
            desktop.set_default_timeout(WAIT_MS)
            desktop_flow(desktop, f"{gateway.url}/", shots)
            tool_flow(desktop)
            phone_context = browser.new_context(viewport={"width": 390, "height": 844}, device_scale_factor=2,
                                                is_mobile=True, has_touch=True)
            phone = phone_context.new_page()
            phone.set_default_timeout(WAIT_MS)
            phone_flow(phone, f"{gateway.url}/", shots)
            unreachable_flow(desktop, gateway)
    except Exception:
        print(gateway.log_tail())
        raise
    finally:
        gateway.stop()
    if os.environ.get("RTGW_UPDATE_SCREENSHOTS") == "1":
        IMG.mkdir(parents=True, exist_ok=True)
        for name in ("demo_desktop.png", "demo_phone.png"):
            shutil.copyfile(shots / name, IMG / name)
