"""The JS SDK's on-device fallback in a real browser: headless Chromium (Debian's, under Playwright)
on the demo page of a real gateway (`python -m gateway serve` on the shipped default config), the
embedded SmolLM2-135M GGUF run in the page by llama.cpp in WebAssembly (wllama).

What it measures, in one run:
- llama.cpp natively on this machine (llama-cpp-python, the same GGUF, greedy): decode tokens/s
  with 1 thread and with the page's thread count, before anything else starts;
- the model's first download through the page (98 MB from the gateway, checked and stored), and
  its load from Cache Storage into the engine as a second visit does (`model_load_from_store_s`);
- decode tokens/s of the model in the page, with 1 thread and with threads (the page is
  cross-origin isolated), and `device_over_native`: the better of the two over native with the
  same thread count;
- `first_device_token_ms_after_drop`: the gateway killed (SIGKILL) between two turns of a
  conversation, the next turn sent at once; from the kill to its first token on the device;
  `first_device_token_ms_mid_answer` the same with the kill in the middle of an answer (its first
  words shown; the device reads the question while the gateway answers it);
- `switch_back_turns`: once the gateway is back, the turns until one is served online again;
- `offsite_requests`: requests the page made to anywhere but the gateway (must be 0).

    .venv/bin/python bench/browser_offline.py            # ~5 minutes
    .venv/bin/python bench/browser_offline.py --smoke    # one drop, short answers
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._browser import (
    WATCH,
    RequestLog,
    ask,
    chromium,
    enable_device,
    wait_device_ready,
    wait_done,
    wait_text,
)
from bench._common import SMOKE_HELP, cpu_facts, figure_path, progress, result_path, write_json
from tests.client_sdk.gateway_process import GatewayProcess, write_config

PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          "<|im_start|>user\nWrite a short story about a lighthouse keeper and a storm.<|im_end|>\n"
          "<|im_start|>assistant\n")

# The page generates from PROMPT on an engine of its own with `threads` threads, loaded from the
# stored model, and reports the load time and the decode rate (first token excluded).
PAGE_DECODE = """async ({ threads, tokens, prompt }) => {
  const mod = await import('/sdk/rtgw-device.js');
  const device = window.rtgwDemo.device();
  const t0 = performance.now();
  const blob = await device.store.load(device.card);
  const engine = new mod.WllamaEngine({ assetsUrl: '/vendor/', threads });
  await engine.load(blob);
  const loadMs = performance.now() - t0;
  const stamps = [];
  for await (const part of engine.generate({ prompt, maxTokens: tokens, temperature: 0 })) {
    if (part.text !== undefined) stamps.push(performance.now());
  }
  const used = engine.threads;
  await engine.unload();
  const rate = stamps.length > 2 ? (stamps.length - 1) / ((stamps.at(-1) - stamps[0]) / 1000) : 0;
  return { loadMs, rate, pieces: stamps.length, threads: used };
}"""


def native_tok_s(threads: int, tokens: int) -> float:
    """llama.cpp natively (llama-cpp-python) on the same GGUF: greedy decode tokens/s, first token excluded."""
    from llama_cpp import Llama

    from llm_shared.modelfile import default_gguf_path

    model = Llama(str(default_gguf_path()), n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
    stamps = []
    for _ in model.create_completion(PROMPT, max_tokens=tokens, temperature=0, stream=True):
        stamps.append(time.perf_counter())
    model.close()
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def page_clock(page: Any) -> float:
    return float(page.evaluate("() => performance.now()"))


def first_device_delta_after(page: Any, t0: float) -> float:
    """ms from the page time `t0` to the first text the device wrote after it."""
    firsts = page.evaluate("() => Object.values(window.__offline.firstDelta)")
    device = [t for t, mode in firsts if mode == "device" and t >= t0]
    if not device:
        raise RuntimeError(f"no device text after the drop: {firsts}")
    return min(device) - t0


def device_mode_after(page: Any, t0: float) -> float:
    """ms from the page time `t0` to the client's switch to the device (the badge's mode)."""
    return min(t for mode, t in page.evaluate("() => window.__offline.modes") if mode == "device" and t >= t0) - t0


def drop_between_turns(page: Any, gateway: GatewayProcess, tokens: int) -> tuple[float, int, dict[str, Any]]:
    """Kill the gateway, send at once; then start it and count the turns until one is online."""
    # the drop comes once the device has read the conversation (a user reading the last answer)
    page.wait_for_function("() => window.rtgwDemo.device()._busy === false")
    t0 = page_clock(page)
    gateway.kill()
    kill_ms = page_clock(page) - t0  # SIGKILL, and the process reaped
    answer = ask(page, "And what should I see there first?", tokens)
    wait_done(page, answer)
    if answer.get_attribute("data-tier") != "device":
        raise RuntimeError(f"the turn after the drop was not served on the device: {answer.get_attribute('data-tier')}")
    first_ms = first_device_delta_after(page, t0)
    timings = page.evaluate("() => window.rtgwDemo.device().engine.lastTimings")
    parts = {"kill_ms": kill_ms, "switch_ms": device_mode_after(page, t0), "cache_n": timings.get("cache_n"),
             "prompt_n": timings.get("prompt_n"), "prompt_ms": timings.get("prompt_ms")}
    gateway.start()
    for turn in range(1, 6):
        answer = ask(page, "Thanks. One more tip, please.", tokens)
        wait_done(page, answer)
        if answer.get_attribute("data-tier") != "device":
            return first_ms, turn, parts
    return first_ms, 99, parts


def drop_mid_answer(page: Any, gateway: GatewayProcess, tokens: int) -> float:
    """Kill the gateway once the answer shows its first words (the device has read the conversation
    before the question, as a user who read the previous answer gives it time to)."""
    page.wait_for_function("() => window.rtgwDemo.device()._busy === false")
    answer = ask(page, "Describe a walk through the old town, street by street.", max(tokens, 96))
    wait_text(page, 12)
    t0 = page_clock(page)
    gateway.kill()
    wait_done(page, answer)
    first_ms = first_device_delta_after(page, t0)
    gateway.start()
    return first_ms


def run(smoke: bool) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    tokens = 24 if smoke else 128
    drops = 1 if smoke else 5
    cores = len(os.sched_getaffinity(0))
    progress(f"native llama.cpp: {tokens} tokens at 1 and {cores} threads")
    native = {1: native_tok_s(1, tokens), cores: native_tok_s(cores, tokens)}
    progress(f"native tok/s: {({k: round(v, 1) for k, v in native.items()})}")

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        routing = "edge" if smoke else "cascade"  # the shipped default route in a real run
        gateway = GatewayProcess(write_config(directory, routing=routing), directory / "gateway.log")
        progress(f"starting the gateway ({routing} route)")
        gateway.start()
        try:
            with sync_playwright() as p, chromium(p) as browser:
                context = browser.new_context(viewport={"width": 1280, "height": 800})
                log = RequestLog(context)
                page = context.new_page()
                page.set_default_timeout(600_000)
                page.goto(f"{gateway.url}/")
                page.wait_for_selector('#status[data-state="connected"]')
                page.evaluate(WATCH)
                progress("prefetching the model in the page (download, SHA-256, Cache Storage, load)")
                enable_device(page)
                wait_device_ready(page)
                states = dict(page.evaluate("() => window.__offline.states"))
                download_s = (states["loading"] - states["downloading"]) / 1000
                threads = int(page.evaluate("() => window.rtgwDemo.device().engine.threads"))
                progress(f"downloaded in {download_s:.1f} s; the page runs {threads} threads")

                progress("decode in the page: 1 thread, then the page's threads")
                one = page.evaluate(PAGE_DECODE, {"threads": 1, "tokens": tokens, "prompt": PROMPT})
                many = page.evaluate(PAGE_DECODE, {"threads": threads, "tokens": tokens, "prompt": PROMPT})
                progress(f"page tok/s: 1 thread {one['rate']:.1f}, {many['threads']} threads {many['rate']:.1f}; "
                         f"load from store {one['loadMs'] / 1000:.2f} s")

                for text in ("I am planning a trip to Lisbon in May.", "What is the weather like then?"):
                    wait_done(page, ask(page, text, tokens))
                after_drop, switch_back, breakdown = [], [], []
                for i in range(drops):
                    progress(f"drop {i + 1}/{drops}: the gateway killed between turns")
                    first_ms, turns, parts = drop_between_turns(page, gateway, tokens)
                    after_drop.append(first_ms)
                    switch_back.append(turns)
                    breakdown.append(parts)
                    progress(f"first device token {first_ms:.0f} ms after the kill (killed and reaped in "
                             f"{parts['kill_ms']:.0f} ms, on the device after {parts['switch_ms']:.0f} ms; prompt {parts['prompt_n']} new tokens in "
                             f"{parts['prompt_ms']:.0f} ms, {parts['cache_n']} from its cache); "
                             f"online again after {turns} turn(s)")
                progress("a drop in the middle of an answer")
                mid_ms = drop_mid_answer(page, gateway, tokens)
                progress(f"first device token {mid_ms:.0f} ms after the kill, mid-answer")
        finally:
            gateway.stop()
        offsite = log.offsite(gateway.url)

    best = max((one["rate"] / native[1], 1), (many["rate"] / native[cores], many["threads"]))
    return {
        "device_tok_s_1t": round(one["rate"], 2),
        "device_tok_s_threads": round(many["rate"], 2),
        "device_threads": many["threads"],
        "native_tok_s_1t": round(native[1], 2),
        "native_tok_s_threads": round(native[cores], 2),
        "device_over_native": round(best[0], 3),
        "first_device_token_ms_after_drop": round(statistics.median(after_drop), 1),
        "first_device_token_ms_after_drop_max": round(max(after_drop), 1),
        "first_device_token_ms_mid_answer": round(mid_ms, 1),
        "drop_breakdown": breakdown,
        "model_download_s": round(download_s, 2),
        "model_load_from_store_s": round(one["loadMs"] / 1000, 2),
        "switch_back_turns": max(switch_back),
        "offsite_requests": len(offsite),
        "offsite": offsite[:5],
        "drops": drops,
        "tokens": tokens,
        "cpu": cpu_facts(),
    }


def plot(result: dict[str, Any], smoke: bool) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, drop) = plt.subplots(1, 2, figsize=(9, 3.4), gridspec_kw={"width_ratios": [1.1, 1]})
    labels = ["1 thread", f"{result['device_threads']} threads"]
    native = [result["native_tok_s_1t"], result["native_tok_s_threads"]]
    device = [result["device_tok_s_1t"], result["device_tok_s_threads"]]
    for i in range(2):
        speed.bar(i - 0.2, native[i], 0.4, color="#2f6fde", label="llama.cpp native" if i == 0 else None)
        speed.bar(i + 0.2, device[i], 0.4, color="#8a5a00", label="in Chromium (wllama)" if i == 0 else None)
        speed.text(i + 0.2, device[i], f"{device[i]:.0f} ({device[i] / native[i]:.2f}x)", ha="center", va="bottom",
                   fontsize=8)
    speed.set_xticks([0, 1], labels)
    speed.set_ylabel("decode tokens/s")
    speed.set_ylim(0, max(native) * 1.25)
    speed.set_title("SmolLM2-135M Q4_1 (Q5_1 blocks in the page), same machine", fontsize=9)
    speed.legend(fontsize=8, loc="upper right")
    killed = [d["kill_ms"] for d in result["drop_breakdown"]]
    drops = [d["switch_ms"] for d in result["drop_breakdown"]]
    prefill = [d["prompt_ms"] for d in result["drop_breakdown"]]
    x = range(1, len(drops) + 1)
    drop.bar(x, killed, color="#d5d9de", label="gateway killed and reaped (the benchmark)")
    drop.bar(x, [s - k for s, k in zip(drops, killed, strict=True)], bottom=killed, color="#9aa3ad",
             label="question sent, gateway tried, device chosen")
    drop.bar(x, prefill, bottom=drops, color="#8a5a00", label="device reads the new message")
    drop.axhline(1500, color="#c93c3c", linestyle="--", linewidth=1)
    drop.text(len(drops) + 0.45, 1500, "floor", color="#c93c3c", fontsize=8, va="bottom", ha="right")
    drop.axhline(500, color="#2e9d58", linestyle=":", linewidth=1)
    drop.text(len(drops) + 0.45, 500, "goal", color="#2e9d58", fontsize=8, va="bottom", ha="right")
    drop.set_xticks(list(x), [f"{d['cache_n']}" for d in result["drop_breakdown"]])
    drop.set_xlabel("drop (conversation tokens already in the device's cache)", fontsize=8)
    drop.set_ylabel("ms from the kill to the device's first token\n(first token's own decode on top)", fontsize=8)
    drop.set_title("gateway killed between turns", fontsize=9)
    drop.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"On-device fallback in the browser ({result['cpu']['model']})", fontsize=9)
    fig.tight_layout()
    path = figure_path("browser_offline.png", smoke)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    result = run(args.smoke)
    write_json(result_path("browser_offline.json", args.smoke), result)
    progress(f"figure: {plot(result, args.smoke)}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
