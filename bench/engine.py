"""The torch engine on this machine's CPU: continuous batching, paged KV, prefix caching and
chunked prefill, each measured side by side against its baseline on the same requests.

Uses the embedded SmolLM2-135M GGUF (bfloat16 where the CPU computes it natively, else float32;
``--dtype`` overrides) and the in-process LLMEngine (one model, one KV
pool; every arm gets a fresh scheduler). Progress goes to stderr; full results to
bench/out/engine.json and a plot to docs/img/engine_concurrency.png; the last stdout line is one
JSON object with throughput_vs_hf, throughput_vs_static, kv_waste, prefix_ttft_ratio,
prefix_nohit_overhead, chunked_p99_itl_ratio, dtype and cpu. Every request ignores the
end-of-sequence token, so output lengths are the workload's, whatever the model would answer.

    .venv/bin/python bench/engine.py [--dtype auto] [--hf-requests 8] [--repeats 6] [--pairs 3] [--smoke]

``--smoke``: every arm on a few requests of a few tokens (``SMOKE_SIZES``; under a minute, figures
meaningless), results and plot in bench/out/smoke/.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from bench._common import (
    SMOKE_HELP,
    cpu_dtype,
    cpu_facts,
    figure_path,
    load_average,
    median,
    percentile,
    progress,
    result_path,
    write_json,
)
from bench._engine_drive import (
    KVPeak,
    Req,
    make_requests,
    output_tokens,
    run_all_at_once,
    run_closed,
    run_open,
)
from engine_gpu.config import EngineConfig
from engine_gpu.engine import LLMEngine
from engine_gpu.kv_cache import PagedKVCache
from engine_gpu.runner import ModelRunner
from gateway.config import DEFAULT_CONFIG, load_config
from llm_shared.models import tokenizer_for

_HERE = Path(__file__).resolve().parent

NUM_REQUESTS = 32


@dataclass(frozen=True)
class Sizes:
    """Every arm's workload size: the full run's, or ``SMOKE_SIZES`` (tiny, to check that each arm runs)."""

    static_batch: int = 16  # rows of a static batch, and the cap of the "continuous (max 16)" reference
    prompt_len: tuple[int, int] = (32, 512)  # the main workload's
    output_len: tuple[int, int] = (16, 256)
    system_tokens: int = 500  # the shared system prompt of the prefix-caching TTFT arm
    prefix_users: int = 8  # its requests after the priming one
    nohit_requests: int = 12  # prefix caching on vs off with nothing shared
    nohit_prompt_len: tuple[int, int] = (32, 512)
    nohit_output_len: tuple[int, int] = (16, 64)
    chunk_streams: int = 16  # decoding while the long prompts arrive
    chunk_stream_tokens: int = 200
    chunk_longs: int = 4
    chunk_long_tokens: int = 1500
    chunk_first_s: float = 1.0  # the first long prompt's arrival, then one every chunk_every_s
    chunk_every_s: float = 1.2
    concurrency: tuple[int, ...] = (1, 4, 16, 32)
    conc_prompt_len: tuple[int, int] = (64, 256)
    conc_output: int = 64


# The long prompt (600) still spans several 256-token chunks, so the chunked arm chunks.
SMOKE_SIZES = Sizes(static_batch=2, prompt_len=(16, 48), output_len=(4, 8), system_tokens=48, prefix_users=2,
                    nohit_requests=3, nohit_prompt_len=(16, 48), nohit_output_len=(4, 4), chunk_streams=2,
                    chunk_stream_tokens=12, chunk_longs=1, chunk_long_tokens=600, chunk_first_s=0.2,
                    chunk_every_s=0.5, concurrency=(1, 2), conc_prompt_len=(16, 32), conc_output=4)
SMOKE_ARGS = {"requests": 4, "hf_requests": 1, "repeats": 1, "pairs": 1}


class Bench:
    """One model and KV pool shared by every arm; ``engine(**changes)`` is a fresh scheduler."""

    def __init__(self, threads: int, dtype: str) -> None:
        config = load_config(DEFAULT_CONFIG)
        self.base = replace(config.engine, dtype=dtype, device="cpu", threads=threads)
        self.model_cfg = config.model(self.base.model)
        progress(f"loading {self.model_cfg.id} ({self.model_cfg.source}) in {dtype}, {threads} threads")
        self.tokenizer = tokenizer_for(self.model_cfg)
        self.runner = ModelRunner.from_config(self.model_cfg, self.base)
        self.vocab = self.runner.vocab_size

    def engine(self, *, own_kv: bool = False, **changes: object) -> LLMEngine:
        """A fresh scheduler over the shared model. Engines sharing the KV pool must not run
        interleaved while one keeps prefix-cache blocks: the other's writes would land in them;
        ``own_kv`` gives this one a pool of its own (the same size)."""
        config: EngineConfig = replace(self.base, **changes)  # type: ignore[arg-type]
        runner = self.runner
        if own_kv:
            pool = runner.kv_cache
            kv = PagedKVCache.for_model(runner.model.args, block_size=pool.block_size, dtype=runner.dtype,
                                        device=runner.device, num_blocks=pool.num_blocks, layout=pool.layout)
            runner = ModelRunner(runner.model, kv, device=runner.device, dtype=runner.dtype,
                                 attention_backend=runner.attention_backend)
        return LLMEngine(runner, self.tokenizer, config, model_cfg=self.model_cfg)


class OtherLoad:
    """CPU time that other processes took during a stretch of this run, as a share of all cores:
    the noise every ratio here is exposed to, recorded next to it."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._me = psutil.Process()
        self.shares: dict[str, float] = {}
        self.steal: dict[str, float] = {}
        self._mark = self._now()
        self._mark_steal = self._mark[3]

    def _now(self) -> tuple[float, float, float, float]:
        t = self._psutil.cpu_times()
        busy = t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
        mine = self._me.cpu_times()
        # steal: time the hypervisor gave our virtual CPUs to other machines
        return time.perf_counter(), busy, mine.user + mine.system, getattr(t, "steal", 0.0)

    def lap(self, name: str) -> float:
        now = self._now()
        wall = now[0] - self._mark[0]
        others = (now[1] - self._mark[1]) - (now[2] - self._mark[2])
        self._mark = now
        capacity = wall * (self._psutil.cpu_count() or 1)
        self.shares[name] = max(0.0, others) / capacity if wall > 0 else 0.0
        self.steal[name] = (now[3] - self._mark_steal) / capacity if wall > 0 else 0.0
        self._mark_steal = now[3]
        progress(f"  (during {name}: other processes used {self.shares[name]:.0%} of the CPUs, "
                 f"the hypervisor stole {self.steal[name]:.0%})")
        return self.shares[name]


def tps(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def run_continuous(b: Bench, reqs: list[Req], tag: str, peak: KVPeak | None = None, **changes: object) -> float:
    traces, secs = run_all_at_once(b.engine(**changes), reqs, tag, on_step=peak)
    return tps(output_tokens(traces), secs)


def run_static(b: Bench, reqs: list[Req], tag: str, *, padded: bool, rows: int) -> float:
    """Batches of ``rows`` run one after another, nobody joining a running batch. Padded:
    every row keeps its slot (and computes) until the batch's longest member finishes, as in a
    fixed-shape batch; compacted: finished rows leave. Only requested tokens count."""
    engine = b.engine(max_num_seqs=rows)
    useful, total_secs = 0, 0.0
    for k in range(0, len(reqs), rows):
        batch = reqs[k:k + rows]
        lens = [max(r.output_len for r in batch)] * len(batch) if padded else None
        _, secs = run_all_at_once(engine, batch, f"{tag}-{k}", max_tokens=lens)
        useful += sum(r.output_len for r in batch)
        total_secs += secs
    return tps(useful, total_secs)


def arm_continuous_and_static(b: Bench, reqs: list[Req], pairs: int, rows: int) -> dict:
    progress(f"continuous batching ({len(reqs)} requests at once, max_num_seqs {b.base.max_num_seqs}) vs padded "
             f"static batching (batches of {rows}, no refill): {pairs} interleaved pairs")
    peak = KVPeak()
    cont, static = [], []
    for k in range(pairs):
        for arm in ("cont", "static") if k % 2 == 0 else ("static", "cont"):
            if arm == "cont":
                cont.append(run_continuous(b, reqs, f"cont{k}", peak if k == 0 else None))
            else:
                static.append(run_static(b, reqs, f"static{k}", padded=True, rows=rows))
        progress(f"  pair {k + 1}: continuous {cont[-1]:.1f} tok/s, static {static[-1]:.1f} tok/s")
    progress(f"  KV at peak: {peak.blocks} blocks for {peak.tokens} tokens, waste {peak.waste:.2%}")
    progress(f"for reference: compacted static batching, and continuous batching capped at {rows} running")
    compacted = run_static(b, reqs, "compacted", padded=False, rows=rows)
    cont16 = run_continuous(b, reqs, "cont16", max_num_seqs=rows)
    progress(f"  compacted static {compacted:.1f} tok/s, continuous (max {rows}) {cont16:.1f} tok/s")
    return {
        "continuous_tok_s": cont, "static_padded_tok_s": static,
        "continuous_vs_static": median([c / s for c, s in zip(cont, static, strict=True)]),
        "static_compacted_tok_s": compacted, "continuous_max16_tok_s": cont16,
        "kv_peak": {"blocks": peak.blocks, "tokens": peak.tokens, "block_size": peak.block_size,
                    "waste": peak.waste, "steps_sampled": peak.samples},
    }


def arm_hf(b: Bench, reqs: list[Req], n: int, engine_tps: float) -> dict:
    from bench._engine_hf import hf_serve_one_at_a_time, load_hf_llama
    from llm_shared.modelfile import resolve_source

    # A subset spread over output lengths (every k-th by length), served one at a time.
    subset = sorted(reqs, key=lambda r: r.output_len)[:: max(1, len(reqs) // n)][:n]
    progress(f"HF generate() baseline: loading LlamaForCausalLM with the same dequantized weights ({b.base.dtype})")
    model = load_hf_llama(resolve_source(b.model_cfg.source), getattr(torch, b.base.dtype))
    progress(f"  serving {len(subset)} of {len(reqs)} requests one at a time "
             f"(mean prompt {sum(len(r.prompt) for r in subset) / len(subset):.0f}, "
             f"mean output {sum(r.output_len for r in subset) / len(subset):.0f} tokens)")
    warm = subset[0]
    hf_serve_one_at_a_time(model, [warm.prompt[:32]], [4])
    secs, tokens, outs = hf_serve_one_at_a_time(model, [r.prompt for r in subset], [r.output_len for r in subset])
    hf_tps = tps(tokens, secs)
    engine_outs = b.engine().generate([r.prompt for r in subset], [r.params() for r in subset], prefix="check")
    # Same weights, but bf16 (if chosen) rounds differently in each implementation and random-token prompts
    # leave near-ties, so long greedy runs may part ways; the first token is the sharp check.
    first = sum(a[0] == e[0] for a, e in zip(outs, engine_outs, strict=True))
    first16 = sum(a[:16] == e[:16] for a, e in zip(outs, engine_outs, strict=True))
    progress(f"  HF: {tokens} tokens in {secs:.1f} s = {hf_tps:.1f} tok/s; greedy tokens equal to the engine's: "
             f"first on {first}/{len(subset)}, first 16 on {first16}/{len(subset)} requests ({b.base.dtype})")
    del model
    return {"tok_s": hf_tps, "seconds": secs, "tokens": tokens, "requests": len(subset),
            "first_token_agree": first, "first16_agree": first16, "ratio": engine_tps / hf_tps}


def arm_prefix(b: Bench, repeats: int, sizes: Sizes) -> dict:
    rng = random.Random(11)
    system = [rng.randrange(3, b.vocab) for _ in range(sizes.system_tokens)]
    users = make_requests(sizes.prefix_users + 1, 12, prompt_len=(24, 24), output_len=(4, 4), vocab=b.vocab,
                          prefix=system)
    progress(f"prefix caching: TTFT at concurrency 1 with a shared {sizes.system_tokens}-token system prompt")
    cold_engine = b.engine(enable_prefix_caching=False)
    warm_engine = b.engine(enable_prefix_caching=True, own_kv=True)  # interleaved with the cold one below
    run_closed(warm_engine, users[-1:], 1, "prime")  # the system prompt enters the cache
    cold, warm = [], []
    for k, r in enumerate(users[:-1]):  # interleaved, one request at a time
        cold += [t.ttft for t in run_closed(cold_engine, [r], 1, f"cold{k}")[0].values()]
        warm += [t.ttft for t in run_closed(warm_engine, [r], 1, f"warm{k}")[0].values()]
    cold_p50, warm_p50 = median(cold), median(warm)
    progress(f"  TTFT p50 cold {cold_p50 * 1e3:.1f} ms, warm {warm_p50 * 1e3:.1f} ms "
             f"(hits: {warm_engine.stats()['prefix_cache_hits']:.0f} tokens)")

    progress(f"prefix caching on vs off with no shared prefix: throughput, {repeats} interleaved pairs")
    reqs = make_requests(sizes.nohit_requests, 13, prompt_len=sizes.nohit_prompt_len,
                         output_len=sizes.nohit_output_len, vocab=b.vocab)
    on, off = [], []
    for k in range(repeats):
        # A fresh scheduler per run (no hits across runs); the order alternates so that neither
        # arm always runs first.
        for flag in (True, False) if k % 2 == 0 else (False, True):
            traces, secs = run_all_at_once(b.engine(enable_prefix_caching=flag), reqs, f"nohit{k}{flag}")
            (on if flag else off).append(tps(output_tokens(traces), secs))
        progress(f"  pair {k + 1}: on {on[-1]:.1f} tok/s, off {off[-1]:.1f} tok/s")
    # The median of the paired ratios: each pair ran back to back, so a burst of load from
    # elsewhere moves both arms of a pair, and one disturbed pair does not move the median.
    ratios = [a / b_ for a, b_ in zip(on, off, strict=True)]
    return {
        "ttft_cold_p50_s": cold_p50, "ttft_warm_p50_s": warm_p50, "ttft_ratio": cold_p50 / warm_p50,
        "ttft_cold_s": cold, "ttft_warm_s": warm,
        "nohit_on_tok_s": on, "nohit_off_tok_s": off, "nohit_ratios": ratios,
        "nohit_overhead": 1 - median(ratios),
    }


def arm_chunked(b: Bench, pairs: int, sizes: Sizes) -> dict:
    n, tokens, long_tokens = sizes.chunk_streams, sizes.chunk_stream_tokens, sizes.chunk_long_tokens
    streams = make_requests(n, 21, prompt_len=(64, 128), output_len=(tokens, tokens), vocab=b.vocab)
    longs = make_requests(sizes.chunk_longs, 22, prompt_len=(long_tokens, long_tokens), output_len=(1, 1), vocab=b.vocab)
    arrivals = [(0.0, f"s{k}", r.prompt, r.params()) for k, r in enumerate(streams)]
    arrivals += [(sizes.chunk_first_s + sizes.chunk_every_s * k, f"long{k}", r.prompt, r.params())
                 for k, r in enumerate(longs)]
    arms = {"unchunked": {"max_num_batched_tokens": 2048, "long_prefill_threshold": 2048}, "chunked": {}}
    progress(f"chunked prefill: {n} decoding streams while {len(longs)} {long_tokens:,}-token prompts arrive, "
             f"{pairs} interleaved pairs "
             f"(chunked = the default budget {b.base.max_num_batched_tokens}, prompt chunks of at most "
             f"{b.base.long_prefill_threshold} while others decode; unchunked = one 2,048-token step)")
    result: dict = {name: [] for name in arms}
    for k in range(pairs):
        for name in list(arms) if k % 2 == 0 else list(reversed(arms)):
            traces, secs = run_open(b.engine(**arms[name]), arrivals)
            itls = [x for rid, t in traces.items() if rid.startswith("s") for x in t.itls]
            result[name].append({"itl_p50_s": median(itls), "itl_p99_s": percentile(itls, 99), "itl_max_s": max(itls),
                                 "seconds": secs, "long_ttft_s": [traces[f"long{j}"].ttft for j in range(len(longs))]})
        progress("  pair {}: ITL p50/p99 unchunked {:.0f}/{:.0f} ms, chunked {:.0f}/{:.0f} ms".format(
            k + 1, *(result[n][-1][q] * 1e3 for n in arms for q in ("itl_p50_s", "itl_p99_s"))))
    result["p99_ratio"] = median([u["itl_p99_s"] / c["itl_p99_s"]
                                  for u, c in zip(result["unchunked"], result["chunked"], strict=True)])
    return result


def arm_concurrency(b: Bench, sizes: Sizes) -> dict:
    rows = {}
    for c in sizes.concurrency:
        reqs = make_requests(max(4, 2 * c), 30 + c, prompt_len=sizes.conc_prompt_len,
                             output_len=(sizes.conc_output, sizes.conc_output), vocab=b.vocab)
        traces, secs = run_closed(b.engine(), reqs, c, f"conc{c}")
        rows[c] = {"tok_s": tps(output_tokens(traces), secs), "ttft_p50_s": median([t.ttft for t in traces.values()]),
                   "requests": len(reqs)}
        progress(f"concurrency {c:2d}: {rows[c]['tok_s']:.1f} tok/s, TTFT p50 {rows[c]['ttft_p50_s'] * 1e3:.0f} ms")
    return rows


def plot(rows: dict, path: Path, dtype: str, sizes: Sizes) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    left.plot(xs, [rows[c]["tok_s"] for c in xs], marker="o")
    left.set(xscale="log", xlabel="concurrent requests", ylabel="output tokens/s", title="Throughput")
    right.plot(xs, [rows[c]["ttft_p50_s"] * 1e3 for c in xs], marker="o", color="tab:orange")
    right.set(xscale="log", xlabel="concurrent requests", ylabel="ms", title="TTFT p50")
    for ax in (left, right):
        ax.set_xticks(xs, [str(c) for c in xs])
        ax.grid(alpha=0.3)
    low, high = sizes.conc_prompt_len
    fig.suptitle(f"Torch engine, SmolLM2-135M {dtype} on 2 CPU cores (prompts {low}-{high}, "
                 f"{sizes.conc_output} output tokens)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf-requests", type=int, default=8, help="requests the HF baseline serves (a subset)")
    parser.add_argument("--repeats", type=int, default=6, help="interleaved pairs of prefix caching on/off runs")
    parser.add_argument("--pairs", type=int, default=3, help="interleaved pairs of the batching and chunking arms")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=NUM_REQUESTS,
                        help="requests in the main workload (fewer for a quick comparison on a slow CPU)")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                        help="auto: bfloat16 where the CPU computes it natively (AVX-512 bf16, AMX), else float32")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {SMOKE_ARGS} and SMOKE_SIZES")
    args = parser.parse_args()
    sizes = SMOKE_SIZES if args.smoke else Sizes()
    if args.smoke:
        for key, value in SMOKE_ARGS.items():
            setattr(args, key, value)
    started = time.perf_counter()
    load_before = load_average()
    progress(f"load average {load_before[0]:.2f}")
    cpu = cpu_facts()
    progress(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags {cpu['flags']}")
    b = Bench(args.threads, cpu_dtype(args.dtype))
    reqs = make_requests(args.requests, 1, prompt_len=sizes.prompt_len, output_len=sizes.output_len, vocab=b.vocab)
    progress("warming up")
    b.engine().generate([r.prompt for r in reqs[:4]], Req([], 8).params(), prefix="warmup")

    load = OtherLoad()
    main_arms = arm_continuous_and_static(b, reqs, args.pairs, sizes.static_batch)
    load.lap("batching")
    cont_tps = median(main_arms["continuous_tok_s"])
    hf = arm_hf(b, reqs, args.hf_requests, cont_tps)
    load.lap("hf")
    prefix = arm_prefix(b, args.repeats, sizes)
    load.lap("prefix")
    chunked = arm_chunked(b, args.pairs, sizes)
    load.lap("chunked")
    rows = arm_concurrency(b, sizes)
    load.lap("concurrency")
    img = figure_path("engine_concurrency.png", args.smoke)
    plot(rows, img, b.base.dtype, sizes)

    summary = {
        "throughput_vs_hf": round(hf["ratio"], 2),
        "throughput_vs_static": round(main_arms["continuous_vs_static"], 2),
        "kv_waste": round(main_arms["kv_peak"]["waste"], 4),
        "prefix_ttft_ratio": round(prefix["ttft_ratio"], 2),
        "prefix_nohit_overhead": round(prefix["nohit_overhead"], 4),
        "chunked_p99_itl_ratio": round(chunked["p99_ratio"], 2),
        "dtype": b.base.dtype,
        "cpu": cpu["model"],
    }
    results = {
        "summary": summary,
        "workload": {"requests": args.requests, "prompt_len": list(sizes.prompt_len),
                     "output_len": list(sizes.output_len), "seed": 1, "ignore_eos": True},
        "sizes": asdict(sizes), "smoke": args.smoke,
        "engine_config": {k: getattr(b.base, k) for k in ("dtype", "block_size", "max_num_batched_tokens",
                                                          "max_num_seqs", "long_prefill_threshold", "threads")},
        "kv_blocks_total": b.runner.num_blocks,
        "cpu": cpu,
        **main_arms, "hf": hf, "prefix": prefix, "chunked_prefill": chunked,
        "concurrency": {str(c): r for c, r in rows.items()},
        "plot": str(img.relative_to(_HERE.parent)),
        "load_average_before": load_before, "load_average_after": load_average(),
        "other_processes_cpu_share": load.shares,
        "hypervisor_steal_share": load.steal,
        "seconds": time.perf_counter() - started,
    }
    out = result_path("engine.json", args.smoke)
    write_json(out, results)
    progress(f"done in {results['seconds']:.0f} s; load average {results['load_average_after'][0]:.2f}; "
             f"results in {out.relative_to(_HERE.parent)}, plot in {results['plot']}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
