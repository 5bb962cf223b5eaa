"""Scale-out on a local Ray cluster (issue 15): what a second replica buys, what prefix-affine
routing buys, and how fast the autoscaler answers a load step.

One run on this machine, CPU replicas of the embedded SmolLM2-135M (configs/cluster.toml), each
replica's engine core pinned to its own CPU with one torch thread; the load comes from this
process through the gateway's ``ReplicaPool`` (membership from Ray, tokens over the engine-core
protocol), so what is measured is the cluster, not the HTTP front:

1. **Throughput**: ``--clients`` closed-loop streams per replica (twice a replica's 4 slots, so
   each runs saturated) of ``--tokens`` tokens each for ``--seconds`` against 1 replica, then
   against 2 (fixed counts); output tokens per second that arrived inside the window.
2. **Prefix affinity**: 2 replicas; ``--conversations`` (7) multi-turn conversations, each with
   its own long system prompt (~300 tokens), ``--turns`` (4) turns of a ~70-token user paragraph
   and a 32-token answer, interleaved one turn at a time across conversations (more live
   conversations than one replica's KV pool of 2,912 tokens holds twice over); TTFT of the turns
   after the first,
   routed by prefix affinity and then round-robin (fresh conversations for each policy, so
   neither finds the other's cache). Then, still on 2 replicas, four long streams on each, all
   past their first token, and one replica's actor killed (as a lost node would be): the seconds
   until its last stream ended (``kill_max_end_s``, goal under 1), and the other replica's
   streams and the next turn completing.
3. **Scale-up**: the autoscaling deployment (1..2 replicas, our queue/KV policy, a 2 s upscale
   delay) idle at one replica, then a step of ``--step-clients`` streams: the seconds until a
   request's first token comes from the second replica. The load then stops and the run
   samples until the deployment is back at one replica; replicas and queue depth over time go to
   docs/img/cluster_scale.png.

The last stdout line is one JSON object with ``scale_2_over_1`` (goal >= 1.7),
``affinity_ttft_gain`` (round-robin TTFT p50 / affine TTFT p50; goal >= 1.5) and ``scale_up_s``,
plus ``kill_max_end_s``, ``machine_2_over_1`` (what two pinned CPUs give over one on a
decode-like load with no engine at all: the ceiling of ``scale_2_over_1`` on this machine) and
``cpu``. Full results: bench/out/cluster.json. Run: ``.venv/bin/python bench/cluster.py``
(about 8 minutes on a quiet 2-core machine; needs `pip install -e '.[cluster]'`). ``--smoke``:
every phase at tiny sizes (``SMOKE``), results and figure in bench/out/smoke/; the cluster's and
the replicas' start-up still take most of a minute or more.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench._common import (
    REPO_ROOT,
    SMOKE_HELP,
    cpu_facts,
    dump_toml,
    figure_path,
    median,
    percentile,
    progress,
    result_path,
    write_json,
)
from engine_cluster.local import delete_app, deploy, kill_replica, running_replicas, start_local, stop_local
from engine_cluster.pool import RayMembership, ReplicaPool
from gateway.config import load_config
from llm_shared.contract import FinishEvent, Priority, SamplingParams, TokenEvent
from llm_shared.models import tokenizer_for

START_S = 600.0
SMOKE = {"clients": 2, "tokens": 8, "seconds": 3.0, "conversations": 2, "turns": 2, "step_clients": 12,
         "ceiling_seconds": 1.0, "kill_tokens": 96, "after_scale_up_s": 1.0}


def write_config(out: Path, app_name: str, **cluster: Any) -> str:
    raw = tomllib.loads((REPO_ROOT / "configs" / "cluster.toml").read_text())
    raw["cluster"].update(app_name=app_name, pin_cpus=True, **cluster)
    path = out / f"{app_name}.toml"
    path.write_text(dump_toml(raw))
    return str(path)


async def open_pool(path: str, route: str = "prefix") -> ReplicaPool:
    config = load_config(path)
    cluster = replace(config.cluster, route=route)
    tokenizer = await asyncio.to_thread(tokenizer_for, config.model(config.engine.model))
    pool = ReplicaPool(cluster, tokenizer, RayMembership(cluster), secret=os.environ[config.engine.secret_env])
    return await pool.start(wait_s=START_S)


async def turn(pool: ReplicaPool, rid: str, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft = None
    tokens: list[int] = []
    token_times: list[float] = []
    replica = ""
    async for event in pool.generate(rid, prompt, params, Priority.REALTIME):
        if isinstance(event, TokenEvent):
            token_times.append(time.perf_counter())
            if ttft is None:
                ttft = time.perf_counter() - t0
                stream = pool._streams.get(rid)
                replica = stream._replica.replica_id if stream is not None and stream._replica else ""
            tokens.append(event.token_id)
        elif isinstance(event, FinishEvent):
            return {"tokens": tokens, "ttft": ttft, "reason": event.reason, "cached": event.cached_tokens,
                    "replica": replica, "first_at": t0 + ttft if ttft is not None else None, "token_times": token_times,
                    "end": time.perf_counter()}
    raise RuntimeError("stream ended without a finish")


def chat(pool: ReplicaPool, system: str, user: str) -> list[int]:
    return pool.tokenizer.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": user}])


# A decode step's memory traffic without the engine: one torch thread streaming ~540 MB of float32
# weights (SmolLM2-135M's size) through (4 x 576) @ (576 x 1536) products, for a fixed time.
CEILING_CODE = """
import sys, time, torch
torch.set_num_threads(1)
ws = [torch.randn(576, 1536) for _ in range(150)]
x = torch.randn(4, 576)
end = time.perf_counter() + float(sys.argv[1])
passes = 0
while time.perf_counter() < end:
    for w in ws:
        x[:, :] = (x @ w)[:, :576] * 1e-3
    passes += 1
print(passes)
"""


def hardware_ceiling(seconds: float = 10.0) -> dict[str, float]:
    """What two CPUs give over one on this machine for a decode-like load, measured the same
    way as the replicas run (one pinned thread each): the most ``scale_2_over_1`` can be here.
    On a VM two vCPUs may share a physical core or its memory bandwidth."""
    import subprocess

    def run(cpus: list[int]) -> list[int]:
        procs = [subprocess.Popen([sys.executable, "-c", CEILING_CODE, str(seconds)], stdout=subprocess.PIPE,
                                  text=True, preexec_fn=lambda c=cpu: os.sched_setaffinity(0, {c}))
                 for cpu in cpus]
        return [int(p.communicate()[0].strip()) for p in procs]

    solo = run([0])[0]
    pair = run([0, 1])
    result = {"solo_passes": solo, "pair_passes": pair, "ceiling_2_over_1": sum(pair) / solo}
    progress(f"hardware ceiling: two pinned CPUs give {result['ceiling_2_over_1']:.2f}x one on a decode-like load")
    return result


async def throughput(path: str, replicas: int, args: argparse.Namespace) -> dict[str, float]:
    await asyncio.to_thread(deploy, path, replicas)
    pool = await open_pool(path, "least_loaded")
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    try:
        await _until(lambda: len(pool.live()) == replicas, START_S)
        await asyncio.gather(*(turn(pool, f"warm{replicas}-{i}", chat(pool, "Be brief.", f"Warm {i}."), params)
                               for i in range(2 * replicas)))
        stop_at = time.perf_counter() + args.seconds
        counted = {"tokens": 0, "requests": 0, "failed": 0}

        async def client(c: int) -> None:
            i = 0
            while time.perf_counter() < stop_at:
                r = await turn(pool, f"tp{replicas}-{c}-{i}", chat(pool, "Be brief.", f"Tell story {c}.{i}."), params)
                # Tokens that arrived inside the window, whole requests or not.
                counted["tokens"] += sum(1 for at in r["token_times"] if at <= stop_at)
                counted["requests"] += r["end"] <= stop_at
                counted["failed"] += r["reason"] not in ("length", "stop")
                i += 1

        t0 = time.perf_counter()
        # The same offered load per replica (twice its slots), so each runs saturated with a queue
        # that refills its batch the moment a request finishes.
        await asyncio.gather(*(client(c) for c in range(args.clients * replicas)))
        elapsed = min(time.perf_counter(), stop_at) - t0
        result = {"replicas": replicas, "tokens_per_s": counted["tokens"] / elapsed, **counted}
        progress(f"throughput, {replicas} replica(s): {result['tokens_per_s']:.1f} tokens/s "
                 f"({counted['requests']} requests, {counted['failed']} failed)")
        return result
    finally:
        await pool.close()
        await asyncio.to_thread(delete_app, load_config(path).cluster.app_name)


async def conversations(path: str, route: str, args: argparse.Namespace) -> dict[str, Any]:
    """``--conversations`` multi-turn conversations routed by ``route``, their turns interleaved
    one at a time (every conversation's turn t before any turn t+1), as many users chatting at
    once do; TTFT of the turns after the first."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    pool = await open_pool(path, route)
    ttfts: list[float] = []
    cached: list[int] = []
    histories = {c: chat(pool, f"You are assistant number {c} for the {route} run. "
                         + " ".join(f"Rule {k}: answer about topic {c}-{k} in one line." for k in range(24)), "Hello.")
                 for c in range(args.conversations)}
    try:
        await _until(lambda: len(pool.live()) == 2, START_S)
        for t in range(args.turns):
            for c, history in histories.items():
                r = await turn(pool, f"{route}-{c}-{t}", history, params)
                if t:
                    ttfts.append(r["ttft"])
                    cached.append(r["cached"])
                # The next user message: a paragraph of its own (~70 tokens), as a chat user types.
                histories[c] = history + r["tokens"] + pool.tokenizer.encode(
                    f" Question {t} of conversation {c}: " + " ".join(
                        f"consider case {c}.{t}.{k} and say whether it holds;" for k in range(8)))
        result = {"ttft_p50_s": median(ttfts), "ttft_p90_s": percentile(ttfts, 90),
                  "cached_tokens_mean": sum(cached) / len(cached), "turns": len(ttfts), "routed": dict(pool.routed),
                  "prompt_tokens_last": max(len(h) for h in histories.values())}
    finally:
        await pool.close()
    progress(f"{route}: later-turn TTFT p50 {result['ttft_p50_s'] * 1e3:.0f} ms, "
             f"cached tokens mean {result['cached_tokens_mean']:.0f}")
    return result


async def kill_one(path: str, tokens: int) -> dict[str, Any]:
    """Two replicas, four long streams each (``tokens`` long, ignoring the end-of-sequence token so
    they are still running at the kill), all past their first token; one replica's actor is killed:
    how long its streams take to end, and whether the others and the next turn are fine."""
    pool = await open_pool(path, "least_loaded")
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    try:
        await _until(lambda: len(pool.live()) == 2, START_S)
        streams = [pool.generate(f"kill-{i}", chat(pool, "Be brief.", f"Long story {i}."), params, Priority.REALTIME)
                   for i in range(8)]
        await asyncio.gather(*(anext(s) for s in streams))
        homes = {f"kill-{i}": pool._streams[f"kill-{i}"]._replica.replica_id for i in range(8)}
        victim = homes["kill-0"]

        async def drain(stream: Any) -> tuple[str, float]:
            last = None
            async for event in stream:
                last = event
            return last.reason, time.perf_counter()

        tasks = {rid: asyncio.create_task(drain(s)) for rid, s in zip(homes, streams, strict=True)}
        killed_at = time.perf_counter()
        await asyncio.to_thread(kill_replica, load_config(path).cluster.app_name, victim)
        ends = {rid: await t for rid, t in tasks.items()}
        affected = [end - killed_at for rid, (reason, end) in ends.items() if homes[rid] == victim]
        others = [reason for rid, (reason, _) in ends.items() if homes[rid] != victim]
        after = await turn(pool, "kill-after", chat(pool, "Be brief.", "Hello?"), params)
        result = {"affected": len(affected), "affected_reasons": sorted({ends[r][0] for r in homes if homes[r] == victim}),
                  "max_end_s": max(affected), "others_completed": others.count("length"), "others": len(others),
                  "next_turn": after["reason"]}
        progress(f"killed replica: {len(affected)} streams ended within {result['max_end_s']:.2f} s; "
                 f"{result['others_completed']}/{len(others)} on the other completed; next turn {after['reason']}")
        return result
    finally:
        await pool.close()


async def affinity(path: str, args: argparse.Namespace) -> dict[str, Any]:
    await asyncio.to_thread(deploy, path, 2)
    try:
        out = {route: await conversations(path, route, args) for route in ("prefix", "round_robin")}
        out["kill"] = await kill_one(path, args.kill_tokens)
    finally:
        await asyncio.to_thread(delete_app, load_config(path).cluster.app_name)
    out["gain"] = out["round_robin"]["ttft_p50_s"] / out["prefix"]["ttft_p50_s"]
    return out


async def scale_up(path: str, args: argparse.Namespace) -> dict[str, Any]:
    app = load_config(path).cluster.app_name
    await asyncio.to_thread(deploy, path)
    pool = await open_pool(path, "prefix")
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    samples: list[dict[str, float]] = []
    stop = asyncio.Event()
    first_replica_ids = {r.replica_id for r in pool.live()}
    second_serving: list[float] = []
    failed = 0
    t0 = time.perf_counter()

    async def sampler() -> None:
        while True:
            stats = pool.stats()
            samples.append({"t": time.perf_counter() - t0,
                            "replicas": float(await asyncio.to_thread(running_replicas, app)),
                            "members": float(len(pool.live())), "queue": stats["waiting"],
                            "running": stats["running"]})
            await asyncio.sleep(0.5)

    async def client(c: int) -> None:
        nonlocal failed
        i = 0
        while not stop.is_set():
            r = await turn(pool, f"step-{c}-{i}", chat(pool, "Be brief.", f"Story {c}.{i}."), params)
            failed += r["reason"] not in ("length", "stop")
            if r["replica"] and r["replica"] not in first_replica_ids and not second_serving:
                second_serving.append(r["first_at"])
            i += 1

    sampling = asyncio.create_task(sampler())
    try:
        await asyncio.sleep(3.0)  # idle baseline
        step_at = time.perf_counter()
        clients = [asyncio.create_task(client(c)) for c in range(args.step_clients)]
        await _until(lambda: bool(second_serving), START_S)
        scale_up_s = second_serving[0] - step_at
        progress(f"scale-up: the second replica served {scale_up_s:.1f} s after the load step")
        await asyncio.sleep(args.after_scale_up_s)  # both replicas serving the step's load for a while
        stop.set()
        await asyncio.gather(*clients)
        load_end = time.perf_counter() - t0
        await _until(lambda: running_replicas(app) == 1, START_S)
        await asyncio.sleep(2.0)
        progress(f"scale-down: back at one replica {time.perf_counter() - t0 - load_end:.1f} s after the load ended")
    finally:
        stop.set()
        sampling.cancel()
        await asyncio.gather(sampling, return_exceptions=True)
        await pool.close()
        await asyncio.to_thread(delete_app, app)
    return {"scale_up_s": scale_up_s, "step_at_s": step_at - t0, "load_end_s": load_end, "failed": failed,
            "samples": samples}


def plot(scale: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = scale["samples"]
    t = [x["t"] for x in s]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.step(t, [x["replicas"] for x in s], where="post", label="replicas (Serve, running)", color="C0")
    ax.set_xlabel("seconds")
    ax.set_ylabel("replicas")
    ax.set_ylim(0, 3)
    ax2 = ax.twinx()
    ax2.plot(t, [x["queue"] for x in s], color="C1", label="requests waiting (all replicas)")
    ax2.plot(t, [x["running"] for x in s], color="C2", alpha=0.6, label="requests running")
    ax2.set_ylabel("requests")
    for x, label in ((scale["step_at_s"], "load step"), (scale["load_end_s"], "load ends")):
        ax.axvline(x, color="grey", linestyle=":")
        ax.text(x, 2.8, label, fontsize=8, ha="left", va="top")
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3,
              fontsize=8, frameon=False)
    ax.set_title("Engine replicas autoscaled on queue depth and KV use (local Ray, CPU)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


async def _until(predicate: Any, timeout_s: float) -> None:
    deadline = time.perf_counter() + timeout_s
    while not predicate():
        if time.perf_counter() > deadline:
            raise TimeoutError("the cluster did not reach the expected state")
        await asyncio.sleep(0.2)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out = result_path("cluster", args.smoke)
    out.mkdir(parents=True, exist_ok=True)
    fixed = write_config(out, "bench-fixed")
    auto = write_config(out, "bench-auto", upscale_delay_s=2.0, downscale_delay_s=10.0, look_back_period_s=2.0)
    start_local(fixed, num_cpus=os.cpu_count())
    try:
        progress("phase 1/3: throughput with one replica, then two")
        ceiling = hardware_ceiling(args.ceiling_seconds)
        one = await throughput(fixed, 1, args)
        two = await throughput(fixed, 2, args)
        progress("phase 2/3: prefix-affine against round-robin routing on multi-turn conversations; a replica killed")
        aff = await affinity(fixed, args)
        progress("phase 3/3: a load step against the autoscaling deployment")
        scale = await scale_up(auto, args)
    finally:
        stop_local()
    plot(scale, figure_path("cluster_scale.png", args.smoke))
    return {"throughput": {"one": one, "two": two, "hardware": ceiling}, "affinity": aff, "scale": scale,
            "figures": {"scale_2_over_1": round(two["tokens_per_s"] / one["tokens_per_s"], 3),
                        "affinity_ttft_gain": round(aff["gain"], 3), "scale_up_s": round(scale["scale_up_s"], 2),
                        "kill_max_end_s": round(aff["kill"]["max_end_s"], 3),
                        "machine_2_over_1": round(ceiling["ceiling_2_over_1"], 3)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=8, help="closed-loop clients per replica")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--conversations", type=int, default=7)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--step-clients", type=int, default=12)
    parser.add_argument("--ceiling-seconds", type=float, default=10.0, help="each run of the hardware ceiling")
    parser.add_argument("--kill-tokens", type=int, default=400, help="length of the streams a replica kill ends")
    parser.add_argument("--after-scale-up-s", type=float, default=10.0,
                        help="the step's load goes on this long after the second replica served")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {SMOKE}")
    args = parser.parse_args()
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    started = time.perf_counter()
    result = asyncio.run(main_async(args))
    result.update(cpu=cpu_facts(), args=vars(args), wall_s=round(time.perf_counter() - started, 1))
    write_json(result_path("cluster.json", args.smoke), result)
    print(json.dumps({**result["figures"], "cpu": result["cpu"]}))


if __name__ == "__main__":
    main()
