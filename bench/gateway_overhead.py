"""What the WebSocket gateway costs over the engine it serves (issue 4).

One run measures, against a real ``python -m gateway serve`` subprocess on a loopback port that
serves the llama.cpp edge tier alone (``[routing] default = "edge"``; clients name its model id,
``routing.edge_model``):

- throughput: tokens/s received by N WebSocket clients (one response each, all at once) over
  tokens/s of the same engine class, built from the same config by the same function and
  consumed in-process with the same prompts, greedy, so both generate the same tokens; every
  response ignores the end-of-sequence token (``x_ignore_eos``, our extension of
  ``response.create``; ``ignore_eos`` in-process), so each is exactly ``--max-tokens`` long. The arms
  are interleaved (in-process, SDK, raw websockets, then the reverse order, ...) and the ratio
  is taken between medians, since a shared 2-core machine drifts;
- added inter-token latency: p50/p99 of the gaps between deltas on the WebSocket minus those
  between tokens in-process;
- cancel latency: from sending ``response.cancel`` to reading ``response.done``, for responses
  cancelled at random points while other sessions keep the engine busy (the responses ignore the
  end-of-sequence token, so every one is still running at its cancel point);
- idle sessions: the server's RSS growth with 1,000 sessions open that send nothing.

Progress goes to stderr; stdout gets a summary, then as its last line one JSON object with
``ws_vs_inprocess``, ``added_itl_p50_ms``, ``added_itl_p99_ms``, ``cancel_p99_ms``,
``idle_sessions_per_gib`` and ``cpu``. Everything is written to bench/out/gateway.json and a figure
to docs/img/gateway_overhead.png.

Run: ``.venv/bin/python bench/gateway_overhead.py`` (about 5 minutes on a quiet 2-core machine);
``--smoke``: 4 streams, 200 idle sessions, a few cancels (results in bench/out/smoke/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import uvloop

from bench._common import (
    REPO_ROOT,
    SMOKE_HELP,
    cpu_facts,
    figure_path,
    load_average,
    machine_busy_s,
    percentile,
    progress,
    raise_nofile_limit,
    result_path,
    write_json,
)
from bench._gateway_clients import (
    DELTA,
    DONE,
    BenchError,
    ClientKind,
    Clients,
    RealtimeClient,
    Round,
    WsClient,
    close_all,
    inprocess_turn,
    prompts,
    response_create,
    wait_for,
    ws_turn,
)
from bench._gateway_report import plot, summarize_throughput, summary_lines
from bench._gateway_server import GatewayProcess, derive_config
from gateway.config import DEFAULT_CONFIG, load_config
from gateway.tiers.build import build_edge_engine
from llm_shared.contract import Engine

HOST = "127.0.0.1"
IDLE_CONNECT_CONCURRENCY = 64  # handshakes in flight while opening the idle sessions
WARMUP_TOKENS = 8
GIB = 1 << 30
# --smoke: every phase on a handful of sessions (200 idle ones: fewer would not grow the RSS
# above its noise, and the phase refuses a run whose RSS did not grow).
SMOKE = {"clients": 4, "max_tokens": 16, "rounds": 2, "cancels": 4, "cancel_sessions": 2, "cancel_max_cut": 4,
         "cancel_max_tokens": 16, "idle_sessions": 200}


class CpuMeter:
    """CPU seconds used by this process, the gateway and everything else since it was made.
    On a shared 2-core machine, a round where other processes ran is a disturbed round."""

    def __init__(self, server: GatewayProcess) -> None:
        self._me = psutil.Process()
        self._server = server
        self._start = self._read()

    def _read(self) -> tuple[float, float, float]:
        times = self._me.cpu_times()
        return times.user + times.system, self._server.cpu_s(), machine_busy_s()

    def split(self) -> tuple[float, float, float]:
        me, server, machine = (b - a for a, b in zip(self._start, self._read(), strict=True))
        return me, server, max(0.0, machine - me - server)


async def inprocess_round(engine: Engine, texts: list[str], max_tokens: int, index: int,
                          server: GatewayProcess) -> Round:
    cpu = CpuMeter(server)
    start = time.perf_counter()
    turns = await asyncio.gather(*(inprocess_turn(engine, p, max_tokens, f"bench-{index}-{i}")
                                   for i, p in enumerate(texts)))
    seconds = max(t.done_at for t in turns) - start
    return Round("inprocess", index, seconds, list(turns), *cpu.split())


async def ws_round(clients: Clients, kind: ClientKind, texts: list[str], max_tokens: int, index: int,
                   server: GatewayProcess) -> Round:
    opened = await clients.open_many(kind, len(texts))
    try:
        cpu = CpuMeter(server)
        start = time.perf_counter()
        turns = await asyncio.gather(*(ws_turn(c, p, max_tokens) for c, p in zip(opened, texts, strict=True)))
        seconds = max(t.done_at for t in turns) - start
        return Round(kind, index, seconds, list(turns), *cpu.split())
    finally:
        await close_all(opened)


async def throughput(engine: Engine, clients: Clients, server: GatewayProcess, args: argparse.Namespace
                     ) -> list[Round]:
    texts = prompts(args.clients)
    progress(f"warm-up: {args.clients} streams of {WARMUP_TOKENS} tokens per arm")
    await inprocess_round(engine, texts, WARMUP_TOKENS, -1, server)
    for kind in ("sdk", "websockets"):
        await ws_round(clients, kind, texts, WARMUP_TOKENS, -1, server)
    rounds: list[Round] = []
    arms = ["inprocess", "sdk", "websockets"]
    for index in range(args.rounds):
        # Alternate the order (A B C, C B A, ...) so a drifting machine favours no arm.
        for arm in arms if index % 2 == 0 else arms[::-1]:
            if arm == "inprocess":
                r = await inprocess_round(engine, texts, args.max_tokens, index, server)
            else:
                r = await ws_round(clients, arm, texts, args.max_tokens, index, server)
            rounds.append(r)
            progress(f"round {index + 1}/{args.rounds} {arm:>10}: {r.tokens} tokens in {r.seconds:.2f} s = "
                     f"{r.tok_s:.1f} tok/s (cpu s: bench {r.client_cpu_s:.1f}, gateway {r.server_cpu_s:.1f}, "
                     f"other processes {r.other_cpu_s:.1f})")
    return rounds


async def cancel_session(client: RealtimeClient, texts: list[str], rng: random.Random, count: int,
                         max_cut: int, max_tokens: int) -> dict[str, Any]:
    """``count`` responses on one session, each cancelled after a random number of deltas."""
    latencies: list[float] = []
    cuts: list[int] = []
    early = raced = 0
    while len(latencies) < count:
        if early + raced > 2 * count:
            raise BenchError(f"{early} responses ended before their cancel point and {raced} raced it")
        cut = rng.randint(1, max_cut)
        await client.send(response_create(rng.choice(texts), max_tokens))
        deltas, cancelled_at = 0, 0.0
        while True:
            ev = await client.recv()
            if ev.type == DELTA and not cancelled_at:
                deltas += 1
                if deltas == cut:
                    cancelled_at = time.perf_counter()
                    await client.send({"type": "response.cancel"})
            elif ev.type == DONE:
                break
            elif ev.type == "error":
                raise BenchError(f"gateway error during the cancel phase: {ev.error_code}: {ev.error_message}")
        if not cancelled_at:
            early += 1
        elif ev.status == "cancelled":
            latencies.append(ev.at - cancelled_at)
            cuts.append(cut)
        else:  # finished just before our cancel arrived: the gateway answers it with an error
            raced += 1
            late = await client.recv()
            if late.type != "error" or late.error_code != "response_cancel_not_active":
                raise BenchError(f"after a raced cancel expected response_cancel_not_active, got {late}")
    return {"latencies": latencies, "cuts": cuts, "early": early, "raced": raced}


async def cancels(clients: Clients, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    sessions = max(1, min(args.cancel_sessions, args.cancels))
    counts = [args.cancels // sessions + (1 if i < args.cancels % sessions else 0) for i in range(sessions)]
    texts = prompts(args.clients)
    progress(f"cancel: {args.cancels} responses on {sessions} concurrent sessions, each cancelled after "
             f"1..{args.cancel_max_cut} deltas")
    opened = await clients.open_many(args.client, sessions)
    try:
        results = await asyncio.gather(*(
            cancel_session(c, texts, random.Random(rng.random()), n, args.cancel_max_cut, args.cancel_max_tokens)
            for c, n in zip(opened, counts, strict=True)))
    finally:
        await close_all(opened)
    latencies = [x for r in results for x in r["latencies"]]
    summary = {
        "client": args.client, "sessions": sessions, "count": len(latencies),
        "max_cut_deltas": args.cancel_max_cut, "max_output_tokens": args.cancel_max_tokens,
        "p50_ms": percentile(latencies, 50) * 1e3, "p99_ms": percentile(latencies, 99) * 1e3,
        "max_ms": max(latencies) * 1e3,
        "ended_before_cut": sum(r["early"] for r in results), "raced": sum(r["raced"] for r in results),
        "latencies_ms": [round(x * 1e3, 3) for x in latencies],
    }
    progress(f"cancel: p50 {summary['p50_ms']:.1f} ms, p99 {summary['p99_ms']:.1f} ms, "
             f"max {summary['max_ms']:.1f} ms ({summary['ended_before_cut']} ended before their cut, "
             f"{summary['raced']} raced)")
    return summary


async def idle_sessions(clients: Clients, server: GatewayProcess, n: int) -> dict[str, Any]:
    """Open ``n`` raw websockets sessions (the library's default options, which offer
    permessage-deflate) that send nothing; the gateway's RSS growth per session."""
    gate = asyncio.Semaphore(IDLE_CONNECT_CONCURRENCY)

    async def open_one() -> WsClient:
        async with gate:
            client = await WsClient.open(clients.ws_url, clients.model, compression="deflate")
            await wait_for(client, "session.created")
            return client

    # One session with one response first, so that one-time costs (lazy imports, first
    # allocations of the session code) are in the baseline rather than in the slope.
    warm = await clients.open("websockets")
    await ws_turn(warm, prompts(1)[0], WARMUP_TOKENS)
    await warm.close()
    base = await server.settled_rss()
    progress(f"idle: server RSS {base / 2**20:.1f} MiB with no session open")
    opened: list[WsClient] = []
    checkpoints = []
    try:
        for target in (n // 4, n // 2, 3 * n // 4, n):
            batch = await asyncio.gather(*(open_one() for _ in range(target - len(opened))), return_exceptions=True)
            opened += [c for c in batch if isinstance(c, WsClient)]
            failures = [c for c in batch if not isinstance(c, WsClient)]
            if failures:
                raise BenchError(f"{len(failures)} idle sessions failed to open, e.g. {failures[0]!r}")
            rss = await server.settled_rss()
            active = await asyncio.to_thread(server.metric, "gateway_sessions_active")
            checkpoints.append({"sessions": target, "rss_bytes": rss, "server_sessions_active": active,
                                "bytes_per_session": (rss - base) / target})
            progress(f"idle: {target} sessions open (server counts {active:g}), RSS +{(rss - base) / 2**20:.1f} MiB"
                     f" = {(rss - base) / target / 1024:.1f} KiB per session")
        extensions = opened[0].negotiated_extensions or "none"
    finally:
        await close_all(opened)
    after = await server.settled_rss()
    per_session = checkpoints[-1]["bytes_per_session"]
    if any(c["server_sessions_active"] != c["sessions"] for c in checkpoints):
        raise BenchError(f"the gateway did not count the sessions opened: {checkpoints}")
    if per_session <= 0:
        raise BenchError(f"the gateway's RSS did not grow with {n} sessions open: {checkpoints}")
    half, full = checkpoints[-3], checkpoints[-1]
    marginal = (full["rss_bytes"] - half["rss_bytes"]) / (full["sessions"] - half["sessions"])
    progress(f"idle: closed; server RSS {after / 2**20:.1f} MiB")
    return {
        "sessions": n, "client": "websockets (default options: offers permessage-deflate)",
        "negotiated_extensions": extensions, "rss_before_bytes": base, "checkpoints": checkpoints,
        "rss_after_close_bytes": after, "bytes_per_session": per_session,
        "marginal_bytes_per_session_second_half": marginal, "sessions_per_gib": GIB / per_session,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    nofile = raise_nofile_limit(args.idle_sessions + 4 * args.clients + 512)
    if nofile < args.idle_sessions + 256:
        raise BenchError(f"RLIMIT_NOFILE is {nofile}: too low for {args.idle_sessions} sessions (raise ulimit -n)")
    load_before = load_average()
    progress(f"load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}; open files limit {nofile}")
    with tempfile.TemporaryDirectory(prefix="gateway-bench-") as tmp:
        config_path = derive_config(args.config, Path(tmp), args.clients, args.idle_sessions)
        config = load_config(config_path)
        server = GatewayProcess(config_path, Path(tmp) / "gateway.log", HOST)
        progress(f"starting the gateway on {server.url} (edge n_seq_max={config.edge.n_seq_max}, "
                 f"kv_cache_mib={config.edge.kv_cache_mib:g})")
        server.start()
        loading = asyncio.create_task(asyncio.to_thread(build_edge_engine, config))  # meanwhile, in this process
        engine: Engine | None = None
        try:
            await server.wait_ready()
            engine = await loading
            progress(f"gateway ready (RSS {server.rss() / 2**20:.0f} MiB); in-process engine loaded")
            clients = Clients(server.url, config.routing.edge_model)
            try:
                # Idle sessions first, on a fresh heap: memory freed by earlier phases would be
                # reused by new sessions without growing the RSS, hiding their cost.
                idle = await idle_sessions(clients, server, args.idle_sessions)
                rounds = await throughput(engine, clients, server, args)
                await engine.close()
                engine = None
                rss_after_throughput = server.rss()
                cancel = await cancels(clients, args)
            finally:
                await clients.openai.close()
        finally:
            if engine is None and not loading.done():
                loading.cancel()
            if engine is not None:
                await engine.close()
            exit_code = server.stop()
            log_problems = server.log_problems()
        for line in log_problems[:20]:
            progress(f"gateway log: {line}")
    tp = summarize_throughput(rounds, args.client)
    return {
        "ws_vs_inprocess": tp["ratio_vs_inprocess"][args.client],
        "added_itl_p50_ms": tp["added_itl_ms"][args.client]["p50"],
        "added_itl_p99_ms": tp["added_itl_ms"][args.client]["p99"],
        "cancel_p99_ms": cancel["p99_ms"],
        "idle_sessions_per_gib": idle["sessions_per_gib"],
        "setup": {
            "command": "python bench/gateway_overhead.py " + " ".join(sys.argv[1:]), "clients": args.clients,
            "max_output_tokens": args.max_tokens, "rounds": args.rounds, "base_config": str(args.config),
            "model": config.routing.edge_model, "ignore_eos": True, "smoke": args.smoke,
            "edge": {"backend": config.edge.backend, "n_seq_max": config.edge.n_seq_max, "kv_cache_mib": config.edge.kv_cache_mib},
            "cpus": os.cpu_count(), "load_before": load_before, "load_after": load_average(),
        },
        "throughput": tp,
        "cancel": cancel,
        "idle": idle,
        "server": {"rss_after_throughput_bytes": rss_after_throughput, "exit_code": exit_code,
                   "log_warnings_and_errors": log_problems},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="base config (default: %(default)s)")
    p.add_argument("--clients", type=int, default=32, help="concurrent streams per throughput round")
    p.add_argument("--max-tokens", type=int, default=128, help="max_output_tokens of each throughput response")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each arm, interleaved (>= 2)")
    p.add_argument("--client", choices=["sdk", "websockets"], default="sdk",
                   help="client behind the headline figures and the cancel phase")
    p.add_argument("--cancels", type=int, default=50)
    p.add_argument("--cancel-sessions", type=int, default=10, help="sessions cancelling concurrently")
    p.add_argument("--cancel-max-cut", type=int, default=48, help="cancel after 1..N deltas (uniform)")
    p.add_argument("--cancel-max-tokens", type=int, default=256)
    p.add_argument("--idle-sessions", type=int, default=1000)
    p.add_argument("--seed", type=int, default=4)
    p.add_argument("--out", type=Path, help="results (default: bench/out/gateway.json)")
    p.add_argument("--plot", help="figure path ('' for none; default: docs/img/gateway_overhead.png)")
    p.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {SMOKE}")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    args.out = args.out or result_path("gateway.json", args.smoke)
    args.plot = str(figure_path("gateway_overhead.png", args.smoke)) if args.plot is None else args.plot
    if not 1 <= args.clients <= 64:
        p.error("--clients must be in 1..64 (the edge engine's n_seq_max range)")
    if args.rounds < 2:
        p.error("--rounds must be >= 2")
    if args.idle_sessions < 2 or args.cancels < 1 or args.cancel_max_cut < 1 or args.max_tokens < 2:
        p.error("--idle-sessions >= 2, --cancels >= 1, --cancel-max-cut >= 1 and --max-tokens >= 2 are required")
    if args.cancel_max_tokens <= args.cancel_max_cut:
        p.error("--cancel-max-tokens must exceed --cancel-max-cut")
    if not args.config.is_file():
        p.error(f"--config {args.config} not found")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = uvloop.run(run(args))
    result["cpu"] = cpu_facts()
    write_json(args.out, result)
    if args.plot:  # a str: Path("") would be "." and write a file named ".png"
        plot(result, Path(args.plot))
    for line in summary_lines(result):
        print(line)
    figures = {k: round(result[k], 4) for k in ("ws_vs_inprocess", "added_itl_p50_ms", "added_itl_p99_ms",
                                                "cancel_p99_ms", "idle_sessions_per_gib")}
    print(json.dumps({**figures, "cpu": result["cpu"]["model"]}))
    progress(f"wrote {args.out.relative_to(REPO_ROOT) if args.out.is_relative_to(REPO_ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
