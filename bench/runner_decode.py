"""Decode step time of the torch engine's ModelRunner on the embedded SmolLM2 GGUF.

    .venv/bin/python bench/runner_decode.py [--context 128] [--steps 16] [--batch 1 8 32] [--threads N] [--smoke]

Prefills ``batch`` random prompts of ``context`` tokens, then times greedy decode steps of the
whole batch through the paged path (no scheduler), twice: with the weights dequantized and every
product ``F.linear`` (``decode_step_ms``), and as the engine runs on a CPU (``tuned_*``): the GGUF's
4-bit blocks kept and each projection's form chosen by ``matmul.tune`` per row count. Prints the
median step time and tokens/s per batch size, then as its last line one JSON object:
``decode_step_ms``, ``decode_tok_s``, ``tuned_decode_step_ms``, ``tuned_decode_tok_s``,
``tuned_speedup`` (dense / tuned step time), ``packed_projections``, ``prefill_tok_s`` (all by
batch size where by anything), ``dtype``, ``threads``, ``context`` and ``cpu``.
``--smoke``: 16-token prompts, 2 steps, batches 1 and 2 (seconds; figures meaningless).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench._common import SMOKE_HELP, cpu_facts
from engine_gpu.kv_cache import PagedKVCache
from engine_gpu.runner import DTYPES, ModelRunner
from engine_gpu.sched_output import ScheduledSeq
from llm_shared.contract import SamplingParams
from llm_shared.llama import matmul
from llm_shared.llama.loader import load_gguf
from llm_shared.modelfile import default_gguf_path

SMOKE = {"context": 16, "steps": 2, "batch": [1, 2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {SMOKE}")
    args = parser.parse_args()
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    dtype = DTYPES[args.dtype]
    started = time.perf_counter()
    model = load_gguf(default_gguf_path(), dtype=dtype, packed4=True)
    print(f"loaded in {time.perf_counter() - started:.1f} s; torch threads: {torch.get_num_threads()}")
    blocks = model.packed_projections()
    per_seq = -(-(args.context + args.steps + 1) // args.block_size)
    cache = PagedKVCache.for_model(model.args, block_size=args.block_size, dtype=dtype, device="cpu",
                                   num_blocks=per_seq * max(args.batch))
    runner = ModelRunner(model, cache, device="cpu", dtype=dtype, attention_backend="torch")
    prefill_tok_s: dict[str, float] = {}
    matmul.reset()
    step_ms = decode_steps(runner, args, per_seq, prefill_tok_s, "dense")
    matmul.tune(model.projection_weights(), packed=blocks)
    tuned_ms = decode_steps(runner, args, per_seq, {}, "tuned")
    matmul.reset()
    print(json.dumps({
        "decode_step_ms": {b: round(ms, 2) for b, ms in step_ms.items()},
        "decode_tok_s": {b: round(int(b) / ms * 1e3, 1) for b, ms in step_ms.items()},
        "tuned_decode_step_ms": {b: round(ms, 2) for b, ms in tuned_ms.items()},
        "tuned_decode_tok_s": {b: round(int(b) / ms * 1e3, 1) for b, ms in tuned_ms.items()},
        "tuned_speedup": {b: round(step_ms[b] / tuned_ms[b], 3) for b in step_ms},
        "packed_projections": len(blocks),
        "prefill_tok_s": {b: round(v, 1) for b, v in prefill_tok_s.items()},
        "dtype": args.dtype, "threads": torch.get_num_threads(), "context": args.context,
        "cpu": cpu_facts()["model"],
    }))


def decode_steps(runner: ModelRunner, args: argparse.Namespace, per_seq: int, prefill_tok_s: dict[str, float],
                 arm: str) -> dict[str, float]:
    """The median decode step (ms) by batch size, the same random prompts in each arm."""
    greedy = SamplingParams(temperature=0.0)
    g = torch.Generator().manual_seed(0)
    vocab = runner.model.args.vocab_size
    step_ms: dict[str, float] = {}
    for batch in args.batch:
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        prompts = [torch.randint(0, vocab, (args.context,), generator=g).tolist() for _ in range(batch)]
        started = time.perf_counter()
        out = runner.execute([ScheduledSeq(f"r{i}", prompts[i], 0, tables[i], sample=True, num_draft_tokens=0,
                                           params=greedy, output_index=0) for i in range(batch)])
        prefill_tok_s[str(batch)] = batch * args.context / (time.perf_counter() - started)
        last = [out[f"r{i}"][0].token_id for i in range(batch)]
        times = []
        for step in range(args.steps):
            items = [ScheduledSeq(f"r{i}", [last[i]], args.context + step, tables[i], sample=True, num_draft_tokens=0,
                                  params=greedy, output_index=step + 1)
                     for i in range(batch)]
            started = time.perf_counter()
            out = runner.execute(items)
            times.append(time.perf_counter() - started)
            last = [out[f"r{i}"][0].token_id for i in range(batch)]
        median = statistics.median(times)
        step_ms[str(batch)] = median * 1e3
        print(f"{arm:5s} batch {batch:3d}: decode step median {median * 1e3:6.1f} ms (min {min(times) * 1e3:.1f}) "
              f"-> {batch / median:5.0f} tok/s")
    return step_ms


if __name__ == "__main__":
    main()
