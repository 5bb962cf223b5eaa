"""The edge tier's two KV layouts side by side: decode speed of several long sequences.

In the shared layout (``[edge] kv_layout = "shared"``, the default: one cell pool, a turn may use
the model's whole context) llama.cpp's attention runs over every used cell of the pool; with
``per_sequence`` streams each sequence attends over its own cells only. Both arms decode the
same ``--seqs`` prompts of ``--context`` tokens together, ``--repeats`` times interleaved;
progress on stderr, the last stdout line one JSON object with both rates, their ratio
(``shared_over_per_sequence``) and the CPU. Streams ignore the end-of-sequence token, so each
decodes exactly ``--tokens``.

    .venv/bin/python bench/kv_layout.py [--seqs 4] [--context 2000] [--tokens 64] [--repeats 2] [--smoke]

``--smoke``: 2 sequences of 64 tokens, 8 decoded, one run per layout (seconds; figures meaningless).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from bench._common import SMOKE_HELP, cpu_facts, median, progress
from engine_edge.config import EdgeConfig
from engine_edge.llama_cpp_backend import LlamaCppBackend
from llm_shared.contract import SamplingParams, TokenEvent
from llm_shared.modelfile import default_gguf_path

CELL_BYTES = 23040  # SmolLM2-135M in llama.cpp: 30 layers x (K, V) x 3 heads x 64 x f16
SMOKE = {"seqs": 2, "context": 64, "tokens": 8, "repeats": 1}


async def decode_rate(engine: LlamaCppBackend, prompts: list[list[int]], n_tokens: int, run: int) -> float:
    """Tokens/s while every sequence decodes (from the last first token to the first last one)."""
    params = SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True)

    async def stream(i: int) -> list[float]:
        stamps = []
        async for event in engine.generate(f"run{run}-{i}", prompts[i], params):
            if isinstance(event, TokenEvent):
                stamps.append(time.perf_counter())
        return stamps

    stamps = await asyncio.gather(*(stream(i) for i in range(len(prompts))))
    start, end = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    return sum(sum(1 for t in s if start < t <= end) for s in stamps) / (end - start)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {SMOKE}")
    args = parser.parse_args()
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    cpu = cpu_facts()
    progress(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags {cpu['flags']}")
    # per_sequence: each of seqs + 1 streams (the drafter's too) holds a context plus the output
    per_stream = -(-(args.context + args.tokens + args.seqs) // 256) * 256
    budgets = {"shared": 256.0, "per_sequence": (args.seqs + 1) * per_stream * CELL_BYTES / 2**20}
    engines = {layout: LlamaCppBackend(default_gguf_path(), EdgeConfig(kv_cache_mib=mib, kv_layout=layout,
                                                                         n_seq_max=args.seqs, prefix_reuse=False))
               for layout, mib in budgets.items()}
    try:
        text = engines["shared"].tokenizer.encode("The quick brown fox jumps over the lazy dog. " * (args.context // 8))
        prompts = [[1, *text[i : i + args.context - 1]] for i in range(args.seqs)]  # distinct, same length
        rates: dict[str, list[float]] = {layout: [] for layout in engines}
        for run in range(args.repeats):
            for layout, engine in engines.items():
                rates[layout].append(await decode_rate(engine, prompts, args.tokens, run))
                progress(f"run {run + 1}/{args.repeats}, {layout}: {rates[layout][-1]:.1f} tok/s "
                         f"({args.seqs} sequences x {args.context} tokens, {engine.n_ctx} cells)")
    finally:
        for engine in engines.values():
            await engine.close()
    shared, separate = median(rates["shared"]), median(rates["per_sequence"])
    print(json.dumps({"shared_tok_s": round(shared, 1), "per_sequence_tok_s": round(separate, 1),
                      "shared_over_per_sequence": round(shared / separate, 3), "seqs": args.seqs,
                      "context": args.context, "cpu": cpu["model"], "cpu_flags": cpu["flags"]}))


if __name__ == "__main__":
    asyncio.run(main())
