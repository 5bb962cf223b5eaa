"""Decode speed of the llama.cpp edge backend against this machine's memory-bandwidth roofline.

Batch-1 decoding reads every weight once per token, so its ceiling is
``memory read bandwidth / weight bytes`` (the GGUF tensor data). Bandwidth is measured here
with numpy sums over a 512 MiB array, on one thread and on as many threads as llama.cpp
uses, best of several runs; the roofline takes the higher. Progress goes to stderr; the last
line on stdout is one JSON object with decode_tok_s_1, decode_tok_s_8, roofline_tok_s and
roofline_ratio (at one sequence), plus the bandwidths, the ratio against one thread's, the
weight bytes and cpu. Streams ignore the end-of-sequence token, so each is exactly --tokens long.

    .venv/bin/python bench/edge.py [--tokens 256] [--repeats 3] [--smoke]

--smoke: 16 tokens a stream, one run per arm, a 64 MiB bandwidth array (seconds; figures meaningless).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench._common import SMOKE_HELP, cpu_facts
from engine_edge.config import EdgeConfig
from engine_edge.llama_cpp_backend import LlamaCppBackend
from llm_shared.contract import SamplingParams, TokenEvent
from llm_shared.modelfile import default_gguf_path

PROMPTS = [
    "Write a long story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe a walk through a forest in autumn.",
    "List some ideas for a birthday party.",
    "Tell me about the history of bread.",
    "How do airplanes stay in the air?",
    "Write a letter to a friend about your holiday.",
    "What makes a good cup of tea?",
]
BANDWIDTH_MIB = 512  # far beyond the CPU's caches
SMOKE = {"tokens": 16, "repeats": 1, "bandwidth_mib": 64}


def progress(message: str) -> None:
    print(f"[bench/edge] {message}", file=sys.stderr, flush=True)


def _best_seconds(fn: object, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best


def memory_bandwidth(n_threads: int, repeats: int = 7, mib: int = 512) -> tuple[float, float]:
    """Read bandwidth in bytes/s (best of ``repeats`` float32 sums of a ``mib`` array): with one
    thread, and the best of that and ``n_threads`` threads summing a slice each."""
    data = np.ones(mib * 1024 * 1024 // 4, dtype=np.float32)
    data.sum()  # fault the pages in before timing
    single = data.nbytes / _best_seconds(data.sum, repeats)
    best = single
    progress(f"memory read bandwidth, 1 thread: {single / 1e9:.1f} GB/s")
    if n_threads > 1:
        parts = np.array_split(data, n_threads)

        def parallel_sum() -> None:  # numpy releases the GIL inside the reduction
            threads = [threading.Thread(target=part.sum) for part in parts]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        multi = data.nbytes / _best_seconds(parallel_sum, repeats)
        progress(f"memory read bandwidth, {n_threads} threads: {multi / 1e9:.1f} GB/s")
        best = max(best, multi)
    return single, best


async def _stream(engine: LlamaCppBackend, request_id: str, prompt: list[int], n_tokens: int) -> list[float]:
    """Arrival time of every token of one greedy stream of exactly ``n_tokens`` tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True)
    return [time.perf_counter() async for e in engine.generate(request_id, prompt, params) if isinstance(e, TokenEvent)]


async def decode_rate(engine: LlamaCppBackend, n_seqs: int, n_tokens: int, run: int) -> float:
    """Tokens/s summed over ``n_seqs`` streams, counted only while all of them are decoding
    (after the last first token, before the first last token), so prompt reading is excluded."""
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
               for i in range(n_seqs)]
    stamps = await asyncio.gather(*(_stream(engine, f"bench-{run}-{i}", p, n_tokens) for i, p in enumerate(prompts)))
    start = max(s[0] for s in stamps)
    end = min(s[-1] for s in stamps)
    tokens = sum(sum(1 for t in s if start < t <= end) for s in stamps)
    return tokens / (end - start)


async def measure(model_path: Path, n_tokens: int, repeats: int, bandwidth_mib: int) -> dict[str, float | int]:
    progress(f"loading {model_path.name}")
    engine = LlamaCppBackend(model_path, EdgeConfig(n_seq_max=8))
    try:
        weight_bytes = engine.weight_bytes
        progress(f"weights {weight_bytes / 1e6:.1f} MB, {engine.n_threads} threads")
        await decode_rate(engine, 1, 16, run=-1)  # warm-up: page in the weights
        results: dict[int, float] = {}
        for n_seqs in (1, 8):
            rates = []
            for run in range(repeats):
                rates.append(await decode_rate(engine, n_seqs, n_tokens, run))
                progress(f"{n_seqs} sequence(s), run {run + 1}/{repeats}: {rates[-1]:.1f} tok/s")
            results[n_seqs] = max(rates)
        n_threads = engine.n_threads
    finally:
        await engine.close()
    single, bandwidth = memory_bandwidth(n_threads, mib=bandwidth_mib)
    # The roofline uses the best bandwidth the machine showed (llama.cpp reads with all its
    # threads); the ratio against a one-thread numpy sum is reported beside it.
    roofline = bandwidth / weight_bytes
    return {
        "decode_tok_s_1": round(results[1], 1),
        "decode_tok_s_8": round(results[8], 1),
        "roofline_tok_s": round(roofline, 1),
        "roofline_ratio": round(results[1] / roofline, 3),
        "bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "bandwidth_1thread_gb_s": round(single / 1e9, 2),
        "roofline_ratio_1thread": round(results[1] * weight_bytes / single, 3),
        "weight_bytes": weight_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens generated per sequence")
    parser.add_argument("--repeats", type=int, default=3, help="runs per concurrency level; the best counts")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_HELP}: {SMOKE}")
    args = parser.parse_args()
    args.bandwidth_mib = BANDWIDTH_MIB
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if args.tokens < 8 or args.repeats < 1:
        parser.error("--tokens must be >= 8 and --repeats >= 1")
    result = asyncio.run(measure(args.model or default_gguf_path(), args.tokens, args.repeats, args.bandwidth_mib))
    progress(f"roofline {result['roofline_tok_s']} tok/s; batch-1 decode reaches {result['roofline_ratio']:.0%} of it")
    print(json.dumps({**result, "cpu": cpu_facts()["model"]}), flush=True)


if __name__ == "__main__":
    main()
