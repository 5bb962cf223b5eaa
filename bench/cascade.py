"""The cascade over the shipped prompt set (issue 12): how many turns stay on the edge, how
close the answers come to always escalating, and what escalation costs in time to first token.

One run, both tiers of the default configuration (the embedded SmolLM2-135M on each):

1. **Calibrate**: every prompt greedily through both tiers in-process (what
   ``python -m gateway.tools.calibrate`` does); the threshold that escalates
   ``--target-escalation`` of them (default 0.3) is the one served next.
2. **Serve**: fresh engines (so no cache from step 1 helps), a gateway in this process with that
   threshold, and for each prompt, one at a time, greedy streamed chat completions: first with
   the torch tier's model id (always escalate), then with the cascade's id. TTFT is from sending
   the request to the first content chunk. The torch engine's prefix cache is off, so the
   cascade's escalated turn does not find the prompt the direct turn just computed.

Figures (the last stdout line is one JSON object with these keys, plus ``cpu``):

- ``edge_share``: share of cascade turns the edge served;
- ``agreement``: share of prompts whose cascade answer equals the always-escalate answer
  (whitespace-normalized);
- ``edge_ttft_ratio``: TTFT p50 of edge-served cascade turns / TTFT p50 of the torch-tier turns;
- ``escalation_overhead_ms``: median, over escalated prompts, of their cascade TTFT minus the
  same prompt's TTFT sent straight to the torch tier;
- ``held_accept_rate``: held edge tokens the torch tier accepted / held tokens handed over.

Results go to bench/out/cascade.json, plots to docs/img/cascade_ttft.png and
docs/img/cascade_calibration.png. Run: ``.venv/bin/python bench/cascade.py`` (about 6 minutes
on a quiet 2-core machine). ``--smoke``: the first prompt of each category, 12 tokens each (past
the 8-token hold window), results and figures in bench/out/smoke/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from bench._common import (
    IMG_DIR,
    REPO_ROOT,
    SMOKE_DIR,
    SMOKE_HELP,
    cpu_facts,
    median,
    progress,
    result_path,
    write_json,
)
from gateway.config import DEFAULT_CONFIG, Config, load_config
from gateway.http.state import STATE
from gateway.process.server import create_app, start_server
from gateway.tiers.build import close_engines, load_engines
from gateway.tools.calibrate import (
    DEFAULT_PROMPTS,
    Prompt,
    calibrate,
    cascade_config,
    curve,
    evaluate,
    load_prompts,
    pick_threshold,
)
from gateway.tools.calibrate import plot as plot_calibration

SMOKE_MAX_TOKENS = 12  # past the hold window (8), so a confident turn also streams after its release


@dataclass
class Turn:
    category: str
    prompt: str
    model: str
    ttft_s: float
    text: str
    tier: str
    route: str
    confidence: float | None


async def stream_turn(http: aiohttp.ClientSession, url: str, model: str, prompt: Prompt, max_tokens: int) -> Turn:
    body = {"model": model, "messages": prompt.messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    started = time.perf_counter()
    ttft, text, head = None, "", {}
    async with http.post(f"{url}/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{model}: HTTP {response.status}: {await response.text()}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{model}: {chunk['error']}")
            head = chunk
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    text += content
    route = head.get("x_route") or {}
    return Turn(prompt.category, prompt.prompt, model, ttft if ttft is not None else time.perf_counter() - started,
                text, head.get("x_tier", "?"), route.get("route", "model"), route.get("confidence"))


def held_tokens(metrics: str) -> tuple[float, float]:
    counts = {"accepted": 0.0, "rejected": 0.0}
    for line in metrics.splitlines():
        if line.startswith("gateway_cascade_held_tokens_total{"):
            counts[line.split('"')[1]] = float(line.split()[-1])
    return counts["accepted"], counts["rejected"]


async def serve(config: Config, prompts: list[Prompt], max_tokens: int) -> tuple[list[Turn], list[Turn], str]:
    engines = await load_engines(config)
    app = create_app(config, engines)
    server = await start_server(app)
    direct, cascaded = [], []
    try:
        routing = config.routing
        async with aiohttp.ClientSession() as http:
            await stream_turn(http, server.url, routing.gpu_model, Prompt("Hello!"), 4)  # warm both paths
            await stream_turn(http, server.url, routing.cascade_model, Prompt("Hello!"), 4)
            for n, prompt in enumerate(prompts):
                direct.append(await stream_turn(http, server.url, routing.gpu_model, prompt, max_tokens))
                cascaded.append(await stream_turn(http, server.url, routing.cascade_model, prompt, max_tokens))
                c, d = cascaded[-1], direct[-1]
                progress(f"serve [{n + 1}/{len(prompts)}] {prompt.category:<18} cascade {c.tier:<4} {c.route:<10} "
                         f"ttft {c.ttft_s * 1e3:6.0f} ms | torch ttft {d.ttft_s * 1e3:6.0f} ms")
            metrics = await (await http.get(f"{server.url}/metrics")).text()
        assert app[STATE].ready
    finally:
        await server.stop()
        await close_engines(engines)
    return direct, cascaded, metrics


def same(a: str, b: str) -> bool:
    return " ".join(a.split()) == " ".join(b.split())


def plot_ttft(direct: list[Turn], cascaded: list[Turn], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {
        "cascade,\nedge-served": [t.ttft_s * 1e3 for t in cascaded if t.tier == "edge"],
        "cascade,\nescalated": [t.ttft_s * 1e3 for t in cascaded if t.route == "escalated"],
        "torch tier\ndirect": [t.ttft_s * 1e3 for t in direct],
    }
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.boxplot([v or [float("nan")] for v in groups.values()], showfliers=True)
    ax.set_xticks(range(1, len(groups) + 1), [f"{k}\n(n={len(v)})" for k, v in groups.items()])
    for i, values in enumerate(groups.values(), 1):
        ax.scatter([i] * len(values), values, s=8, alpha=0.5)
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def first_of_each_category(prompts: list[Prompt]) -> list[Prompt]:
    """One prompt per category, in the set's order: the smoke run's set."""
    firsts: dict[str, Prompt] = {}
    for prompt in prompts:
        firsts.setdefault(prompt.category, prompt)
    return list(firsts.values())


async def run(args: argparse.Namespace) -> dict[str, Any]:
    base = load_config(args.config)
    config = cascade_config(base)
    prompts = load_prompts(Path(args.prompts))
    if args.smoke:
        prompts = first_of_each_category(prompts)
    progress(f"calibrating on {len(prompts)} prompts ({args.max_tokens} tokens each, both tiers)")
    samples = await calibrate(config, prompts, args.max_tokens)
    threshold = pick_threshold([s.confidence for s in samples], args.target_escalation)
    chosen = evaluate(samples, threshold)
    progress(f"threshold {threshold:.4f}: escalates {chosen['escalation_rate']:.0%} of the prompt set")
    served = replace(config, cascade=replace(config.cascade, threshold=threshold,
                                             min_threshold=min(config.cascade.min_threshold, threshold)),
                     engine=replace(config.engine, enable_prefix_caching=False))
    progress("serving the prompt set through a fresh gateway: torch tier direct, then the cascade, per prompt")
    direct, cascaded, metrics = await serve(served, prompts, args.max_tokens)

    edge_turns = [t for t in cascaded if t.tier == "edge"]
    escalated = [(c, d) for c, d in zip(cascaded, direct, strict=True) if c.route == "escalated"]
    accepted, rejected = held_tokens(metrics)
    direct_p50 = median([t.ttft_s for t in direct])
    headline = {
        "edge_share": len(edge_turns) / len(cascaded),
        "agreement": sum(same(c.text, d.text) for c, d in zip(cascaded, direct, strict=True)) / len(cascaded),
        "edge_ttft_ratio": median([t.ttft_s for t in edge_turns]) / direct_p50 if edge_turns else None,
        "escalation_overhead_ms": (median([(c.ttft_s - d.ttft_s) * 1e3 for c, d in escalated])
                                   if escalated else None),
        "held_accept_rate": accepted / (accepted + rejected) if accepted + rejected else None,
    }
    details = {
        "threshold": threshold,
        "calibration": chosen,
        "ttft_p50_ms": {"edge_served": median([t.ttft_s for t in edge_turns]) * 1e3 if edge_turns else None,
                        "escalated": median([c.ttft_s for c, _ in escalated]) * 1e3 if escalated else None,
                        "torch_direct": direct_p50 * 1e3},
        "routes": {route: sum(t.route == route for t in cascaded) for route in {t.route for t in cascaded}},
        "edge_share_by_category": {
            cat: sum(t.tier == "edge" for t in cascaded if t.category == cat) / sum(t.category == cat for t in cascaded)
            for cat in sorted({t.category for t in cascaded})},
        "held_tokens": {"accepted": accepted, "rejected": rejected},
    }
    result = {"headline": headline, "details": details, "config": {
        "prompts": str(Path(args.prompts)), "prompt_count": len(prompts), "smoke": args.smoke,
        "max_tokens": args.max_tokens, "target_escalation": args.target_escalation,
        "hold_tokens": config.cascade.hold_tokens, "scorer": config.cascade.scorer,
        "speculative": config.engine.speculative.method, "torch_dtype": config.engine.dtype},
        "calibration_samples": [asdict(s) for s in samples],
        "calibration_curve": curve(samples),
        "turns": {"direct": [asdict(t) for t in direct], "cascade": [asdict(t) for t in cascaded]}}
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    parser.add_argument("--target-escalation", type=float, default=0.3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, help="results (default: bench/out/cascade.json)")
    parser.add_argument("--plot-dir", help="where the two figures go ('' for none; default: docs/img)")
    parser.add_argument("--from-json", type=Path, default=None, help="report and plot a saved run instead of running")
    parser.add_argument("--smoke", action="store_true",
                        help=f"{SMOKE_HELP}: one prompt per category, {SMOKE_MAX_TOKENS} tokens each")
    args = parser.parse_args(argv)
    if args.smoke:
        args.max_tokens = SMOKE_MAX_TOKENS
    args.out = args.out or result_path("cascade.json", args.smoke)
    # a str until here: Path("") would be "." and draw the figures into the working directory
    args.plot_dir = (SMOKE_DIR if args.smoke else IMG_DIR) if args.plot_dir is None else args.plot_dir
    args.plot_dir = Path(args.plot_dir) if str(args.plot_dir) else None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text(encoding="utf-8"))
    else:
        result = asyncio.run(run(args))
        result["cpu"] = cpu_facts()
        write_json(args.out, result)
    h, d = result["headline"], result["details"]
    cpu = result["cpu"]["model"]
    if args.plot_dir is not None:
        plot_calibration(result["calibration_curve"], d["calibration"], args.plot_dir / "cascade_calibration.png",
                         f"cascade_prompts.jsonl, {len(result['turns']['cascade'])} prompts, {cpu}")
        turns = result["turns"]
        plot_ttft([Turn(**t) for t in turns["direct"]], [Turn(**t) for t in turns["cascade"]],
                  args.plot_dir / "cascade_ttft.png", f"TTFT per route at threshold {d['threshold']:.3f} ({cpu})")
    print(f"threshold {d['threshold']:.4f} (target escalation {args.target_escalation:.0%}); routes {d['routes']}")
    print(f"edge share {h['edge_share']:.2f}, agreement with always escalating {h['agreement']:.3f}")
    print(f"TTFT p50 ms: edge-served {d['ttft_p50_ms']['edge_served']}, escalated {d['ttft_p50_ms']['escalated']}, "
          f"torch direct {d['ttft_p50_ms']['torch_direct']:.0f}")
    print(f"held tokens accepted on escalation: {d['held_tokens']}")
    figures = {k: None if v is None else round(v, 4) for k, v in h.items()}
    if args.from_json is None:
        out = args.out.relative_to(REPO_ROOT) if args.out.is_relative_to(REPO_ROOT) else args.out
        progress(f"wrote {out}")
    print(json.dumps({**figures, "cpu": cpu}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
