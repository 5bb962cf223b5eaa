"""Healthy voice and text sessions beside two hostile clients, with the real models and Redis limits.

    .venv/bin/python bench/hostile.py [--voice 4] [--streams 16] [--turns 6] [--hostile both|ptt|schema|none] [--smoke]

One ``python -m gateway serve`` subprocess on the shipped config (the edge route, voice as shipped,
the per-key limits as shipped, kept in a ``redis-server`` of its own), four API keys. Two arms, the
same gateway, one after the other:

- **baseline**: ``--voice`` healthy voice sessions (the voice benchmark's client: a microphone in
  real time, server VAD, spoken answers; ``--turns`` questions each) and ``--streams`` text
  streams (the official ``openai`` SDK, streamed chat completions of 48 tokens, one after another
  until the voice sessions are done);
- **hostile**: the same, plus one hostile voice session (push to talk: 100 ms of tone appended and
  committed every 50 ms, 20 recognitions a second asked for) and one hostile HTTP client (every
  100 ms a chat completion with 128 new tools whose last schema cannot be compiled, so the compile
  and the attribution over every tool run each time).

Measured: the healthy voice sessions' speech-to-first-audio p99 and the text streams' inter-token
latency p99 in each arm (``healthy_first_audio_p99_ratio``, ``healthy_itl_p99_ratio``: hostile
over baseline, goal ≤ 1.5), how often the gateway marked its limits store down
(``limits_store_down_events``, sampled from ``gateway_limits_degraded`` every 250 ms; goal 0), and
failed healthy turns in the hostile arm (``healthy_failed``; goal 0), with the gateway's log
lines saying why (``limits_store_down_logged``). Also what the hostile clients got: recognitions
answered and refused, compiles run (400) and refused (429). ``--hostile`` runs one hostile client
alone, or none (the baseline twice: the ratios' noise).
``--smoke``: one voice session, two text streams, two turns.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import secrets
import struct
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import websockets
from openai import AsyncOpenAI

from bench._common import (
    SMOKE_HELP,
    BenchError,
    cpu_facts,
    dump_toml,
    percentile,
    progress,
    result_path,
    write_json,
)
from bench._gateway_server import GatewayProcess
from bench._redis import Redis
from bench._voice_client import VoiceSession, speech_clips
from gateway.config import DEFAULT_CONFIG

MODEL = "smollm2-135m-edge"
KEYS = {"voice": "sk-healthy-voice", "text": "sk-healthy-text", "ptt": "sk-hostile-ptt", "schema": "sk-hostile-schema"}
QUESTIONS = ("What is the capital of France?", "Turn on the kitchen lights.", "How far away is the moon?",
             "Tell me a fun fact about cats.", "What time does the store open?", "Set a timer for ten minutes.")
PROMPTS = ("Tell me about the sea.", "Name three fruits.", "What is a planet?", "Describe a forest.")
TONE_100MS = struct.pack("<h", 8000) * 2400  # 100 ms of a loud 24 kHz sample: speech to any VAD


def derive_config(directory: Path, redis_url: str) -> Path:
    raw = tomllib.loads(Path(DEFAULT_CONFIG).read_text(encoding="utf-8"))
    raw.setdefault("routing", {})["default"] = "edge"
    server = raw.setdefault("server", {})
    server["api_keys"] = list(KEYS.values())
    server["api_keys_env"] = ""
    raw["limits"] = {"backend": "redis", "url": redis_url, "failure": "fail_open"}
    # The healthy voice sessions and the hostile one are all admitted: this measures their contention.
    raw.setdefault("voice", {})["max_sessions"] = 64
    path = directory / "hostile.toml"
    path.write_text(dump_toml(raw), encoding="utf-8")
    return path


@dataclass
class Arm:
    name: str
    first_audio_ms: list[float] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)
    voice_failed: int = 0
    text_failed: int = 0
    text_done: int = 0
    errors: list[str] = field(default_factory=list)
    hostile: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        def p99(values: list[float]) -> float | None:
            return round(percentile(values, 99), 1) if values else None

        return {"arm": self.name, "voice_turns": len(self.first_audio_ms), "first_audio_ms_p99": p99(self.first_audio_ms),
                "first_audio_ms_p50": round(percentile(self.first_audio_ms, 50), 1) if self.first_audio_ms else None,
                "itl_ms_p99": p99(self.itl_ms), "text_streams_done": self.text_done,
                "voice_failed": self.voice_failed, "text_failed": self.text_failed, "hostile": self.hostile,
                "errors": self.errors[:5]}


async def voice_sessions(url: str, arm: Arm, sessions: int, turns: int, clips: dict[str, bytes]) -> None:
    async def one(n: int) -> None:
        # back to back (each question right after the last answer's response.done): the load its
        # figures were measured under, a ratio against its own baseline arm
        async with VoiceSession(url, MODEL, silence_ms=500, max_output_tokens=24, api_key=KEYS["voice"],
                                listen=False) as session:
            for t in range(turns):
                try:
                    turn = await session.turn(clips[QUESTIONS[(n + t) % len(QUESTIONS)]])
                except BenchError as e:
                    arm.voice_failed += 1
                    arm.errors.append(f"voice: {e}")
                    continue
                arm.first_audio_ms.append(turn.first_audio_ms)

    await asyncio.gather(*(one(n) for n in range(sessions)))


async def text_streams(url: str, arm: Arm, streams: int, stop: asyncio.Event) -> None:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["text"], max_retries=0, timeout=120)

    async def one(n: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            last = None
            try:
                stream = await client.chat.completions.create(
                    model=MODEL, stream=True, max_tokens=48,
                    messages=[{"role": "user", "content": PROMPTS[(n + i) % len(PROMPTS)]}])
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        now = time.perf_counter()
                        if last is not None:
                            arm.itl_ms.append((now - last) * 1000)
                        last = now
                arm.text_done += 1
            except Exception as e:  # a healthy stream that fails is what this counts
                arm.text_failed += 1
                arm.errors.append(f"text: {type(e).__name__}: {e}"[:200])

    async with client:
        await asyncio.gather(*(one(n) for n in range(streams)))


async def hostile_push_to_talk(url: str, arm: Arm, stop: asyncio.Event) -> None:
    """Push to talk as fast as the audio rate bound lets it: 100 ms appended and committed every 50 ms."""
    counts = arm.hostile
    ws_url = f"{url.replace('http', 'ws', 1)}/v1/realtime?model={MODEL}"
    async with websockets.connect(ws_url, additional_headers={"Authorization": f"Bearer {KEYS['ptt']}"},
                                  max_size=None, open_timeout=60) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "audio": {"input": {"turn_detection": None}}}}))

        async def read() -> None:
            async for message in ws:
                event = json.loads(message)
                kind = event["type"]
                if kind.endswith("transcription.completed"):
                    counts["ptt_transcribed"] = counts.get("ptt_transcribed", 0) + 1
                elif kind.endswith("transcription.failed"):
                    counts["ptt_refused"] = counts.get("ptt_refused", 0) + 1
                elif kind == "error":
                    counts["ptt_errors"] = counts.get("ptt_errors", 0) + 1

        reader = asyncio.create_task(read())
        audio = base64.b64encode(TONE_100MS).decode()
        try:
            while not stop.is_set():
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                counts["ptt_commits"] = counts.get("ptt_commits", 0) + 1
                await asyncio.sleep(0.05)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, websockets.ConnectionClosed):
                await reader


def failing_tools() -> list[dict[str, Any]]:
    """128 new tools (new names: no cache hit) whose last schema cannot be compiled (a look-around
    in a pattern), so the attribution compiles every other one alone before it finds it."""
    tag = secrets.token_hex(4)
    tools = [{"type": "function", "function": {"name": f"f_{tag}_{i}", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a"]}}}
             for i in range(127)]
    tools.append({"type": "function", "function": {"name": f"f_{tag}_bad", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(?=a)b"}}, "required": ["x"]}}})
    return tools


async def hostile_schemas(url: str, arm: Arm, stop: asyncio.Event) -> None:
    counts = arm.hostile
    headers = {"Authorization": f"Bearer {KEYS['schema']}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        while not stop.is_set():
            started = time.perf_counter()
            body = {"model": MODEL, "max_tokens": 8, "tool_choice": "required", "tools": failing_tools(),
                    "messages": [{"role": "user", "content": "Call a tool."}]}
            async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response:
                key = f"schema_http_{response.status}"
                counts[key] = counts.get(key, 0) + 1
                await response.read()
            await asyncio.sleep(max(0.0, 0.1 - (time.perf_counter() - started)))


async def watch_degraded(gw: GatewayProcess, flips: list[float], stop: asyncio.Event) -> None:
    """Count the limits store's outages: ``gateway_limits_degraded`` going to 1."""
    was = 0.0
    while not stop.is_set():
        try:
            now = await asyncio.to_thread(gw.metric, "gateway_limits_degraded")
        except BenchError:
            now = was
        if now and not was:
            flips.append(time.monotonic())
        was = now
        await asyncio.sleep(0.25)


async def run_arm(name: str, gw: GatewayProcess, args: argparse.Namespace, clips: dict[str, bytes],
                  flips: list[float]) -> Arm:
    arm = Arm(name)
    stop = asyncio.Event()
    background = [asyncio.create_task(text_streams(gw.url, arm, args.streams, stop)),
                  asyncio.create_task(watch_degraded(gw, flips, stop))]
    if name == "hostile":
        if args.hostile in ("both", "ptt"):
            background.append(asyncio.create_task(hostile_push_to_talk(gw.url, arm, stop)))
        if args.hostile in ("both", "schema"):
            background.append(asyncio.create_task(hostile_schemas(gw.url, arm, stop)))
        await asyncio.sleep(2.0)  # the hostile clients are at it before the healthy voice turns start
    try:
        await voice_sessions(gw.url, arm, args.voice, args.turns, clips)
    finally:
        stop.set()
        results = await asyncio.gather(*background, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            arm.errors.append(f"background: {type(result).__name__}: {result}"[:200])
    return arm


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    progress("speech for the questions (flite)")
    clips = speech_clips(list(QUESTIONS))
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        redis = Redis(directory)
        redis.start()
        gw = GatewayProcess(derive_config(directory, redis.url), directory / "gateway.log", "127.0.0.1")
        try:
            gw.start()
            progress("gateway starting (edge route, voice, limits in Redis)")
            await gw.wait_ready()
            arms: dict[str, Arm] = {}
            flips: dict[str, list[float]] = {"baseline": [], "hostile": []}
            for name in ("baseline", "hostile"):
                progress(f"arm {name}: {args.voice} voice sessions x {args.turns} turns, {args.streams} text streams"
                         + (", a push-to-talk flood and a failing 128-tool schema every 100 ms" if name == "hostile"
                            else ""))
                arms[name] = await run_arm(name, gw, args, clips, flips[name])
                progress(f"arm {name}: {json.dumps(arms[name].summary())}")
        finally:
            gw.stop()
            # why the store was marked down, as the gateway logged it (its log goes with the directory)
            outages = [line for line in gw.log_problems() if "limits store" in line][:5]
            redis.stop()
    base, hostile = arms["baseline"].summary(), arms["hostile"].summary()

    def ratio(key: str) -> float | None:
        return round(hostile[key] / base[key], 3) if hostile[key] and base[key] else None

    return {
        "healthy_first_audio_p99_ratio": ratio("first_audio_ms_p99"),
        "healthy_itl_p99_ratio": ratio("itl_ms_p99"),
        "limits_store_down_events": len(flips["baseline"]) + len(flips["hostile"]),
        "limits_store_down_logged": outages,
        "healthy_failed": hostile["voice_failed"] + hostile["text_failed"],
        "baseline": base, "hostile": hostile,
        "voice_sessions": args.voice, "text_streams": args.streams, "turns": args.turns, "cpu": cpu_facts(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--voice", type=int, default=4)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--hostile", choices=("both", "ptt", "schema", "none"), default="both",
                        help="which hostile clients the hostile arm runs (default both: the issue's figures; "
                             "none: the baseline twice, for the ratios' run-to-run noise)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    if args.smoke:
        args.voice, args.streams, args.turns = 1, 2, 2
    result = asyncio.run(main_async(args))
    write_json(result_path("hostile.json", args.smoke), result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
