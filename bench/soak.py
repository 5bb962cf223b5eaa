"""Soaks of one gateway process (issue 14, issue 26): does memory stay flat over thousands of turns?

Two arms, one after the other, each against its own ``python -m gateway serve`` subprocess:

- ``synthetic``: the synthetic edge backend (20 tokens/s per stream, see bench/load.py) and
  1,000 Realtime sessions open for the whole run (``--seconds``, 9 minutes): the gateway's own
  memory, thousands of sessions at once.
- ``real``: the shipped default config, the cascade over the real SmolLM2-135M tiers on this
  CPU (``--real-sessions`` 16 sessions for ``--real-seconds``, 7 minutes, short pauses): the
  product's own path under sustained load; RSS is the gateway's plus its engine core's.

Each session loops: one turn in its conversation (a user item, then a response of a few dozen
tokens), both items deleted again (a client keeping a window of its conversation, so that a
session's state does not grow by design), a pause; now and then a cancel mid-stream, a
truncate, or a session closed and opened again, so that every path that allocates runs many
times. RSS is sampled throughout; the growth is the RSS at the end over the RSS after the
warm-up, minus one (goal: within 5%). The warm-up is the first minute (a quarter of a short run)
and, in the real arm, until the edge's host copies of idle conversations have filled their
bounded store (``[edge] snapshot_mib``, about 2 minutes here): a cache that fills to its bound is
capacity, not a leak. The real arm runs 7 minutes, so that at least 5 are measured; its result
also says when the store filled and the growth from the first minute. A turn
that does not end with ``response.done`` is hung (goal 0); a turn that ends ``failed`` or a
session that breaks counts as failed (goal 0); the KV still held once every session has
closed is read from ``/metrics`` (goal 0).

Progress on stderr, a summary, and as the last line one JSON object with ``soak_rss_growth``,
``soak_turns``, ``soak_hung``, ``soak_leaked_kv`` (the synthetic arm), ``soak_real_rss_growth``,
``soak_real_turns``, ``soak_real_failed``, ``soak_real_leaked_kv`` (the real arm),
``python_ref_ms`` and ``cpu``. Results in bench/out/soak.json.

Run: ``.venv/bin/python bench/soak.py`` (about 17 minutes; ``--arms real`` alone about 8).
``--smoke``: a few sessions for seconds each (the figures mean nothing; results in
bench/out/smoke/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import uvloop
import websockets

from bench._common import SMOKE_HELP, cpu_facts, progress, raise_nofile_limit, result_path, write_json
from bench._faults_ws import derive_config
from bench._gateway_server import GatewayProcess
from bench._load_setup import synthetic_config
from gateway.config import DEFAULT_CONFIG

EVENT_TIMEOUT_S = 60.0
REAL_EVENT_TIMEOUT_S = 300.0  # real models on a busy 2-core host: a turn may wait behind others
WARMUP_S = 60.0
FULL_SHARE = 0.9  # the snapshot store counts as full at this share of its budget
PAUSE_S = (5.0, 15.0)  # a client's pause between turns (and the spread of the sessions' first turns)
REAL_PAUSE_S = (0.2, 1.0)  # the real arm keeps its 16 sessions busy
SYNTHETIC_TOKENS = 20
REAL_TOKENS = 32
ARMS = ("synthetic", "real")
SMOKE = {"sessions": 20, "seconds": 6.0, "pause_s": (0.1, 0.5), "real_sessions": 2, "real_seconds": 8.0}
# KV a tier still holds once every session has closed: the torch tier's blocks, the edge's cells
# of running work and those kept for conversations' next turns (every conversation has ended)
# (the edge's kv_cells_used is exported as engine_kv_blocks_in_use{tier="edge"}), and the drafter's
REAL_KV_METRICS = ('engine_kv_blocks_in_use{tier="gpu"}', 'engine_kv_blocks_in_use{tier="edge"}',
                   'engine_kv_cells_cached{tier="edge"}', 'engine_drafter_kv_cells_used{tier="gpu"}')


async def recv_until(ws: Any, kind: str, timeout: float = EVENT_TIMEOUT_S) -> dict[str, Any]:
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        if event["type"] == kind:
            return event


async def session_loop(url: str, deadline: float, rng: random.Random, counts: Counter[str],
                       pause_s: tuple[float, float], tokens: int = SYNTHETIC_TOKENS,
                       timeout: float = EVENT_TIMEOUT_S) -> None:
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
            await ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": tokens}}))
            try:
                if action == "cancel":
                    await recv_until(ws, "response.output_text.delta", timeout)
                    await ws.send(json.dumps({"type": "response.cancel"}))
                done = await recv_until(ws, "response.done", timeout)
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


def tree_rss(server: GatewayProcess) -> tuple[float, float]:
    """MiB resident in the gateway and every process it started (the engine core), and in the
    gateway alone."""
    process = server.process
    own = process.memory_info().rss
    return (own + sum(p.memory_info().rss for p in process.children(recursive=True))) / 2**20, own / 2**20


async def soak(server: GatewayProcess, sessions: int, seconds: float, pause_s: tuple[float, float], seed: int,
               tokens: int, timeout: float, kv_metrics: tuple[str, ...], name: str) -> dict[str, Any]:
    """``sessions`` looping sessions for ``seconds`` against a started gateway."""
    await server.wait_ready()
    url = f"ws://127.0.0.1:{server.port}/v1/realtime"
    start = time.monotonic()
    deadline = start + seconds
    counts: Counter[str] = Counter()
    rng = random.Random(seed)
    tasks = [asyncio.create_task(session_loop(url, deadline, random.Random(rng.random()), counts, pause_s, tokens,
                                              timeout))
             for _ in range(sessions)]
    samples: list[tuple[float, float]] = []
    gateway_rss: list[tuple[float, float]] = []
    snapshots: list[tuple[float, float]] = []  # the edge's host copies of idle conversations (bounded)
    real = kv_metrics is REAL_KV_METRICS
    budget_mib = server.metric('engine_snapshot_budget_bytes{tier="edge"}') / 2**20 if real else 0.0
    full_at: float | None = None  # when the edge's bounded snapshot store first reached FULL_SHARE of its budget
    while not all(t.done() for t in tasks):
        total, own = tree_rss(server)
        samples.append((time.monotonic() - start, total))
        gateway_rss.append((samples[-1][0], own))
        if real and len(samples) % 10 == 0:
            snapshot_mib = server.metric('engine_snapshot_bytes{tier="edge"}') / 2**20
            snapshots.append((samples[-1][0], snapshot_mib))
            if full_at is None and budget_mib > 0 and snapshot_mib >= FULL_SHARE * budget_mib:
                full_at = samples[-1][0]
        if len(samples) % 60 == 0:
            snapshot_mib = snapshots[-1][1] if snapshots else 0.0
            progress(f"{name} {samples[-1][0]:.0f} s: RSS {total:.0f} MiB (gateway {own:.0f}), {counts['turns']} turns, "
                     f"{counts['hung']} hung, {counts['failed']} failed"
                     + (f", edge snapshots {snapshot_mib:.0f} MiB" if kv_metrics is REAL_KV_METRICS else ""))
        await asyncio.sleep(1.0)
    errors = [t.exception() for t in tasks if t.exception() is not None]
    # The baseline: RSS once warm (the first minute), and for the real arm once the edge's bounded
    # snapshot store is full too, since its filling is capacity by design, not growth; if it never
    # fills, from the first minute (its filling then counts as growth).
    warmup_s = min(WARMUP_S, seconds / 4)
    first_minute = ([rss for t, rss in samples if t >= warmup_s] or [samples[-1][1]])[0]
    warmup_s = max(warmup_s, full_at or 0.0)
    warm = [rss for t, rss in samples if t >= warmup_s] or [samples[-1][1]]
    baseline, end = warm[0], samples[-1][1]
    await asyncio.sleep(2.0)
    leaked = sum(server.metric(metric) for metric in kv_metrics)
    return {"sessions": sessions, "seconds": seconds, "pause_s": pause_s, "tokens": tokens, "counts": dict(counts),
            "session_errors": [repr(e) for e in errors[:10]], "session_error_count": len(errors),
            "rss_samples": samples, "gateway_rss_samples": gateway_rss, "edge_snapshot_mib": snapshots,
            "warmup_s": warmup_s, "snapshot_store_full_s": full_at, "snapshot_budget_mib": budget_mib,
            "measured_s": samples[-1][0] - warmup_s, "rss_growth_from_first_minute": end / first_minute - 1.0,
            "rss_after_warmup_mib": baseline, "rss_end_mib": end,
            "rss_peak_mib": max(r for _, r in samples), "rss_growth": end / baseline - 1.0,
            "turns": counts["turns"], "hung": counts["hung"], "failed": counts["failed"] + len(errors),
            "leaked_kv": leaked}


async def run_arm(args: argparse.Namespace, arm: str, directory: Path) -> dict[str, Any]:
    if arm == "synthetic":
        config = synthetic_config(directory, "soak", max_streams=20_000)
    else:
        config = derive_config(DEFAULT_CONFIG, directory, "soak-real", {"server": {"idle_timeout_s": 3600.0}})
    server = GatewayProcess(config, directory / f"soak-{arm}.log", "127.0.0.1")
    server.start()
    try:
        if arm == "synthetic":
            return await soak(server, args.sessions, args.seconds, args.pause_s, args.seed, SYNTHETIC_TOKENS,
                              EVENT_TIMEOUT_S, ('engine_kv_blocks_in_use{tier="edge"}',), arm)
        return await soak(server, args.real_sessions, args.real_seconds, REAL_PAUSE_S if not args.smoke else (0.1, 0.3),
                          args.seed, REAL_TOKENS, REAL_EVENT_TIMEOUT_S, REAL_KV_METRICS, arm)
    finally:
        server.stop()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    raise_nofile_limit(4 * args.sessions + 1000)
    arms = {}
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        for arm in args.arms:
            progress(f"{arm}: starting")
            arms[arm] = await run_arm(args, arm, Path(tmp))
    return {"arms": arms, "smoke": args.smoke}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--sessions", type=int, default=1000, help="synthetic arm: sessions open at once")
    parser.add_argument("--seconds", type=float, default=540.0, help="synthetic arm: duration")
    parser.add_argument("--real-sessions", type=int, default=16, help="real arm: sessions (each one turn at a time)")
    parser.add_argument("--real-seconds", type=float, default=420.0,
                        help="real arm: duration (the snapshot store fills in about 2 minutes; 5 measured after)")
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
    figures: dict[str, Any] = dict.fromkeys(("soak_rss_growth", "soak_turns", "soak_hung", "soak_leaked_kv",
                                             "soak_real_rss_growth", "soak_real_turns", "soak_real_failed",
                                             "soak_real_leaked_kv"))
    for arm, r in result["arms"].items():
        print(f"{arm}: {r['sessions']} sessions for {r['seconds']:.0f} s: {r['turns']} turns ({r['counts']}), "
              f"{r['hung']} hung, {r['failed']} failed; RSS {r['rss_after_warmup_mib']:.0f} MiB after warm-up -> "
              f"{r['rss_end_mib']:.0f} MiB at the end (peak {r['rss_peak_mib']:.0f}): {r['rss_growth'] * 100:+.1f}%; "
              f"KV held after: {r['leaked_kv']:.0f}")
        prefix = "soak" if arm == "synthetic" else "soak_real"
        figures[f"{prefix}_rss_growth"] = round(r["rss_growth"], 4)
        figures[f"{prefix}_turns"] = r["turns"]
        figures[f"{prefix}_leaked_kv"] = r["leaked_kv"]
        if arm == "synthetic":
            figures["soak_hung"] = r["hung"]
        else:
            figures["soak_real_failed"] = r["failed"] + r["hung"]
    print(json.dumps({**figures, "cpu": result["cpu"]["model"], "python_ref_ms": result["cpu"]["python_ref_ms"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
