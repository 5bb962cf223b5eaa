"""Does the edge tier remember the conversation? TTFT turn by turn over 8-turn chats (issue 10).

Each arm starts its own ``python -m gateway serve`` subprocess on a loopback port, with a
config derived from the base one that serves one tier alone (``[routing] default = "edge"`` or
``"gpu"``; the sessions name that tier's own model id, ``routing.edge_model`` or
``routing.gpu_model``), sends one warm-up turn, then runs conversations through the
official openai SDK (``AsyncOpenAI.realtime.connect``): per turn ``conversation.item.create``
(one user message), ``response.create`` (greedy, ``max_output_tokens``), events read until
``response.done``. TTFT is from sending ``response.create`` to the first
``response.output_text.delta``; input and cached tokens come from ``response.done``'s usage.

Arms (``--arms`` picks a subset):

- ``edge-on-1``, ``edge-off-1``: the llama.cpp edge tier with ``[edge] prefix_reuse`` on / off,
  one session at a time, ``--repeats`` conversations in a row;
- ``edge-on-multi``, ``edge-off-multi``: the same with ``--sessions`` concurrent sessions on
  ``--slots`` sequence slots (``[edge] n_seq_max``), so idle conversations' KV has to leave
  its slot (host-memory snapshots) or be computed again; ``ceil(repeats / sessions)`` rounds;
- ``gpu-1``: the torch tier (dtype chosen for this CPU, 2 threads) with its block prefix cache,
  one session.

Every conversation opens with a different name and city, so one conversation's turns never
hit another's cache beyond the chat template's shared system prompt.

Progress goes to stderr; stdout gets a summary, then as its last line one JSON object with
``ttft_turn8_over_turn1``, ``reuse_speedup_turn8``, ``cached_token_share``,
``gpu_ttft_turn8_over_turn1``, ``ttft_turn8_over_turn1_c8``, ``reuse_speedup_turn8_c8`` and
``cpu`` ("turn 8" is the last turn, "c8" the multi-session arms; null for arms not run).
Everything is written to bench/out/conversation.json and a figure to
docs/img/conversation_ttft.png.

Run: ``.venv/bin/python bench/conversation.py`` (about 6 minutes on a quiet 2-core machine);
``--smoke``: every arm, 2 turns of 4 tokens, 2 sessions on 1 slot (results in bench/out/smoke/);
one arm by hand: ``.venv/bin/python bench/conversation.py --turns 2 --max-tokens 8 --repeats 1 --arms edge-on-1``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import sys
import tempfile
import time
import tomllib
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import uvloop
from openai import AsyncOpenAI

from bench._common import (
    REPO_ROOT,
    SMOKE_HELP,
    cpu_dtype,
    cpu_facts,
    dump_toml,
    figure_path,
    load_average,
    percentile,
    progress,
    result_path,
    write_json,
)
from bench._gateway_clients import BENCH_API_KEY, DELTA, DONE, BenchError
from bench._gateway_server import GatewayProcess
from gateway.config import DEFAULT_CONFIG, parse_config

HOST = "127.0.0.1"
CONNECT_TIMEOUT_S = 60.0  # opening a session and reading session.created
EVENT_TIMEOUT_S = 300.0  # between two events of one turn: a queued prefill on a busy 2-core machine
WARMUP_TOKENS = 8
GPU_THREADS = 2  # torch intra-op threads in the engine core process: the machine's two cores

USER_TURNS = (
    "Hi! I'm {name}, and I'm planning a weekend trip to {city} next month.",
    "What are two or three things I shouldn't miss there?",
    "I'm travelling with my ten-year-old daughter. Which of those would she enjoy most?",
    "Good idea. What kind of weather should we expect in early spring?",
    "Should we rent a car, or is public transport easier for getting around?",
    "We love trying local food. Which dish should we order at least once?",
    "Thanks! Is there a quiet place nearby where we could spend a relaxed afternoon?",
    "Great. Can you sum up our plan in a few short bullet points?",
)
NAMES = ("Maya", "Tom", "Aiko", "Lucas", "Fatima", "Oskar", "Priya", "Diego")
CITIES = ("Lisbon", "Kyoto", "Edinburgh", "Vienna", "Montreal", "Seville", "Prague", "Copenhagen")
WARMUP_TEXT = "Hello there, can you hear me?"
# --smoke: every arm on the smallest conversation that still has a "last turn" after a first
# one, and two sessions contending for one slot.
SMOKE = {"turns": 2, "max_tokens": 4, "repeats": 1, "sessions": 2, "slots": 1}


def user_turns(conversation: int, turns: int) -> list[str]:
    """The user messages of conversation ``conversation``: the same script, a different opener."""
    if conversation >= len(NAMES) * len(CITIES):
        raise BenchError(f"only {len(NAMES) * len(CITIES)} distinct conversations are scripted")
    name, city = NAMES[conversation % len(NAMES)], CITIES[conversation // len(NAMES)]
    return [t.format(name=name, city=city) for t in USER_TURNS[:turns]]


@dataclass(frozen=True)
class Arm:
    name: str
    tier: str  # "edge" or "gpu"
    reuse: bool  # edge.prefix_reuse (the torch tier's prefix cache stays on)
    sessions: int  # concurrent conversations

    @property
    def label(self) -> str:
        if self.tier == "gpu":
            return "torch tier, 1 session"
        sessions = "1 session" if self.sessions == 1 else f"{self.sessions} sessions"
        return f"edge, reuse {'on' if self.reuse else 'off'}, {sessions}"


def all_arms(sessions: int) -> dict[str, Arm]:
    return {a.name: a for a in (
        Arm("edge-on-1", "edge", True, 1), Arm("edge-off-1", "edge", False, 1),
        Arm("edge-on-multi", "edge", True, sessions), Arm("edge-off-multi", "edge", False, sessions),
        Arm("gpu-1", "gpu", True, 1),
    )}


def arm_config(base: dict[str, Any], arm: Arm, slots: int) -> dict[str, Any]:
    """The base config with what this arm changes; limits raised so no turn is refused."""
    raw = copy.deepcopy(base)
    server = raw.setdefault("server", {})
    server["max_sessions_per_key"] = arm.sessions + 16  # all bench sessions share one key
    server["requests_per_minute"] = 1_000_000
    server["tokens_per_minute"] = 100_000_000
    raw.setdefault("routing", {})["default"] = arm.tier
    if arm.tier == "edge":
        edge = raw.setdefault("edge", {})
        edge["prefix_reuse"] = arm.reuse
        if arm.sessions > 1:
            edge["n_seq_max"] = slots
    else:
        engine = raw.setdefault("engine", {})
        if engine.get("device", "cpu") == "cpu":
            engine["dtype"] = cpu_dtype("auto")  # bf16 only where the CPU computes it natively
            engine["threads"] = GPU_THREADS
    return raw


def served_model(raw: dict[str, Any], arm: Arm) -> str:
    """The model id that names ``arm``'s tier in its config (validated as the gateway will)."""
    routing = parse_config(raw).routing
    return routing.edge_model if arm.tier == "edge" else routing.gpu_model


@dataclass
class TurnResult:
    arm: str
    conversation: int
    turn: int  # 1-based
    ttft_s: float
    total_s: float  # response.create sent -> response.done read
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    status: str
    reply: str


async def recv(conn: Any) -> Any:
    return await asyncio.wait_for(conn.recv(), EVENT_TIMEOUT_S)


async def read_until(conn: Any, event_type: str) -> Any:
    while True:
        ev = await recv(conn)
        if ev.type == event_type:
            return ev
        if ev.type == "error":
            raise BenchError(f"gateway error while waiting for {event_type}: {ev.error.code}: {ev.error.message}")


async def open_session(stack: AsyncExitStack, client: AsyncOpenAI, model: str) -> Any:
    async def opened() -> Any:
        conn = await stack.enter_async_context(client.realtime.connect(model=model))
        await read_until(conn, "session.created")
        return conn

    return await asyncio.wait_for(opened(), CONNECT_TIMEOUT_S)


async def turn(conn: Any, text: str, max_tokens: int) -> tuple[float, float, Any, str]:
    """One user message and one response: (ttft_s, total_s, response.done, reply text)."""
    await conn.conversation.item.create(
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
    await read_until(conn, "conversation.item.done")  # the item is in; time only the response
    sent = time.perf_counter()
    # temperature is our GA extension (greedy): both reuse arms then generate the same replies.
    await conn.response.create(response={"max_output_tokens": max_tokens, "temperature": 0})
    first = 0.0
    parts: list[str] = []
    while True:
        ev = await recv(conn)
        if ev.type == DELTA:
            first = first or time.perf_counter()
            parts.append(ev.delta)
        elif ev.type == DONE:
            done_at = time.perf_counter()
            if ev.response.status not in ("completed", "incomplete"):
                raise BenchError(f"response ended {ev.response.status!r}: {ev.response.status_details}")
            if not first:
                raise BenchError("response.done without any response.output_text.delta")
            return first - sent, done_at - sent, ev, "".join(parts)
        elif ev.type == "error":
            raise BenchError(f"gateway error event: {ev.error.code}: {ev.error.message}")


async def conversation(client: AsyncOpenAI, model: str, arm: Arm, index: int, turns: int, max_tokens: int
                       ) -> list[TurnResult]:
    results = []
    async with AsyncExitStack() as stack:
        conn = await open_session(stack, client, model)
        for number, text in enumerate(user_turns(index, turns), start=1):
            ttft, total, done, reply = await turn(conn, text, max_tokens)
            usage = done.response.usage
            if usage is None or usage.input_tokens is None:
                raise BenchError("response.done carries no usage.input_tokens")
            cached = usage.input_token_details.cached_tokens if usage.input_token_details else None
            results.append(TurnResult(arm.name, index, number, ttft, total, usage.input_tokens, cached or 0,
                                      usage.output_tokens or 0, done.response.status or "", reply))
    return results


async def run_arm(arm: Arm, base: dict[str, Any], args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    raw = arm_config(base, arm, args.slots)
    config_path = tmp / f"{arm.name}.toml"
    config_path.write_text(dump_toml(raw), encoding="utf-8")
    model = served_model(raw, arm)
    server = GatewayProcess(config_path, tmp / f"{arm.name}.log", HOST)
    rounds = math.ceil(args.repeats / arm.sessions)
    progress(f"{arm.name} ({arm.label}): starting the gateway on {server.url}")
    results: list[TurnResult] = []
    started = time.perf_counter()
    server.start()
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=BENCH_API_KEY, max_retries=0)
    try:
        await server.wait_ready()
        async with AsyncExitStack() as stack:
            conn = await open_session(stack, client, model)
            ttft, *_ = await turn(conn, WARMUP_TEXT, WARMUP_TOKENS)
        progress(f"{arm.name}: gateway ready after {time.perf_counter() - started:.1f} s; warm-up TTFT "
                 f"{ttft * 1e3:.0f} ms")
        cpu_before = server.cpu_s()
        measured = time.perf_counter()
        for r in range(rounds):
            batch = await asyncio.gather(*(
                conversation(client, model, arm, r * arm.sessions + s, args.turns, args.max_tokens)
                for s in range(arm.sessions)))
            for conv in batch:
                results += conv
            mine = [t for conv in batch for t in conv]
            last = [t.ttft_s for t in mine if t.turn == args.turns]
            progress(f"{arm.name}: round {r + 1}/{rounds}: {len(batch)} conversation(s), turn {args.turns} TTFT "
                     f"p50 {percentile(last, 50) * 1e3:.0f} ms, cached {sum(t.cached_tokens for t in mine)}/"
                     f"{sum(t.input_tokens for t in mine)} input tokens")
        wall_s, gateway_cpu_s = time.perf_counter() - measured, server.cpu_s() - cpu_before
    except BaseException:
        progress(f"{arm.name} failed; the gateway's log ends:\n{server.log_tail()}")
        raise
    finally:
        await client.close()
        exit_code = server.stop()
        problems = server.log_problems()
    for line in problems[:10]:
        progress(f"{arm.name} gateway log: {line}")
    return summarize(arm, raw, results, args.turns) | {
        "wall_s": wall_s, "gateway_cpu_s": gateway_cpu_s, "rounds": rounds,
        "server": {"exit_code": exit_code, "log_warnings_and_errors": problems},
    }


def summarize(arm: Arm, raw: dict[str, Any], results: list[TurnResult], turns: int) -> dict[str, Any]:
    by_turn = []
    for k in range(1, turns + 1):
        ts = [t for t in results if t.turn == k]
        ttft = [t.ttft_s for t in ts]
        by_turn.append({
            "turn": k, "n": len(ts), "ttft_p50_ms": percentile(ttft, 50) * 1e3,
            "ttft_p90_ms": percentile(ttft, 90) * 1e3, "ttft_max_ms": max(ttft) * 1e3,
            "input_tokens_p50": percentile([t.input_tokens for t in ts], 50),
            "cached_tokens_p50": percentile([t.cached_tokens for t in ts], 50),
            "input_tokens_sum": sum(t.input_tokens for t in ts), "cached_tokens_sum": sum(t.cached_tokens for t in ts),
            "output_tokens_p50": percentile([t.output_tokens for t in ts], 50),
        })
    inputs = sum(t.input_tokens for t in results)
    return {
        "label": arm.label, "tier": arm.tier, "model": parse_config(raw).routing.default_model,
        "prefix_reuse": arm.reuse, "sessions": arm.sessions,
        "conversations": len({t.conversation for t in results}), "config": raw,
        "ttft_last_over_first": by_turn[-1]["ttft_p50_ms"] / by_turn[0]["ttft_p50_ms"],
        "input_tokens": inputs, "cached_tokens": sum(t.cached_tokens for t in results),
        "cached_token_share": sum(t.cached_tokens for t in results) / inputs if inputs else math.nan,
        "by_turn": by_turn, "turns": [asdict(t) for t in results],
    }


def headline(arms: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    def ratio(name: str) -> float | None:
        return arms[name]["ttft_last_over_first"] if name in arms else None

    def speedup(off: str, on: str) -> float | None:
        if off not in arms or on not in arms:
            return None
        return arms[off]["by_turn"][-1]["ttft_p50_ms"] / arms[on]["by_turn"][-1]["ttft_p50_ms"]

    reuse_on = [arms[n] for n in ("edge-on-1", "edge-on-multi") if n in arms]
    inputs = sum(a["input_tokens"] for a in reuse_on)
    return {
        "ttft_turn8_over_turn1": ratio("edge-on-1"),
        "reuse_speedup_turn8": speedup("edge-off-1", "edge-on-1"),
        "cached_token_share": sum(a["cached_tokens"] for a in reuse_on) / inputs if inputs else None,
        "gpu_ttft_turn8_over_turn1": ratio("gpu-1"),
        "ttft_turn8_over_turn1_c8": ratio("edge-on-multi"),
        "reuse_speedup_turn8_c8": speedup("edge-off-multi", "edge-on-multi"),
    }


def same_replies(arms: dict[str, dict[str, Any]], a: str, b: str) -> dict[str, int] | None:
    """How many turns (same conversation, same turn) got the same reply with reuse on and off:
    greedy decoding over the same prompt, so reuse should change timing only."""
    if a not in arms or b not in arms:
        return None
    replies = {(t["conversation"], t["turn"]): t["reply"] for t in arms[b]["turns"]}
    pairs = [(t["reply"], replies.get((t["conversation"], t["turn"]))) for t in arms[a]["turns"]]
    return {"identical": sum(x == y for x, y in pairs), "turns": len(pairs)}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for arm in result["arms"].values():
        turns = [b["turn"] for b in arm["by_turn"]]
        label = arm["label"] + (f" / {result['setup']['slots']} slots" if arm["sessions"] > 1 else "")
        ax.plot(turns, [b["ttft_p50_ms"] for b in arm["by_turn"]], "o-" if arm["prefix_reuse"] else "s--",
                label=f"{label} ({arm['conversations']} conv.)")
    ax.set(title=f"TTFT by turn, {result['setup']['max_output_tokens']}-token replies ({result['cpu']['model']})",
           xlabel="turn", ylabel="TTFT p50 (ms)", yscale="log")
    ax.title.set_fontsize(9)
    for axis_ticks in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis_ticks(matplotlib.ticker.FormatStrFormatter("%g"))  # 300, not 3x10^2
    ax.set_xticks(range(1, result["setup"]["turns"] + 1))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for arm in result["arms"].values():
        first, last = arm["by_turn"][0], arm["by_turn"][-1]
        lines.append(f"{arm['label']:<32} TTFT p50 turn 1 {first['ttft_p50_ms']:7.0f} ms, turn {last['turn']} "
                     f"{last['ttft_p50_ms']:7.0f} ms (x{arm['ttft_last_over_first']:.2f}); cached "
                     f"{arm['cached_token_share']:.0%} of {arm['input_tokens']} input tokens; "
                     f"{arm['conversations']} conversations in {arm['wall_s']:.0f} s")
    h = result["headline"]
    for key, what in (("reuse_speedup_turn8", "1 session"), ("reuse_speedup_turn8_c8", "multi-session")):
        if h[key] is not None:
            lines.append(f"edge, {what}: last-turn TTFT p50 with reuse off / on = {h[key]:.2f}")
    for key, check in result["replies_identical_on_vs_off"].items():
        if check is not None:
            lines.append(f"{key}: {check['identical']}/{check['turns']} replies identical with reuse on and off")
    return lines


async def run(args: argparse.Namespace) -> dict[str, Any]:
    base = tomllib.loads(args.config.read_text(encoding="utf-8"))
    arms = all_arms(args.sessions)
    load_before = load_average()
    progress(f"load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}; arms {args.arms}")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="conversation-bench-") as tmp:
        for name in args.arms:
            results[name] = await run_arm(arms[name], base, args, Path(tmp))
    return {
        "headline": headline(results),
        "replies_identical_on_vs_off": {"1 session": same_replies(results, "edge-on-1", "edge-off-1"),
                                        "multi-session": same_replies(results, "edge-on-multi", "edge-off-multi")},
        "setup": {
            "command": "python bench/conversation.py " + " ".join(sys.argv[1:]), "turns": args.turns,
            "max_output_tokens": args.max_tokens, "repeats": args.repeats, "sessions": args.sessions,
            "slots": args.slots, "base_config": str(args.config), "user_turns": list(USER_TURNS[:args.turns]),
            "smoke": args.smoke,
            "load_before": load_before, "load_after": load_average(),
        },
        "arms": results,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="base config (default: %(default)s)")
    p.add_argument("--turns", type=int, default=len(USER_TURNS), help=f"user turns per conversation (2..{len(USER_TURNS)})")
    p.add_argument("--max-tokens", type=int, default=48, help="max_output_tokens of each reply")
    p.add_argument("--repeats", type=int, default=3,
                   help="conversations per arm (multi-session arms: rounds of --sessions, at least this many)")
    p.add_argument("--sessions", type=int, default=8, help="concurrent sessions of the multi-session arms")
    p.add_argument("--slots", type=int, default=4, help="edge n_seq_max of the multi-session arms")
    p.add_argument("--arms", default=",".join(all_arms(8)),
                   help="comma-separated subset of: %(default)s")
    p.add_argument("--out", type=Path, help="results (default: bench/out/conversation.json)")
    p.add_argument("--plot", help="figure path ('' for none; default: docs/img/conversation_ttft.png)")
    p.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {SMOKE}")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    args.out = args.out or result_path("conversation.json", args.smoke)
    args.plot = str(figure_path("conversation_ttft.png", args.smoke)) if args.plot is None else args.plot
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in args.arms if a not in all_arms(args.sessions)]
    if unknown or not args.arms:
        p.error(f"--arms: unknown {unknown}; choose from {','.join(all_arms(args.sessions))}")
    if not 2 <= args.turns <= len(USER_TURNS):
        p.error(f"--turns must be in 2..{len(USER_TURNS)}")
    if args.max_tokens < 1 or args.repeats < 1 or args.sessions < 2 or not 1 <= args.slots <= 64:
        p.error("--max-tokens >= 1, --repeats >= 1, --sessions >= 2 and --slots in 1..64 are required")
    if math.ceil(args.repeats / args.sessions) * args.sessions > len(NAMES) * len(CITIES):
        p.error(f"at most {len(NAMES) * len(CITIES)} conversations per arm are scripted")
    if not args.config.is_file():
        p.error(f"--config {args.config} not found")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = uvloop.run(run(args))
    result["cpu"] = cpu_facts()
    write_json(args.out, result)
    if args.plot:
        plot(result, Path(args.plot))
    for line in summary_lines(result):
        print(line)
    figures = {k: None if v is None else round(v, 4) for k, v in result["headline"].items()}
    print(json.dumps({**figures, "cpu": result["cpu"]["model"]}))
    progress(f"wrote {args.out.relative_to(REPO_ROOT) if args.out.is_relative_to(REPO_ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
