"""Arm ``cancels`` of bench/faults.py: many turns ended early in every way a client can, then
the KV both tiers still hold once every session is gone (the leak, goal 0).

``sessions`` workers each open a session on a random served model, set short instructions, run
one to ``MAX_TURNS_PER_SESSION`` turns in it (each turn on a random model, switched with
``session.update``), and close it; a turn that ends with a disconnect or a hang ends its session.
Each turn adds one short user message to the conversation and asks for a response, then ends
one way (shares in ``WAYS``; on CPU a turn costs about its prefill, so most end at or before
the first token):

- ``cancel_before_token``: ``response.cancel`` sent right behind ``response.create``;
- ``cancel_after_first_delta`` / ``cancel_after_deltas``: after the first / 2..6 text deltas;
- ``truncate`` / ``delete``: ``conversation.item.truncate`` (at a random character of what was
  received) / ``conversation.item.delete`` of the assistant item being written, after 1..4 deltas;
- ``disconnect``: the socket aborted (no close frame) right after ``response.create`` or after
  1..4 deltas;
- ``complete``: runs to its end with ``max_output_tokens`` 1..4.

Every turn but a disconnect must end with ``response.done``; a turn whose next event does not
come within ``TURN_TIMEOUT_S`` is a hang, counted, and its socket aborted. A response that ends
on its own before the client acts is counted as such (``finished_first/<status>``). Also
recorded: seconds from the client's act to ``response.done`` by way, turn seconds by model,
error events (a cancel that crossed the response's end is tolerated), events of a response
after its ``response.done``, handshakes refused (503 while the cascade's probes find a tier
slow), and the CPU seconds of the gateway and its engine core.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidStatus

from bench._common import percentile, progress
from bench._faults_ws import (
    DELTA,
    DONE,
    Budget,
    complete_turn,
    connect,
    derive_config,
    kv_held,
    labels_of,
    read_metrics,
    recv,
    sample,
    samples_of,
    send,
    served_models,
    start_gateway,
    user_item,
    wait_quiet,
    ws_url,
)
from bench._gateway_clients import TOPICS, BenchError
from bench._gateway_server import GatewayProcess

WAYS: dict[str, float] = {  # how a turn ends -> its share; most end at or before the first token
    "cancel_before_token": 0.5, "cancel_after_first_delta": 0.18, "cancel_after_deltas": 0.06,
    "truncate": 0.06, "delete": 0.06, "disconnect": 0.09, "complete": 0.05,
}
MAX_TURNS_PER_SESSION = 4
CANCEL_MAX_TOKENS = 48  # long enough that most turns are still streaming when the client acts
TURN_TIMEOUT_S = 120.0  # from response.create to response.done: far above a queued turn on 2 busy cores
TOLERATED_ERRORS = frozenset({"response_cancel_not_active"})  # a cancel that crossed the response's end
ERROR_SAMPLES = 20
REFUSED_BACKOFF_S = 0.25
INSTRUCTIONS = "Be brief."


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)  # "way outcome"
    models: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)  # unexpected error event codes
    tolerated_errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    late_events: int = 0  # events of a response after its response.done
    hangs: int = 0
    sessions: int = 0
    connect_failures: int = 0
    handshakes_refused: Counter[str] = field(default_factory=Counter)  # HTTP status -> count
    end_s: dict[str, list[float]] = field(default_factory=dict)  # way -> seconds from the client's act to response.done
    turn_s: dict[str, list[float]] = field(default_factory=dict)  # model -> seconds from response.create to the end
    done: int = 0  # turns over, whichever way

    def error(self, text: str) -> None:
        if len(self.error_samples) < ERROR_SAMPLES:
            self.error_samples.append(text[:300])


def choose_way(rng: random.Random) -> str:
    return rng.choices(list(WAYS), weights=list(WAYS.values()))[0]


def trigger_after(way: str, rng: random.Random) -> int:
    """Text deltas to read before acting (0: act at once; -1: never)."""
    return {"cancel_before_token": 0, "cancel_after_first_delta": 1, "cancel_after_deltas": rng.randint(2, 6),
            "truncate": rng.randint(1, 4), "delete": rng.randint(1, 4), "disconnect": rng.randint(0, 4),
            "complete": -1}[way]


async def turn(ws: ClientConnection, way: str, model: str, rng: random.Random, tally: Tally, finished: set[str]
               ) -> str:
    """One turn ended ``way``; returns its outcome: the response's status, ``disconnected`` or
    ``hang`` (the socket is aborted then); ``finished_first/<status>`` when the response ended
    before the client acted."""
    max_tokens = rng.randint(1, 4) if way == "complete" else CANCEL_MAX_TOKENS
    await send(ws, user_item(f"About {rng.choice(TOPICS)}?"))
    await send(ws, {"type": "response.create", "response": {"max_output_tokens": max_tokens}})
    created_at = acted_at = time.perf_counter()
    after = trigger_after(way, rng)
    acted = way == "complete"
    if way == "cancel_before_token":
        await send(ws, {"type": "response.cancel"})
        acted = True
    elif way == "disconnect" and after == 0:
        ws.transport.abort()
        return "disconnected"
    response_id, item_id, text, deltas = None, None, "", 0
    deadline = time.monotonic() + TURN_TIMEOUT_S
    while True:
        try:
            event = await recv(ws, max(0.01, deadline - time.monotonic()))
        except TimeoutError:
            tally.hangs += 1
            tally.error(f"{way}: no response.done within {TURN_TIMEOUT_S:.0f} s ({deltas} deltas, response "
                        f"{response_id})")
            ws.transport.abort()
            return "hang"
        kind = event["type"]
        if kind == "response.created":
            response_id = event["response"]["id"]
        elif kind in (DELTA, "response.output_item.added", DONE):
            rid = event["response"]["id"] if kind == DONE else event.get("response_id")
            if rid in finished or rid != response_id:
                tally.late_events += 1
                tally.error(f"{kind} of {rid} while waiting for {response_id}")
                continue
            if kind == "response.output_item.added":
                item_id = event["item"]["id"]
            elif kind == DELTA:
                deltas += 1
                text += event["delta"]
                if not acted and deltas >= after:
                    acted, acted_at = True, time.perf_counter()
                    if way == "disconnect":
                        ws.transport.abort()
                        return "disconnected"
                    await send(ws, act(way, item_id, text, rng))
            else:
                finished.add(rid)
                status = event["response"]["status"]
                now = time.perf_counter()
                tally.turn_s.setdefault(model, []).append(now - created_at)
                if acted and way != "complete":
                    tally.end_s.setdefault(way, []).append(now - acted_at)
                return status if acted else f"finished_first/{status}"
        elif kind == "error":
            code = event["error"].get("code") or ""
            if code in TOLERATED_ERRORS:
                tally.tolerated_errors += 1
            else:
                tally.errors[code] += 1
                tally.error(f"{way}: error event {event['error']}")


def act(way: str, item_id: str | None, text: str, rng: random.Random) -> dict[str, Any]:
    if way in ("truncate", "delete") and item_id is None:
        raise BenchError("a text delta came before response.output_item.added")
    if way == "truncate":
        return {"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                "x_text_end": rng.randint(0, len(text))}
    if way == "delete":
        return {"type": "conversation.item.delete", "item_id": item_id}
    return {"type": "response.cancel"}


async def session_worker(url_for: Callable[[str], str], models: list[str], budget: Budget, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    finished: set[str] = set()
    while budget.left:
        model = rng.choice(models)
        try:
            ws = await connect(url_for(model))
        except InvalidStatus as e:
            # 503 while the cascade's probes say a tier is down (a busy machine): the refusal is
            # the server's answer, counted; try again after a short backoff.
            tally.handshakes_refused[str(e.response.status_code)] += 1
            if e.response.status_code != 503:
                raise BenchError(f"the handshake was refused: {e}") from e
            await asyncio.sleep(REFUSED_BACKOFF_S)
            continue
        except (OSError, TimeoutError, ConnectionClosed, BenchError) as e:
            tally.connect_failures += 1
            tally.error(f"connect: {e!r}")
            if tally.connect_failures > 50:
                raise BenchError("more than 50 sessions failed to open") from e
            continue
        tally.sessions += 1
        open_ = True
        try:
            # A short system prompt (the template's default one is 20 tokens): prefills are most
            # of what a turn costs on CPU, and this arm is about how turns end.
            await send(ws, {"type": "session.update", "session": {"type": "realtime", "instructions": INSTRUCTIONS}})
            for _ in range(rng.randint(1, MAX_TURNS_PER_SESSION)):
                if not budget.take():
                    break
                turn_model = rng.choice(models)
                if turn_model != model:
                    await send(ws, {"type": "session.update", "session": {"type": "realtime", "model": turn_model}})
                    model = turn_model
                way = choose_way(rng)
                tally.models[model] += 1
                outcome = await turn(ws, way, model, rng, tally, finished)
                tally.outcomes[f"{way} {outcome}"] += 1
                tally.done += 1
                if outcome in ("disconnected", "hang"):
                    open_ = False
                    break
        except (ConnectionClosed, BenchError) as e:
            tally.outcomes["connection_closed_by_server" if isinstance(e, ConnectionClosed) else "bad_events"] += 1
            tally.done += 1
            tally.error(f"session ended: {e!r}")
            ws.transport.abort()
            open_ = False
        finally:
            if open_:
                try:
                    await asyncio.wait_for(ws.close(), 10)
                except TimeoutError:
                    ws.transport.abort()


def cpu_seconds(server: GatewayProcess) -> dict[str, float]:
    """CPU seconds used so far by the gateway, its engine core and this benchmark's process."""
    def used(p: psutil.Process) -> float:
        t = p.cpu_times()
        return t.user + t.system

    out = {"gateway": used(server.process), "bench_client": used(psutil.Process())}
    for child in server.process.children(recursive=True):
        try:
            name = "engine_core" if any("core_process" in part for part in child.cmdline()) else f"child_{child.pid}"
            out[name] = out.get(name, 0.0) + used(child)
        except psutil.NoSuchProcess:
            continue
    return out


async def report_progress(tally: Tally, total: int, started: float) -> None:
    step = max(1, total // 10)
    mark = step
    while True:
        await asyncio.sleep(1.0)
        if tally.done >= mark:
            rate = tally.done / (time.perf_counter() - started)
            progress(f"cancels: {tally.done}/{total} turns ({rate:.1f}/s), {tally.sessions} sessions, "
                     f"{tally.hangs} hangs, {sum(tally.errors.values())} unexpected errors")
            mark = (tally.done // step + 1) * step


async def run_cancels(base: Path, tmp: Path, turns: int, sessions: int, changes: dict[str, dict[str, Any]],
                      seed: int, only_models: list[str] | None = None) -> dict[str, Any]:
    """``changes``: config tables updated over ``base``; ``only_models``: a subset of the served ids."""
    config = derive_config(base, tmp, "cancels", changes)
    server = await start_gateway(config, tmp, "cancels")
    tally = Tally()
    try:
        async with aiohttp.ClientSession() as http:
            models = await served_models(http, server)
            if only_models:
                unknown = sorted(set(only_models) - set(models))
                if unknown:
                    raise BenchError(f"models {unknown} are not served; served: {models}")
                models = sorted(only_models)
            for model in models:  # warm-up: every route serves one whole turn first
                await complete_turn(ws_url(server, model), "Hello, who are you?", 8, TURN_TIMEOUT_S)
            progress(f"cancels: models {models}; {turns} turns over {sessions} concurrent sessions")
            before = await read_metrics(http, server)
            cpu_before = cpu_seconds(server)
            budget = Budget(turns)
            started = time.perf_counter()
            reporter = asyncio.create_task(report_progress(tally, turns, started))
            try:
                async with asyncio.TaskGroup() as workers:  # one that fails stops the others
                    for w in range(sessions):
                        workers.create_task(session_worker(lambda m: ws_url(server, m), models, budget, tally,
                                                           seed * 1000 + w))
            finally:
                reporter.cancel()
            wall_s = time.perf_counter() - started
            cpu = {k: v - cpu_before.get(k, 0.0) for k, v in cpu_seconds(server).items()}
            progress(f"cancels: {tally.done} turns in {wall_s:.0f} s; waiting for sessions and engines to settle")
            after, settle_s, settled = await wait_quiet(http, server)
        alive = server.process.is_running()
    finally:
        exit_code = server.stop()
        problems = server.log_problems()
    held = kv_held(after)
    leaked = held["gpu_kv_blocks_in_use"] + held["edge_kv_cells_used"] + held["edge_kv_cells_cached"]
    cancels = {k: v - sample(before, "gateway_cancels_total", **labels_of(k))
               for k, v in samples_of(after, "gateway_cancels_total").items()}
    return {
        "leaked_kv_after_cancels": leaked, "kv_held_after": held, "settled": settled, "settle_s": settle_s,
        "engine_running_after": samples_of(after, "engine_running_requests"),
        "sessions_active_after": sample(after, "gateway_sessions_active"),
        "cpu_s": cpu, "turns": tally.done, "turns_per_s": tally.done / wall_s if wall_s else 0.0, "wall_s": wall_s,
        "sessions": tally.sessions, "concurrency": sessions, "outcomes": dict(sorted(tally.outcomes.items())),
        "by_way": _by_way(tally.outcomes), "models": dict(tally.models), "hangs": tally.hangs,
        "all_ended_with_response_done": _all_done(tally.outcomes),
        "act_to_done_s": {way: _spread(v) for way, v in sorted(tally.end_s.items())},
        "turn_s_by_model": {m: _spread(v) for m, v in sorted(tally.turn_s.items())},
        "handshakes_refused": dict(tally.handshakes_refused),
        "unexpected_errors": dict(tally.errors), "tolerated_errors": tally.tolerated_errors,
        "late_events": tally.late_events, "connect_failures": tally.connect_failures,
        "error_samples": tally.error_samples, "server_cancels": cancels,
        "server_alive_at_end": alive, "server_exit_code": exit_code,
        "server_log_warnings_and_errors": problems[:50], "server_log_problem_lines": len(problems),
        "config_changes": changes,
    }


def _by_way(outcomes: Counter[str]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for key, n in outcomes.items():
        way, _, outcome = key.partition(" ")
        out.setdefault(way, {})[outcome or "-"] = n
    return out


def _all_done(outcomes: Counter[str]) -> bool:
    """Every turn but the disconnects ended with response.done (any status)."""
    return all(key.split(" ", 1)[-1] != "hang" and " " in key for key in outcomes)


def _spread(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99),
            "max": max(values, default=math.nan)}
