"""Does the gateway survive what clients and crashes do to it? Cancels, fuzzing, a killed core (issue 14).

Four arms, each against its own ``python -m gateway serve`` subprocess on a loopback port with
a config derived from the base one (no API keys; session, rate and concurrency limits raised so
that no bench client is refused):

- ``cancels`` (bench/_faults_cancels.py): the shipped cascade over both tiers, the real
  SmolLM2-135M on the llama.cpp edge tier and in the torch engine core. ``--turns`` turns over
  ``--sessions`` concurrent sessions, each on a random one of the served models
  (``smollm2-135m`` = cascade, ``-edge``, ``-gpu``), each ended a random way: ``response.cancel``
  before any token, after the first delta or after a few; a ``conversation.item.truncate`` or
  ``delete`` of the item being written; an abrupt disconnect mid-stream; or run to completion
  with a small ``max_output_tokens``. Once every session has closed, ``/metrics`` is polled
  until no session, request or KV is left (or a minute passes) and
  ``leaked_kv_after_cancels`` = the torch tier's KV blocks in use + the edge's KV cells in use
  (running work, ``engine_kv_blocks_in_use{tier="edge"}``) + the edge's cells kept for
  sessions' next turns (``engine_kv_cells_cached``: every session has ended, so none should
  remain). Goal 0. Every turn but a disconnect must end with ``response.done``; one that does
  not within two minutes is a hang, counted. The shipped config as users run it: speculation
  on, each tier's threads from the host's CPU budget (one each on two cores; before the budget,
  every pool on all cores made the tiers fight: 2 turns/s against 7).
- ``fuzz`` (bench/_faults_fuzz.py, frames from bench/_faults_frames.py): the synthetic edge
  backend (50 tokens/s a stream, no model arithmetic). ``--frames`` hostile frames over
  ``--fuzz-connections`` connections, JSON text and msgpack binary (``x-openai-realtime-msgpack``):
  random and near-valid events, random bytes, text frames that are not UTF-8, deep nesting,
  huge numbers, broken JSON and msgpack, fragments, the other encoding's frames, and now and
  then frames over ``server.max_frame_bytes`` (an error event; text that is not UTF-8 closes
  with 1007 and the client reopens). Meanwhile one healthy session takes turns that must complete, and the HTTP
  endpoints are probed (a hostile chat completion among them). ``fuzz_cases`` = frames sent;
  ``fuzz_crashes`` = server deaths + failed healthy turns + 1011 closes + HTTP 5xx.
- ``fuzz_real``: the same against the base config's own route with the real models (the
  shipped cascade), sized for two cores (``--real-frames``): the healthy session's turns
  compute on both tiers while the fuzzers hammer the event loop. ``fuzz_real_cases``,
  ``fuzz_real_crashes``.
- ``core_kill`` (bench/_faults_core.py): the torch tier alone, ``--streams`` concurrent
  400-token streams; once all stream, SIGKILL to the engine core process.
  ``core_kill_max_end_s`` = the longest time from the kill to a stream's ``response.done``
  (status failed; goal under 1 s; null if one hung), ``core_restore_s`` = from the kill until
  ``/readyz`` is 200 again and a new turn has completed.

Progress goes to stderr; stdout gets a summary, then as its last line one JSON object with
``leaked_kv_after_cancels``, ``fuzz_cases``, ``fuzz_crashes``, ``fuzz_real_cases``,
``fuzz_real_crashes``, ``core_kill_max_end_s``, ``core_restore_s`` and ``cpu`` (null for arms
not run or failed). Everything is written to
bench/out/faults.json. An arm that fails is reported there and the next one runs; the exit
status is then 1.

Run: ``.venv/bin/python bench/faults.py`` (about 15 minutes on a quiet 2-core machine, most of it
the 10,000 cancels); quick check, all arms small (under 2 minutes):
``.venv/bin/python bench/faults.py --quick``; smaller still, to check that every arm runs and
prints its keys: ``--smoke`` (results in bench/out/smoke/); one arm: ``--arms fuzz``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvloop

from bench._common import (
    REPO_ROOT,
    SMOKE_HELP,
    cpu_facts,
    load_average,
    progress,
    raise_nofile_limit,
    result_path,
    write_json,
)
from bench._faults_cancels import WAYS, run_cancels
from bench._faults_core import run_core_kill
from bench._faults_fuzz import run_fuzz
from gateway.config import DEFAULT_CONFIG

ARMS = ("cancels", "fuzz", "fuzz_real", "core_kill")
FULL = {"turns": 10_000, "frames": 100_000, "real_frames": 200_000, "streams": 8}
QUICK = {"turns": 300, "frames": 5_000, "real_frames": 20_000, "streams": 8}
SMOKE = {"turns": 30, "frames": 500, "real_frames": 100, "streams": 2, "sessions": 6, "fuzz_connections": 2}
# The cancels run on the shipped config as users run it: both tiers on the host's CPU budget
# (gateway/config/host.py: one thread each on two cores), speculation as shipped.
CANCELS_CHANGES: dict[str, dict[str, Any]] = {}
HEADLINE_BY_ARM = {"cancels": ("leaked_kv_after_cancels",), "fuzz": ("fuzz_cases", "fuzz_crashes"),
                   "fuzz_real": ("fuzz_real_cases", "fuzz_real_crashes"),
                   "core_kill": ("core_kill_max_end_s", "core_restore_s")}
HEADLINE = tuple(key for keys in HEADLINE_BY_ARM.values() for key in keys)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    raise_nofile_limit(4096)
    load_before = load_average()
    progress(f"load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}; arms {args.arms}")
    arms: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="faults-bench-") as tmp_name:
        tmp = Path(tmp_name)
        plans: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {
            "cancels": lambda: run_cancels(args.config, tmp, args.turns, args.sessions, CANCELS_CHANGES, args.seed,
                                           args.models),
            "fuzz": lambda: run_fuzz(args.config, tmp, args.frames, args.fuzz_connections, args.seed),
            "fuzz_real": lambda: real_fuzz(args.config, tmp, args.real_frames, args.fuzz_connections, args.seed),
            "core_kill": lambda: run_core_kill(args.config, tmp, args.streams),
        }
        for name in args.arms:
            started = time.perf_counter()
            try:
                arms[name] = await plans[name]()
            except Exception as e:  # reported in the results; the other arms still run
                progress(f"{name} failed: {e!r}")
                arms[name] = {"error": repr(e), "traceback": traceback.format_exc()}
            arms[name]["arm_s"] = time.perf_counter() - started
            progress(f"{name}: done in {arms[name]['arm_s']:.0f} s")
    return {
        "headline": headline(arms),
        "setup": {"command": "python bench/faults.py " + " ".join(sys.argv[1:]), "quick": args.quick,
                  "smoke": args.smoke,
                  "turns": args.turns, "sessions": args.sessions, "ways": WAYS, "frames": args.frames,
                  "fuzz_connections": args.fuzz_connections, "streams": args.streams, "seed": args.seed,
                  "base_config": str(args.config), "load_before": load_before, "load_after": load_average()},
        "arms": arms,
    }


async def real_fuzz(base: Path, tmp: Path, frames: int, connections: int, seed: int) -> dict[str, Any]:
    """The fuzz arm against the base config's own route with the real models."""
    result = await run_fuzz(base, tmp, frames, connections, seed, real=True)
    return {**result, "fuzz_real_cases": result["fuzz_cases"], "fuzz_real_crashes": result["fuzz_crashes"]}


def headline(arms: dict[str, dict[str, Any]]) -> dict[str, float | int | None]:
    out: dict[str, float | int | None] = dict.fromkeys(HEADLINE)
    for name, arm in arms.items():
        for key in HEADLINE_BY_ARM[name]:
            if key in arm:
                out[key] = arm[key]
    return out


def summary_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    arms = result["arms"]
    for name, arm in arms.items():
        if "error" in arm:
            lines.append(f"{name}: FAILED: {arm['error']}")
    c = arms.get("cancels", {})
    if "turns" in c:
        lines.append(f"cancels: {c['turns']} turns over {c['concurrency']} sessions ({c['sessions']} opened) in "
                     f"{c['wall_s']:.0f} s ({c['turns_per_s']:.1f}/s); hangs {c['hangs']}, every non-disconnect turn "
                     f"ended with response.done: {c['all_ended_with_response_done']}")
        for way, outcomes in sorted(c["by_way"].items()):
            lines.append(f"  {way:<26} " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
        held = c["kv_held_after"]
        lines.append(f"  after all sessions ended ({'settled' if c['settled'] else 'NOT settled'} in "
                     f"{c['settle_s']:.1f} s): gpu KV blocks in use {held['gpu_kv_blocks_in_use']:g}, edge KV cells "
                     f"in use {held['edge_kv_cells_used']:g} + kept {held['edge_kv_cells_cached']:g}, running "
                     f"{sum(c['engine_running_after'].values()):g} -> leaked_kv_after_cancels "
                     f"{c['leaked_kv_after_cancels']:g}")
        if c["unexpected_errors"] or c["late_events"] or c["handshakes_refused"]:
            lines.append(f"  unexpected error events {c['unexpected_errors']}, events after response.done "
                         f"{c['late_events']}, handshakes refused {c['handshakes_refused']}")
    for name in ("fuzz", "fuzz_real"):
        f = arms.get(name, {})
        if "fuzz_cases" in f:
            lines.append(f"{name}: {f['fuzz_cases']} frames over {f['connections_opened']} connections in "
                         f"{f['wall_s']:.0f} s ({f['frames_per_s']:.0f}/s); closes {f['close_codes']}; "
                         f"{f['healthy_turns']} healthy turns; crashes {f['fuzz_crashes']} {f['crashes']}; "
                         f"server_error events {f['server_error_events']}")
    k = arms.get("core_kill", {})
    if "core_restore_s" in k:
        end = k["core_kill_max_end_s"]
        lines.append(f"core_kill: {k['streaming_at_kill']}/{k['streams']} streams running at the kill; statuses "
                     f"{k['statuses']}, the last response.done "
                     f"{'never (a stream hung)' if end is None else f'{end:.3f} s'} after the kill; /readyz 200 after "
                     f"{k['readyz_s']:.1f} s, a new turn done after {k['core_restore_s']:.1f} s")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="base config (default: %(default)s)")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of: %(default)s")
    p.add_argument("--quick", action="store_true",
                   help=f"small counts for a check by hand: {QUICK} unless given (full: {FULL})")
    p.add_argument("--turns", type=int, help="cancels: turns in all")
    p.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {SMOKE} unless given")
    p.add_argument("--sessions", type=int, help="cancels: concurrent sessions (default 24)")
    p.add_argument("--models", help="cancels: comma-separated subset of the served model ids (default: all)")
    p.add_argument("--frames", type=int, help="fuzz: frames to send")
    p.add_argument("--real-frames", type=int, help="fuzz_real: frames to send")
    p.add_argument("--fuzz-connections", type=int, help="fuzz: concurrent fuzzing connections (default 4)")
    p.add_argument("--streams", type=int, help="core_kill: concurrent streams at the kill")
    p.add_argument("--seed", type=int, default=14)
    p.add_argument("--out", type=Path, help="results (default: bench/out/faults.json)")
    args = p.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown or not args.arms:
        p.error(f"--arms: unknown {unknown}; choose from {','.join(ARMS)}")
    if args.quick and args.smoke:
        p.error("--quick and --smoke are two sizes: choose one")
    sizes = {"sessions": 24, "fuzz_connections": 4} | (SMOKE if args.smoke else QUICK if args.quick else FULL)
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.out = args.out or result_path("faults.json", args.smoke)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
    if min(args.turns, args.sessions, args.frames, args.real_frames, args.fuzz_connections, args.streams) < 1:
        p.error("--turns, --sessions, --frames, --fuzz-connections and --streams must be >= 1")
    if not args.config.is_file():
        p.error(f"--config {args.config} not found")
    return args


def _rounded(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) and math.isfinite(value) else value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = uvloop.run(run(args))
    result["cpu"] = cpu_facts()
    write_json(args.out, result)
    for line in summary_lines(result):
        print(line)
    figures = {k: _rounded(v) for k, v in result["headline"].items()}
    print(json.dumps({**figures, "cpu": result["cpu"]["model"],
                      "python_ref_ms": result["cpu"]["python_ref_ms"]}))
    progress(f"wrote {args.out.relative_to(REPO_ROOT) if args.out.is_relative_to(REPO_ROOT) else args.out}")
    return 1 if any("error" in arm for arm in result["arms"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
