"""Speculative decoding in the torch engine on this machine's CPU, every arm side by side in one run.

Target: the embedded SmolLM2-135M GGUF through the in-process LLMEngine (dequantized, in the
dtype ``auto`` picks here), all cores; drafter: the same GGUF through llama.cpp (method "edge"),
or prompt lookup (method "ngram"). One model, one KV pool and one llama.cpp drafter serve every
arm; each arm is a fresh scheduler and speculator, so arms differ only in speculation. Greedy,
ignore_eos, the same prompts in every arm; prefix caching is off everywhere because interleaved
arms share the KV pool, and one scheduler's cached blocks would be overwritten by another's.

1. concurrency 1, chat prompts served one at a time, the arms interleaved prompt by prompt:
   no speculation, the edge drafter with a fixed k (adaptive off), and the edge drafter as
   configured by default (adaptive). Speedup = median over prompts of the paired time ratios.
2. acceptance rate and tokens per verification round of the fixed-k arm, the drafter's cost
   per draft token over a plain decode step (both timed here), the cost of verifying k drafts
   over a 1-token step (runner.execute timed directly), and what Leviathan et al. (2023)
   predict from them: E = (1 - a^(k+1)) / (1 - a) tokens per round over k * c + v_k steps;
   and the same per whole request, with the target's prefill and the drafter's catch-up on the
   prompt (a request's first drafting step feeds it all to llama.cpp), which the formula leaves out.
3. the n-gram drafter on prompts whose answer copies the prompt (repeat a text, fix a typo).
4. throughput (A-B-B-A quads of runs, so that a drift of the machine's speed cancels; the
   median of the quads' ratios) with the edge drafter as configured by default (every step priced from measured
   costs, default max_batch) vs none at 2..32 requests added at once; concurrency 1 is arm 1's
   adaptive figure. Each arm is a fresh engine (a server just started): its speculator
   calibrates, then learns, within the run.

Progress on stderr; full results in bench/out/spec.json, a plot in docs/img/spec_speedup.png; the
last stdout line is one JSON object (speedup_c1, acceptance_rate, mean_accepted_len, cost_ratio,
predicted_speedup_c1, efficiency_vs_predicted, ngram_speedup_copy, speedup_c32,
speedup_min_over_concurrency, cpu, ...). A --quick run writes bench/out/spec_quick.json and
bench/out/spec_quick.png instead; a --smoke run (seconds) writes under bench/out/smoke/.

    .venv/bin/python bench/spec.py [--k 4] [--prompts 6] [--tokens 96] [--copy-prompts 3]
        [--copy-tokens 96] [--concurrency 1 2 4 8 16 32] [--conc-tokens 64] [--pairs 8] [--quick | --smoke]

About 7 minutes on an idle 2-core AVX-512 machine (bf16; 5 minutes with 5 quads), longer on an
AVX2 one (fp32); --quick runs small sizes in about a minute, --smoke tiny ones to check that it
runs. Where speculation is priced out, both arms run the same steps: the quads' spread there
(0.85-1.11 per quad at 2 requests) is the machine's noise, which the median of 8 quads narrows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

from bench._common import (
    OUT_DIR,
    SMOKE_HELP,
    cpu_dtype,
    cpu_facts,
    figure_path,
    load_average,
    median,
    progress,
    result_path,
    write_json,
)
from bench._spec_drive import (
    Run,
    TimedDrafter,
    chat_prompts,
    copy_prompts,
    drive,
    plot,
    verify_step_times,
)
from bench.engine import OtherLoad
from engine_gpu.config import SpeculativeConfig
from engine_gpu.engine import LLMEngine
from engine_gpu.runner import ModelRunner
from engine_gpu.speculative.speculator import Speculator, build_speculator
from gateway.config import DEFAULT_CONFIG, load_config
from llm_shared.models import tokenizer_for

_HERE = Path(__file__).resolve().parent

DRAFT_MODEL = "smollm2-135m"
OFF = SpeculativeConfig()


class Setup:
    """The target model and KV pool, and one llama.cpp drafter, shared by every arm."""

    def __init__(self, threads: int, dtype: str) -> None:
        config = load_config(DEFAULT_CONFIG)
        self.base = replace(config.engine, dtype=dtype, device="cpu", threads=threads, enable_prefix_caching=False)
        self.model_cfg = config.model(self.base.model)
        progress(f"loading {self.model_cfg.id} ({self.model_cfg.source}) in {dtype}, {threads} threads")
        self.tokenizer = tokenizer_for(self.model_cfg)
        self.runner = ModelRunner.from_config(self.model_cfg, self.base)
        progress(f"loading the edge drafter {DRAFT_MODEL} through llama.cpp (tokenizer checked against the target's)")
        drafting = SpeculativeConfig(method="edge", draft_model=DRAFT_MODEL, draft_threads=threads)
        edge = build_speculator(drafting, config.model(DRAFT_MODEL), self.tokenizer, self.base.max_num_seqs)
        assert edge is not None
        self.edge_drafter = edge.drafter

    def engine(self, spec: SpeculativeConfig) -> LLMEngine:
        """A fresh scheduler (and speculator, drafter wrapped in a TimedDrafter) over the shared model."""
        config = replace(self.base, speculative=spec)
        speculator = None
        if spec.method == "edge":
            speculator = Speculator(spec, TimedDrafter(self.edge_drafter))
        elif spec.method == "ngram":
            ngram = build_speculator(spec, None, self.tokenizer, self.base.max_num_seqs)
            assert ngram is not None
            speculator = Speculator(spec, TimedDrafter(ngram.drafter))
        return LLMEngine(self.runner, self.tokenizer, config, model_cfg=self.model_cfg, speculator=speculator)

    def close(self) -> None:
        self.edge_drafter.close()


def timed(engine: LLMEngine) -> TimedDrafter:
    assert engine.speculator is not None and isinstance(engine.speculator.drafter, TimedDrafter)
    return engine.speculator.drafter


def warm_up(s: Setup, arms: dict[str, SpeculativeConfig], prompt: list[int], batch: int = 1) -> None:
    """One short run per arm on a throwaway scheduler: torch and llama.cpp warm, no controller state kept."""
    for name, spec in arms.items():
        engine = s.engine(spec)
        drive(engine, [prompt] * batch, 8, f"warm-{name}")
        engine.close()


def interleaved(s: Setup, arms: dict[str, SpeculativeConfig], prompts: list[list[int]], tokens: int,
                tag: str) -> tuple[dict[str, list[Run]], dict[str, LLMEngine]]:
    """Concurrency 1: each prompt through every arm in turn (the order rotating), one engine per arm."""
    warm_up(s, arms, prompts[0])
    engines = {name: s.engine(spec) for name, spec in arms.items()}
    runs: dict[str, list[Run]] = {name: [] for name in arms}
    names = list(arms)
    for i, prompt in enumerate(prompts):
        for name in names[i % len(names):] + names[: i % len(names)]:
            runs[name].append(drive(engines[name], [prompt], tokens, f"{tag}-{name}-{i}"))
        progress(f"  prompt {i + 1}/{len(prompts)} ({len(prompt)} tokens): "
                 + ", ".join(f"{name} {runs[name][-1].tok_s:.1f} tok/s" for name in names))
    return runs, engines


def arm_summary(runs: list[Run], plain: list[Run], engine: LLMEngine) -> dict:
    ratios = [p.seconds / r.seconds for r, p in zip(runs, plain, strict=True)]
    tokens, seconds = sum(r.tokens for r in runs), sum(r.seconds for r in runs)
    same = sum(r.outputs == p.outputs for r, p in zip(runs, plain, strict=True))
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "speedup": median(ratios),
            "speedup_aggregate": (tokens / seconds) / (sum(p.tokens for p in plain) / sum(p.seconds for p in plain)),
            "speedup_per_prompt": ratios, "outputs_identical_to_plain": f"{same}/{len(runs)}",
            **drafting(engine), "stats": engine.stats()}


def drafting(engine: LLMEngine) -> dict:
    calls = timed(engine).calls
    return {"propose_calls": len(calls), "propose_s": sum(c.seconds for c in calls)}


def arm_c1(s: Setup, prompts: list[list[int]], tokens: int, k: int, verify_reps: int) -> dict:
    edge = SpeculativeConfig(method="edge", draft_model=DRAFT_MODEL, num_draft_tokens=k)
    arms = {"plain": OFF, "edge_fixed": replace(edge, adaptive=False), "edge_adaptive": edge}
    progress(f"concurrency 1: {len(prompts)} chat prompts x {tokens} tokens, no speculation vs edge drafter "
             f"(fixed k = {k}) vs edge drafter (adaptive, k <= {k}), interleaved prompt by prompt")
    runs, engines = interleaved(s, arms, prompts, tokens, "c1")
    out: dict = {"plain": {"tokens": sum(r.tokens for r in runs["plain"]), "seconds": sum(r.seconds for r in runs["plain"]),
                           "stats": engines["plain"].stats()}}
    out["plain"]["tok_s"] = out["plain"]["tokens"] / out["plain"]["seconds"]
    for name in ("edge_fixed", "edge_adaptive"):
        out[name] = arm_summary(runs[name], runs["plain"], engines[name])
        st = out[name]["stats"]
        progress(f"  {name}: {out[name]['tok_s']:.1f} tok/s vs {out['plain']['tok_s']:.1f}, speedup "
                 f"{out[name]['speedup']:.2f} (aggregate {out[name]['speedup_aggregate']:.2f}); acceptance "
                 f"{st['spec_acceptance_rate']:.2f}, {st['spec_mean_accepted_len']:.2f} tokens per round; drafting "
                 f"{out[name]['propose_s']:.1f} s in {out[name]['propose_calls']} calls; priced out "
                 f"{st['spec_off_by_gain']:.0f} steps; outputs identical to plain: {out[name]['outputs_identical_to_plain']}")

    out["model"] = prediction(s, runs, timed(engines["edge_fixed"]), out["edge_fixed"], prompts[0], k, verify_reps)
    for name in engines:
        engines[name].close()
    return out


def prediction(s: Setup, runs: dict[str, list[Run]], drafter: TimedDrafter, fixed: dict, prompt: list[int], k: int,
               verify_reps: int) -> dict:
    """Leviathan et al.'s expected speedup for the fixed-k arm, every term timed in this run."""
    plain_steps = [t for r in runs["plain"] for t in r.decode_step_s]
    plain_step = statistics.fmean(plain_steps)
    per_position, steady_calls = drafter.steady_seconds_per_position()
    c = per_position / plain_step
    progress(f"timing verification at batch 1 with 0..{k} drafts on the runner ({verify_reps} reps each)")
    vt = verify_step_times(s.runner, prompt, runs["plain"][0].outputs[0], k, verify_reps)
    v_k = vt[k] / vt[0]
    st = fixed["stats"]
    a = st["spec_accepted_tokens"] / st["spec_draft_tokens"] if st["spec_draft_tokens"] else 0.0
    expected = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0
    predicted = expected / (k * c + v_k)
    measured_len = st["spec_mean_accepted_len"]
    # Outside the formula: each request's first propose also feeds its whole prompt to the drafter.
    firsts = [call for call in drafter.calls if call.first]
    catch_up = statistics.fmean(call.seconds - call.positions * per_position for call in firsts)
    prefill = statistics.fmean(sum(r.other_step_s) for r in runs["plain"])
    n = statistics.fmean(len(o) for r in runs["plain"] for o in r.outputs)
    whole = (prefill + (n - 1) * plain_step) / (prefill + catch_up + (n - 1) / expected * (k * c + v_k) * plain_step)
    speedup = fixed["speedup"]
    progress(f"  plain decode step (engine.step, batch 1): mean {plain_step * 1e3:.1f} ms over {len(plain_steps)} "
             f"steps; runner.execute with 1 token: {vt[0] * 1e3:.1f} ms")
    progress(f"  drafter: {per_position * 1e3:.2f} ms per draft token ({steady_calls} propose calls of k = {k}); "
             f"a request's first call also feeds its prompt: +{catch_up * 1e3:.0f} ms (mean of {len(firsts)})")
    progress("  verify step / 1-token step: " + ", ".join(f"v_{j} = {t / vt[0]:.2f}" for j, t in enumerate(vt)))
    progress(f"  predicted speedup = E / (k*c + v_k), E = (1 - a^(k+1)) / (1 - a): a = {a:.3f}, k = {k}, "
             f"E = {expected:.2f} (measured tokens per round {measured_len:.2f}), c = {c:.3f}, v_k = {v_k:.2f} "
             f"-> {expected:.2f} / ({k} * {c:.3f} + {v_k:.2f}) = {predicted:.2f}")
    progress(f"  measured {speedup:.2f} / predicted {predicted:.2f} = efficiency {speedup / predicted:.2f}; with "
             f"the target's prefill ({prefill * 1e3:.0f} ms) and the drafter's prompt catch-up per request of "
             f"{n:.0f} tokens, the prediction is {whole:.2f} (efficiency {speedup / whole:.2f})")
    return {
        "k": k, "acceptance_rate": a, "expected_tokens_per_round": expected, "mean_accepted_len": measured_len,
        "cost_ratio": c, "drafter_s_per_draft_token": per_position, "drafter_steady_calls": steady_calls,
        "drafter_prompt_catch_up_s": catch_up, "drafter_first_calls": len(firsts),
        "plain_step_s_mean": plain_step, "plain_step_s_median": median(plain_steps), "plain_steps": len(plain_steps),
        "plain_prefill_s_mean": prefill, "tokens_per_request": n,
        "runner_step_s_by_drafts": vt, "v_by_drafts": [t / vt[0] for t in vt], "v_k": v_k,
        "predicted_speedup": predicted, "predicted_speedup_measured_len": measured_len / (k * c + v_k),
        "efficiency_vs_predicted": speedup / predicted,
        "predicted_speedup_whole_request": whole, "efficiency_vs_whole_request": speedup / whole,
        "formula": "E / (k * c + v_k), E = (1 - a^(k+1)) / (1 - a); whole request: (P + (n-1) s) / "
                   "(P + D + (n-1) / E * (k c + v_k) s), P target prefill, D drafter prompt catch-up, s plain step",
    }


def arm_copy(s: Setup, prompts: list[list[int]], tokens: int, k: int) -> dict:
    ngram = SpeculativeConfig(method="ngram", num_draft_tokens=k)
    progress(f"copy workload: {len(prompts)} prompts x {tokens} tokens, no speculation vs n-gram drafter "
             f"(k <= {k}, adaptive), interleaved")
    runs, engines = interleaved(s, {"plain": OFF, "ngram": ngram}, prompts, tokens, "copy")
    out = arm_summary(runs["ngram"], runs["plain"], engines["ngram"])
    out["plain_tok_s"] = sum(r.tokens for r in runs["plain"]) / sum(r.seconds for r in runs["plain"])
    out["sample_output"] = s.tokenizer.decode(runs["plain"][0].outputs[0])[:300]
    st = out["stats"]
    progress(f"  n-gram: {out['tok_s']:.1f} tok/s vs {out['plain_tok_s']:.1f}, speedup {out['speedup']:.2f}; "
             f"acceptance {st['spec_acceptance_rate']:.2f}, {st['spec_mean_accepted_len']:.2f} tokens per round; "
             f"outputs identical to plain: {out['outputs_identical_to_plain']}")
    progress(f"  the plain answer begins: {out['sample_output'][:120]!r}")
    for engine in engines.values():
        engine.close()
    return out


def arm_concurrency(s: Setup, levels: list[int], tokens: int, pairs: int, k: int) -> dict:
    edge = SpeculativeConfig(method="edge", draft_model=DRAFT_MODEL, num_draft_tokens=k)
    arms = {"plain": OFF, "edge_adaptive": edge}
    progress(f"concurrency sweep {levels}: {tokens} tokens per request, all added at once, no speculation vs the "
             f"edge drafter with every step priced (none above {edge.max_batch} decoding), {pairs} pair(s) each")
    warm_up(s, arms, chat_prompts(s.tokenizer, 1)[0], batch=max(levels))  # the largest shapes, once
    rows: dict[int, dict] = {}
    for n, c in enumerate(levels):
        prompts = chat_prompts(s.tokenizer, c)
        pair_rows = []
        for p in range(pairs):
            # A B B A (or B A A B): a drift of the machine's speed during the quad cancels out
            first, second = list(arms) if (n + p) % 2 == 0 else list(reversed(arms))
            runs: dict[str, list] = {name: [] for name in arms}
            for i, name in enumerate((first, second, second, first)):
                engine = s.engine(arms[name])
                runs[name].append((drive(engine, prompts, tokens, f"conc{c}-{p}-{name}-{i}"),
                                   {**engine.stats(), **(drafting(engine) if engine.speculator else {})}))
                engine.close()
            plain_tok_s = statistics.fmean(r.tok_s for r, _ in runs["plain"])
            spec_tok_s = statistics.fmean(r.tok_s for r, _ in runs["edge_adaptive"])
            plain, (spec, st) = runs["plain"][0][0], runs["edge_adaptive"][-1]
            st = {**st, "propose_calls": sum(x.get("propose_calls", 0) for _, x in runs["edge_adaptive"]),
                  "propose_s": sum(x.get("propose_s", 0.0) for _, x in runs["edge_adaptive"])}
            pair_rows.append({
                "plain_tok_s": plain_tok_s, "spec_tok_s": spec_tok_s, "speedup": spec_tok_s / plain_tok_s,
                "runs_tok_s": {name: [r.tok_s for r, _ in rs] for name, rs in runs.items()},
                "outputs_identical_to_plain": f"{sum(a == b for a, b in zip(spec.outputs, plain.outputs, strict=True))}/{c}",
                "switch": {key: st.get(key, 0.0) for key in ("spec_enabled", "spec_off_by_batch", "spec_off_by_gain",
                                                             "spec_predicted_gain",
                                                             "spec_rounds", "propose_calls", "propose_s")},
                "stats": st,
            })
            sw = pair_rows[-1]["switch"]
            progress(f"  concurrency {c:2d} quad {p + 1}: plain {plain_tok_s:.1f} tok/s, speculative {spec_tok_s:.1f} "
                     f"-> {spec_tok_s / plain_tok_s:.3f}; switch: enabled {sw['spec_enabled']:.0f}, off by batch "
                     f"{sw['spec_off_by_batch']:.0f} steps, priced out {sw['spec_off_by_gain']:.0f} (predicted gain "
                     f"{sw['spec_predicted_gain']:.2f}); "
                     f"{sw['propose_calls']:.0f} drafting steps took {sw['propose_s']:.1f} s, "
                     f"{st['drafter_catchup_tokens']:.0f} tokens fed to catch up")
        rows[c] = {"speedup": median([r["speedup"] for r in pair_rows]), "pairs": pair_rows}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round (the fixed arm's k, the others' most)")
    parser.add_argument("--prompts", type=int, default=6, help="chat prompts at concurrency 1")
    parser.add_argument("--tokens", type=int, default=96, help="output tokens per prompt at concurrency 1")
    parser.add_argument("--copy-prompts", type=int, default=3)
    parser.add_argument("--copy-tokens", type=int, default=96)
    parser.add_argument("--ngram-k", type=int, default=4, help="the n-gram drafter's most drafts per round")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--conc-tokens", type=int, default=64, help="output tokens per request in the sweep")
    parser.add_argument("--pairs", type=int, default=8,
                        help="A-B-B-A quads of runs per concurrency level in the sweep (speedup: their median)")
    parser.add_argument("--verify-reps", type=int, default=12, help="timed runner calls per draft count")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="small sizes (~1-2 min)")
    sizes.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.tokens, args.copy_prompts, args.copy_tokens = 2, 16, 1, 24
        args.concurrency, args.conc_tokens, args.pairs, args.verify_reps = [1, 2, 4, 32], 6, 1, 3
    if args.smoke:
        args.prompts, args.tokens, args.copy_prompts, args.copy_tokens = 1, 8, 1, 8
        args.concurrency, args.conc_tokens, args.pairs, args.verify_reps = [1, 2, 16], 4, 1, 1
    started = time.perf_counter()
    load_before = load_average()
    cpu = cpu_facts()
    progress(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags {cpu['flags']}; load average {load_before[0]:.2f}")
    s = Setup(args.threads, cpu_dtype(args.dtype))
    load = OtherLoad()
    c1 = arm_c1(s, chat_prompts(s.tokenizer, args.prompts), args.tokens, args.k, args.verify_reps)
    load.lap("concurrency 1")
    copy = arm_copy(s, copy_prompts(s.tokenizer, args.copy_prompts), args.copy_tokens, args.ngram_k)
    load.lap("copy")
    sweep = arm_concurrency(s, [c for c in args.concurrency if c > 1], args.conc_tokens, args.pairs, args.k)
    load.lap("concurrency sweep")
    s.close()

    by_conc = {1: c1["edge_adaptive"]["speedup"], **{c: row["speedup"] for c, row in sweep.items()}}
    model = c1["model"]
    title = (f"Speculative decoding, SmolLM2-135M {s.base.dtype} target\n{cpu['model']}, {cpu['cores']} cores "
             f"({', '.join(cpu['flags'])})")
    # a quick or smoke run writes beside the full results, never over them
    img = OUT_DIR / "spec_quick.png" if args.quick else figure_path("spec_speedup.png", args.smoke)
    out_path = OUT_DIR / "spec_quick.json" if args.quick else result_path("spec.json", args.smoke)
    plot(by_conc, c1["edge_fixed"]["speedup"], SpeculativeConfig().max_batch, args.k, title, img)
    summary = {
        "speedup_c1": round(c1["edge_fixed"]["speedup"], 3),
        "acceptance_rate": round(model["acceptance_rate"], 3),
        "mean_accepted_len": round(model["mean_accepted_len"], 3),
        "cost_ratio": round(model["cost_ratio"], 4),
        "predicted_speedup_c1": round(model["predicted_speedup"], 3),
        "efficiency_vs_predicted": round(model["efficiency_vs_predicted"], 3),
        "ngram_speedup_copy": round(copy["speedup"], 3),
        "speedup_c32": round(sweep[32]["speedup"], 3) if 32 in sweep else None,
        "cpu": cpu["model"],
        "dtype": s.base.dtype,
        "threads": args.threads,
        "k": args.k,
        "v_k": round(model["v_k"], 3),
        "speedup_c1_adaptive": round(c1["edge_adaptive"]["speedup"], 3),
        "speedup_by_concurrency": {str(c): round(v, 3) for c, v in sorted(by_conc.items())},
        "speedup_min_over_concurrency": round(min(by_conc.values()), 3),
        "quick": args.quick,
        "smoke": args.smoke,
    }
    results = {
        "summary": summary,
        "settings": {k: getattr(args, k) for k in ("k", "prompts", "tokens", "copy_prompts", "copy_tokens", "ngram_k",
                                                   "concurrency", "conc_tokens", "pairs", "verify_reps", "threads",
                                                   "quick", "smoke")},
        "engine_config": {k: v for k, v in asdict(s.base).items() if k != "speculative"},
        "speculative_defaults": asdict(SpeculativeConfig()),
        "drafter_threads": args.threads,
        "cpu": cpu,
        "concurrency_1": c1,
        "copy": copy,
        "concurrency": {str(c): row for c, row in sweep.items()},
        "plot": str(img.relative_to(_HERE.parent)),
        "load_average_before": load_before, "load_average_after": load_average(),
        "other_processes_cpu_share": load.shares,
        "hypervisor_steal_share": load.steal,
        "seconds": time.perf_counter() - started,
    }
    write_json(out_path, results)
    progress(f"done in {results['seconds']:.0f} s; results in {out_path.relative_to(_HERE.parent)}, plot in "
             f"{results['plot']}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
