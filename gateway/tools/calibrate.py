"""Calibrating the cascade's threshold on a prompt set, as RouteLLM calibrates its routers.

    python -m gateway.tools.calibrate --prompts configs/cascade_prompts.jsonl --target-escalation 0.3

Every prompt runs greedily through both tiers of the configuration, in this process: the edge's
first ``hold_tokens`` token probabilities give the turn's confidence (the configured scorer),
and the two answers are compared. The threshold that escalates the target share of prompts is
then the one written out, with the agreement the cascade reaches there: the share of prompts
whose cascade answer (the edge's where it stays, the torch tier's where it escalates) equals
the answer of always escalating, and the agreement among the edge-served ones alone. A plot
of escalation rate against agreement over every threshold shows what other targets would buy.

Prompt files are JSON lines: ``{"prompt": "...", "category": "..."}`` (category optional).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import math
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from gateway.cascade.confidence import ConfidenceScorer, build_scorer
from gateway.config import DEFAULT_CONFIG, Config, load_config
from llm_shared.contract import Engine, FinishEvent, Priority, SamplingParams, TokenEvent
from llm_shared.errors import ConfigError, EngineError
from llm_shared.models import REPO_ROOT

DEFAULT_PROMPTS = REPO_ROOT / "configs" / "cascade_prompts.jsonl"
MAX_PROMPTS = 10_000
MAX_PROMPT_CHARS = 20_000


@dataclass(frozen=True)
class Prompt:
    prompt: str
    category: str = ""

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.prompt}]


@dataclass(frozen=True)
class Sample:
    """One prompt through both tiers."""

    category: str
    prompt: str
    confidence: float  # the edge's score of its first hold_tokens tokens
    edge_text: str
    gpu_text: str
    edge_seconds: float
    gpu_seconds: float

    @property
    def agree(self) -> bool:
        return " ".join(self.edge_text.split()) == " ".join(self.gpu_text.split())


def load_prompts(path: Path) -> list[Prompt]:
    """The prompt set, or ConfigError naming the line that is wrong."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the prompt file {str(path)!r}: {e}") from e
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{number}: not JSON ({e.msg})") from e
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str) or not entry["prompt"].strip():
            raise ConfigError(f"{path}:{number}: each line needs a non-empty string 'prompt'")
        if len(entry["prompt"]) > MAX_PROMPT_CHARS:
            raise ConfigError(f"{path}:{number}: the prompt is longer than {MAX_PROMPT_CHARS} characters")
        category = entry.get("category", "")
        if not isinstance(category, str):
            raise ConfigError(f"{path}:{number}: 'category' must be a string")
        prompts.append(Prompt(entry["prompt"], category))
        if len(prompts) > MAX_PROMPTS:
            raise ConfigError(f"{path}: more than {MAX_PROMPTS} prompts")
    if not prompts:
        raise ConfigError(f"{path}: no prompts")
    return prompts


async def run_tier(engine: Engine, request_id: str, prompt_ids: list[int],
                   params: SamplingParams) -> tuple[list[TokenEvent], str, float]:
    """One greedy generation: its tokens, its text and its seconds."""
    started = time.perf_counter()
    tokens: list[TokenEvent] = []
    text = ""
    async for event in engine.generate(request_id, prompt_ids, params, Priority.BATCH):
        if isinstance(event, TokenEvent):
            tokens.append(event)
            text += event.text
        elif isinstance(event, FinishEvent):
            if event.reason == "error":
                raise EngineError(f"the {engine.tier} tier failed on {request_id}: {event.message}")
            text += event.text
    return tokens, text, time.perf_counter() - started


async def collect(engines: Mapping[str, Engine], prompts: Sequence[Prompt], scorer: ConfidenceScorer,
                  hold_tokens: int, max_tokens: int,
                  progress: Callable[[int, int, Sample], None] | None = None) -> list[Sample]:
    """Every prompt through the edge, then the torch tier, one at a time."""
    edge, gpu = engines["edge"], engines["gpu"]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    samples = []
    for n, prompt in enumerate(prompts):
        ids = edge.tokenizer.encode_chat(prompt.messages)
        edge_tokens, edge_text, edge_s = await run_tier(edge, f"calibrate-edge-{n}", ids, params)
        _, gpu_text, gpu_s = await run_tier(gpu, f"calibrate-gpu-{n}", ids, params)
        held = [t.logprob for t in edge_tokens[:hold_tokens]]
        sample = Sample(prompt.category, prompt.prompt, scorer.score(held) if held else 0.0, edge_text, gpu_text,
                        edge_s, gpu_s)
        samples.append(sample)
        if progress is not None:
            progress(n + 1, len(prompts), sample)
    return samples


def pick_threshold(confidences: Sequence[float], target_escalation: float) -> float:
    """The threshold that escalates (scores below it) the ``target`` share of prompts, rounded
    to the nearest count; halfway between the last escalated and the first kept score."""
    scores = sorted(confidences)
    k = round(target_escalation * len(scores))
    if k <= 0:
        return max(0.0, scores[0] - 1e-6) if scores[0] > 0 else 0.0
    if k >= len(scores):
        return min(1.0, scores[-1] + 1e-6)
    return (scores[k - 1] + scores[k]) / 2


def evaluate(samples: Sequence[Sample], threshold: float) -> dict[str, float]:
    """What the cascade does at ``threshold`` on these samples."""
    kept = [s for s in samples if s.confidence >= threshold]
    escalated = len(samples) - len(kept)
    return {
        "threshold": threshold,
        "escalation_rate": escalated / len(samples),
        "edge_share": len(kept) / len(samples),
        # escalated turns are the torch tier's own answers: they agree by construction
        "agreement": (sum(s.agree for s in kept) + escalated) / len(samples),
        "edge_served_agreement": sum(s.agree for s in kept) / len(kept) if kept else 1.0,
    }


def curve(samples: Sequence[Sample]) -> list[dict[str, float]]:
    """``evaluate`` at every distinct cut of the scores, from escalating nothing to everything."""
    scores = sorted({s.confidence for s in samples})
    cuts = [0.0, *[(a + b) / 2 for a, b in itertools.pairwise(scores)], scores[-1] + 1e-6]  # the last: all escalate
    return [evaluate(samples, t) for t in cuts]


def snippet(threshold: float, command: str, summary: Mapping[str, float]) -> str:
    return (f"# {command}\n"
            f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.processor() or platform.machine()}: "
            f"escalation {summary['escalation_rate']:.2f}, agreement {summary['agreement']:.3f} "
            f"(edge-served {summary['edge_served_agreement']:.3f})\n"
            f"[cascade]\nthreshold = {threshold:.4f}\n")


def plot(points: Sequence[Mapping[str, float]], chosen: Mapping[str, float], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("calibrate: matplotlib is not installed; no plot", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p["escalation_rate"] for p in points], [p["agreement"] for p in points], marker=".", label="cascade")
    ax.plot([p["escalation_rate"] for p in points], [p["edge_served_agreement"] for p in points], linestyle="--",
            label="edge-served turns only")
    ax.scatter([chosen["escalation_rate"]], [chosen["agreement"]], color="red", zorder=3,
               label=f"threshold {chosen['threshold']:.3f}")
    ax.set_xlabel("escalation rate (share of turns sent to the torch tier)")
    ax.set_ylabel("agreement with always escalating")
    ax.set_xlim(0, 1)
    ax.set_ylim(max(0.0, min(p["edge_served_agreement"] for p in points) - 0.05), 1.01)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def cascade_config(config: Config) -> Config:
    """The configuration with both tiers built (whatever its routing default)."""
    return replace(config, routing=replace(config.routing, default="cascade"))


async def calibrate(config: Config, prompts: Sequence[Prompt], max_tokens: int) -> list[Sample]:
    from gateway.tiers.build import close_engines, load_engines

    scorer = build_scorer(config.cascade)
    print(f"calibrate: loading both tiers ({config.edge.model} on the edge, {config.engine.model} on the torch tier)",
          file=sys.stderr)
    engines = await load_engines(cascade_config(config))
    try:
        def progress(n: int, total: int, s: Sample) -> None:
            print(f"calibrate: [{n}/{total}] {s.category or '-':<18} confidence {s.confidence:.3f}  "
                  f"{'agree' if s.agree else 'differ'}  (edge {s.edge_seconds:.1f} s, torch {s.gpu_seconds:.1f} s)",
                  file=sys.stderr, flush=True)

        return await collect(engines, prompts, scorer, config.cascade.hold_tokens, max_tokens, progress)
    finally:
        await close_engines(engines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.tools.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="gateway config (both tiers are built)")
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="JSON lines with a 'prompt' each")
    parser.add_argument("--target-escalation", type=float, required=True,
                        help="share of prompts to send to the torch tier, 0..1")
    parser.add_argument("--max-tokens", type=int, default=32, help="answer length compared between tiers")
    parser.add_argument("--out", default="", help="write the [cascade] snippet here (default: print it only)")
    parser.add_argument("--plot", default="cascade_calibration.png", help="escalation vs agreement plot ('' for none)")
    parser.add_argument("--json", default="", help="write every sample and the curve here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if not 0.0 <= args.target_escalation <= 1.0 or math.isnan(args.target_escalation):
            raise ConfigError("--target-escalation must be between 0 and 1")
        if not 1 <= args.max_tokens <= 4096:
            raise ConfigError("--max-tokens must be 1..4096")
        config = load_config(args.config)
        prompts = load_prompts(Path(args.prompts))
        samples = asyncio.run(calibrate(config, prompts, args.max_tokens))
    except (ConfigError, EngineError) as e:
        print(f"calibrate: {e}", file=sys.stderr)
        return 2
    threshold = pick_threshold([s.confidence for s in samples], args.target_escalation)
    chosen = evaluate(samples, threshold)
    command = "python -m gateway.tools.calibrate " + " ".join(sys.argv[1:] if argv is None else argv)
    text = snippet(threshold, command, chosen)
    print(text, end="")
    print(f"calibrate: {len(samples)} prompts; threshold {threshold:.4f} escalates {chosen['escalation_rate']:.0%}; "
          f"agreement with always escalating {chosen['agreement']:.3f}, among edge-served turns "
          f"{chosen['edge_served_agreement']:.3f}", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    points = curve(samples)
    if args.plot and plot(points, chosen, Path(args.plot), f"{Path(args.prompts).name}: {len(samples)} prompts, "
                                                         f"scorer {config.cascade.scorer}"):
        print(f"calibrate: plot written to {args.plot}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"chosen": chosen, "curve": points,
                                               "samples": [asdict(s) | {"agree": s.agree} for s in samples]},
                                              indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
