"""The demo page in Debian's Chromium under Playwright, for the on-device fallback's test
(tests/gateway/test_demo_offline.py) and benchmark (bench/browser_offline.py): the browser's
flags, the page's controls, and a record of every request the page makes, to show that none
leaves the gateway's origin."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
WAIT_MS = 300_000  # the model on a busy 2-core CPU, in WebAssembly

# Every state the device badge and the client go through, with the page's clock, and the time of
# each answer's first text: what the test and the benchmark read back.
WATCH = """() => {
  const w = window.__offline = { modes: [], states: [], progress: [], firstDelta: {}, tiers: [] };
  const badge = document.getElementById('device');
  new MutationObserver(() => w.modes.push([badge.dataset.mode, performance.now()]))
    .observe(badge, { attributes: true, attributeFilter: ['data-mode'] });
  const hook = () => {
    const c = window.rtgwDemo.client(), d = window.rtgwDemo.device();
    if (c && !c.__watched) {
      c.__watched = true;
      // keyed by response and mode: an answer the device continues has a first device delta of its own
      c.on('delta', ({ turn }) => { w.firstDelta[`${turn.responseId} ${c.mode}`] ??= [performance.now(), c.mode]; });
      c.on('turn', (turn) => turn.result.then((r) => w.tiers.push(r.tier)));
    }
    if (d && !d.__watched) {
      d.__watched = true;
      d.on('state', ({ state }) => w.states.push([state, performance.now()]));
      d.on('progress', ({ loaded, total }) => w.progress.push([loaded, total]));
    }
  };
  hook();
  setInterval(hook, 50);
}"""


@contextmanager
def chromium(playwright: Any) -> Iterator[Any]:
    """Debian's Chromium, headless with ``ARGS``, under a started (sync) Playwright; closed after."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
    try:
        yield browser
    finally:
        browser.close()


class RequestLog:
    """Every request of the browser context (pages and their workers), as URLs."""

    def __init__(self, context: Any) -> None:
        self.urls: list[str] = []
        context.on("request", lambda request: self.urls.append(request.url))

    def offsite(self, origin: str) -> list[str]:
        """The requests to anywhere but ``origin`` (blob: and data: URLs are the page's own)."""
        home = urlsplit(origin)
        out = []
        for url in self.urls:
            parts = urlsplit(url)
            if parts.scheme in ("blob", "data"):
                continue
            if (parts.scheme, parts.netloc) != (home.scheme, home.netloc):
                out.append(url)
        return out

    def count(self, path: str) -> int:
        return sum(1 for url in self.urls if urlsplit(url).path == path)


def last_answer(page: Any) -> Any:
    return page.locator(".msg.assistant").last


def ask(page: Any, text: str, max_tokens: int) -> Any:
    page.evaluate("""(n) => { const input = document.getElementById('max-tokens');
                             input.value = n; input.dispatchEvent(new Event('change')); }""", max_tokens)
    page.fill("#prompt", text)
    page.click("#send")
    return last_answer(page)


def wait_done(page: Any, answer: Any, timeout_ms: int = WAIT_MS) -> str:
    answer.locator("xpath=self::*[@data-status!='waiting' and @data-status!='streaming']").wait_for(timeout=timeout_ms)
    page.wait_for_function("() => !document.getElementById('send').disabled", timeout=timeout_ms)
    return str(answer.get_attribute("data-status"))


def wait_text(page: Any, chars: int, timeout_ms: int = WAIT_MS) -> None:
    page.wait_for_function(
        """(n) => { const b = [...document.querySelectorAll('.msg.assistant')].at(-1);
                    return b && b.querySelector('.text').textContent.length >= n; }""", arg=chars, timeout=timeout_ms)


def enable_device(page: Any) -> None:
    """Settings: "Answer on this device" on (the page loads rtgw-device.js and starts a new chat)."""
    page.evaluate("() => { document.getElementById('settings').open = true; }")
    page.check("#offline")
    page.evaluate("() => { document.getElementById('settings').open = false; }")


def wait_device_ready(page: Any, timeout_ms: int = WAIT_MS) -> None:
    page.wait_for_function("() => window.rtgwDemo.device()?.state === 'ready' || "
                           "window.rtgwDemo.device()?.state === 'error'", timeout=timeout_ms)
    state = page.evaluate("() => [window.rtgwDemo.device().state, window.rtgwDemo.device().error?.message ?? '']")
    if state[0] != "ready":
        raise AssertionError(f"the on-device model did not get ready: {state[1]}")
