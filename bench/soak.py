"""A 10-minute soak of one gateway process (issue 14): does memory stay flat over thousands of turns?

A ``python -m gateway serve`` subprocess with the synthetic edge backend (20 tokens/s per stream,
see bench/load.py) and 1,000 Realtime sessions open for the whole run. Each session loops: one
turn in its conversation (a user item, then a 20-token response), both items deleted again (a
client keeping a window of its conversation, so that a session's state does not grow by design),
a pause of 5 to 15 s; now and then a cancel mid-stream, a truncate, or a session closed and opened
again, so that every path that allocates runs many times. The server's RSS is sampled throughout;
``soak_rss_growth`` is the RSS at the end over the RSS after the first minute (the warm-up), minus
one (goal: within 5%). Turns that did not end with ``response.done`` are counted as hung
(goal 0), and the KV cells still in use once every session has closed are read from ``/metrics``.

Progress on stderr, a summary, and as the last line one JSON object with ``soak_rss_growth``,
``soak_turns``, ``soak_hung``, ``soak_leaked_kv`` and ``cpu``. Results in bench/out/soak.json.

Run: ``.venv/bin/python bench/soak.py`` (10 minutes; ``--seconds`` shortens it). ``--smoke``: 20
sessions for 6 s with pauses of 0.1 to 0.5 s (the figures mean nothing; results in bench/out/smoke/).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this folder leads sys.path and bench/gateway.py would shadow the `gateway` package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from typing import Any  # noqa: E402

import uvloop  # noqa: E402
import websockets  # noqa: E402

from bench._common import SMOKE_HELP, cpu_facts, progress, raise_nofile_limit, result_path, write_json  # noqa: E402
from bench._gateway_server import GatewayProcess  # noqa: E402
from bench.load import synthetic_config  # noqa: E402

EVENT_TIMEOUT_S = 60.0
WARMUP_S = 60.0
PAUSE_S = (5.0, 15.0)  # a client's pause between turns (and the spread of the sessions' first turns)
SMOKE = {"sessions": 20, "seconds": 6.0, "pause_s": (0.1, 0.5)}


async def recv_until(ws: Any, kind: str) -> dict[str, Any]:
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), EVENT_TIMEOUT_S))
        if event["type"] == kind:
            return event


async def session_loop(url: str, deadline: float, rng: random.Random, counts: Counter[str],
                       pause_s: tuple[float, float]) -> None:
    ws = await websockets.connect(url, max_size=None, open_timeout=EVENT_TIMEOUT_S, ping_interval=None)
    await recv_until(ws, "session.created")
    await asyncio.sleep(rng.uniform(0, pause_s[1]))  # spread the sessions' turns over time
    try:
        while time.monotonic() < deadline:
            action = rng.choices(["turn", "cancel", "truncate", "reopen"], [84, 8, 5, 3])[0]
            if action == "reopen":
                await ws.close()
                ws = await websockets.connect(url, max_size=None, open_timeout=EVENT_TIMEOUT_S, ping_interval=None)
                await recv_until(ws, "session.created")
                counts["reopened"] += 1
                continue
            user_id = f"u{counts['turns']}_{rng.randrange(1 << 30)}"
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "id": user_id, "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "Tell me more."}]}}))
            await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 20}}))
            try:
                if action == "cancel":
                    await recv_until(ws, "response.output_text.delta")
                    await ws.send(json.dumps({"type": "response.cancel"}))
                done = await recv_until(ws, "response.done")
            except TimeoutError:
                counts["hung"] += 1
                continue
            counts["turns"] += 1
            counts[done["response"]["status"]] += 1
            output = done["response"].get("output") or []
            if action == "truncate" and output:
                await ws.send(json.dumps({"type": "conversation.item.truncate", "item_id": output[0]["id"],
                                          "content_index": 0, "audio_end_ms": 0, "x_text_end": 3}))
            # A client keeps a window of its conversation: it deletes what falls out of it (one turn
            # here), so a session's state stays the same size and growth would be a leak.
            if output:
                await ws.send(json.dumps({"type": "conversation.item.delete", "item_id": output[0]["id"]}))
            await ws.send(json.dumps({"type": "conversation.item.delete", "item_id": user_id}))
            await asyncio.sleep(rng.uniform(*pause_s))
    finally:
        await ws.close()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    raise_nofile_limit(4 * args.sessions + 1000)
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        directory = Path(tmp)
        server = GatewayProcess(synthetic_config(directory, "soak", max_streams=20_000), directory / "soak.log",
                                "127.0.0.1")
        server.start()
        try:
            await server.wait_ready()
            url = f"ws://127.0.0.1:{server.port}/v1/realtime"
            start = time.monotonic()
            deadline = start + args.seconds
            counts: Counter[str] = Counter()
            rng = random.Random(args.seed)
            tasks = [asyncio.create_task(session_loop(url, deadline, random.Random(rng.random()), counts,
                                                      args.pause_s))
                     for _ in range(args.sessions)]
            samples: list[tuple[float, float]] = []
            while not all(t.done() for t in tasks):
                samples.append((time.monotonic() - start, server.rss() / 2**20))
                if len(samples) % 60 == 0:
                    progress(f"soak {samples[-1][0]:.0f} s: RSS {samples[-1][1]:.0f} MiB, {counts['turns']} turns, "
                             f"{counts['hung']} hung")
                await asyncio.sleep(1.0)
            errors = [t.exception() for t in tasks if t.exception() is not None]
            warm = [rss for t, rss in samples if t >= min(WARMUP_S, args.seconds / 4)]
            baseline, end = warm[0], samples[-1][1]
            await asyncio.sleep(2.0)
            leaked = server.metric('engine_kv_blocks_in_use{tier="edge"}')
        finally:
            server.stop()
    return {"sessions": args.sessions, "seconds": args.seconds, "pause_s": args.pause_s, "smoke": args.smoke,
            "counts": dict(counts),
            "session_errors": [repr(e) for e in errors[:10]], "rss_samples": samples,
            "rss_after_warmup_mib": baseline, "rss_end_mib": end, "rss_peak_mib": max(r for _, r in samples),
            "soak_rss_growth": end / baseline - 1.0, "soak_turns": counts["turns"], "soak_hung": counts["hung"],
            "soak_leaked_kv": leaked}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, help="results (default: bench/out/soak.json)")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {SMOKE}")
    args = parser.parse_args(argv)
    args.pause_s = PAUSE_S
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    args.out = args.out or result_path("soak.json", args.smoke)
    result = uvloop.run(run(args))
    result["cpu"] = cpu_facts()
    write_json(args.out, result)
    print(f"{result['sessions']} sessions for {result['seconds']:.0f} s: {result['soak_turns']} turns "
          f"({result['counts']}), {result['soak_hung']} hung, {len(result['session_errors'])} session errors")
    print(f"RSS {result['rss_after_warmup_mib']:.0f} MiB after warm-up -> {result['rss_end_mib']:.0f} MiB at the end "
          f"(peak {result['rss_peak_mib']:.0f}): {result['soak_rss_growth'] * 100:+.1f}%; KV cells in use after: "
          f"{result['soak_leaked_kv']:.0f}")
    figures = {k: result[k] for k in ("soak_rss_growth", "soak_turns", "soak_hung", "soak_leaked_kv")}
    print(json.dumps({**{k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()},
                      "cpu": result["cpu"]["model"],
                      "python_ref_ms": result["cpu"]["python_ref_ms"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
