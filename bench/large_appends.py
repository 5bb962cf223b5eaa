"""Sixty-four sessions each sending a 15 MiB append at once, beside a healthy session (issue 41).

    .venv/bin/python bench/large_appends.py [--sessions 64] [--append-mib 15] [--budget-mib 64]
                                            [--rounds 5] [--turns 3] [--smoke]

One ``python -m gateway serve`` subprocess on the shipped config (the edge route, voice as
shipped, the shipped per-key limits: the flood is exactly one key's ``max_sessions_per_key``),
with ``server.large_frames_budget_bytes`` set to ``--budget-mib`` (64, as shipped). Its RSS (all
its processes) is sampled every 10 ms from a thread while frames are in flight. A healthy
session (the official ``openai`` SDK's Realtime client, text turns: an out-of-band
``response.create`` of 16 tokens, one after another) stays open throughout. In order:

- **one append**: one session sends one ``--append-mib`` append (silence, "A" x 15 MiB: 245 s of
  24 kHz PCM16, refused after decoding with ``input_audio_buffer_full``, the input buffer holding
  120 s). Its RSS peak over the settled RSS before, divided by the frame's bytes, is what one
  admitted frame costs the server at most (``frame_cost_factor``): its bytes in aiohttp and the
  copies its parse, its JSON and its base64 make while it is handled;
- ``--rounds`` times: the healthy session takes ``--turns`` turns (its **baseline**, right before
  each flood: the machine's load drifts), then the **flood**: ``--sessions`` sessions (already
  open; new ones each round) each send one such frame at once, then an
  ``input_audio_buffer.clear`` (its ``cleared`` tells that the append was handled: events keep
  their order), while the healthy session keeps taking turns. Each session's answer is recorded:
  ``large_frames_busy`` (dropped at the gate, the budget held), or past the gate
  (``input_audio_buffer_full`` for a 15 MiB append);
- the flooding sessions closed, the RSS once a periodic full collection has run.

The bound (``bound_mib``): the frames the budget lets in are held whole (aiohttp's reads of
them, then their text) until each is handled, and the event loop handles one at a time, so the
most the server holds for them at once is the budget's bytes plus the extra copies of the one
frame being handled: ``budget + (frame_cost_factor - 1) x max_large_frame_bytes``, plus a fixed
allowance for what else moves meanwhile (``ALLOWANCE_MIB``: the healthy session's turns, the
reads of dropped frames, the allocator's slack). ``within_bound``: the flood's RSS peak minus the
settled RSS before it is under that. docs/reliability.md, "Large appends", has the derivation.

Last line: ``sessions`` (a round's), ``rounds``, ``append_mib``, ``budget_mib``, ``admitted``
(flood appends past the gate, all rounds), ``refused_busy`` (same), ``rss_before_mib``,
``rss_peak_mib`` and ``rss_growth_mib`` (of the round that grew most), ``rss_after_mib``
(settled at the end, the flooding sessions closed and a periodic full collection run: what was
not given back; compare with ``details.single.rss_before_mib``), ``frame_cost_factor``,
``bound_mib``, ``within_bound``, ``healthy_turns`` and ``healthy_failed`` (all the healthy
session's turns), ``healthy_ttft_p50_ratio`` (its time to first token during the flood over the
baseline's, p50), ``flood_s`` (first byte sent to last answer, the longest round), ``cpu``.
``--smoke``: 4 flood sessions of 2 MiB appends under a 4 MiB budget, the input buffer 10 s (so
that they too are refused once decoded), one round, 2 turns, no wait for the collection.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from openai import AsyncOpenAI

from bench._common import (
    SMOKE_HELP,
    cpu_facts,
    dump_toml,
    median,
    progress,
    result_path,
    write_json,
)
from bench._gateway_server import GatewayProcess
from bench._large_flood import Outcome, RawSession, RssSampler, append_frame
from gateway.config import DEFAULT_CONFIG, load_config

MODEL = "smollm2-135m-edge"
KEYS = {"healthy": "sk-healthy", "probe": "sk-probe", "flood": "sk-flood"}
MIB = 2**20
# What else the server's RSS may grow by while the flood runs, besides the large frames: the
# healthy session's turns and the dropped frames' reads in flight (64 sockets' worth of uvloop
# reads), and malloc's slack. Fixed, not fitted to a run.
ALLOWANCE_MIB = 32
TURN_TIMEOUT_S = 60.0
PROMPTS = ("Name three fruits.", "What is a planet?", "Describe a forest.", "Tell me about the sea.")


def derive_config(directory: Path, budget_bytes: int, input_buffer_s: float | None) -> Path:
    raw = tomllib.loads(Path(DEFAULT_CONFIG).read_text(encoding="utf-8"))
    raw.setdefault("routing", {})["default"] = "edge"  # the edge tier alone: no torch core on the two cores
    server = raw.setdefault("server", {})
    server["api_keys"] = list(KEYS.values())
    server["api_keys_env"] = ""
    server["large_frames_budget_bytes"] = budget_bytes
    if input_buffer_s is not None:  # the smoke run's small appends still overfill it, as 15 MiB does 120 s
        raw.setdefault("voice", {})["max_input_buffer_s"] = input_buffer_s
    path = directory / "large-appends.toml"
    path.write_text(dump_toml(raw), encoding="utf-8")
    return path


@dataclass
class Turn:
    at_s: float = 0.0  # perf_counter when it started
    ttft_ms: float | None = None
    done_ms: float | None = None
    ok: bool = False
    error: str = ""


@dataclass
class Healthy:
    """The healthy session: turns, each recorded with the phase it started in."""

    conn: Any
    turns: dict[str, list[Turn]] = field(default_factory=dict)

    async def turn(self, phase: str, n: int) -> Turn:
        turn = Turn()
        self.turns.setdefault(phase, []).append(turn)
        started = turn.at_s = time.perf_counter()
        try:
            async with asyncio.timeout(TURN_TIMEOUT_S):
                await self.conn.response.create(response={
                    "conversation": "none", "output_modalities": ["text"], "max_output_tokens": 16,
                    "input": [{"type": "message", "role": "user",
                               "content": [{"type": "input_text", "text": PROMPTS[n % len(PROMPTS)]}]}]})
                while True:
                    event = await self.conn.recv()
                    if event.type == "response.output_text.delta" and turn.ttft_ms is None:
                        turn.ttft_ms = (time.perf_counter() - started) * 1000
                    elif event.type == "error":
                        turn.error = f"{event.error.code}: {event.error.message}"
                        return turn
                    elif event.type == "response.done":
                        turn.done_ms = (time.perf_counter() - started) * 1000
                        status = event.response.status
                        reason = event.response.status_details.reason if event.response.status_details else None
                        # 16 tokens, or the answer ending sooner: either is a turn served
                        turn.ok = turn.ttft_ms is not None and (
                            status == "completed" or (status == "incomplete" and reason == "max_output_tokens"))
                        turn.error = "" if turn.ok else f"response {status} ({reason})"
                        return turn
        except TimeoutError:
            turn.error = f"no response.done after {TURN_TIMEOUT_S:.0f} s"
        return turn

    async def until(self, phase: str, stop: asyncio.Event) -> None:
        """Turns back to back until ``stop`` (at least one)."""
        n = 0
        while True:
            await self.turn(phase, n)
            n += 1
            if stop.is_set():
                return

    def ttfts(self, phase: str) -> list[float]:
        return [t.ttft_ms for t in self.turns.get(phase, []) if t.ok and t.ttft_ms is not None]


async def one_append(gw: GatewayProcess, frame: memoryview, processes: list[Any]) -> dict[str, Any]:
    """One session, one large append: the RSS it costs the server at its peak."""
    host, port = gw.host, gw.port
    session = await RawSession.open(host, port, f"/v1/realtime?model={MODEL}", KEYS["probe"])
    try:
        before = await gw.settled_rss()
        with RssSampler(processes) as sampler:
            outcome = await session.send_large(frame, time.perf_counter())
            await asyncio.sleep(0.2)  # the handling's last copies are freed by now
        after = await gw.settled_rss()
    finally:
        session.close()
    growth = sampler.peak - before
    return {"outcome": outcome.kind, "rss_before_mib": before / MIB, "rss_peak_mib": sampler.peak / MIB,
            "rss_after_mib": after / MIB, "growth_mib": growth / MIB, "frame_cost_factor": growth / len(frame)}


async def flood(gw: GatewayProcess, frame: memoryview, sessions: int, healthy: Healthy,
                processes: list[Any], round_: int) -> dict[str, Any]:
    """One round: ``sessions`` sessions open, then each sends its append at once; the healthy
    session takes turns until every append is answered."""
    path = f"/v1/realtime?model={MODEL}"
    flooders = await asyncio.gather(*(RawSession.open(gw.host, gw.port, path, KEYS["flood"]) for _ in range(sessions)))
    try:
        before = await gw.settled_rss()
        stop = asyncio.Event()
        me = psutil.Process()
        server_cpu, client_cpu = gw.cpu_s(), sum(me.cpu_times()[:2])
        with RssSampler(processes) as sampler:
            turns = asyncio.create_task(healthy.until("flood", stop))
            started = time.perf_counter()
            outcomes: list[Outcome] = await asyncio.gather(*(s.send_large(frame, started) for s in flooders))
            flood_s = max((o.answered_s or time.perf_counter() - started) for o in outcomes)
            server_cpu, client_cpu = gw.cpu_s() - server_cpu, sum(me.cpu_times()[:2]) - client_cpu
            stop.set()
            await turns
        held_after = await asyncio.to_thread(gw.metric, "gateway_large_frames_bytes")
        after = await gw.settled_rss()
    finally:
        for s in flooders:
            s.close()
    # The key's sessions are counted until the server has seen them close: the next round waits.
    while await asyncio.to_thread(gw.metric, "gateway_sessions_active") > 1:
        await asyncio.sleep(0.1)
    kinds = Counter(o.kind for o in outcomes)
    return {"round": round_, "rss_before_mib": before / MIB, "rss_peak_mib": sampler.peak / MIB,
            "rss_after_mib": after / MIB, "growth_mib": (sampler.peak - before) / MIB, "flood_s": flood_s,
            "outcomes": dict(kinds), "sent_s_max": max(o.sent_s for o in outcomes),
            # CPU seconds until every append was answered: the gateway's, and this process's (the clients)
            "server_cpu_s": server_cpu, "client_cpu_s": client_cpu,
            "large_frames_bytes_after": held_after,
            "rss_trace_mib": [(round(t - started, 3), round(rss / MIB, 1)) for t, rss in sampler.samples]}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    chars = int(args.append_mib * MIB) // 4 * 4
    frame = memoryview(append_frame(chars))
    budget = int(args.budget_mib * MIB)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        gw = GatewayProcess(derive_config(directory, budget, args.input_buffer_s), directory / "gateway.log", "127.0.0.1", tree=True)
        served = load_config(gw.config_path).server
        cap, gc_every_s = served.max_large_frame_bytes, served.gc_full_every_s
        try:
            gw.start()
            progress("gateway starting (the shipped config on the edge route, voice on)")
            await gw.wait_ready()
            processes = [gw.process, *gw.process.children(recursive=True)]
            client = AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=KEYS["healthy"], max_retries=0)
            async with client, client.realtime.connect(model=MODEL) as conn:
                await conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                                   "audio": {"input": {"turn_detection": None}}})
                healthy = Healthy(conn)
                for n in range(2):
                    await healthy.turn("warm-up", n)
                single = await one_append(gw, frame, processes)
                progress(f"one {len(frame) / MIB:.1f} MiB append: {json.dumps(single)}")
                rounds = []
                for r in range(args.rounds):
                    # The baseline right before each flood: the machine's load drifts between rounds.
                    for n in range(args.turns):
                        await healthy.turn("baseline", n)
                    progress(f"flood {r + 1}/{args.rounds}: {args.sessions} sessions x {len(frame) / MIB:.1f} MiB "
                             f"at once, budget {budget / MIB:g} MiB")
                    rounds.append(await flood(gw, frame, args.sessions, healthy, processes, r + 1))
                    progress(f"flood {r + 1}: {json.dumps({k: v for k, v in rounds[-1].items() if k != 'rss_trace_mib'})}")
                for n in range(2):
                    await healthy.turn("after", n)
                # What stays once every flooding session is gone and a periodic full collection has
                # run (a closed session's aiohttp objects are cycles; server.gc_full_every_s).
                wait_s = 0.0 if args.smoke else gc_every_s + 1
                await asyncio.sleep(wait_s)
                end = await gw.settled_rss()
                progress(f"{wait_s:.0f} s later: RSS {end / MIB:.1f} MiB")
        finally:
            gw.stop()
            problems = gw.log_problems()
    turns = [t for phase, ts in healthy.turns.items() if phase != "warm-up" for t in ts]
    base, during = healthy.ttfts("baseline"), healthy.ttfts("flood")
    k = single["frame_cost_factor"]
    bound = budget / MIB + (k - 1) * cap / MIB + ALLOWANCE_MIB
    outcomes: Counter[str] = Counter()
    for r in rounds:
        outcomes.update(r["outcomes"])
    busy = outcomes["large_frames_busy"]
    admitted = sum(n for kind, n in outcomes.items() if kind not in ("large_frames_busy", "frame_too_large", "closed"))
    worst = max(rounds, key=lambda r: r["growth_mib"])
    details = {"single": single, "floods": rounds, "outcomes": dict(outcomes), "turns": {p: [vars(t) for t in ts] for p, ts in healthy.turns.items()},
               "max_large_frame_bytes": cap, "allowance_mib": ALLOWANCE_MIB, "log_problems": problems[:20]}
    return {
        "sessions": args.sessions, "rounds": args.rounds, "append_mib": round(len(frame) / MIB, 2), "budget_mib": round(budget / MIB, 2),
        "admitted": admitted, "refused_busy": busy,
        "rss_before_mib": round(worst["rss_before_mib"], 1), "rss_peak_mib": round(worst["rss_peak_mib"], 1),
        "rss_growth_mib": round(worst["growth_mib"], 1), "rss_after_mib": round(end / MIB, 1),
        "frame_cost_factor": round(k, 2), "bound_mib": round(bound, 1), "within_bound": worst["growth_mib"] <= bound,
        "healthy_turns": len(turns), "healthy_failed": sum(not t.ok for t in turns),
        "healthy_ttft_p50_ratio": round(median(during) / median(base), 2) if base and during else None,
        "flood_s": round(max(r["flood_s"] for r in rounds), 2), "cpu": cpu_facts(), "details": details,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=64, help="flooding sessions (one key: at most 64 as shipped)")
    parser.add_argument("--append-mib", type=float, default=15.0, help="base64 in each append")
    parser.add_argument("--budget-mib", type=float, default=64.0, help="server.large_frames_budget_bytes")
    parser.add_argument("--turns", type=int, default=3, help="the healthy session's baseline turns before each flood")
    parser.add_argument("--rounds", type=int, default=5, help="floods, one after another (new sessions each)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    args.input_buffer_s = None  # voice.max_input_buffer_s as shipped (120 s)
    if args.smoke:
        args.sessions, args.append_mib, args.budget_mib, args.turns, args.input_buffer_s = 4, 2.0, 4.0, 2, 10.0
        args.rounds = 1
    result = asyncio.run(main_async(args))
    details = result.pop("details")
    shipped = args.budget_mib == 64.0 or args.smoke  # another budget's run keeps the shipped one's results
    name = "large_appends.json" if shipped else f"large_appends_budget{args.budget_mib:g}.json"
    write_json(result_path(name, args.smoke), {**result, **details})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
