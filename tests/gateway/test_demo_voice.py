"""The demo page's voice in Debian's Chromium (through Playwright) with a fake microphone, against
a served gateway with the real voice pipeline (Silero VAD, Whisper tiny.en, flite) and a fake
language model whose answer is long and slow, so that it is still playing when the user speaks
again.

The fake microphone plays a WAV made by flite, in a loop: silence, the question, a longer
silence, the question again... The page's Talk button starts the SDK's VoiceSession (getUserMedia,
an AudioWorklet, 24 kHz PCM appends; Web Audio playback): the first question is transcribed and
answered in speech, the page plays it, and the question's next round, heard while the answer
plays, interrupts it: the page stops playback and truncates the answer to the ms it played, and
the next answer's prompt holds only those words. Waits are long (a busy 2-core machine) and
observed, never slept.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeEngine
from voice_serving import QUESTION, serve, spoken, voice_pipeline, words, write_wav

from gateway.ws.voice_service import GatewayVoice

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream"]
WAIT_MS = 180_000
ANSWER = ["The ", "kitchen ", "lights ", "are ", "on ", "now. ", "Is ", "there ", "anything ", "else ", "you ",
          "would ", "like? "]

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium is not installed (make system-deps)"),
]
playwright_async = pytest.importorskip("playwright.async_api")


@pytest.fixture(scope="module")
def voice() -> Iterator[GatewayVoice]:
    yield from voice_pipeline()


def microphone_wav(directory: Path) -> Path:
    """What the fake microphone loops: 1 s of silence, the question, 5 s of silence (the first
    answer starts playing in it; the question's next round interrupts it)."""
    rate = 48_000
    return write_wav(directory / "microphone.wav", spoken(rate=rate, before_ms=1000, after_ms=5000), rate)


async def stats(page: Any) -> dict[str, Any]:
    return dict(await page.evaluate("() => window.rtgwDemo.voice()"))


async def wait_stats(page: Any, condition: str) -> None:
    """Until ``condition`` (JavaScript over ``s``, the page's voice figures) holds."""
    await page.wait_for_function(f"() => {{ const s = window.rtgwDemo.voice(); return {condition}; }}",
                                 timeout=WAIT_MS)


async def test_talk_hear_and_interrupt_in_chromium_with_a_fake_microphone(voice: GatewayVoice, tmp_path: Path) -> None:
    engine = FakeEngine(reply=lambda p, s: ANSWER * 6, tokens_per_second=8)
    args = [*ARGS, f"--use-file-for-fake-audio-capture={microphone_wav(tmp_path)}"]
    async for served in serve(voice, engine):
        async with playwright_async.async_playwright() as p:
            browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
            try:
                page = await browser.new_page(viewport={"width": 1280, "height": 800})
                page.set_default_timeout(WAIT_MS)
                await page.goto(f"{served.url}/")
                await page.wait_for_selector('#status[data-state="connected"]')
                await page.click("#mic")
                assert await page.get_attribute("#mic", "aria-pressed") == "true"

                # Speak: the question is heard and transcribed into the conversation.
                await wait_stats(page, "s.transcripts.length >= 1")
                first = await stats(page)
                assert words(first["transcripts"][0]) == words(QUESTION), first
                assert first["micKind"] == "worklet" and first["micMs"] > 0
                user = page.locator(".msg.user.voice").first
                assert words(await user.locator(".text").inner_text()) == words(QUESTION)

                # Hear: the spoken answer arrives and plays.
                await wait_stats(page, "s.audioDeltas > 0 && s.playbackStarts > 0 && s.playedMs > 0")
                await page.wait_for_function(
                    "() => document.querySelector('.msg.assistant.voice .text').textContent.startsWith('The kitchen')")

                # Interrupt: the question's next round, heard while the answer plays, cuts it.
                await wait_stats(page, "s.cuts.length >= 1")
                cut = (await stats(page))["cuts"][0]
                assert cut["audioEndMs"] > 0
                cut_box = page.locator(f'.msg.assistant[data-item-id="{cut["itemId"]}"]')
                await cut_box.locator("xpath=self::*[@data-interrupted='true']").wait_for()
                assert await cut_box.get_attribute("data-status") == "cancelled"
                kept = await page.evaluate(
                    "(id) => window.rtgwDemo.client().conversation.find((i) => i.id === id).text", cut["itemId"])
                assert kept == cut["text"] == await cut_box.locator(".text").inner_text()
                said = "".join(ANSWER * 6)
                assert said.startswith(kept) and len(kept) < len(said)

                # The next answer starts from a conversation that holds only the words played.
                turns = (await stats(page))["turns"]
                index = next(i for i, t in enumerate(turns) if t["itemId"] == cut["itemId"])
                await wait_stats(page, f"s.turns.length > {index + 1} && s.turns[{index + 1}].itemId !== null")
                following = (await stats(page))["turns"][index + 1]["responseId"]
                prompt = "".join(map(chr, engine.prompts[following]))
                assert (kept == "" or f"<assistant>{kept}\n" in prompt) and said not in prompt

                await page.click("#mic")  # stop talking
                assert await page.get_attribute("#mic", "aria-pressed") == "false"
                assert not (await stats(page))["on"]
            finally:
                await browser.close()
