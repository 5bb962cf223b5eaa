"""The default route under load, with the real models: the cascade against each tier alone.

One ``python -m gateway serve`` subprocess with the shipped default config (the cascade over the
llama.cpp edge tier and the torch tier on this CPU, speculation and the host's CPU budget as
shipped), only its per-key limits raised so that no benchmark client is refused by a rate limit.
Per concurrency level, each served model id (the cascade, the edge alone, the torch tier alone)
runs through both APIs: streaming chat completions with the official ``openai`` SDK, and
Realtime with the SDK's realtime client (one session per client, out-of-band responses, so a
prompt never grows). Each arm is a closed loop of ``c`` clients until ``max(--requests-min,
2c)`` turns are done; the arms' order rotates from level to level. Every turn asks for
``--tokens`` tokens at temperature 0.7 ("Tell me a short story about a robot number i."), so
answers may end early at the model's end of sequence: throughput counts the tokens received.

Per arm and per model id (both APIs together): tokens/s received, time to first token p50/p99,
failed turns (an error status, an error event, a broken stream), and how the cascade routed its
turns (``x_route``). Per level: the tiers' up/down transitions (``gateway_tier_transitions_total``).
The threads each compute pool ran with come from ``/metrics`` (``gateway_host_threads``).

Threads follow the load as shipped (``[host] follow_load``); a second gateway in the same run
serves the edge model id alone at 8 and 32 clients with the static split (``follow_load =
false``), a third the same with the torch tier stopped (synthetic: the edge holds every core at
every moment), and llama-cpp-python's own OpenAI server (``python -m llama_cpp.server``, the same GGUF,
``--interrupt_requests False``, its default threads; the ``bench-peer`` extra) serves the same
streamed chat completions at 32 clients (the largest level below 32 in a shorter run).

``--splits 1,1,1 2,2,2 ...`` instead runs the cascade alone at 8 and 32 clients under each
thread split (edge, torch, drafter), a gateway per split: which split serves best here.

Progress on stderr; results in bench/out/cascade_load.json (``--splits``: cascade_splits.json)
and a plot in docs/img/cascade_load.png; the last stdout line is one JSON object:
``cascade_over_best_tier_tok_s_c1`` / ``_c8`` / ``_c32``, ``cascade_ttft_p99_over_best_tier_c32``,
``cascade_failed_c8``, ``cascade_failed_c32``, ``failed`` (every arm), ``tier_down_transitions``
(the whole run), ``threads`` (at start), ``by_level`` (per model id: tok/s, TTFT p50/p99 in ms,
failed); the edge alone: ``edge_alone_tok_s_c8`` / ``_c32``, the same with the static split
(``*_static``) and their ratio (``edge_alone_over_static_c8`` / ``_c32``), holding every core
(``*_whole``) and the ratio to it (``edge_alone_over_whole_c8`` / ``_c32``), ``edge_ttft_p50_ms_c32``,
``edge_ttft_p99_ms_c32``, ``edge_c32_over_c8_tok_s``, ``peer_tok_s_c32`` and
``edge_over_peer_tok_s_c32`` (HTTP arms only); the budget's moves over the main run:
``thread_reassignments_per_s``, ``thread_claims`` and ``thread_claim_wait_ms_mean`` (what a tier
that was idle waited for its threads); ``cpu``.

    .venv/bin/python bench/cascade_load.py [--levels 1 8 32 64] [--tokens 64] [--smoke]
    .venv/bin/python bench/cascade_load.py --splits 1,1,1 2,2,2 1,2,2 2,1,1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import tomllib
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from bench._common import (
    SMOKE_HELP,
    cpu_facts,
    dump_toml,
    figure_path,
    load_average,
    percentile,
    progress,
    raise_nofile_limit,
    result_path,
    write_json,
)
from bench._gateway_clients import BenchError
from bench._gateway_server import GatewayProcess
from bench._llama_peer import LlamaCppServer, peer_missing
from gateway.config import DEFAULT_CONFIG, load_config
from llm_shared.modelfile import default_gguf_path

TEMPERATURE = 0.7
TURN_TIMEOUT_S = 600.0  # a turn that takes longer has failed (a busy 2-core host answers far sooner)
API_KEY = "cascade-load-bench"
POOLS = ("edge", "torch", "drafter")


def prompt(i: int) -> str:
    return f"Tell me a short story about a robot number {i}."


@dataclass
class TurnResult:
    ok: bool
    sent_at: float
    first_at: float = 0.0
    done_at: float = 0.0
    tokens: int = 0
    route: str = ""  # the cascade's x_route ("" for a pinned tier)
    reason: str = ""  # x_route's reason, or the error
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.first_at - self.sent_at if self.first_at else None


@dataclass
class Arm:
    model: str
    api: str
    concurrency: int
    turns: list[TurnResult] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        return summarize(self.turns, self.seconds)


def summarize(turns: list[TurnResult], seconds: float) -> dict[str, Any]:
    ttfts = [t.ttft for t in turns if t.ok and t.ttft is not None]
    tokens = sum(t.tokens for t in turns if t.ok)
    routes = Counter(f"{t.route}:{t.reason}" if t.reason else t.route for t in turns if t.ok and t.route)
    errors = Counter(t.error[:160] for t in turns if not t.ok)
    return {
        "turns": len(turns), "failed": sum(not t.ok for t in turns), "tokens": tokens, "seconds": seconds,
        "tok_s": tokens / seconds if seconds > 0 else 0.0,
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3 if ttfts else None,
        "ttft_p99_ms": percentile(ttfts, 99) * 1e3 if ttfts else None,
        "routes": dict(routes), "errors": dict(errors),
    }


# ---- the two APIs ----------------------------------------------------------------------------------

async def http_turn(client: AsyncOpenAI, model: str, i: int, tokens: int) -> TurnResult:
    result = TurnResult(ok=False, sent_at=time.perf_counter())
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt(i)}], max_tokens=tokens,
            temperature=TEMPERATURE, stream=True, stream_options={"include_usage": True})
        pieces = 0  # streamed content chunks: the tokens of a server that sends no usage (the peer)
        async for chunk in stream:
            extra = chunk.model_extra or {}
            if chunk.choices and chunk.choices[0].delta.content:
                pieces += 1
                if not result.first_at:
                    result.first_at = time.perf_counter()
            route = extra.get("x_route")
            if isinstance(route, dict):
                result.route, result.reason = str(route.get("route") or ""), str(route.get("reason") or "")
            if chunk.usage is not None:
                result.tokens = chunk.usage.completion_tokens
        result.tokens = result.tokens or pieces
        result.done_at = time.perf_counter()
        result.ok = True
    except Exception as e:  # every failure counts; the benchmark goes on
        result.error = f"{type(e).__name__}: {e}"
    return result


class RealtimeSession:
    """One Realtime session of the official SDK; out-of-band turns, one at a time."""

    def __init__(self, stack: AsyncExitStack, connection: Any) -> None:
        self._stack = stack
        self._conn = connection

    @classmethod
    async def open(cls, client: AsyncOpenAI, model: str) -> RealtimeSession:
        stack = AsyncExitStack()
        try:
            connection = await stack.enter_async_context(client.realtime.connect(model=model))
        except BaseException:
            await stack.aclose()
            raise
        return cls(stack, connection)

    async def turn(self, i: int, tokens: int) -> TurnResult:
        result = TurnResult(ok=False, sent_at=time.perf_counter())
        await self._conn.send({"type": "response.create", "response": {
            "conversation": "none", "max_output_tokens": tokens, "temperature": TEMPERATURE,
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt(i)}]}]}})
        while True:
            event = await self._conn.recv()
            if event.type == "response.output_text.delta" and not result.first_at:
                result.first_at = time.perf_counter()
            elif event.type == "error":
                result.error = f"error event {event.error.code}: {event.error.message}"
                return result
            elif event.type == "response.done":
                response = event.response
                metadata = response.metadata or {}
                result.route, result.reason = metadata.get("x_route", ""), metadata.get("x_route_reason", "")
                result.tokens = (response.usage.output_tokens or 0) if response.usage else 0
                result.done_at = time.perf_counter()
                if response.status in ("completed", "incomplete"):
                    result.ok = True
                else:
                    details = response.status_details
                    error = getattr(details, "error", None) if details else None
                    result.error = f"status {response.status}: {getattr(error, 'code', '')} {getattr(error, 'message', '')}"
                return result

    async def close(self) -> None:
        await self._stack.aclose()


async def run_arm(url: str, model: str, api: str, concurrency: int, n_turns: int, tokens: int,
                  first_id: int) -> Arm:
    """``concurrency`` clients in a closed loop until ``n_turns`` turns are done."""
    arm = Arm(model, api, concurrency)
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=TURN_TIMEOUT_S)
    counter = iter(range(first_id, first_id + n_turns))

    async def worker() -> None:
        session: RealtimeSession | None = None
        try:
            for i in counter:
                if api == "http":
                    arm.turns.append(await http_turn(client, model, i, tokens))
                    continue
                try:
                    if session is None:
                        session = await RealtimeSession.open(client, model)
                    arm.turns.append(await asyncio.wait_for(session.turn(i, tokens), TURN_TIMEOUT_S))
                except Exception as e:  # a broken session fails its turn; the next turn opens a new one
                    arm.turns.append(TurnResult(ok=False, sent_at=time.perf_counter(), error=f"{type(e).__name__}: {e}"))
                    if session is not None:
                        await session.close()
                    session = None
        finally:
            if session is not None:
                await session.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    arm.seconds = time.perf_counter() - started
    await client.close()
    return arm


# ---- the gateway -------------------------------------------------------------------------------------

def derive_config(directory: Path, max_clients: int, threads: tuple[int, int, int] | None,
                  budget: str = "follow", tag: str = "") -> Path:
    """The shipped default config with per-key limits raised for the benchmark's one key (and the
    pools' threads set, for a split). ``budget``: "follow" as shipped, "static" (``[host]
    follow_load = false``), or "whole": the torch tier synthetic (it computes nothing), so the
    edge holds every core at every moment."""
    raw = tomllib.loads(DEFAULT_CONFIG.read_text(encoding="utf-8"))
    if budget == "static":
        raw.setdefault("host", {})["follow_load"] = False
    elif budget == "whole":
        raw.setdefault("engine", {})["backend"] = "synthetic"
    server = raw.setdefault("server", {})
    server.update(api_keys=[API_KEY], api_keys_env="", requests_per_minute=1_000_000,
                  tokens_per_minute=100_000_000, max_sessions_per_key=4 * max_clients + 64,
                  max_concurrent_requests_per_key=4 * max_clients + 64)
    if threads is not None:
        raw.setdefault("edge", {})["n_threads"] = threads[0]
        engine = raw.setdefault("engine", {})
        engine["threads"] = threads[1]
        engine.setdefault("speculative", {})["draft_threads"] = threads[2]
    # model sources are relative to the configs folder
    models = raw.get("models", {})
    for model in models.values():
        source = model.get("source", "")
        if source and not source.startswith("package:") and not Path(source).is_absolute():
            model["source"] = str((DEFAULT_CONFIG.parent / source).resolve())
    path = directory / f"cascade-load{'-' + tag if tag else ''}.toml"
    path.write_text(dump_toml(raw), encoding="utf-8")
    return path


def metric_sum(server: GatewayProcess, prefix: str) -> float:
    """The sum of every sample of a labelled metric in /metrics (0 when it has none yet)."""
    status, body = server._get("/metrics")
    if status != 200:
        raise BenchError(f"/metrics answered {status}")
    return sum(float(line.split()[-1]) for line in body.decode().splitlines() if line.startswith(prefix + "{"))


def host_threads(server: GatewayProcess) -> dict[str, int]:
    status, body = server._get("/metrics")
    if status != 200:
        raise BenchError(f"/metrics answered {status}")
    out: dict[str, int] = {}
    for line in body.decode().splitlines():
        if line.startswith("gateway_host_threads{"):
            pool = line.split('pool="', 1)[1].split('"', 1)[0]
            out[pool] = int(float(line.split()[-1]))
    return out


class Gateway:
    def __init__(self, directory: Path, max_clients: int, threads: tuple[int, int, int] | None, tag: str,
                 budget: str = "follow") -> None:
        self.config_path = derive_config(directory, max_clients, threads, budget, tag)
        self.process = GatewayProcess(self.config_path, directory / f"gateway-{tag}.log", "127.0.0.1")
        config = load_config(self.config_path)
        self.ids = {"cascade": config.routing.cascade_model, "edge": config.routing.edge_model,
                    "gpu": config.routing.gpu_model}

    async def __aenter__(self) -> Gateway:
        progress(f"starting the gateway ({self.config_path.name}); both tiers load (model, drafter, calibration)")
        self.process.start()
        try:
            await self.process.wait_ready()
        except BaseException:
            self.process.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        problems = self.process.log_problems()
        if problems:
            progress(f"gateway log: {len(problems)} warning/error lines, e.g. {problems[0][:200]}")
        self.process.stop()

    def transitions(self) -> float:
        return metric_sum(self.process, "gateway_tier_transitions_total")

    def reassignments(self) -> float:
        return self.process.metric("gateway_thread_reassignments_total")


# ---- the runs ----------------------------------------------------------------------------------------

async def run_levels(gw: Gateway, levels: list[int], tokens: int, requests_min: int,
                     apis: list[str], models: list[str]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    next_id = 0
    for n, c in enumerate(levels):
        n_turns = max(requests_min, 2 * c)
        order = models[n % len(models):] + models[: n % len(models)]
        before = gw.transitions()
        arms: list[Arm] = []
        for model in order:
            for api in apis:
                arm = await run_arm(gw.process.url, gw.ids[model], api, c, n_turns, tokens, next_id)
                next_id += n_turns
                arms.append(arm)
                s = arm.summary()
                progress(f"  c={c:2d} {model:7s} {api:8s}: {s['tok_s']:6.1f} tok/s, TTFT p50 {fmt_ms(s['ttft_p50_ms'])} "
                         f"p99 {fmt_ms(s['ttft_p99_ms'])}, failed {s['failed']}/{s['turns']}"
                         + (f", routes {s['routes']}" if s["routes"] else "")
                         + (f", errors {s['errors']}" if s["errors"] else ""))
        transitions = gw.transitions() - before
        per_model = {}
        for model in models:
            mine = [a for a in arms if a.model == gw.ids[model]]
            per_model[model] = summarize([t for a in mine for t in a.turns], sum(a.seconds for a in mine))
            per_model[model]["by_api"] = {a.api: a.summary() for a in mine}
        out[c] = {"turns_per_arm": n_turns, "tier_transitions": transitions, "models": per_model}
        progress(f"c={c}: " + ", ".join(f"{m} {per_model[m]['tok_s']:.1f} tok/s (p99 {fmt_ms(per_model[m]['ttft_p99_ms'])})"
                                        for m in models) + f"; tier transitions {transitions:g}")
    return out


def fmt_ms(value: float | None) -> str:
    return f"{value:,.0f} ms" if value is not None else "-"


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def edge_figures(levels: dict[int, dict[str, Any]], static: dict[int, dict[str, Any]],
                 whole: dict[int, dict[str, Any]], peer: tuple[int, float] | None) -> dict[str, Any]:
    """The edge model id alone: with the moving budget (the shipped one), with the static split
    (``*_static``) and holding every core (``*_whole``, the torch tier stopped), each another
    gateway in the same run, and against llama-cpp-python's server."""
    def edge(table: dict[int, dict[str, Any]], c: int, key: str) -> Any:
        value = table[c]["models"]["edge"][key] if c in table else None
        return round(value, 1) if value is not None else None

    out: dict[str, Any] = {}
    for c in (8, 32):
        out[f"edge_alone_tok_s_c{c}"] = edge(levels, c, "tok_s")
        out[f"edge_alone_tok_s_c{c}_static"] = edge(static, c, "tok_s")
        out[f"edge_alone_over_static_c{c}"] = ratio(edge(levels, c, "tok_s"), edge(static, c, "tok_s"))
        out[f"edge_alone_tok_s_c{c}_whole"] = edge(whole, c, "tok_s")
        out[f"edge_alone_over_whole_c{c}"] = ratio(edge(levels, c, "tok_s"), edge(whole, c, "tok_s"))
    out["edge_ttft_p50_ms_c32"] = edge(levels, 32, "ttft_p50_ms")
    out["edge_ttft_p99_ms_c32"] = edge(levels, 32, "ttft_p99_ms")
    out["edge_c32_over_c8_tok_s"] = ratio(edge(levels, 32, "tok_s"), edge(levels, 8, "tok_s"))
    if peer is not None:
        c, peer_tok_s = peer
        ours = levels[c]["models"]["edge"]["by_api"]["http"]["tok_s"]
        out[f"peer_tok_s_c{c}"] = round(peer_tok_s, 1)
        out[f"edge_over_peer_tok_s_c{c}"] = ratio(ours, peer_tok_s)
    return out


def headline(levels: dict[int, dict[str, Any]], transitions: float, threads: dict[str, int]) -> dict[str, Any]:
    def best_tier(c: int, key: str, lower: bool) -> float | None:
        values = [levels[c]["models"][m][key] for m in ("edge", "gpu") if levels[c]["models"][m][key] is not None]
        return (min(values) if lower else max(values)) if values else None

    def cascade(c: int, key: str) -> Any:
        return levels[c]["models"]["cascade"][key] if c in levels else None

    return {
        "cascade_over_best_tier_tok_s_c1": ratio(cascade(1, "tok_s"), best_tier(1, "tok_s", False)) if 1 in levels else None,
        "cascade_over_best_tier_tok_s_c8": ratio(cascade(8, "tok_s"), best_tier(8, "tok_s", False)) if 8 in levels else None,
        "cascade_over_best_tier_tok_s_c32": ratio(cascade(32, "tok_s"), best_tier(32, "tok_s", False)) if 32 in levels else None,
        "cascade_ttft_p99_over_best_tier_c32": (ratio(cascade(32, "ttft_p99_ms"), best_tier(32, "ttft_p99_ms", True))
                                                if 32 in levels else None),
        "cascade_failed_c8": cascade(8, "failed"),
        "cascade_failed_c32": cascade(32, "failed"),
        "failed": sum(m["failed"] for level in levels.values() for m in level["models"].values()),
        "tier_down_transitions": transitions,
        "threads": threads,
        "by_level": {str(c): {m: {"tok_s": round(v["tok_s"], 1),
                                  "ttft_p50_ms": round(v["ttft_p50_ms"], 1) if v["ttft_p50_ms"] is not None else None,
                                  "ttft_p99_ms": round(v["ttft_p99_ms"], 1) if v["ttft_p99_ms"] is not None else None,
                                  "failed": v["failed"]} for m, v in level["models"].items()}
                     for c, level in levels.items()},
    }


def plot(levels: dict[int, dict[str, Any]], threads: dict[str, int], cpu: dict[str, Any], path: Path,
         static: dict[int, dict[str, Any]] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = sorted(levels)
    labels = {"cascade": "cascade (default route)", "edge": "edge tier alone", "gpu": "torch tier alone"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for model, style in (("cascade", "o-"), ("edge", "s--"), ("gpu", "^--")):
        ax1.plot(xs, [levels[c]["models"][model]["tok_s"] for c in xs], style, label=labels[model])
        p99 = [levels[c]["models"][model]["ttft_p99_ms"] for c in xs]
        ax2.plot(xs, [v / 1e3 if v is not None else float("nan") for v in p99], style, label=labels[model])
    if static:
        cs = sorted(static)
        edge = [static[c]["models"]["edge"] for c in cs]
        label = "edge alone, static split"
        ax1.plot(cs, [e["tok_s"] for e in edge], "x:", color="C1", label=label)
        ax2.plot(cs, [e["ttft_p99_ms"] / 1e3 for e in edge], "x:", color="C1", label=label)
    ax1.set(xscale="log", xlabel="concurrent streaming turns", ylabel="tokens/s received", title="Throughput")
    ax2.set(xscale="log", yscale="log", xlabel="concurrent streaming turns", ylabel="seconds",
            title="Time to first token, p99")
    for ax in (ax1, ax2):
        ax.set_xticks(xs, [str(c) for c in xs])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    split = ", ".join(f"{pool} {threads.get(pool, 0)}" for pool in POOLS)
    fig.suptitle(f"Real SmolLM2-135M tiers through the gateway, HTTP + Realtime; threads follow the load "
                 f"(split when both busy: {split})\n"
                 f"{cpu['model']}, {cpu['cores']} cores", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def main_levels(args: argparse.Namespace, directory: Path, cpu: dict[str, Any]) -> dict[str, Any]:
    async with Gateway(directory, max(args.levels), None, "levels") as gw:
        threads = host_threads(gw.process)
        progress(f"threads per pool (from /metrics): {threads}")
        start, moved, began = gw.transitions(), gw.reassignments(), time.perf_counter()
        levels = await run_levels(gw, args.levels, args.tokens, args.requests_min, args.apis, ["cascade", "edge", "gpu"])
        transitions = gw.transitions() - start
        reassignments_per_s = (gw.reassignments() - moved) / (time.perf_counter() - began)
        claims = metric_sum(gw.process, "gateway_thread_claim_wait_seconds_count")
        claim_wait_ms = metric_sum(gw.process, "gateway_thread_claim_wait_seconds_sum") * 1e3 / claims if claims else None
    static_levels = [c for c in (8, 32) if c in args.levels]
    static: dict[int, dict[str, Any]] = {}
    whole: dict[int, dict[str, Any]] = {}
    if static_levels:
        progress(f"the edge model id alone with the static split ([host] follow_load = false) at {static_levels}")
        async with Gateway(directory, max(static_levels), None, "static", budget="static") as gw:
            static = await run_levels(gw, static_levels, args.tokens, args.requests_min, args.apis, ["edge"])
        progress(f"the edge model id alone holding every core (the torch tier synthetic) at {static_levels}")
        async with Gateway(directory, max(static_levels), None, "whole", budget="whole") as gw:
            whole = await run_levels(gw, static_levels, args.tokens, args.requests_min, args.apis, ["edge"])
    peer = await run_peer(args, directory, 32 if 32 in args.levels else max(args.levels))
    summary = {**headline(levels, transitions, threads), **edge_figures(levels, static, whole, peer),
               "thread_reassignments_per_s": round(reassignments_per_s, 2),
               "thread_claims": claims, "thread_claim_wait_ms_mean": round(claim_wait_ms, 2) if claim_wait_ms else claim_wait_ms,
               "cpu": cpu["model"]}
    img = figure_path("cascade_load.png", args.smoke)
    plot(levels, threads, cpu, img, static)
    write_json(result_path("cascade_load.json", args.smoke), {
        "summary": summary, "levels": {str(c): v for c, v in levels.items()}, "cpu": cpu,
        "static_levels": {str(c): v for c, v in static.items()},
        "whole_levels": {str(c): v for c, v in whole.items()},
        "settings": {k: getattr(args, k) for k in ("levels", "tokens", "requests_min", "apis", "smoke")},
        "plot": str(img)})
    return summary


async def run_peer(args: argparse.Namespace, directory: Path, c: int) -> tuple[int, float] | None:
    """(c, tokens/s) of llama-cpp-python's own server on the same GGUF, streamed chat completions
    at ``c`` clients; None where its extra packages are not installed."""
    missing = peer_missing()
    if missing:
        progress(f"no peer arm: llama_cpp.server needs {', '.join(missing)} "
                 "(.venv/bin/pip install -e '.[bench-peer]', which `make bench` runs)")
        return None
    progress(f"llama-cpp-python's server (same GGUF, its default threads) at {c} clients")
    async with LlamaCppServer(default_gguf_path(), directory / "llama-cpp-server.log") as server:
        arm = await run_arm(server.url, "smollm2", "http", c, max(args.requests_min, 2 * c), args.tokens, 0)
    s = arm.summary()
    progress(f"  c={c:2d} peer    http    : {s['tok_s']:6.1f} tok/s, TTFT p50 {fmt_ms(s['ttft_p50_ms'])} "
             f"p99 {fmt_ms(s['ttft_p99_ms'])}, failed {s['failed']}/{s['turns']}")
    return c, s["tok_s"]


async def main_splits(args: argparse.Namespace, directory: Path, cpu: dict[str, Any]) -> dict[str, Any]:
    rows = {}
    for split in args.splits:
        threads = tuple(int(x) for x in split.split(","))
        if len(threads) != 3 or min(threads) < 1:
            raise BenchError(f"a split is edge,torch,drafter threads, each >= 1; got {split!r}")
        async with Gateway(directory, 32, threads, split.replace(",", "-")) as gw:  # type: ignore[arg-type]
            start = gw.transitions()
            levels = await run_levels(gw, [8, 32], args.tokens, args.requests_min, args.apis, ["cascade"])
            rows[split] = {"transitions": gw.transitions() - start,
                           **{f"c{c}": {k: levels[c]["models"]["cascade"][k]
                                        for k in ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "failed")} for c in levels}}
        progress(f"split {split}: {rows[split]}")
    write_json(result_path("cascade_splits.json", args.smoke), {"splits": rows, "cpu": cpu})
    return {"splits": rows, "cpu": cpu["model"]}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    raise_nofile_limit(8 * max(args.levels) + 512)
    cpu = cpu_facts()
    progress(f"CPU: {cpu['model']}, {cpu['cores']} cores; load average {load_average()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="cascade-load-") as tmp:
        if args.splits:
            return await main_splits(args, Path(tmp), cpu)
        return await main_levels(args, Path(tmp), cpu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32, 64], help="concurrent clients per level")
    p.add_argument("--tokens", type=int, default=64, help="max tokens per turn")
    p.add_argument("--requests-min", type=int, default=16, help="turns per arm at least (else 2 x concurrency)")
    p.add_argument("--apis", nargs="+", choices=["http", "realtime"], default=["http", "realtime"])
    p.add_argument("--splits", nargs="*", default=[], metavar="E,T,D",
                   help="instead: the cascade at 8 and 32 clients under each split of edge,torch,drafter threads")
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = p.parse_args()
    if args.smoke:
        args.levels, args.tokens, args.requests_min = [1, 8], 4, 2
    started = time.perf_counter()
    summary = asyncio.run(main_async(args))
    progress(f"done in {time.perf_counter() - started:.0f} s")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
